"""Chunk writes of one connection: verified and stored in batches on worker threads."""

from __future__ import annotations

from collections.abc import Callable

import trio

from ...fs.chunk import CorruptChunk
from ...fs.store import Store
from ..wire import protocol as p
from ..wire.requests import RequestError

WRITE_BATCH_BYTES = 4 << 20
WRITE_BATCH_CHUNKS = 256


class ChunkWrites:
    """The store writes one connection has in flight, and the errors they met.

    Chunks are verified and written in batches on worker threads: for a tree of small files a
    thread hop per chunk costs more than the write. A batch goes out when it holds
    WRITE_BATCH_BYTES or WRITE_BATCH_CHUNKS, or when the connection waits for `idle`; the
    daemon-wide limiter bounds the batches in flight, which bounds memory and pushes back on
    the sender."""

    def __init__(self, store: Store, *, raw: bool, counters: dict[str, int],
                 limiter: trio.CapacityLimiter,
                 on_stored: Callable[[list[bytes]], None] | None = None) -> None:
        self.store = store
        self.on_stored = on_stored  # told each batch's ids once written (fetch.Fetcher.stored)
        self.raw = raw  # keep chunks decompressed (NodeService.store_raw)
        self.counters = counters
        self.limiter = limiter
        self.errors: list[str] = []
        self.store_failed = False  # a write failed: what this push stored is given back
        self._batch: list[p.PutChunk] = []
        self._batch_bytes = 0
        self._running: dict[object, trio.Event] = {}  # each batch in flight: set once done

    async def start(self, nursery: trio.Nursery, msg: p.PutChunk) -> None:
        self._batch.append(msg)
        self._batch_bytes += len(msg.blob)
        if self._batch_bytes >= WRITE_BATCH_BYTES or len(self._batch) >= WRITE_BATCH_CHUNKS:
            await self._launch(nursery)

    async def hurry(self, nursery: trio.Nursery) -> None:
        """Write what is batched now: a reader waits for a chunk in it (push --early)."""
        if self._batch:
            await self._launch(nursery)

    async def _launch(self, nursery: trio.Nursery) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        token = object()
        # In flight from now on, for `idle` and `written`: a batch waiting for the limiter
        # holds chunks received before them (a manifest's folder objects, for its placement's
        # load on another task: session.py).
        self._running[token] = trio.Event()
        try:
            await self.limiter.acquire_on_behalf_of(token)
        except BaseException:
            self._running.pop(token).set()
            raise
        nursery.start_soon(self._run, token, batch)

    def _put_all(self, batch: list[p.PutChunk]) -> tuple[int, list[str], bool]:
        """Verify and store a batch (its records in one write: Store.put_blobs); (chunks
        stored, errors, whether the store failed)."""
        try:
            done = self.store.put_blobs([(msg.cid, msg.blob) for msg in batch], raw=self.raw,
                                        digests=[msg.digest for msg in batch])
        except OSError as e:  # a full disk: none of the batch's records was kept
            more = f" (and {len(batch) - 1} more)" if len(batch) > 1 else ""
            return 0, [f"cannot store chunk {batch[0].cid.hex()}{more}: {e.strerror or e}"], True
        errors = [f"rejected {d}" for d in done if isinstance(d, CorruptChunk)]
        return sum(d is True for d in done), errors, False

    async def _run(self, token: object, batch: list[p.PutChunk]) -> None:
        try:
            stored, errors, store_failed = await trio.to_thread.run_sync(self._put_all, batch)
            self.counters["chunks_stored"] += stored
            self.errors += errors
            self.store_failed |= store_failed
            if self.on_stored is not None:
                self.on_stored([msg.cid for msg in batch])
        finally:
            self.limiter.release_on_behalf_of(token)
            self._running.pop(token).set()

    async def idle(self, nursery: trio.Nursery) -> None:
        """Wait until every chunk received so far is stored (or has failed), and every batch
        launched meanwhile."""
        if self._batch:
            await self._launch(nursery)
        while self._running:
            await next(iter(self._running.values())).wait()

    async def written(self, nursery: trio.Nursery) -> None:
        """Wait until every chunk received so far is stored (or has failed): unlike `idle`,
        not for those that arrive meanwhile (a task beside the receiving one, which goes on)."""
        if self._batch:
            await self._launch(nursery)
        for done in list(self._running.values()):
            await done.wait()

    def raise_first(self) -> None:
        """Refuse the request at hand if a chunk of this connection could not be stored."""
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise RequestError(self.errors[0] + more)
