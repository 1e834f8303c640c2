"""The owner's side of a proc mesh's connections.

The owner (the controller, or an actor that spawns meshes) listens on a fresh port with a fresh
random token that only these procs receive, and each proc connects back, authenticates and says
hello with its rank and pid. Calls then travel over those connections, one reader and one writer
task per proc. The readers route what arrives: results and errors to the calls in flight, an
actor's unhandled failure to supervision, and the launch requests of actors that spawn meshes of
their own to the daemons (the owner holds the daemon connections).
"""

from __future__ import annotations

import signal

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.limits import Limits, serve_listeners
from ..daemon.wire.transport import Channel, accept
from . import wire
from .calls import settle_answer
from .errors import Failure, MeshError
from .link_writer import LinkWriter
from .mesh_state import MeshState, Proc, log

MESH_MAX_FRAME = 2 * wire.PIECE  # a larger message goes as pieces (wire.send)
EXIT_WAIT = 5.0  # seconds to wait for the daemon's exit report after a proc's connection drops
HELLO_TIMEOUT = 10.0


class OwnerService:
    """The listener the procs of one mesh connect back to, and a reader and a writer per proc;
    it changes the mesh's state only through MeshState."""

    def __init__(self, state: MeshState) -> None:
        self.state = state

    async def serve(self, listeners: list[trio.SocketListener],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        state = self.state
        with trio.CancelScope() as state.scope:
            async with trio.open_nursery() as nursery:
                state.nursery = nursery
                # Only these procs ever connect; the limits keep strangers cheap.
                limits = Limits(max_connections=len(state.procs) + 64,
                                max_per_peer=len(state.procs) + 64,
                                handshake_timeout=HELLO_TIMEOUT)
                await nursery.start(serve_listeners, self._connection, listeners, limits, log)
                task_status.started()
                await trio.sleep_forever()

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            chan = await accept(stream, self.state.token, {"mesh": self.state.name},
                                timeout=HELLO_TIMEOUT)
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
        state = self.state
        if proc.failure is None and not state.stopping:
            with trio.move_on_after(EXIT_WAIT):  # the daemon's report says more, if it comes
                await proc.exited.wait()
            state.fail(proc, state.failure_of(proc, "closed its connection to the controller"))

    async def _hello(self, chan: Channel) -> Proc | None:
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                msg = await chan.receive()
            h = wire.header(msg) if isinstance(msg, p.Data) else {}
            proc = self.state.procs[int(h["rank"])]
            with trio.fail_after(HELLO_TIMEOUT):
                await proc.spawned.wait()
        except (Exception, trio.TooSlowError):
            return None
        if h.get("op") != "hello" or proc.chan is not None or h.get("pid") != proc.pid:
            return None
        proc.chan = chan
        proc.link = LinkWriter(chan, proc.outbox.send_nowait)
        proc.link.pending = proc.outbox.statistics().current_buffer_used  # posted before
        proc.peer = str(h.get("peer") or "")
        self.state.wake()
        return proc

    async def _writer(self, proc: Proc, chan: Channel) -> None:
        """Write what proc.post queued (it writes a small message itself when nothing is)."""
        link = proc.link
        assert link is not None
        async for msg in proc.outbox_receive:
            await link.write(msg)

    async def _reader(self, proc: Proc, chan: Channel) -> None:
        async for h, msg in wire.messages(chan):
            self._message(proc, h, msg)
            del msg  # not held while the next message is received (message_buffers.py)

    def _message(self, proc: Proc, h: dict, msg: p.Data) -> None:
        state = self.state
        op = h["op"]
        if op in ("result", "error"):
            settle_answer(state.calls, proc.rank, str(proc.info), h, msg)
        elif op == "failure":  # an actor did not handle the failure of a mesh it owns
            nested = str(h.get("description", "a mesh it owns failed"))
            reason = f"actor {h.get('actor')!r} did not handle a failure of its mesh: {nested}"
            state.fail(proc, Failure(state.name, proc.rank, str(proc.info), proc.pid,
                                    reason=reason))
        elif op in ("launch", "kill", "request"):
            assert state.nursery is not None
            state.nursery.start_soon(self._serve_owner_request, proc, h)

    # ---- meshes owned by actors: their launches go through us --------------------------

    async def _serve_owner_request(self, proc: Proc, h: dict) -> None:
        """An actor in `proc` spawns or stops procs of its own, or asks a daemon something: we
        hold the daemon connections, so do it for it and forward the procs' events back."""
        launcher = self.state.launcher
        req = h.get("req")
        try:
            host = int(h["host"])
            if not 0 <= host < len(launcher.hosts):
                raise MeshError(f"no host {host}")
            if h["op"] == "kill":
                if (host, h.get("proc")) in proc.launched:
                    await launcher.kill(host, int(h["proc"]), int(h.get("signal", 15)))
                return
            if h["op"] == "request":
                name = str(h.get("name"))
                if name not in ("status", "free_port"):
                    raise MeshError("only status and free_port requests are forwarded")
                value = await launcher.request(host, name)
                proc.post(wire.encode({"op": "reply", "req": req, "value": value}))
                return

            def forward(kind: str, data: dict) -> None:
                proc.post(wire.encode({"op": "proc_event", "req": req, "kind": kind,
                                       "data": data}))

            spec = dict(h.get("spec") or {})
            if proc.failure is not None or self.state.stopping:
                raise MeshError("the requesting proc is going away")
            reply = await launcher.spawn(host, spec, forward)
            proc.launched.append((host, reply["proc"]))
            if proc.failure is not None:  # it died while we launched
                await launcher.kill(host, reply["proc"], signal.SIGKILL)
            proc.post(wire.encode({"op": "reply", "req": req, "value": reply}))
        except Exception as e:
            proc.post(wire.encode({"op": "reply", "req": req, "error": str(e)}))
