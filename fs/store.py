"""The content-addressed store: one file per chunk blob, named by the chunk id.

Writes go to a temporary file and are renamed into place, so a reader or a crash never sees a
partial object; every blob is verified against its id before it is written and when it is read.
Durability is batched: `sync()` flushes the whole store once before a version is published,
instead of an fsync per chunk.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from .chunk import CorruptChunk, chunk_id, decode, encode

_libc = ctypes.CDLL(None, use_errno=True)  # syncfs(2) has no os wrapper


class Store:
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self.objects.mkdir(parents=True, exist_ok=True)
        # Leftovers of writes interrupted by a crash are never objects: drop them.
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._seq = 0

    def path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self.objects / h[:2] / h[2:]

    def has(self, cid: bytes) -> bool:
        return self.path(cid).exists()

    def missing(self, ids: Iterable[bytes]) -> list[bytes]:
        return [cid for cid in ids if not self.has(cid)]

    def put_blob(self, cid: bytes, blob: bytes | memoryview) -> bool:
        """Verify `blob` against `cid` and store it; False (a no-op) when the object exists."""
        decode(cid, blob)
        dest = self.path(cid)
        if dest.exists():
            return False
        dest.parent.mkdir(exist_ok=True)
        self._seq += 1
        tmp = self.tmp / f"{os.getpid()}-{id(blob):x}-{self._seq}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.rename(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def put(self, data: bytes) -> bytes:
        cid = chunk_id(data)
        if not self.has(cid):
            self.put_blob(cid, encode(data))
        return cid

    def get_blob(self, cid: bytes) -> bytes:
        try:
            return self.path(cid).read_bytes()
        except FileNotFoundError:
            raise KeyError(cid.hex()) from None

    def get(self, cid: bytes) -> bytes:
        """The verified raw bytes of a chunk. KeyError if absent, CorruptChunk if damaged."""
        return decode(cid, self.get_blob(cid))

    def sync(self) -> None:
        """Flush every object written so far to disk (one syncfs, not an fsync per object)."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(self.root))
        finally:
            os.close(fd)

    def usage(self) -> tuple[int, int]:
        """(objects, bytes on disk)."""
        count = size = 0
        for sub in os.scandir(self.objects):
            for obj in os.scandir(sub.path):
                count += 1
                size += obj.stat().st_size
        return count, size


__all__ = ["Store", "CorruptChunk"]
