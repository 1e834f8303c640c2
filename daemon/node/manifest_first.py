"""The manifest arrives ahead of the files: a session tells the store where each large file's
chunks go as soon as the manifest's root object is here, before any of those chunks is written
(fs/file_objects.py writes each one once, in place)."""

from __future__ import annotations

import logging

import trio

from ...fs.backing import place_files
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
