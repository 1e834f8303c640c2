"""A push's chunks in the forms its links take: the wire form (zstd when that saves 1/16, else
raw) and the raw form (for links faster than the codec: link_codec.py), each read or encoded
once, on a worker thread, and what of it goes into the dev box store.

The send path does only what the bytes need to leave: a read, and a compression only for a
link that takes zstd. Everything else is kept off it:

- a chunk that does not compress (its sample says so: chunk.compressible) is sent as read, and
  the dev box store only records that its wire form is its source (ControllerStore.sourced): a
  copy would be written for nothing, since a later push reads the same bytes from the file
  either way. Writing 1 GiB of such data into the store was 47% of the push process's samples
  (py-spy), and the whole chunk's zstd attempt 18%;
- a chunk that does compress but went raw (a loopback link) is left for after the publish
  (ControllerStore.fill compresses what the store lacks then): zstd beside the send took a
  quarter of a venv push's CPU (py-spy) on the cores the send and the nodes need, and the
  keeper's budget left part of it to each of the next pushes; a chunk that went zstd hands its
  blob to the keeper (keeper.py), only to be written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping

from ...fs import chunk
from ...fs.snapshot import SourceChanged
from .controller_store import ControllerStore, as_raw

Batch = list[tuple[bytes, bytes | memoryview]]
# What the keeper is handed (keeper.py): chunk ids and their blobs, only to be written.
Later = list[tuple[bytes, bytes | bytearray | memoryview]]


def encoded(cids: list[bytes], *, zstd: bool, raw: bool, store: ControllerStore | None,
            objects: Mapping[bytes, bytes],
            read: Callable[[bytes, int | None], bytearray | memoryview],
            fresh: Callable[[bytes], bool], kept: Collection[bytes] = (),
            ahead: Callable[[list[bytes]], dict[bytes, int]] | None = None
            ) -> tuple[Batch, Batch, Later]:
    """(wire forms, raw forms, what the keeper is to keep) of `cids`; each form only if asked
    (else empty). `read(cid, fd)` gives a chunk's bytes after one free byte, checked against
    its id (from `fd`, its file opened by `ahead`, which asks for all of the batch's bytes
    that are read from files at once: Snapshot.open_ahead); `fresh(cid)`: whether a raw link
    had better read it from its source than decompress the stored blob
    (stream.Payload._fresh). `objects`: the manifest's folder objects, which have no file to
    be read from again. `kept`: ids the keeper has in hand already."""
    stored = {cid: blob for cid in cids
              if store is not None and (zstd or not fresh(cid))
              and (blob := store.get(cid)) is not None}
    fds = ahead([c for c in cids if c not in stored]) if ahead is not None else {}
    blobs: Batch = []
    raws: Batch = []
    later: Later = []
    try:
        for cid in cids:
            blob = stored.get(cid)
            if blob is not None:
                if raw:
                    raws.append((cid, as_raw(cid, blob)))
                if zstd:
                    blobs.append((cid, blob))
                continue
            try:
                buf = read(cid, fds.pop(cid, None))
            except SourceChanged:
                if store is None or not store.store.has(cid):
                    raise
                raws.append((cid, as_raw(cid, store.store.get_blob(cid))))
                continue  # raw only: the file changed unseen; the store has the id's bytes
            data = memoryview(buf)[1:]
            sourced = store is not None and store.is_sourced(cid)
            # Whether the store is to keep it: a cold push from a whole store keeps nothing, so a
            # raw link then takes no zstd sample of its chunks (they would only say how to keep).
            keep = not (store is None or sourced or store.store.has(cid) or cid in kept)
            squeeze = (zstd or keep) and not sourced and chunk.compressible(data)
            packed = chunk.encode(data) if zstd and squeeze else None
            if packed is not None and packed[0] == chunk.RAW:
                packed, squeeze = None, False  # the sample was wrong: it did not save enough
            buf[0] = chunk.RAW  # the raw blob in place: not copied again
            if raw:
                raws.append((cid, memoryview(buf)))
            if zstd:
                blobs.append((cid, packed if packed is not None else memoryview(buf)))
            if not keep:
                continue
            assert store is not None
            if packed is not None:
                later.append((cid, packed))
            elif squeeze:
                continue  # compressed and kept after the publish (ControllerStore.fill)
            elif cid in objects:  # no file to read it from again: its few bytes are kept
                later.append((cid, bytes(buf)))
            else:  # raw on every link: its file is its wire form
                store.add_sourced(cid)
    finally:
        for fd in fds.values():  # not read (an error, or a chunk twice in the batch)
            os.close(fd)
    return blobs, raws, later
