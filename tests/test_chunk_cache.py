"""fs/chunk_cache.py: the read path's chunk cache (one load per chunk however many readers,
LRU bounded in bytes, failures not cached), over fakes and over a real store."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from helpers import flip_bits as _flip
from monarch_fs.fs.chunk import CorruptChunk
from monarch_fs.fs.chunk_cache import ChunkCache
from monarch_fs.fs.store import Store


async def cget(cache: ChunkCache, key: bytes) -> bytes:
    with trio.fail_after(5):  # a broken cache fails the test rather than hanging it
        return await cache.get(key)


class Loader:
    """A load function that counts its calls and can be held until released."""

    def __init__(self, size: int = 10, hold: bool = False):
        self.calls: list[bytes] = []
        self.size = size
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, cid_: bytes) -> bytes:
        self.calls.append(cid_)
        self.started.set()
        assert self.release.wait(5), "never released"
        return cid_[:1] * self.size


async def test_concurrent_gets_of_one_chunk_share_one_load():
    load = Loader(hold=True)
    cache = ChunkCache(load)
    results = []

    async def reader():
        results.append(await cget(cache, b"A"))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(reader)
        try:
            with trio.fail_after(5):
                while not load.started.is_set():  # the load is running in its thread...
                    await trio.sleep(0.001)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.05)  # ...and every reader has had time to ask for the chunk
            assert load.calls == [b"A"]  # every other reader is waiting on the one load
        finally:
            load.release.set()
    assert results == [b"A" * 10] * 20
    assert load.calls == [b"A"]
    assert cache.misses == 1 and cache.hits == 19
    assert await cget(cache, b"A") == b"A" * 10 and load.calls == [b"A"]


async def test_distinct_chunks_load_independently():
    load = Loader()
    cache = ChunkCache(load)
    async with trio.open_nursery() as nursery:
        for k in (b"A", b"B", b"C"):
            nursery.start_soon(cget, cache, k)
    assert sorted(load.calls) == [b"A", b"B", b"C"]


async def test_eviction_bounds_cached_bytes_least_recently_used_first():
    load = Loader(size=40)
    cache = ChunkCache(load, max_bytes=100)  # room for two 40-byte chunks
    await cget(cache, b"A")
    await cget(cache, b"B")
    await cget(cache, b"A")  # A is now the most recently used
    await cget(cache, b"C")  # over the bound: B goes
    assert load.calls == [b"A", b"B", b"C"]
    await cget(cache, b"A")
    await cget(cache, b"C")
    assert load.calls == [b"A", b"B", b"C"]
    await cget(cache, b"B")
    assert load.calls == [b"A", b"B", b"C", b"B"]

    # However many chunks pass through, at most two stay cached.
    for k in b"DEFGHIJK":
        await cget(cache, bytes([k]))
    before = len(load.calls)
    for k in b"DEFGHIJK":
        await cget(cache, bytes([k]))
    assert len(load.calls) - before >= 6


async def test_a_chunk_larger_than_the_cache_is_still_served():
    load = Loader(size=1000)
    cache = ChunkCache(load, max_bytes=100)
    assert await cget(cache, b"A") == b"A" * 1000
    assert await cget(cache, b"B") == b"B" * 1000
    assert await cget(cache, b"A") == b"A" * 1000
    assert load.calls == [b"A", b"B", b"A"]


async def test_a_failed_load_is_raised_and_not_cached():
    attempts = []

    def load(c: bytes) -> bytes:
        attempts.append(c)
        if len(attempts) == 1:
            raise CorruptChunk("damaged")
        return b"fine"

    cache = ChunkCache(load)
    with pytest.raises(CorruptChunk):
        await cget(cache, b"A")
    assert await cget(cache, b"A") == b"fine"
    assert attempts == [b"A", b"A"]


async def test_a_miss_found_in_memory_needs_no_load():
    load = Loader()
    cache = ChunkCache(load, load_cached=lambda c: b"mem" if c == b"A" else None)
    assert await cget(cache, b"A") == b"mem" and await cget(cache, b"B") == b"B" * 10
    assert load.calls == [b"B"]
    assert (cache.misses, cache.nowait, cache.hits) == (2, 1, 0)
    assert await cget(cache, b"A") == b"mem" and cache.hits == 1  # kept like any load


async def test_cache_over_a_real_store(tmp_path):
    s = Store(tmp_path / "store")
    data = b"real bytes " * 5000
    c = s.put(data)
    cache = ChunkCache(s.get)
    assert await cget(cache, c) == data
    path, off, _ = s.locate(c)
    _flip(path, off + 1, 0x01)
    assert await cget(cache, c) == data  # served from the cache, already verified
    other = s.put(b"other " * 500)
    path, off, length = s.locate(other)
    _flip(path, off + length - 1, 0x01)
    with pytest.raises(CorruptChunk):
        await cget(cache, other)
