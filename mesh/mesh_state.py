"""What a proc mesh, its slices and its actor meshes share: the procs, the calls in flight,
supervision, and stopping.

Supervision: the daemon reports how each proc ended (exit code or signal, stderr tail). The first
proc that dies, or whose connection or daemon goes away, fails the whole mesh: pending calls fail
at once with that cause, and so does every later call. The failure then goes to the mesh's
supervisor: the owning actor's `__supervise__`, or at the top the controller's report on stderr.

The connections themselves are served by owner.py; launching is proc_mesh.py.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.calls import Call, Calls
from ..daemon.wire.transport import Channel
from . import wire
from .errors import ActorError, Failure, MeshError, SpawnError, SupervisionError
from .hosts import HostInfo, Launcher
from .shape import HOSTS

log = logging.getLogger("monarch_fs.mesh")

STOP_GRACE = 5.0  # seconds a proc gets to exit after "stop" before it is killed

Output = Callable[[str, int, str, list[str]], None]  # (mesh name, rank, stream, lines)
Supervisor = Callable[[Failure], None]


def print_output(mesh: str, rank: int, stream: str, lines: list[str]) -> None:
    """The default: each line on our stdout/stderr, prefixed with its rank."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    prefix = f"[rank {rank}]" if mesh == "procs" else f"[{mesh} rank {rank}]"
    out.write("".join(f"{prefix} {line}\n" for line in lines))
    out.flush()


def report_unhandled(failure: Failure) -> None:
    """The top of the supervision tree: nobody handled it, so a person must read it."""
    print(f"monarch-fs mesh: {failure.describe()}", file=sys.stderr, flush=True)


@dataclass
class Proc:
    """One proc of a mesh: its rank, and the host and local rank it runs as."""

    rank: int
    host: int  # index into the launcher's hosts
    local_rank: int
    info: HostInfo
    proc_id: int | None = None
    pid: int | None = None
    chan: Channel | None = None
    exit: dict | None = None  # the daemon's exit report
    failure: Failure | None = None
    launched: list[tuple[int, int]] = field(default_factory=list)  # (host, proc id) of procs
    # that actors in this proc launched through us
    spawned: trio.Event = field(default_factory=trio.Event)
    exited: trio.Event = field(default_factory=trio.Event)  # or known to be unreachable

    def __post_init__(self) -> None:
        # Unbounded on purpose. Whatever goes to one proc must stay in the order it was posted
        # (an actor sees calls in the order they were made), and some posters cannot wait:
        # `broadcast()` is a plain function, from a script and from trio code alike, and the
        # events of procs its actors launched are forwarded from a daemon link's reader, in a
        # callback that must not block (that reader also delivers every daemon reply). Calls
        # that expect a reply are bounded by their callers, who wait for it; broadcasts are
        # fire-and-forget by design. Nothing counts bytes: a queued message is one frame.
        self.outbox, self.outbox_receive = trio.open_memory_channel[p.Data](math.inf)

    @property
    def connected(self) -> bool:
        return self.chan is not None

    def post(self, msg: p.Data) -> None:
        try:
            self.outbox.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the proc is gone; its failure is reported elsewhere


class PendingCall(Call[dict[int, Any]]):
    """A call to some ranks: settled with the results by rank once every rank has answered
    (or with the lowest rank's ActorError), or failed at once when a rank it targets dies."""

    def __init__(self, cid: int, ranks: Iterable[int], actor: str, method: str) -> None:
        super().__init__()
        self.id = cid
        self.remaining = set(ranks)
        self.actor, self.method = actor, method
        self.results: dict[int, Any] = {}
        self.errors: dict[int, ActorError] = {}
        self.posted_at = 0.0  # trio.current_time() when it was queued to its ranks
        self.arrivals: list[int] = []  # ranks in the order they answered (for stream())
        self.arrived = trio.Event()  # set, and replaced, at each answer

    def answer(self, rank: int, value: Any = None, error: ActorError | None = None) -> None:
        """One rank's answer (a reader calls this)."""
        if rank not in self.remaining:
            return
        self.remaining.discard(rank)
        if error is not None:
            self.errors[rank] = error
        else:
            self.results[rank] = value
        self.arrivals.append(rank)
        self.arrived.set()
        self.arrived = trio.Event()
        if self.remaining:
            return
        if self.errors:
            first = self.errors[min(self.errors)]
            first.others = len(self.errors) - 1
            self.set_error(first)
        else:
            self.set_value(self.results)

    def outcome(self) -> dict[int, Any]:
        """The results of a settled call, or raise its error."""
        assert self.settled
        if self._error is not None:
            raise self._error.with_traceback(None)
        return self._value or {}


class MeshCalls(Calls[PendingCall]):
    """The calls in flight on a mesh. Their ids are drawn by whoever makes the call, in any
    thread (the call's header is encoded there), so `add` keeps the id it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(1)  # next() on a count is atomic: any thread may draw

    def add(self, call: PendingCall) -> PendingCall:
        self._pending[call.id] = call
        return call

    def pending(self) -> list[PendingCall]:
        return list(self._pending.values())


class MeshState:
    """Everything a proc mesh, its slices and its actor meshes share."""

    def __init__(self, name: str, launcher: Launcher, per_host: dict[str, int],
                 supervisor: Supervisor, output: Output | None) -> None:
        self.name = name
        self.launcher = launcher
        self.dims = (HOSTS, *per_host)
        self.extent = (len(launcher.hosts), *per_host.values())
        per_host_n = self.per_host = math.prod(per_host.values())
        self.procs = [Proc(h * per_host_n + lr, h, lr, info)
                      for h, info in enumerate(launcher.hosts) for lr in range(per_host_n)]
        self.token = secrets.token_bytes(32)
        self.supervisor = supervisor
        self.output = output
        self.failure: Failure | None = None  # the first rank's failure
        self.stopping = False
        self.stopped = False
        self.calls = MeshCalls()
        self.chosen = 0  # where choose() starts looking, so ties take turns
        self.call_timeout: float | None = None  # what Future.get() waits at most by default
        self.actors: set[str] = set()  # names of the actor meshes spawned on these procs
        self.stopped_actors: set[tuple[str, int]] = set()  # (actor, rank) stopped on purpose
        self.trio_token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        # The owner's service (owner.py) sets these: its nursery, and the scope stop() cancels.
        self.scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None

    # ---- state -------------------------------------------------------------------------

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def check(self, ranks: Iterable[int] = (), actor: str | None = None) -> None:
        """Raise at once if a call to `ranks` (of actor `actor`) cannot be made: the mesh was
        stopped, one of those ranks failed, or the actor was stopped there."""
        if self.stopping:  # stop() sets it first
            raise MeshError(f"proc mesh {self.name!r} has been stopped")
        for rank in ranks:
            failure = self.procs[rank].failure
            if failure is not None:
                raise SupervisionError(failure)
            if actor is not None and (actor, rank) in self.stopped_actors:
                raise MeshError(f"actor mesh {actor!r} of proc mesh {self.name!r} was stopped "
                                f"on rank {rank}")

    def fail(self, proc: Proc, failure: Failure) -> None:
        """Rank `proc` is gone: the calls that target it fail at once, and its failure goes to
        the supervisor (once per rank). Calls to the other ranks go on."""
        if proc.failure is not None:
            return
        proc.failure = failure
        self.wake()
        if self.stopping:
            return
        self.kill_launched(proc)
        if self.failure is None:
            self.failure = failure
        for call in self.calls.pending():
            if proc.rank in call.remaining:
                call.set_error(SupervisionError(failure, f"{call.actor}.{call.method}"))
                self.calls.remove(call)
        log.debug("mesh %s: %s", self.name, failure.describe())
        try:
            self.supervisor(failure)
        except Exception:  # a supervisor bug must not take the readers down
            log.exception("supervisor of mesh %s failed", self.name)

    def failure_of(self, proc: Proc, reason: str = "") -> Failure:
        ex = proc.exit or {}
        return Failure(self.name, proc.rank, str(proc.info), proc.pid, ex.get("code"),
                       ex.get("signal"), reason, list(ex.get("stderr_tail") or []))

    # ---- calls -------------------------------------------------------------------------

    def post_call(self, ranks: list[int], op: str, actor: str, method: str, fields: dict,
                  args: tuple, kwargs: dict, reply: bool = True) -> PendingCall | None:
        """Queue one message to every rank in `ranks`, without waiting (in the loop). With
        `reply`, the call whose replies the readers settle; without, the arguments are copied
        now (the caller may change them as soon as this returns)."""
        pending = PendingCall(next(self.calls.ids), ranks, actor, method) if reply else None
        header = {"op": op, "call": pending.id if pending else None, "actor": actor, **fields}
        msg = wire.encode(header, (args, kwargs), has_body=True, copy=not reply)
        self.start_call(ranks, msg, pending)
        return pending

    def start_call(self, ranks: list[int], msg: p.Data, pending: PendingCall | None) -> None:
        """Hold `pending` (if any) for its answers and queue `msg` to `ranks` (in the loop)."""
        if pending is not None:
            pending.posted_at = trio.current_time()
            self.calls.add(pending)
        for rank in ranks:
            self.procs[rank].post(msg)

    def describe_waiting(self, pending: PendingCall, timeout: float) -> str:
        """Why a call has no answer yet: the ranks that have not answered, and what each one
        is running (the oldest call of that actor it has not answered, maybe another one)."""
        now = trio.current_time()
        calls = sorted((c for c in self.calls.pending() if c.actor == pending.actor),
                       key=lambda c: c.posted_at)
        lines = []
        for rank in sorted(pending.remaining):
            running = next((c for c in calls if rank in c.remaining), pending)
            what = f"{running.actor}.{running.method}"
            since = f"for {now - running.posted_at:.1f}s"
            if running is not pending:
                what += f" (this call waits behind it), {since}"
            else:
                what += f", {since}"
            lines.append(f"rank {rank} on {self.procs[rank].info}: running {what}")
        total = len(pending.remaining) + len(pending.results) + len(pending.errors)
        return (f"{pending.actor}.{pending.method}: no answer within {timeout:g}s from "
                f"{len(pending.remaining)} of {total} ranks (the call is still in flight; "
                f"get() again to wait more):\n  "
                + "\n  ".join(lines))

    # ---- events from the daemons -------------------------------------------------------

    def on_proc_event(self, proc: Proc, kind: str, data: dict) -> None:
        if kind == "output":
            if self.output is not None:
                self.output(self.name, proc.rank, data.get("stream", "stdout"),
                            list(data.get("lines") or []))
        elif kind == "exit":  # any exit we did not ask for is a failure (fail() knows)
            proc.exit = data
            proc.exited.set()
            self.fail(proc, self.failure_of(proc))
        elif kind == "lost":
            proc.exited.set()
            self.fail(proc, self.failure_of(proc, data.get("reason", "its daemon went away")))

    def kill_launched(self, proc: Proc) -> None:
        """The procs an actor of `proc` launched die with it (they would also exit on their own
        once their owner's connection drops)."""
        if proc.launched and self.nursery is not None and not self.stopped:
            for host, pid in proc.launched:
                self.nursery.start_soon(self.launcher.kill, host, pid, signal.SIGKILL)
            proc.launched = []

    # ---- life cycle ----------------------------------------------------------------------

    async def wait_connected(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            while True:
                if self.failure is not None:
                    raise SupervisionError(self.failure, f"starting proc mesh {self.name!r}")
                if all(pr.connected for pr in self.procs):
                    return
                await self._changed.wait()
        waiting = [pr.rank for pr in self.procs if not pr.connected]
        raise SpawnError(f"proc mesh {self.name!r}: ranks {waiting} did not connect back "
                         f"within {timeout:g}s (is this controller reachable from the hosts?)")

    async def stop(self) -> None:
        """Ask every proc to exit, kill what has not after STOP_GRACE, and end the service."""
        if self.stopped:
            return
        self.stopping = True

        async def exits() -> None:
            with trio.move_on_after(STOP_GRACE):
                for proc in self.procs:
                    if proc.proc_id is not None:
                        await proc.exited.wait()

        with trio.CancelScope(shield=True):
            for proc in self.procs:  # a proc stops the meshes its actors own, then exits
                proc.post(wire.encode({"op": "stop"}))
            await exits()
            for proc in self.procs:
                self.kill_launched(proc)
                if proc.proc_id is not None and not proc.exited.is_set():
                    await self.launcher.kill(proc.host, proc.proc_id, signal.SIGKILL)
            await exits()
        self.stopped = True
        self.calls.fail_all(lambda call: MeshError(f"proc mesh {self.name!r} was stopped"))
        for proc in self.procs:
            proc.outbox.close()
        if self.scope is not None:
            self.scope.cancel()
