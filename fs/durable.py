"""Durable points: how much of each unsealed pack is known to be on disk, and the check at
start of what lies past it.

A node publishes a version once its chunks are written, in the page cache; flushing them to disk
follows in the background (daemon/node/flusher.py). After each flush of a pack its durable point
(the pack's size then) is written beside it:

    store/packs/00000007.durable   8 bytes, little-endian: the offset up to which the pack is
                                   durable (a sealed pack, with its .idx, is durable whole)

The point is written after the flush and is never flushed itself: a crash can only leave an
older point (or none, read as 0), which is never past what is on disk. At start, the records
past it are read back and verified against their ids (fs/chunk.decode): the first one that does
not verify, and everything after it, is cut off, so a power cut that lost the page cache never
leaves a wrong object in the index. What was cut is counted (`Tail`), and the versions that
used it are found missing by the node (daemon/node/lost.py). After a stop that lost nothing (a
clean stop, or a killed process whose writes the kernel kept) every record verifies.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from .chunk import CorruptChunk, decode
from .pack import RECORD, pack_path, scan, unloc, write_index
from .private_files import PRIVATE_FILE

POINT = struct.Struct("<Q")


@dataclass
class Tail:
    """What the check of a pack past its durable point found."""

    verified: int = 0  # records past the point that verified
    dropped: int = 0  # whole records past the point that did not, or followed one that did not
    cut: int = 0  # bytes cut off the pack (those records, and a torn end)


def point_path(folder: Path, n: int) -> Path:
    return folder / f"{n:08d}.durable"


def read_point(folder: Path, n: int) -> int:
    """Pack `n`'s durable point; 0 (check it all) when none was written or it is unreadable."""
    try:
        data = point_path(folder, n).read_bytes()
    except OSError:
        return 0
    return POINT.unpack(data)[0] if len(data) == POINT.size else 0


def write_point(folder: Path, n: int, offset: int) -> None:
    """Record that pack `n` is durable up to `offset` (call only once it is: after the flush).
    Not flushed: a lost update leaves an older point, which is only checked more."""
    fd = os.open(point_path(folder, n), os.O_WRONLY | os.O_CREAT, PRIVATE_FILE)
    try:
        os.pwrite(fd, POINT.pack(offset), 0)
    finally:
        os.close(fd)


def drop_point(folder: Path, n: int) -> None:
    """Pack `n` is sealed (durable whole, its index written): its point is not needed."""
    point_path(folder, n).unlink(missing_ok=True)


def check_tail(path: Path, records: list[tuple[bytes, int]], durable: int,
               size_before: int) -> tuple[list[tuple[bytes, int]], Tail]:
    """Verify the `records` (id, location; from pack.scan) of the pack at `path` that lie past
    its durable point, cutting the pack at the first one that does not verify. Returns the
    records kept and what was found. `size_before`: the pack's size before the scan cut a torn
    end, counted as cut."""
    tail = Tail()
    kept = records
    with open(path, "rb+") as f:
        fd = f.fileno()
        for i, (cid, at) in enumerate(records):
            _, off, length = unloc(at)
            if off < durable:
                continue
            try:
                blob = os.pread(fd, length, off)
                if len(blob) != length:
                    raise CorruptChunk("short")
                decode(cid, blob)
            except (CorruptChunk, OSError, ValueError):
                kept = records[:i]
                tail.dropped = len(records) - i
                os.ftruncate(fd, off - RECORD.size)
                break
            tail.verified += 1
        size = os.fstat(fd).st_size
    tail.cut = max(0, size_before - size)
    return kept, tail


def scan_unsealed(folder: Path, n: int) -> tuple[list[tuple[bytes, int]], Tail]:
    """The records of pack `n`, which has no index, those past its durable point verified
    (check_tail); the pack is flushed and its point moved to its end if anything lay past it,
    so the next start checks nothing twice."""
    path = pack_path(folder, n)
    size = path.stat().st_size
    point = read_point(folder, n)
    found, tail = check_tail(path, list(scan(folder, n)), point, size)
    if point != size - tail.cut:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            write_point(folder, n, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return found, tail


def seal_checked(folder: Path, n: int, records: list[tuple[bytes, int]]) -> None:
    """Seal pack `n`, checked at start (scan_unsealed made it durable): its index, then no
    durable point."""
    write_index(folder, n, records)
    drop_point(folder, n)


class Seals:
    """Full packs whose seal (flush, then index) waits for the next flush (--durable
    background): a seal on the append path made every 256 MiB of a push wait for the disk.
    Until sealed, such a pack is read like any other and never collected (fs/collect.py); a
    crash leaves it without an index, checked past its durable point at start like the open
    pack and sealed then."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[int, list[tuple[bytes, int]]]] = {}  # n -> (fd, records)
        self._lock = threading.Lock()

    def defer(self, n: int, fd: int, records: list[tuple[bytes, int]]) -> None:
        with self._lock:
            self.pending[n] = (fd, records)

    def finish(self, folder: Path) -> None:
        """Seal every pending pack: flush it, write its index, forget its durable point."""
        while True:
            with self._lock:
                if not self.pending:
                    return
                n, (fd, records) = next(iter(self.pending.items()))
            os.fsync(fd)
            write_index(folder, n, records)
            drop_point(folder, n)
            with self._lock:
                del self.pending[n]
            os.close(fd)

    def close(self) -> None:
        for fd, _ in self.pending.values():
            os.close(fd)
        self.pending.clear()
