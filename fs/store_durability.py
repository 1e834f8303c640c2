"""The store's durability: when what was appended is flushed to disk, and what a failed push
gives back. Apart from the Store's write and read paths (fs/store.py), whose class takes these
methods, because they are one policy with its own crash reasoning (fs/durable.py: durable
points and the check past them at start).

`sync` flushes before a version is published (`daemon --durable sync`); `settle` before and
`flush` after, in the background (`--durable background`, daemon/node/flusher.py). `cut_back`
gives back what was appended since the last durable or settled record.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import durable
from .chunk import RAW, CorruptChunk
from .file_objects import FileObjects
from .pack import unloc
from .private_files import fsync_dir

RAW_CODEC = bytes([RAW])


class StoreDurability:
    """The Store's flushes and cut backs (see the module docstring)."""

    if TYPE_CHECKING:  # the Store's, which this is a part of
        from pathlib import Path

        packs: Path
        objects: FileObjects
        seals: durable.Seals
        _lock: threading.Lock
        _sync_lock: threading.Lock
        _index: dict[bytes, int]
        _records: list[tuple[bytes, int]]
        _fd: int
        _cur: int
        _size: int
        _durable: int
        _settled: int
        _cuts: int

        def get(self, cid: bytes) -> bytes | memoryview: ...

        def _append(self, cid: bytes, parts: list[bytes | memoryview]) -> None: ...

    def sync(self, spill: bool = True, needed: Callable[[bytes], bool] | None = None) -> None:
        """Make every object written so far durable (a sealed pack was when it was sealed).
        Only the store's own files: a syncfs would also wait for everything else written to this
        filesystem. Without `spill`, chunks of file objects still arriving stay there, not
        durable; `needed`: those a publish counts on, the only ones copied (FileObjects.sync)."""
        with self._sync_lock:
            self.objects.sync(self._fill, self._spill if spill else None, needed)
            self.seals.finish(self.packs)
            self._flush_pack()

    def settle(self, needed: Callable[[bytes], bool] | None = None) -> None:
        """`sync` before a publish without waiting for the disk (--durable background): file
        objects completed, they and the open pack's records kept by a cut back; `flush` makes
        them durable later, and a crash before that is found at start (fs/durable.py)."""
        with self._sync_lock:
            self.objects.settle(self._fill, self._spill, needed)
            with self._lock:
                self._settled = self._size

    def flush(self) -> None:
        """Make the complete file objects and the open pack durable, and record its durable
        point; appends go on meanwhile (see _flush_pack)."""
        with self._sync_lock:
            self.objects.flush()
            self.seals.finish(self.packs)
            self._flush_pack()

    def _flush_pack(self) -> None:
        """fdatasync the open pack as it is now (a duplicate descriptor, outside the store's
        lock), then record its durable point. Holds _sync_lock."""
        with self._lock:
            fd, n, size, cuts = os.dup(self._fd), self._cur, self._size, self._cuts
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        with self._lock:  # sealed meanwhile: durable whole; cut back: the point is moot
            if self._cur == n and self._cuts == cuts:
                self._durable = max(self._durable, size)
                durable.write_point(self.packs, n, size)
        fsync_dir(self.packs)

    def _fill(self, cid: bytes) -> bytes | memoryview | None:
        """A chunk's verified bytes for a file object that lacks it, if the store has it."""
        try:
            return self.get(cid)
        except (KeyError, CorruptChunk):
            return None

    def _spill(self, cid: bytes, data: bytes) -> None:
        """Copy a chunk of a file object that cannot be completed to the open pack, raw."""
        with self._lock:
            if cid not in self._index:
                self._append(cid, [RAW_CODEC, data])

    def cut_back(self) -> int:
        """Drop the records appended to the open pack since it was last made durable or
        settled, giving their space back now (a push that failed on a full disk: no collect
        reaches them); the bytes freed. No published or prepared version loses anything; the
        dropped objects leave the index, so a later push sends them again."""
        with self._sync_lock:  # not while a flush records what it cuts
            freed_objects = self.objects.cut_back()
        with self._lock:
            cut = max(self._durable, self._settled)
            if self._size <= cut:
                return freed_objects
            os.ftruncate(self._fd, cut)
            kept: list[tuple[bytes, int]] = []
            for cid, at in self._records:
                if unloc(at)[1] < cut:
                    kept.append((cid, at))
                elif self._index.get(cid) == at:
                    del self._index[cid]
            self._records = kept
            self._cuts += 1
            freed, self._size = self._size - cut, cut
        return freed + freed_objects

