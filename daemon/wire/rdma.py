"""RDMA bulk channels: RC queue pairs (InfiniBand, RoCE) and SRD (AWS EFA) behind bulk.py's
BulkSender / BulkReceiver.

The protocol itself (ring, credits, reordering, the completion state machines) lives in
rdma_engines.py and is tested without hardware; the verbs resources are rdma_endpoint.py's and
the devices rdma_devices.py's. This module sets a channel up over the control channel and runs
it: it posts the work requests the state machines ask for and feeds them the completions.

Completions are polled without blocking trio: `CQ.poll()` never blocks, and an empty poll sleeps
on the trio loop with a short backoff (rdma_engines.Backoff). A completion channel would let us
`trio.lowlevel.wait_readable()` its fd instead, but pyverbs' CompChannel does not expose the fd
(rdma-core 44 through 59), and a thread blocked in `get_cq_event()` cannot be cancelled.

Environment (optional, see monarch_fs/settings.py): MONARCH_FS_RDMA_SLOTS,
MONARCH_FS_RDMA_SLOT_SIZE (the ring geometry a sender proposes).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ...settings import settings
from .bulk_channel import BulkError, BulkReceiver, BulkSender, Deliver
from .rdma_endpoint import RdmaEndpoint
from .rdma_engines import RECV, Backoff, PostRecv, ReceiverEngine, SenderEngine
from .rdma_format import BulkProtocolError, check_geometry, decode_credit
from .seal import ChunkSealer, SealError

log = logging.getLogger("monarch_fs.rdma")


def _geometry() -> tuple[int, int]:
    slots, size = settings.rdma_slots, settings.rdma_slot_size
    check_geometry(slots, size)
    return slots, size


# ---- the bulk channels ---------------------------------------------------------------------------


class RdmaSender(BulkSender):
    """Sends chunks over one queue pair. No background task: send_chunk() and flush() poll the
    CQ themselves (credits, completions) while they wait, yielding to trio between polls."""

    def __init__(self, ep: RdmaEndpoint, engine: SenderEngine, peer: str, sealer: ChunkSealer):
        super().__init__()
        self.kind = ep.mode
        self.ep = ep
        self.engine = engine
        self.peer = peer
        # RDMA bytes bypass the session's sealed frames: each chunk carries its own seal.
        self._sealer = sealer
        self._backoff = Backoff()
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, chan: Any, mode: str, dev: dict) -> RdmaSender:
        """Create our queue pair and ring, trade queue-pair info over `chan`, go to RTS."""
        from pyverbs.pyverbs_error import PyverbsError

        try:
            return await cls._connect(chan, mode, dev)
        except (PyverbsError, BulkProtocolError) as e:
            raise BulkError(f"rdma setup with {chan.peer} failed: {e}") from e

    @classmethod
    async def _connect(cls, chan: Any, mode: str, dev: dict) -> RdmaSender:
        slots, size = _geometry()
        ep = RdmaEndpoint(mode, dev, slots, size, receiver=False)
        try:
            for buf in range(slots):  # credit messages may arrive as soon as the peer is up
                ep.post_recv(buf)
            reply = await chan.request("bulk", kind=mode, device_kind=dev["kind"], qp=ep.info(),
                                       slots=slots, slot_size=size)
            peer = reply.get("qp")
            if not isinstance(peer, dict):
                raise BulkProtocolError("bulk reply carries no queue-pair info")
            ep.connect(peer)
        except BaseException:
            ep.close()
            raise
        log.info("bulk %s channel to %s (%s)", mode, chan.peer, dev["name"])
        return cls(ep, SenderEngine(mode, slots, size), chan.peer, ChunkSealer(chan.conn.bulk_key))

    def _check(self) -> None:
        # Not prefixed with the peer: push and the relay report it under the node's address.
        if self.engine.error:
            raise BulkError(f"rdma: {self.engine.error}")

    def _post(self) -> None:
        for w in self.engine.work():
            self.ep.write_slot(w.slot, w.header, w.payload)
            self.ep.post_data(w)

    def _poll(self) -> int:
        cs = self.ep.poll()
        for c in cs:
            if c.kind == RECV and c.ok:
                self.engine.on_credit(decode_credit(self.ep.read_msg(c.wr_id)))
            for r in self.engine.on_completion(c):
                self.ep.post_recv(r.buf)
        return len(cs)

    async def _pump(self, done) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            while True:
                self._check()
                self._post()
                if done():
                    return
                if self._poll():
                    self._backoff.reset()
                    continue
                delay = self._backoff.next_delay()
                await (trio.sleep(delay) if delay else trio.lowlevel.checkpoint())
        except (PyverbsError, BulkProtocolError) as e:
            self.engine.error = self.engine.error or str(e)
            self._check()

    async def send_chunk(self, cid: bytes, blob: bytes | memoryview) -> None:
        async with self._lock:
            self._check()
            self.engine.submit(cid, b"".join((blob, self._sealer.seal(cid, blob))))
            await self._pump(lambda: self.engine.queued == 0)  # all posted; may be in flight
            self.chunks_sent += 1
            self.bytes_sent += len(blob)

    async def flush(self) -> dict:
        async with self._lock:
            await self._pump(lambda: self.engine.idle)
            return {"bulk_chunks": self.engine.chunks_submitted}

    async def aclose(self) -> None:
        self.ep.close()

    def describe(self) -> dict:
        return {**super().describe(), "peer": self.peer, "device": self.ep.dev.get("name")}


class RdmaReceiver(BulkReceiver):
    """Receives chunks over one queue pair; run() polls the CQ and delivers in order."""

    def __init__(self, ep: RdmaEndpoint, engine: ReceiverEngine, deliver: Deliver):
        super().__init__(deliver)
        self.kind = ep.mode
        self.ep = ep
        self.engine = engine
        self._backoff = Backoff()
        self._closed = False
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._started = False

    @classmethod
    def accept(cls, mode: str, dev: dict, args: dict, deliver: Deliver,
               key: bytes) -> RdmaReceiver:
        """`key`: the control session's bulk key, which every chunk's seal must verify under."""
        opener = ChunkSealer(key)

        async def checked(cid: bytes, sealed: bytes | memoryview) -> None:
            try:
                blob = opener.open(cid, sealed)
            except SealError as e:
                raise BulkProtocolError(str(e)) from None
            await deliver(cid, blob)

        peer = args.get("qp")
        slots, size = check_geometry(args.get("slots"), args.get("slot_size"))
        if not isinstance(peer, dict):
            raise BulkProtocolError("bulk request carries no queue-pair info")
        ep = RdmaEndpoint(mode, dev, slots, size, receiver=True)
        try:
            for buf in range(slots):
                ep.post_recv(buf)
            ep.connect(peer)
        except BaseException:
            ep.close()
            raise
        engine = ReceiverEngine(mode, slots, size, ep.read_slot)
        return cls(ep, engine, checked)

    def reply(self) -> dict:
        return {"qp": self.ep.info()}

    async def run(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        self._started = True
        try:
            with self._scope:
                await self._loop()
        except (PyverbsError, BulkProtocolError, BulkError) as e:
            if not self._closed:
                self._fail(str(e))
        finally:
            self._done.set()

    async def _loop(self) -> None:
        ep, engine = self.ep, self.engine
        while not self._closed:
            cs = ep.poll()
            if not cs:
                delay = self._backoff.next_delay()
                await (trio.sleep(delay) if delay else trio.lowlevel.checkpoint())
                continue
            self._backoff.reset()
            for c in cs:
                msg = ep.read_msg(c.wr_id) if c.kind == RECV and c.ok else b""
                work, chunks = engine.on_completion(c, msg)
                if engine.error:
                    raise BulkProtocolError(engine.error)
                for w in work:
                    if isinstance(w, PostRecv):
                        ep.post_recv(w.buf)
                    else:
                        ep.post_read(w)
                for cid, blob in chunks:
                    await self._delivered(cid, blob)  # may wait: the sender waits for credit
            credit = engine.credit()
            if credit is not None:
                ep.post_credit(credit.released)

    async def aclose(self) -> None:
        """Stop run() first (it may be mid-delivery), then free the verbs resources."""
        self._closed = True
        self._scope.cancel()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                if self._started:
                    await self._done.wait()
        self.ep.close()
