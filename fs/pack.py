"""The pack file format: records appended to a pack, and the index written when it is sealed.

    store/packs/00000001.pack  records: b"MFSR", chunk id (16 bytes), blob length (u32), blob
    store/packs/00000001.idx   (sealed packs) id, offset, length per record

Kept apart from the Store (fs/store.py) so that the bytes on disk are described in one place:
the store appends and reads records, the collector (fs/collect.py) copies and deletes them, and
both find an object through a location packed into one int (`loc`).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path

from .private_files import PRIVATE_FILE

RECORD = struct.Struct("<4s16sI")  # magic, chunk id, blob length
MAGIC = b"MFSR"
IDX = struct.Struct("<16sQI")  # chunk id, blob offset, blob length
PACK_SHIFT = 72  # a location's pack number is loc >> PACK_SHIFT (see loc)
_IOV_MAX = 1024  # iovecs one writev takes (Linux's UIO_MAXIOV)
Buffer = bytes | bytearray | memoryview


def loc(pack: int, offset: int, length: int) -> int:
    """Where an object is, as one int: a 100k-chunk index is 8 MB smaller than with tuples."""
    return pack << PACK_SHIFT | offset << 32 | length


def unloc(location: int) -> tuple[int, int, int]:
    """(pack, offset, length) of a location."""
    return location >> PACK_SHIFT, (location >> 32) & ((1 << 40) - 1), location & 0xFFFFFFFF


def pack_path(folder: Path, n: int) -> Path:
    return folder / f"{n:08d}.pack"


def idx_path(folder: Path, n: int) -> Path:
    return folder / f"{n:08d}.idx"


def read_index(folder: Path, n: int) -> list[tuple[bytes, int]] | None:
    """(id, location) of every record a sealed pack's index lists; None if it has no index or
    a damaged one (then the pack is scanned)."""
    try:
        data = idx_path(folder, n).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) % IDX.size:
        return None  # damaged index: rebuild from the pack
    return [(cid, loc(n, off, length)) for cid, off, length in IDX.iter_unpack(data)]


def scan(folder: Path, n: int) -> Iterator[tuple[bytes, int]]:
    """(id, location) of every whole record of a pack, read from its record headers; a torn
    record at the end (a crash mid-append) is cut off once the scan reaches it."""
    path = pack_path(folder, n)
    off = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # Mapped, the headers are read in place, not by a seek and a read each (the dev box's
        # store reopens its unsealed pack at every push: opening one of 15k records took 15-17
        # ms, 7-10 ms with this and its records kept as read).
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else nullcontext(
                b"") as data:
            while off + RECORD.size <= size:
                magic, cid, length = RECORD.unpack_from(data, off)
                end = off + RECORD.size + length
                if magic != MAGIC or end > size:
                    break
                yield cid, loc(n, off + RECORD.size, length)
                off = end
    if off != size:
        os.truncate(path, off)


def append(fd: int, size: int, records: Sequence[tuple[bytes, Sequence[Buffer]]]
           ) -> list[tuple[int, int]]:
    """Append `records` (id, blob parts) to the pack open for appending as `fd`, `size` bytes
    long until now, in as few writes as the iovec limit allows; (blob offset, length) of each.
    On any error the pack is cut back to `size`: no partial record stays behind."""
    iov: list[Buffer] = []
    places, off = [], size
    for cid, parts in records:
        length = sum(len(part) for part in parts)
        iov += [RECORD.pack(MAGIC, cid, length), *parts]
        places.append((off + RECORD.size, length))
        off += RECORD.size + length
    try:
        for i in range(0, len(iov), _IOV_MAX):
            group = iov[i:i + _IOV_MAX]
            written = os.writev(fd, group)
            if written < sum(len(b) for b in group):  # short: finish from where it stopped
                rest = memoryview(b"".join(group))[written:]
                while rest:
                    rest = rest[os.write(fd, rest):]
    except BaseException:
        os.ftruncate(fd, size)
        raise
    return places


def write_index(folder: Path, n: int, records: list[tuple[bytes, int]]) -> None:
    """Write a sealed pack's index (its records' ids and locations, in append order) durably,
    under its final name only once complete: a crash leaves no index, never a partial one."""
    path = idx_path(folder, n)
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        try:
            data = memoryview(b"".join(IDX.pack(cid, *unloc(at)[1:]) for cid, at in records))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
