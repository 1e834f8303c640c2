"""Provisional file objects: a large file's chunks written once, at their offsets, before the
manifest that names the file has arrived.

A push that sends a new large file's chunks as its scan hashes them (streaming while
scanning: daemon/client/scan_stream.py) reaches the node before the manifest does, so the node
cannot know the file object's key (backing.key: a digest of all its chunk ids). It opens a
provisional object instead, `store/files/provisional-<random>.part`, and learns its chunk list
window by window (`declare`); each chunk is verified against its id and written with O_DIRECT
where it belongs, like any file object's (FileObjects.place). When the manifest arrives,
FileObjects.expect finds the provisional object whose chunks are exactly an entry's and renames
it to the entry's key (`_claim`): the file is written once. One never claimed is dropped with
its session (`drop`). A provisional object is never flushed or recorded, so a crash leaves only
a `.part` file, which the next start deletes like any unrecorded one; a version never counts on
it before the manifest claims it.
"""

from __future__ import annotations

import os

from .file_objects import PART, FileObject, FileObjects, open_part

PREFIX = "provisional-"
MAX_CHUNK = 64 << 20  # the largest chunk size a declaration may name


class ProvisionalError(ValueError):
    """A declaration that does not fit its object (its message says why)."""


def open_object(objects: FileObjects, size: int) -> FileObject:
    """A new provisional object of `size` bytes, with no chunk declared yet."""
    if size <= 0:
        raise ProvisionalError(f"a provisional file of {size} bytes")
    key = PREFIX + os.urandom(12).hex()
    fd, direct = open_part(objects.root / (key + PART))
    obj = FileObject(key, size, fd, direct, [], provisional=True)
    with objects._lock:
        objects.objects[key] = objects.provisional[key] = obj
    return obj


def declare(objects: FileObjects, obj: FileObject, first: int, ids: list[bytes],
            chunk_size: int) -> None:
    """The chunks `first`, `first + 1`, ... of `obj` are `ids`: each of them that arrives from
    now on is written at its offset (chunk i at i * chunk_size)."""
    if not 0 < chunk_size <= MAX_CHUNK:
        raise ProvisionalError(f"chunk size {chunk_size} is not in 1..{MAX_CHUNK}")
    count = -(-obj.size // chunk_size)
    with objects._lock:
        if objects.provisional.get(obj.key) is not obj:
            raise ProvisionalError("the file was claimed or dropped already")
        if first != len(obj.spans):
            raise ProvisionalError(f"chunk {first} declared after {len(obj.spans)} chunks: "
                                   "declarations go in order")
        if first + len(ids) > count:
            raise ProvisionalError(f"{first + len(ids)} chunks declared for a file of "
                                   f"{obj.size} bytes in chunks of {chunk_size}")
        if obj.spans and obj.spans[0][2] != chunk_size and count > 1:
            raise ProvisionalError("the chunk size changed between declarations")
        for i, cid in enumerate(ids, first):
            off = i * chunk_size
            span = (cid, off, min(chunk_size, obj.size - off))
            obj.spans.append(span)
            objects._pending.setdefault(cid, []).append((obj, off, span[2]))


def drop(objects: FileObjects, objs: list[FileObject]) -> int:
    """Delete those of `objs` no manifest claimed (their session ended); how many."""
    with objects._lock:
        gone = [o for o in objs if objects.provisional.get(o.key) is o]
    objects.drop(gone)
    return len(gone)
