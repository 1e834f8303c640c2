"""What every bulk channel is (bulk.py has the kinds and how one is chosen): a sender that hands
chunk payloads to one peer, and a receiver that delivers them in the order sent. The RDMA
channels (rdma.py) implement it without knowing how a channel is chosen or opened.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from .protocol import PutChunk
from .rdma_format import TCP

log = logging.getLogger("monarch_fs.transport")

Deliver = Callable[[bytes, bytes | memoryview], Awaitable[None]]  # a received chunk's id, blob



class BulkError(Exception):
    """A bulk channel failed (completion error, protocol violation, refused setup)."""


class BulkRefused(BulkError):
    """A node refused to open a bulk channel of the kind asked for."""


# What one send_chunks() call carries at most (or one larger chunk): small chunks are read,
# compressed and sent in batches this big by the pusher and by relays.
BATCH_BYTES = 1 << 20
BATCH_CHUNKS = 256


class BulkSender(abc.ABC):
    """Sends chunk payloads to one peer."""

    kind: str = TCP

    def __init__(self) -> None:
        self.chunks_sent = 0
        self.bytes_sent = 0

    @abc.abstractmethod
    async def send_chunk(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Hand one chunk to the transport; may wait for buffer space (credits)."""

    async def send_chunks(self, batch: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """Hand several (id, blob) pairs over, in order: what a pusher of many small chunks
        calls, so a transport can move them in fewer operations."""
        for cid, blob in batch:
            await self.send_chunk(cid, blob)

    async def send_puts(self, batch: Sequence[PutChunk]) -> None:
        """send_chunks() of received messages: a transport that carries a chunk's seal
        (chunk_seals.py: TCP) forwards it, the others seal the chunk their own way."""
        await self.send_chunks([(msg.cid, msg.blob) for msg in batch])

    @abc.abstractmethod
    async def flush(self) -> dict:
        """Wait until every chunk given to send_chunk() has left this host's buffers; returns
        the arguments the control channel's "flush" request must carry."""

    async def aclose(self) -> None:  # noqa: B027 (optional: a no-op unless overridden)
        """Release the transport's resources (never the control channel: its owner closes it)."""

    def describe(self) -> dict:
        return {"kind": self.kind, "chunks_sent": self.chunks_sent, "bytes_sent": self.bytes_sent}


class BulkReceiver(abc.ABC):
    """Receives chunk payloads from one peer and hands each, in the order sent, to `deliver`."""

    kind: str = TCP

    def __init__(self, deliver: Deliver) -> None:
        self.deliver = deliver
        self.chunks_delivered = 0
        self.bytes_delivered = 0
        self.error: str | None = None
        self._changed = trio.Event()

    @abc.abstractmethod
    async def run(self) -> None:
        """Receive and deliver until closed or failed (run it in a nursery)."""

    async def _delivered(self, cid: bytes, blob: bytes | memoryview) -> None:
        await self.deliver(cid, blob)
        self.chunks_delivered += 1
        self.bytes_delivered += len(blob)
        self._wake()

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            log.warning("bulk %s channel failed: %s", self.kind, why)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_delivered(self, count: int) -> str | None:
        """Wait until `count` chunks were delivered; the channel's error instead, if it failed."""
        while self.chunks_delivered < count and self.error is None:
            await self._changed.wait()
        return self.error if self.chunks_delivered < count else None

    async def aclose(self) -> None:  # noqa: B027 (optional: a no-op unless overridden)
        pass

    def describe(self) -> dict:
        d = {"kind": self.kind, "chunks_delivered": self.chunks_delivered,
             "bytes_delivered": self.bytes_delivered}
        if self.error:
            d["error"] = self.error
        return d
