"""Actor meshes passed as arguments: a pickled ActorMesh is a reference by which any process
of the job calls those actors directly, without going through the controller.

    class Generator(Actor):
        @endpoint
        def run(self, buffer):                  # buffer: an ActorMesh the controller passed
            buffer.add.call(self.sample()).get()   # straight to the buffer's procs

Every proc of a mesh listens on a port of its own for direct calls. A reference holds the
procs' addresses and the mesh's peer token: a fresh random secret, separate from the token by
which procs connect to their owner, handed to the procs through their secrets pipe and to
holders of a reference only inside mesh messages (which travel on authenticated connections).
A direct connection runs the same HMAC handshake as every other connection; nothing is
unpickled before it.

The process that owns the mesh calls it through its own connections; any other process opens
one connection per proc it calls, in the loop registered here (the runtime's, or a host
mesh's), and keeps it. Answers come back on it; a broken connection fails the calls waiting on
that rank (the owner supervises the proc itself).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.transport import ConnectError, connect
from . import wire
from .calls import CallTarget, MeshRef, settle_answer
from .errors import Failure, MeshError, SupervisionError
from .owner import MESH_MAX_FRAME

_lock = threading.Lock()
_owned: weakref.WeakValueDictionary[bytes, CallTarget] = weakref.WeakValueDictionary()
_peers: dict[bytes, PeerMesh] = {}
_loop: list[tuple[trio.Nursery, trio.lowlevel.TrioToken]] = []  # where PeerMesh tasks run


def register_owned(token: bytes, state: CallTarget) -> None:
    with _lock:
        _owned[token] = state


def use_loop(nursery: trio.Nursery) -> None:
    """Open the direct connections of this process in `nursery`'s loop (the latest wins)."""
    with _lock:
        _loop.append((nursery, trio.lowlevel.current_trio_token()))


def leave_loop(nursery: trio.Nursery) -> None:
    with _lock:
        _loop[:] = [entry for entry in _loop if entry[0] is not nursery]
        for token, peer in list(_peers.items()):
            if peer.nursery is nursery:
                del _peers[token]


def state_for(ref: MeshRef) -> CallTarget:
    """The mesh a reference names: the owner's own state here, else direct connections."""
    with _lock:
        owned = _owned.get(ref.token)
        if owned is not None and not owned.stopping:
            return owned
        peer = _peers.get(ref.token)
        if peer is not None and peer.ref.addrs != ref.addrs:
            peer.refresh(ref)  # a rank was respawned: a fresh proc at a new address
        if peer is None:
            if not _loop:
                raise MeshError(f"actor mesh of proc mesh {ref.name!r} arrived in a process "
                                "with no mesh loop: open a HostMesh first")
            peer = _peers[ref.token] = PeerMesh(ref, *_loop[-1])
        return peer


@dataclass
class PeerRank:
    """One proc of a mesh this process calls directly."""

    rank: int
    info: str
    addr: str
    failure: Failure | None = None
    started: bool = False
    outbox: trio.MemorySendChannel[p.Data] = field(init=False)
    inbox: trio.MemoryReceiveChannel[p.Data] = field(init=False)

    def __post_init__(self) -> None:
        # Unbounded, as a proc's outbox on the owner's side (mesh_state.Proc says why).
        self.outbox, self.inbox = trio.open_memory_channel[p.Data](math.inf)

    def post(self, msg: p.Data) -> None:
        try:
            self.outbox.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class PeerMesh(CallTarget):
    """A proc mesh that this process calls directly, through a reference it was given."""

    def __init__(self, ref: MeshRef, nursery: trio.Nursery,
                 token: trio.lowlevel.TrioToken) -> None:
        self.ref, self.nursery, self.trio_token = ref, nursery, token
        self.name, self.dims, self.extent = ref.name, ref.dims, ref.extent
        self.per_host = math.prod(ref.extent[1:])
        self.procs = [PeerRank(r, info, addr)
                      for r, (info, addr) in enumerate(zip(ref.hosts, ref.addrs))]
        self._init_calls()

    def mesh_ref(self) -> MeshRef:
        return self.ref

    def refresh(self, ref: MeshRef) -> None:
        """A newer reference: ranks at a new address are new procs, to connect to afresh."""
        for rank, addr in enumerate(ref.addrs):
            if addr != self.procs[rank].addr:
                self.procs[rank].outbox.close()
                self.procs[rank] = PeerRank(rank, ref.hosts[rank], addr)
        self.ref = ref

    def start_call(self, ranks: list[int], msg: p.Data, pending: object) -> None:
        super().start_call(ranks, msg, pending)  # type: ignore[arg-type]
        for rank in ranks:
            proc = self.procs[rank]
            if not proc.started:
                proc.started = True
                self.nursery.start_soon(self._serve, proc)

    async def _serve(self, proc: PeerRank) -> None:
        try:
            chan = await connect(proc.addr, self.ref.token, encrypt="auto")
        except ConnectError as e:
            self._fail(proc, f"cannot reach it directly: {e}")
            return
        chan.conn.max_frame = MESH_MAX_FRAME

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wire.forward, chan, proc.inbox)
            async for h, msg in wire.messages(chan):
                if h["op"] in ("result", "error"):
                    settle_answer(self.calls, proc.rank, proc.info, h, msg)
            nursery.cancel_scope.cancel()
        await trio.aclose_forcefully(chan.stream)
        self._fail(proc, "its direct connection closed (the proc is gone)")

    def _fail(self, proc: PeerRank, reason: str) -> None:
        proc.failure = Failure(self.name, proc.rank, proc.info, reason=reason)
        proc.outbox.close()
        for call in self.calls.pending():
            if proc.rank in call.remaining:
                call.set_error(SupervisionError(proc.failure, f"{call.actor}.{call.method}"))
                self.calls.remove(call)
