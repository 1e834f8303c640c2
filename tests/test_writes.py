"""A connection's chunk writes (daemon/node/writes.py): batches stored on worker threads, and
what a task beside the receiving one can wait for. Real store, real threads."""

from __future__ import annotations

import os

import trio
import trio.testing

from monarch_fs.daemon.node.writes import WRITE_BATCH_CHUNKS, ChunkWrites
from monarch_fs.daemon.wire.protocol import PutChunk
from monarch_fs.fs.chunk import chunk_id, encode
from monarch_fs.fs.store import Store


def chunks(n: int) -> list[PutChunk]:
    out = []
    for _ in range(n):
        data = os.urandom(100)
        out.append(PutChunk(chunk_id(data), encode(data)))
    return out


async def test_written_waits_for_a_batch_still_waiting_for_the_limiter(tmp_path):
    """The chunks received before `written` is called are stored when it returns, even those
    of a batch that left the receiving task but still waits for a write slot (a manifest's
    folder objects, which its placement then loads): it returned early, and the load found an
    object missing and put every large file in packs."""
    store = Store(tmp_path / "store")
    limiter = trio.CapacityLimiter(1)
    writes = ChunkWrites(store, raw=True, counters={"chunks_stored": 0}, limiter=limiter)
    first = chunks(WRITE_BATCH_CHUNKS)  # a whole batch: launched by the last start()
    busy = object()
    await limiter.acquire_on_behalf_of(busy)  # every write slot taken
    try:
        async with trio.open_nursery() as nursery:
            async def receive() -> None:
                for msg in first:
                    await writes.start(nursery, msg)

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()  # its batch waits for the limiter
            assert not store.has(first[0].cid)
            got: list[bool] = []

            async def beside() -> None:
                await writes.written(nursery)
                got.append(all(store.has(m.cid) for m in first))

            nursery.start_soon(beside)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # not while that batch waits
            limiter.release_on_behalf_of(busy)
            busy = None
        assert got == [True]
        assert writes.counters["chunks_stored"] == WRITE_BATCH_CHUNKS and not writes.errors
    finally:
        if busy is not None:
            limiter.release_on_behalf_of(busy)
        store.close()
