"""What a proc mesh, its slices and its actor meshes share: the procs, the calls in flight,
supervision, and stopping.

Supervision: the daemon reports how each proc ended (exit code or signal, stderr tail). The first
proc that dies, or whose connection or daemon goes away, fails the whole mesh: pending calls fail
at once with that cause, and so does every later call. The failure then goes to the mesh's
supervisor: the owning actor's `__supervise__`, or at the top the controller's report on stderr.

The connections themselves are served by owner.py; launching is proc_mesh.py.
"""

from __future__ import annotations

import logging
import math
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.jobs import new_job_name
from ..daemon.wire.transport import Channel
from . import wire
from .calls import CallTarget, MeshRef
from .errors import Failure, MeshError, SpawnError, SupervisionError
from .hosts import HostInfo, Launcher
from .link_writer import LinkWriter
from .log_output import LogControl
from .rank_stop import Started, signal_all
from .shape import HOSTS

log = logging.getLogger("monarch_fs.mesh")

STOP_GRACE = 5.0  # seconds a proc gets to exit after "stop" before it is killed

Output = Callable[[str, int, str, list[str]], None]  # (mesh name, rank, stream, lines)
Supervisor = Callable[[Failure], None]


def print_output(mesh: str, rank: int, stream: str, lines: list[str]) -> None:
    """The default: each line on our stdout/stderr, prefixed with its rank. A stream the
    script closed (or a reader that went away) loses the lines, not the mesh: this runs in
    the mesh's loop, whose end would fail every call."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    prefix = f"[rank {rank}]" if mesh == "procs" else f"[{mesh} rank {rank}]"
    try:
        out.write("".join(f"{prefix} {line}\n" for line in lines))
        out.flush()
    except (ValueError, OSError) as e:  # closed file, broken pipe
        log.debug("output of %s rank %d lost: %s", mesh, rank, e)


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
    link: LinkWriter | None = None  # how messages go onto chan (link_writer.py)
    peer: str = ""  # where it listens for direct calls (mesh_ref.py)
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
        """Send `msg` now if nothing is queued ahead of it, else queue it for the writer."""
        try:
            if self.link is not None:
                self.link.post(msg)
            else:
                self.outbox.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the proc is gone; its failure is reported elsewhere


class MeshState(CallTarget):
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
        self.job = new_job_name(name)  # its procs' MONARCH_FS_JOB: `monarch-fs logs`, `stacks`
        self.token = secrets.token_bytes(32)
        self.peer_token = secrets.token_bytes(32)  # for direct calls; never the owner's token
        self.supervisor = supervisor
        self.output = LogControl(output)
        self.failure: Failure | None = None  # the first rank's failure
        self.stopping = False
        self.stopped = False
        self._init_calls()
        self.actors: set[str] = set()  # names of the actor meshes spawned on these procs
        self.specs: list[dict] = []  # what each rank was launched with (for respawn)
        # (name, ranks, fields, args, kwargs) of each actor mesh spawned (for respawn)
        self.constructed: list[tuple[str, list[int], dict, tuple, dict]] = []
        self.trio_token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        # The owner's service (owner.py) sets these: its nursery, and the scope stop() cancels.
        self.scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None

    # ---- state -------------------------------------------------------------------------

    def mesh_ref(self) -> MeshRef:
        """What a pickled actor mesh of ours carries (see mesh_ref.py)."""
        if not all(proc.peer for proc in self.procs):
            raise MeshError(f"proc mesh {self.name!r}: its procs do not all take direct calls")
        return MeshRef(self.name, self.dims, self.extent, self.peer_token,
                       tuple(proc.peer for proc in self.procs),
                       tuple(str(proc.info) for proc in self.procs))

    async def changed(self) -> None:
        """Until a proc connects or fails."""
        await self._changed.wait()

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

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

    # ---- events from the daemons -------------------------------------------------------

    def on_proc_event(self, proc: Proc, kind: str, data: dict) -> None:
        if kind == "output":  # LogControl decides what to forward, and how
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
            await signal_all(self.launcher, [  # all at once, each bounded (rank_stop.py)
                Started(proc.host, proc.proc_id) for proc in self.procs
                if proc.proc_id is not None and not proc.exited.is_set()], signal.SIGKILL)
            await exits()
        self.stopped = True
        self.calls.fail_all(lambda call: MeshError(f"proc mesh {self.name!r} was stopped"))
        for proc in self.procs:
            proc.outbox.close()
        if self.scope is not None:
            self.scope.cancel()
