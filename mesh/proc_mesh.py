"""A proc mesh: K actor-runtime processes on each host, connected back to their owner.

The owner (the controller, or an actor that spawns meshes) listens on a fresh port with a fresh
random token that only these procs receive (in their spawn request's secrets, which reach a
proc through a pipe, never its environment; never the cluster token), launches
`python -m monarch_fs.mesh.runtime` on every host through the daemons, and waits until every
proc has connected back and authenticated. Calls then travel over those
connections, one reader and one writer task per proc.

Supervision: the daemon reports how each proc ended (exit code or signal, stderr tail). The first
proc that dies, or whose connection or daemon goes away, fails the whole mesh: pending calls fail
at once with that cause, and so does every later call. The failure then goes to the mesh's
supervisor: the owning actor's `__supervise__`, or at the top the controller's report on stderr.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import secrets
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.calls import Call, Calls
from ..daemon.wire.limits import Limits, serve_listeners
from ..daemon.wire.transport import Channel, ConnectionLost, accept, format_addr
from . import wire
from .actor import ActorMesh, class_ref
from .errors import ActorError, Failure, MeshError, SpawnError, SupervisionError
from .hosts import HostInfo, Launcher, workspace_version
from .loop import run_async_api, run_sync_api
from .shape import Selector, Shaped

log = logging.getLogger("monarch_fs.mesh")

MESH_MAX_FRAME = 1 << 30  # between authenticated mesh peers, frames may carry big tensors
STOP_GRACE = 5.0  # seconds a proc gets to exit after "stop" before it is killed
EXIT_WAIT = 5.0  # seconds to wait for the daemon's exit report after a proc's connection drops
HELLO_TIMEOUT = 10.0
SPAWN_TIMEOUT = 30.0  # for a daemon to answer a spawn request

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
        self.outbox, self._outbox_recv = trio.open_memory_channel[p.Data](math.inf)

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
    (or with the lowest rank's ActorError), or failed as a whole when the mesh fails."""

    def __init__(self, ranks: Iterable[int], actor: str, method: str) -> None:
        super().__init__()
        self.remaining = set(ranks)
        self.actor, self.method = actor, method
        self.results: dict[int, Any] = {}
        self.errors: dict[int, ActorError] = {}

    def answer(self, rank: int, value: Any = None, error: ActorError | None = None) -> None:
        """One rank's answer (a reader calls this)."""
        if rank not in self.remaining:
            return
        self.remaining.discard(rank)
        if error is not None:
            self.errors[rank] = error
        else:
            self.results[rank] = value
        if self.remaining:
            return
        if self.errors:
            first = self.errors[min(self.errors)]
            first.others = len(self.errors) - 1
            self.set_error(first)
        else:
            self.set_value(self.results)


class MeshState:
    """Everything a proc mesh, its slices and its actor meshes share."""

    def __init__(self, name: str, launcher: Launcher, per_host: int, supervisor: Supervisor,
                 output: Output | None) -> None:
        self.name = name
        self.launcher = launcher
        self.per_host = per_host
        self.procs = [Proc(h * per_host + lr, h, lr, info)
                      for h, info in enumerate(launcher.hosts) for lr in range(per_host)]
        self.token = secrets.token_bytes(32)
        self.supervisor = supervisor
        self.output = output
        self.failure: Failure | None = None
        self.stopping = False
        self.stopped = False
        self.calls: Calls[PendingCall] = Calls()
        self.actors: set[str] = set()  # names of the actor meshes spawned on these procs
        self.trio_token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        self._scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None

    # ---- state -------------------------------------------------------------------------

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def check(self) -> None:
        """Raise at once if the mesh cannot take calls."""
        if self.failure is not None:
            raise SupervisionError(self.failure)
        if self.stopping:  # stop() sets it first
            raise MeshError(f"proc mesh {self.name!r} has been stopped")

    def fail(self, proc: Proc, failure: Failure) -> None:
        if proc.failure is not None:
            return
        proc.failure = failure
        self.wake()
        if self.stopping:
            return
        self._kill_launched(proc)
        if self.failure is not None:
            return
        self.failure = failure
        self.calls.fail_all(lambda call: SupervisionError(failure, f"{call.actor}.{call.method}"))
        log.debug("mesh %s failed: %s", self.name, failure.describe())
        try:
            self.supervisor(failure)
        except Exception:  # a supervisor bug must not take the readers down
            log.exception("supervisor of mesh %s failed", self.name)

    def _failure(self, proc: Proc, reason: str = "") -> Failure:
        ex = proc.exit or {}
        return Failure(self.name, proc.rank, str(proc.info), proc.pid, ex.get("code"),
                       ex.get("signal"), reason, list(ex.get("stderr_tail") or []))

    # ---- calls -------------------------------------------------------------------------

    def post_call(self, ranks: list[int], op: str, actor: str, method: str, fields: dict,
                  args: tuple, kwargs: dict, reply: bool = True) -> PendingCall | None:
        """Queue one message to every rank in `ranks`, without waiting. With `reply`, the call
        whose replies the readers settle; without, the arguments are copied now (the caller
        may change them as soon as this returns)."""
        pending = self.calls.add(PendingCall(ranks, actor, method)) if reply else None
        header = {"op": op, "call": pending.id if pending else None, "actor": actor, **fields}
        msg = wire.encode(header, (args, kwargs), has_body=True, copy=not reply)
        for rank in ranks:
            self.procs[rank].post(msg)
        return pending

    async def wait_call(self, pending: PendingCall) -> dict[int, Any]:
        """The results of a posted call, by rank (or what it raised)."""
        try:
            return await pending.result()
        finally:
            self.calls.remove(pending)

    # ---- events from the daemons -------------------------------------------------------

    def on_proc_event(self, proc: Proc, kind: str, data: dict) -> None:
        if kind == "output":
            if self.output is not None:
                self.output(self.name, proc.rank, data.get("stream", "stdout"),
                            list(data.get("lines") or []))
        elif kind == "exit":  # any exit we did not ask for is a failure (fail() knows)
            proc.exit = data
            proc.exited.set()
            self.fail(proc, self._failure(proc))
        elif kind == "lost":
            proc.exited.set()
            self.fail(proc, self._failure(proc, data.get("reason", "its daemon went away")))

    # ---- the service: listener, one reader and one writer per proc ----------------------

    async def serve(self, listeners: list[trio.SocketListener],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                # Only these procs ever connect; the limits keep strangers cheap.
                limits = Limits(max_connections=len(self.procs) + 64,
                                max_per_peer=len(self.procs) + 64,
                                handshake_timeout=HELLO_TIMEOUT)
                await nursery.start(serve_listeners, self._connection, listeners, limits, log)
                task_status.started()
                await trio.sleep_forever()

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            chan = await accept(stream, self.token, {"mesh": self.name}, timeout=HELLO_TIMEOUT)
        except Exception:
            return  # not one of ours (wrong token) or broken: nothing to tell anyone
        chan.conn.max_frame = MESH_MAX_FRAME
        proc = await self._hello(chan)
        if proc is None:
            await trio.aclose_forcefully(chan.stream)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, proc, chan)
            try:
                await self._reader(proc, chan)
            finally:
                nursery.cancel_scope.cancel()
                await trio.aclose_forcefully(chan.stream)
        if proc.failure is None and not self.stopping:
            with trio.move_on_after(EXIT_WAIT):  # the daemon's report says more, if it comes
                await proc.exited.wait()
            self.fail(proc, self._failure(proc, "closed its connection to the controller"))

    async def _hello(self, chan: Channel) -> Proc | None:
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                msg = await chan.receive()
            h = wire.header(msg) if isinstance(msg, p.Data) else {}
            proc = self.procs[int(h["rank"])]
            with trio.fail_after(HELLO_TIMEOUT):
                await proc.spawned.wait()
        except (Exception, trio.TooSlowError):
            return None
        if h.get("op") != "hello" or proc.chan is not None or h.get("pid") != proc.pid:
            return None
        proc.chan = chan
        self.wake()
        return proc

    async def _writer(self, proc: Proc, chan: Channel) -> None:
        try:
            async for msg in proc._outbox_recv:
                await chan.send(msg)
        except (ConnectionLost, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def _reader(self, proc: Proc, chan: Channel) -> None:
        async for h, msg in wire.messages(chan):
            self._message(proc, h, msg)

    def _message(self, proc: Proc, h: dict, msg: p.Data) -> None:
        op = h["op"]
        if op in ("result", "error"):
            call = self.calls.get(h.get("call"))
            if call is None:
                return
            if op == "error":
                call.answer(proc.rank, error=ActorError(
                    str(h.get("actor", call.actor)), str(h.get("method", call.method)),
                    proc.rank, str(proc.info), str(h.get("type", "Exception")),
                    str(h.get("message", "")), str(h.get("traceback", ""))))
                return
            try:
                value = wire.body(msg)
            except Exception as e:
                call.answer(proc.rank, error=ActorError(
                    call.actor, call.method, proc.rank, str(proc.info), type(e).__name__,
                    f"the result could not be unpickled here: {e}", ""))
            else:
                call.answer(proc.rank, value)
        elif op == "failure":  # an actor did not handle the failure of a mesh it owns
            nested = str(h.get("description", "a mesh it owns failed"))
            reason = f"actor {h.get('actor')!r} did not handle a failure of its mesh: {nested}"
            self.fail(proc, Failure(self.name, proc.rank, str(proc.info), proc.pid,
                                    reason=reason))
        elif op in ("launch", "kill", "request"):
            assert self.nursery is not None
            self.nursery.start_soon(self._serve_owner_request, proc, h)

    # ---- meshes owned by actors: their launches go through us --------------------------

    async def _serve_owner_request(self, proc: Proc, h: dict) -> None:
        """An actor in `proc` spawns or stops procs of its own, or asks a daemon something: we
        hold the daemon connections, so do it for it and forward the procs' events back."""
        req, host = h.get("req"), h.get("host")
        try:
            host = int(host)
            if not 0 <= host < len(self.launcher.hosts):
                raise MeshError(f"no host {host}")
            if h["op"] == "kill":
                if (host, h.get("proc")) in proc.launched:
                    await self.launcher.kill(host, int(h["proc"]), int(h.get("signal", 15)))
                return
            if h["op"] == "request":
                if h.get("name") != "status":
                    raise MeshError("only status requests are forwarded")
                value = await self.launcher.request(host, "status")
                proc.post(wire.encode({"op": "reply", "req": req, "value": value}))
                return

            def forward(kind: str, data: dict) -> None:
                proc.post(wire.encode({"op": "proc_event", "req": req, "kind": kind,
                                       "data": data}))

            spec = dict(h.get("spec") or {})
            if proc.failure is not None or self.stopping:
                raise MeshError("the requesting proc is going away")
            reply = await self.launcher.spawn(host, spec, forward)
            proc.launched.append((host, reply["proc"]))
            if proc.failure is not None:  # it died while we launched
                await self.launcher.kill(host, reply["proc"], signal.SIGKILL)
            proc.post(wire.encode({"op": "reply", "req": req, "value": reply}))
        except Exception as e:
            proc.post(wire.encode({"op": "reply", "req": req, "error": str(e)}))

    def _kill_launched(self, proc: Proc) -> None:
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
                self._kill_launched(proc)
                if proc.proc_id is not None and not proc.exited.is_set():
                    await self.launcher.kill(proc.host, proc.proc_id, signal.SIGKILL)
            await exits()
        self.stopped = True
        self.calls.fail_all(lambda call: MeshError(f"proc mesh {self.name!r} was stopped"))
        for proc in self.procs:
            proc.outbox.close()
        if self._scope is not None:
            self._scope.cancel()


async def spawn_proc_mesh(launcher: Launcher, nursery: trio.Nursery, *, per_host: int,
                          name: str = "procs", env: dict[str, str] | None = None,
                          cwd: str | None = None, workspace: str | None = None,
                          version: str | None = None, python: str | None = None,
                          python_path: Iterable[str] = (),
                          supervisor: Supervisor = report_unhandled,
                          output: Output | None = print_output,
                          connect_timeout: float = 60.0) -> MeshState:
    """Launch the runtimes and wait until every one has connected back."""
    if per_host < 1:
        raise ValueError("per_host must be at least 1")
    state = MeshState(name, launcher, per_host, supervisor, output)
    listeners: dict[str, trio.SocketListener] = {}
    addrs: list[str] = []  # per host: where its procs connect back to
    for host in range(len(launcher.hosts)):
        listen = launcher.listen_host(host)
        if listen not in listeners:
            listeners[listen] = (await trio.open_tcp_listeners(0, host=listen))[0]
        addrs.append(format_addr(listen, listeners[listen].socket.getsockname()[1]))
    await nursery.start(state.serve, list(listeners.values()))
    try:
        if workspace and not version:
            version = await workspace_version(launcher, workspace)
        specs = _spawn_specs(state, addrs, env, cwd, workspace, version, python,
                             list(python_path))
        errors: list[SpawnError] = []
        async with trio.open_nursery() as starting:
            for proc, spec in zip(state.procs, specs):
                starting.start_soon(_spawn_one, state, proc, spec, errors)
        if errors:
            raise errors[0]
        await state.wait_connected(connect_timeout)
    except BaseException:
        await state.stop()
        raise
    return state


def _spawn_specs(state: MeshState, addrs: list[str], env: dict | None, cwd: str | None,
                 workspace: str | None, version: str | None, python: str | None,
                 python_path: list[str]) -> list[dict[str, Any]]:
    """What the daemons are asked to run, one spec per proc."""
    hosts = [[h.addr, h.name] for h in state.launcher.hosts]
    shared_env = {
        "MONARCH_MESH_HOSTS": wire.compact_json(hosts),
        "MONARCH_MESH_PYTHON_PATH": os.pathsep.join(python_path),
        # What meshes spawned by actors in this proc inherit, with their {placeholders}
        # unexpanded (base64, so the daemon does not expand them for this node).
        "MONARCH_MESH_DEFAULTS": base64.b64encode(wire.compact_json({
            "python": python, "python_path": python_path, "workspace": workspace,
            "version": version}).encode()).decode(),
    }
    options: dict[str, Any] = {}
    if cwd:
        options["cwd"] = cwd
    if workspace:
        options["workspace"] = workspace
        if version:
            options["version"] = version
    argv = [python or sys.executable, "-m", "monarch_fs.mesh.runtime"]
    # The token goes in `secrets`, which the daemon hands over through a pipe, never in an
    # environment (/proc/PID/environ); see daemon/node/procs.py.
    secrets = {"MONARCH_MESH_TOKEN": state.token.hex()}
    return [{"argv": argv, "secrets": secrets, "env": {
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
        "MONARCH_MESH_ADDR": addrs[proc.host],
        "MONARCH_MESH_NAME": state.name,
        "MONARCH_MESH_RANK": str(proc.rank),
        "MONARCH_MESH_WORLD_SIZE": str(len(state.procs)),
        "MONARCH_MESH_LOCAL_RANK": str(proc.local_rank),
        "MONARCH_MESH_HOST": str(proc.host),
        **shared_env,
    }, **options} for proc in state.procs]


async def _spawn_one(state: MeshState, proc: Proc, spec: dict[str, Any],
                     errors: list[SpawnError]) -> None:
    try:
        # Once asked, learn the proc id (so stop() can kill it) even if we are being cancelled.
        reply = None
        with trio.CancelScope(shield=True, deadline=trio.current_time() + SPAWN_TIMEOUT):
            reply = await state.launcher.spawn(
                proc.host, spec, lambda kind, data: state.on_proc_event(proc, kind, data))
    except MeshError as e:
        errors.append(SpawnError(f"proc mesh {state.name!r}, rank {proc.rank}: {e}"))
        return
    if reply is None:
        errors.append(SpawnError(f"proc mesh {state.name!r}, rank {proc.rank}: {proc.info} "
                                 f"did not answer the spawn request within {SPAWN_TIMEOUT:g}s"))
        return
    proc.proc_id, proc.pid = reply["proc"], reply["pid"]
    proc.spawned.set()


class ProcMesh(Shaped):
    """Procs running the actor runtime, `per_host` on each host; or a slice of them."""

    def __init__(self, state: MeshState, host_coords: tuple[int, ...] | None = None,
                 proc_coords: tuple[int, ...] | None = None) -> None:
        self._state = state
        self._per_host = state.per_host
        self._host_coords = host_coords or tuple(range(len(state.launcher.hosts)))
        self._proc_coords = proc_coords or tuple(range(state.per_host))

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def failure(self) -> Failure | None:
        """Why the mesh failed, once a proc of it has died."""
        return self._state.failure

    @property
    def pids(self) -> dict[int, tuple[str, int | None]]:
        """rank -> (host, pid), for the ranks of this view."""
        procs = self._state.procs
        return {r: (procs[r].info.addr, procs[r].pid) for r in self.ranks}

    def slice(self, host: Selector = None, proc: Selector = None) -> ProcMesh:
        hosts, procs = self._sliced(host, proc)
        return ProcMesh(self._state, hosts, procs)

    async def spawn_async(self, name: str, cls: type | str, *args: Any,
                          **kwargs: Any) -> ActorMesh:
        """Construct `cls(*args, **kwargs)` on every proc of this view, as actor `name`.
        `cls` is a class (procs import it by module and name) or "module:QualName" for code
        only the procs can import (e.g. pushed to the mount, found through python_path)."""
        return await run_async_api(self._state.trio_token, self._spawn, name, cls, args, kwargs)

    def spawn(self, name: str, cls: type | str, *args: Any, **kwargs: Any) -> ActorMesh:
        """spawn_async for synchronous code."""
        return run_sync_api(self._state.trio_token, "spawn", self._spawn, name, cls, args,
                            kwargs)

    async def _spawn(self, name: str, cls: type | str, args: tuple, kwargs: dict) -> ActorMesh:
        module, qualname, main = class_ref(cls)
        state = self._state
        state.check()
        if name in state.actors:
            raise ValueError(f"proc mesh {state.name!r} already has actors named {name!r}")
        pending = state.post_call(self.ranks, "spawn", name, "__init__",
                                  {"module": module, "qualname": qualname, "main": main},
                                  args, kwargs)
        state.actors.add(name)
        assert pending is not None
        await state.wait_call(pending)
        return ActorMesh(state, name, cls if isinstance(cls, type) else None,
                         self._host_coords, self._proc_coords)

    async def stop_async(self) -> None:
        """Stop every proc of the whole mesh (not only this slice): asked to exit, then killed."""
        await run_async_api(self._state.trio_token, self._state.stop)

    def stop(self) -> None:
        run_sync_api(self._state.trio_token, "stop", self._state.stop)

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self.sizes} ranks {self.ranks}>"
