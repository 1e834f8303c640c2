"""The actor runtime: what runs in every proc of a mesh (`python -m monarch_fs.mesh.runtime`).

It connects back to its owner with the per-mesh token from its spawn request's secrets (read
from the pipe the daemon passes, first thing, then closed: the token is never in an environment,
and processes it starts inherit neither the token nor the pipe), says hello with its rank and
pid, and then serves: constructs actors, runs their endpoints, and answers. Each actor handles
its messages one at a time, in order: async endpoints on the proc's asyncio loop
(asyncio_loop.py), sync ones on the actor's own thread (so they may block, keep per-thread
state such as the CUDA device between calls, and use the synchronous mesh API themselves),
which answers the caller itself (actor_slot.py).

An actor may spawn meshes of its own through `self.hosts`. The owner holds the daemon
connections, so the launch requests and the procs' events travel through it (see
owner.OwnerService._serve_owner_request); the new procs connect to this proc directly. Their
failures go to the actor's `__supervise__`; what it does not handle travels up to the owner.

The runtime exits when told to stop, or as soon as its owner's connection ends: a proc never
outlives the controller that started it (and the daemon kills it in that case anyway).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import trio

from ..daemon.node.process_start import read_secrets
from ..daemon.wire import protocol as p
from ..daemon.wire.calls import Call, Calls
from ..daemon.wire.transport import Channel, ConnectError, connect
from . import wire
from .actor_slot import Reply, Slot
from .asyncio_loop import AsyncioLoop
from .calls import error_message
from .context import enter_proc
from .errors import Failure, MeshError, SpawnError
from .hosts import KILL_TIMEOUT, HostInfo, Launcher, OnEvent
from .mesh_ref import use_loop
from .mesh_state import print_output
from .outbox import Outbox
from .owner import MESH_MAX_FRAME
from .peer_service import serve_peers
from .shape import Shaped
from .tensor_buffer import serve_here

EXIT_OWNER_GONE = 3
CLEANUP_GRACE = 3.0  # seconds the actors' __cleanup__ get when their proc is stopped


class OwnerLauncher(Launcher):
    """Launch procs for this proc's actors through the owner, which holds the daemon links."""

    def __init__(self, runtime: Runtime, hosts: list[HostInfo]) -> None:
        self.runtime = runtime
        self.hosts = hosts
        self._calls: Calls[Call[dict]] = Calls()
        self._handlers: dict[int, OnEvent] = {}  # by the id of the launch request

    def listen_host(self, host: int) -> str:
        return self.runtime.local_host

    async def _ask(self, call: Call[dict], header: dict) -> dict:
        """Send `header` to the owner as request `call` and wait for the owner's reply."""
        await self.runtime.send({**header, "req": call.id})
        return await call.result() or {}

    async def spawn(self, host: int, spec: dict, on_event: OnEvent) -> dict:
        with self._calls.expecting(Call()) as call:
            self._handlers[call.id] = on_event
            try:
                return await self._ask(call, {"op": "launch", "host": host, "spec": spec})
            except MeshError as e:
                self._handlers.pop(call.id, None)
                raise SpawnError(str(e)) from None

    async def kill(self, host: int, proc: int, sig: int = 15,
                   timeout: float = KILL_TIMEOUT) -> bool:
        """Handed to our owner, which holds the daemon links and bounds the kill there."""
        await self.runtime.send({"op": "kill", "host": host, "proc": proc, "signal": int(sig)})
        return True

    async def request(self, host: int, op: str, **args: object) -> dict:
        with self._calls.expecting(Call()) as call:
            return await self._ask(call, {"op": "request", "host": host, "name": op,
                                          "args": args})

    def on_message(self, h: dict) -> None:
        """A reply or a launched proc's event from the owner (called by the runtime's reader)."""
        req = h.get("req")
        if h["op"] == "reply":
            if "error" in h:
                self._calls.fail(req, MeshError(str(h["error"])))
            else:
                self._calls.settle(req, h.get("value") or {})
        elif h["op"] == "proc_event" and isinstance(req, int):
            handler = self._handlers.get(req)
            if handler is not None:
                kind = str(h.get("kind"))
                if kind in ("exit", "lost"):
                    self._handlers.pop(req, None)
                handler(kind, h.get("data") or {})


class Runtime:
    """The actor runtime inside one spawned proc: it connects back to its owner with the
    mesh's secret and serves the actors spawned in it."""

    def __init__(self, env: dict[str, str], secrets: dict[str, str]) -> None:
        self.addr = env["MONARCH_MESH_ADDR"]
        self.token = bytes.fromhex(secrets["MONARCH_MESH_TOKEN"])
        self.peer_token = bytes.fromhex(secrets.get("MONARCH_MESH_PEER_TOKEN", "")) or self.token
        self.rank = int(env["MONARCH_MESH_RANK"])
        self.world_size = int(env.get("MONARCH_MESH_WORLD_SIZE", "1"))
        self.local_rank = int(env.get("MONARCH_MESH_LOCAL_RANK", "0"))
        self.host = int(env.get("MONARCH_MESH_HOST", "0"))
        self.hosts = [HostInfo(a, n) for a, n in json.loads(env.get("MONARCH_MESH_HOSTS", "[]"))]
        dims = json.loads(env.get("MONARCH_MESH_DIMS", "[]")) or [["hosts", len(self.hosts)]]
        shape = Shaped()
        shape._init_shape(tuple(d for d, _ in dims), tuple(n for _, n in dims))
        enter_proc(shape.point_of(self.rank), self.host)
        self.local_host = "127.0.0.1"
        defaults = env.get("MONARCH_MESH_DEFAULTS")
        self.defaults = json.loads(base64.b64decode(defaults)) if defaults else {}
        self.actors: dict[str, Slot] = {}
        self.aio = AsyncioLoop()  # where async endpoints run
        self.host_meshes: list[Any] = []
        self.launcher = OwnerLauncher(self, self.hosts)
        # Bounded: whoever answers waits while the owner's connection is busy. The writer
        # drains it on its own (the owner's reader never waits on us), so the reader may wait
        # here too without a deadlock.
        self.outbox = Outbox()
        self.nursery: trio.Nursery | None = None
        self.trio_token: trio.lowlevel.TrioToken | None = None  # the loop's, once it runs
        self.stopping = False
        self.exit_code = EXIT_OWNER_GONE

    async def post(self, msg: p.Data) -> None:
        """Send `msg` to the owner, in order; dropped once the connection is going away."""
        await self.outbox.post(msg)

    async def send(self, header: dict) -> None:
        await self.post(wire.encode(header))

    def post_from_thread(self, msg: p.Data, reply_to: Reply) -> None:
        """An actor thread's answer: written on its caller's link (the owner's, or a direct
        caller's) from that thread when nothing is queued ahead of it, else via the loop."""
        now = self.outbox.send_now if reply_to == self.post else getattr(
            reply_to, "send_now", None)  # a direct caller's (peer_service.PeerReply)
        if now is not None and now(msg):
            return
        try:
            trio.from_thread.run(reply_to, msg, trio_token=self.trio_token)
        except trio.RunFinishedError:
            pass  # the proc is exiting: its owner is gone or told it to stop

    def host_mesh_for(self, slot: Slot) -> Callable[[], Any]:
        """A getter of the hosts as one actor sees them (meshes it spawns report failures to
        it), made on first use, from any thread: most actors spawn nothing, and host_mesh.py's
        imports cost ~20 ms of CPU."""
        token = trio.lowlevel.current_trio_token()
        made: list[Any] = []

        def make() -> None:  # on the runtime's loop
            if made:
                return
            from .host_mesh import HostMesh

            def supervise(failure: Failure) -> None:
                slot.mailbox.send_nowait(({"op": "supervise"}, failure, self.post))

            assert self.nursery is not None
            hosts = HostMesh(self.launcher, self.nursery, supervisor=supervise,
                             output=print_output)
            hosts._defaults = self.defaults
            self.host_meshes.append(hosts)
            made.append(hosts)

        def get() -> Any:
            if not made:
                try:
                    trio.lowlevel.current_trio_token()
                except RuntimeError:  # an actor's thread, or its asyncio loop
                    trio.from_thread.run_sync(make, trio_token=token)
                else:
                    make()
            return made[0]

        return get

    async def run(self) -> int:
        try:
            # Encrypted when the owner is on another host, else authenticated only (as push).
            chan = await connect(self.addr, self.token, encrypt="auto")
        except ConnectError as e:
            print(f"monarch-fs runtime: cannot reach the controller: {e}", file=sys.stderr)
            return 2
        chan.conn.max_frame = MESH_MAX_FRAME
        self.local_host = chan.local_host
        self.trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            use_loop(nursery)  # actor meshes passed to our actors are called from here
            peer = await nursery.start(serve_peers, self.peer_token, self.local_host,
                                       {"mesh": "peer", "rank": self.rank}, self.deliver)
            serve_here(peer, self.peer_token, trio.lowlevel.current_trio_token())
            await chan.send(wire.encode({"op": "hello", "rank": self.rank, "pid": os.getpid(),
                                         "peer": peer}))
            nursery.start_soon(self.outbox.writer, chan)
            await self._serve(chan)  # until the owner goes away, or _stop() cancels it
            nursery.cancel_scope.cancel()
        await trio.aclose_forcefully(chan.stream)
        self.aio.stop()
        return self.exit_code

    async def _stop(self) -> None:
        """Told to stop: stop the meshes our actors own (their procs' exits still arrive
        through the owner, so the reader keeps going meanwhile), send what is queued, exit."""
        self.stopping = True
        for hosts in self.host_meshes:
            await hosts._stop_all()
        with trio.move_on_after(CLEANUP_GRACE):  # each actor's __cleanup__, after its messages
            for slot in list(self.actors.values()):
                slot.mailbox.send_nowait(({"op": "stop_actor", "call": None}, None, self.post))
            for slot in list(self.actors.values()):
                await slot.finished.wait()
        self.outbox.close()
        with trio.move_on_after(2):
            await self.outbox.flushed.wait()
        self.exit_code = 0
        assert self.nursery is not None
        self.nursery.cancel_scope.cancel()

    async def _serve(self, chan: Channel) -> None:
        assert self.nursery is not None
        async for h, msg in wire.messages(chan):
            op = h["op"]
            if op == "stop":
                if not self.stopping:
                    self.nursery.start_soon(self._stop)
            elif op in ("reply", "proc_event"):
                self.launcher.on_message(h)
            elif op == "log_level":
                set_log_level(int(h.get("level", logging.INFO)))
                await self.post(wire.encode({"op": "result", "call": h.get("call")}, None,
                                            has_body=True))
            elif op in ("spawn", "call", "stop_actor"):
                await self.deliver(h, msg, self.post)
            del msg  # not held while the next message is received (message_buffers.py)

    async def deliver(self, h: dict, msg: p.Data, reply_to: Reply) -> None:
        """A message for an actor, from the owner or a peer, into that actor's mailbox."""
        if self.stopping:
            return
        assert self.nursery is not None
        name = str(h.get("actor"))
        slot = self.actors.get(name)
        if slot is None and h["op"] == "spawn":
            slot = self.actors[name] = Slot(self, name)
            self.nursery.start_soon(slot.run)
        if slot is None:
            if h.get("call") is not None:
                await reply_to(error_message(h["call"], name, h.get("method", "?"), "MeshError",
                                             f"no actor {name!r} on this proc", ""))
            return
        slot.mailbox.send_nowait((h, msg, reply_to))


def set_log_level(level: int) -> None:
    """The level of this proc's root logger (with a stderr handler if it has none)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(level)


def main() -> int:
    secrets = read_secrets()  # before anything else runs: then the pipe is closed
    if "MONARCH_MESH_TOKEN" not in secrets:
        print("monarch-fs runtime: no mesh token: a runtime is started by its proc mesh, "
              "through a daemon", file=sys.stderr)
        return 2
    env = dict(os.environ)
    os.environ.pop("MONARCH_MESH_ADDR", None)  # the actors' children are not mesh procs
    path = [e for e in env.get("MONARCH_MESH_PYTHON_PATH", "").split(os.pathsep) if e]
    sys.path[:0] = path
    return trio.run(Runtime(env, secrets).run)


if __name__ == "__main__":
    sys.exit(main())
