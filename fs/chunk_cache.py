"""A bounded cache of decoded chunks for the read path.

The kernel reads a file in requests of at most a few hundred KiB, so without a cache one 4 MiB
zstd chunk would be read, decompressed and verified dozens of times. Loads run in worker threads
(disk, decompression and hashing must not stall the FUSE loop), and concurrent readers of one
chunk share a single load; except that a `load_cached` function, which must never block (a small
chunk already in the page cache), is tried first on the caller's thread.

A chunk the store lacks (a version published before all of it arrived: push --early) is
handed to `fetch`, which returns once the chunk is stored (asking whoever streams it to send it
first) or raises; the chunk is then loaded, and verified, from the store like any other.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

LOAD_THREADS = 4  # chunk loads (read, decompress, hash) running at once


class ChunkCache:
    """Decoded chunks for the read path, bounded in bytes (LRU): a sequential reader takes one
    chunk in many requests, and decoding it again for each would cost more than the read."""

    def __init__(self, load: Callable[[bytes], bytes | memoryview],
                 max_bytes: int = 128 * 1024 * 1024,
                 load_cached: Callable[[bytes], bytes | memoryview | None] | None = None,
                 fetch: Callable[[bytes], Awaitable[None]] | None = None):
        self._load = load
        self.fetch = fetch  # a missing chunk: wait until it is stored, or raise
        self._load_cached = load_cached
        self._max = max_bytes
        self._bytes = 0
        self._data: OrderedDict[bytes, bytes | memoryview] = OrderedDict()
        self._loading: dict[bytes, trio.Event] = {}
        self._limiter = trio.CapacityLimiter(LOAD_THREADS)
        self.hits = 0
        self.misses = 0
        self.nowait = 0  # misses answered by load_cached, without a worker thread
        self.load_ns = 0  # time spent loading chunks on worker threads (disk, decoding)

    def prefetch(self, nursery: trio.Nursery, cid: bytes) -> None:
        """Start loading a chunk a sequential reader will want next, unless it is underway."""
        if cid not in self._data and cid not in self._loading:
            nursery.start_soon(self._prefetch, cid)

    async def _prefetch(self, cid: bytes) -> None:
        try:
            await self.get(cid)
        except Exception:
            pass  # the reader that needs it will get the error itself

    async def get(self, cid: bytes) -> bytes | memoryview:
        while True:
            data = self._data.get(cid)
            if data is not None:
                self._data.move_to_end(cid)
                self.hits += 1
                return data
            pending = self._loading.get(cid)
            if pending is None:
                break
            await pending.wait()  # another reader is loading it; then look again
        self.misses += 1
        if self._load_cached is not None:
            data = self._load_cached(cid)
            if data is not None:
                self.nowait += 1
                self._keep(cid, data)
                return data
        done = self._loading[cid] = trio.Event()
        start = time.perf_counter_ns()
        try:
            try:
                data = await trio.to_thread.run_sync(self._load, cid, limiter=self._limiter)
            except KeyError:
                if self.fetch is None:
                    raise
                await self.fetch(cid)  # stored now, or it raised
                data = await trio.to_thread.run_sync(self._load, cid, limiter=self._limiter)
        finally:
            self.load_ns += time.perf_counter_ns() - start
            del self._loading[cid]
            done.set()
        self._keep(cid, data)
        return data

    def _keep(self, cid: bytes, data: bytes | memoryview) -> None:
        self._data[cid] = data
        self._bytes += len(data)
        while self._bytes > self._max and len(self._data) > 1:
            _, old = self._data.popitem(last=False)
            self._bytes -= len(old)
