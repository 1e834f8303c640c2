"""The manifest arrives ahead of the files: a session tells the store where each large file's
chunks go as soon as the manifest's root object is here, before any of those chunks is written
(fs/file_objects.py writes each one once, in place).

Beside the stream, not in its way: loading the manifest takes a node a while (0.2-0.3 s for a
venv of 43k files), and in the receiving task it held the dev box up. So the placement is a
task of its own (`start`), and only a chunk that may be a large file's waits for it (`wait`);
the small files the push sends first meanwhile (client/send_order.py `lead`) are stored."""

from __future__ import annotations

import logging

import trio

from ...fs.backing import MIN_SIZE, place_files
from ...fs.chunk import CorruptChunk
from ...fs.manifest import ManifestError
from .publisher import Publisher
from .writes import ChunkWrites

log = logging.getLogger("monarch_fs.daemon")


async def place(publisher: Publisher, writes: ChunkWrites, nursery: trio.Nursery, cid: bytes,
                blob: bytes | memoryview) -> None:
    """The manifest `cid` arrived (its folder objects, the root last), in a session whose
    chunks `writes` stores. Loaded on a worker thread once the objects before the root are
    stored; one that does not load places nothing (over RDMA the root may come before other
    objects), and prepare says why if it still does not."""
    try:
        await writes.written(nursery)  # the objects that came before the root
        manifest = await publisher.manifest(cid, blob)  # prepare's, loaded once
        placed = await trio.to_thread.run_sync(place_files, publisher.store, manifest)
    except (KeyError, CorruptChunk, ManifestError, OSError) as e:
        log.info("manifest %s: large files go to packs: %s", cid.hex()[:12], e)
        return
    if placed:
        log.debug("manifest %s: %d large files written in place", cid.hex()[:12], placed)


def start(publisher: Publisher, writes: ChunkWrites, nursery: trio.Nursery, cid: bytes,
          blob: bytes | memoryview) -> trio.Event:
    """place() as a task of `nursery`: the event is set once it is done, placed or not."""
    placed = trio.Event()

    async def run() -> None:
        try:
            await place(publisher, writes, nursery, cid, blob)
        finally:
            placed.set()

    nursery.start_soon(run)
    return placed


async def wait(placed: trio.Event | None, blob: bytes | memoryview | None = None) -> None:
    """Wait for the placement (`start`'s event), if any: for a chunk, only if `blob` may be a
    large file's (a smaller one is a small file's, or a large file's tail: a pack holds it
    until settle)."""
    if placed is not None and (blob is None or len(blob) >= MIN_SIZE):
        await placed.wait()
