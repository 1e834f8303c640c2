"""Backing files: large snapshot files kept whole on local disk for FUSE passthrough.

Through FUSE, every page of a file is filled by a request to this daemon and cached in 4 KiB
pages: a cold 1 GiB read runs at half the speed of local disk, and warm reads and mmaps (a
loader mapping `libtorch_cpu.so`) pay the small pages. With passthrough (Linux 6.9+; see
fs/passthrough.py) an open file is bound to a file on local disk, and the kernel reads and maps
it directly: local-disk speed, cold and warm, and no request at all after the open.

A backing file is the plain content of one file, named by the digest of its chunk ids, so every
version and workspace holding the same content shares one. It is copied from the chunk store
(where every chunk was verified when it arrived) under a temporary name and renamed, so a
backing file that exists is complete.

The copies start when a version is committed (queued before it becomes visible), and a publish
does not wait for them: that would add a second write of every new large file to every push.
Starting them at prepare slowed the other nodes' prepares. An open of a file whose copy is queued
or running waits for that one copy (it jumps the queue), so the first reader still gets
passthrough; a copy that failed leaves the file to be served from the chunk store.

Backing files are a cache of the store, so they are not flushed at publish (that would wait for
the disk to take every large file): they are flushed when the daemon stops, which leaves a
`clean` marker. A daemon that finds no marker (it crashed, or the machine did) cannot trust
them, deletes them all and writes them again from the store; until then the daemon serves those
files itself. Files below MIN_SIZE stay in the chunk store only: for them a FUSE read
is one request, and a second copy on disk buys nothing.

Since a push sends the manifest first, a large file that arrives whole is written once, straight
into its file object in the store (fs/file_objects.py), and that is what passthrough binds
(`ready`): no copy is made. The copy here is the fallback, for files whose chunks were on the
node before the push said where they go (older versions, an older daemon or client).

Like the store, the folder is private to the daemon's user (0700, files 0400): a backing file is
the content of a pushed file whatever its mode, and the mount is the only way others read it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
import xxhash

from .chunk import CorruptChunk
from .manifest import Entry, Kind, Manifest
from .private_files import PRIVATE_FILE, fsync_dir, private_dir

if TYPE_CHECKING:  # a push asks `wanted` without loading a node's store
    from .store import Store

MIN_SIZE = 256 * 1024
_TMP = ".tmp"
_CLEAN = "clean"  # present only while no daemon uses the folder, after a clean stop


def wanted(entry: Entry) -> bool:
    """Whether a file is served from a backing file (when passthrough is on)."""
    return entry.kind == Kind.FILE and entry.size >= MIN_SIZE


def key(entry: Entry) -> str:
    """The backing file's name: what the content is (its chunk ids), not where it is."""
    return xxhash.xxh3_128_hexdigest(b"".join(entry.chunks))


def place_files(store: Store, manifest: Manifest) -> int:
    """Tell the store where the chunks of `manifest`'s large files go, before they arrive, so
    that each is written once, into its file object; how many file objects will be written.
    (Only those of the folders it does not share with the version loaded before it: the others
    were there; all of them while a provisional file object waits for its manifest, which may
    be one loaded before: fs/provisional.py.)"""
    entries = list(manifest) if store.objects.provisional else manifest.added_entries()
    return sum(store.expect_file(key(e), e.size, e.chunks, manifest.chunk_size)
               for e in entries if wanted(e))


@dataclass
class _Copy:
    """One backing file to write: queued, then running, then done (with an error or not)."""
    entry: Entry
    store: Store
    started: bool = False
    error: str | None = None
    done: trio.Event = field(default_factory=trio.Event)


class BackingFiles:
    """Large files of served versions, kept whole on local disk for passthrough: a cache of
    the store, written after a publish, trusted after a clean stop only."""

    def __init__(self, root: str | os.PathLike[str], store: Store | None = None):
        self.root = Path(root)
        self.store = store  # its file objects are backing files already (ready)
        private_dir(self.root)
        marker = self.root / _CLEAN
        self.trusted = marker.exists()  # else: whatever is here may not have reached the disk
        for p in self.root.iterdir():
            if not self.trusted or p.name.endswith(_TMP):
                p.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        self._unflushed: set[str] = set()
        self._copies: dict[str, _Copy] = {}  # queued or running, by key
        self.waits = 0  # opens that waited for their file's copy

    @property
    def writing(self) -> int:
        """How many backing files are queued or being written."""
        return len(self._copies)

    async def write_missing(self, entries: Iterable[Entry], store: Store, parallel: int = 2,
                            *, task_status=trio.TASK_STATUS_IGNORED) -> list[str]:
        """Write the backing files `entries` lack, `parallel` at a time, and return what failed
        (a line a file). A file already queued or being written is waited for, not written
        twice. Started (nursery.start) once every copy is queued: an open from then on waits
        for its file's copy."""
        try:
            todo = await trio.to_thread.run_sync(self.missing, entries)
        except OSError:
            task_status.started()  # nothing was queued
            raise
        copies, new = [], []  # every copy this waits for; those it queued itself
        for entry in todo:
            k = key(entry)
            if k not in self._copies:
                self._copies[k] = _Copy(entry, store)
                new.append((k, self._copies[k]))
            copies.append(self._copies[k])
        task_status.started()
        limiter = trio.CapacityLimiter(parallel)

        async def queued(k: str, copy: _Copy) -> None:
            try:
                async with limiter:
                    await self._run(k, copy)
            finally:
                if not copy.started:  # cancelled while queued
                    self._copies.pop(k, None)
                    copy.done.set()

        async with trio.open_nursery() as nursery:
            for k, copy in new:
                nursery.start_soon(queued, k, copy)
        for copy in copies:
            await copy.done.wait()
        return [c.error for c in copies if c.error]

    async def wait(self, entry: Entry) -> None:
        """Return once `entry`'s backing file is written, if it is queued or being written
        (a queued one is written now, ahead of the others)."""
        k = key(entry)
        copy = self._copies.get(k)
        if copy is not None:
            self.waits += 1
            await self._run(k, copy)

    async def _run(self, k: str, copy: _Copy) -> None:
        if copy.started:
            await copy.done.wait()
            return
        copy.started = True
        try:
            await trio.to_thread.run_sync(self.write, copy.entry, copy.store,
                                          trio.from_thread.check_cancelled)
        except (OSError, KeyError, CorruptChunk) as e:
            what = e.strerror if isinstance(e, OSError) and e.strerror else e
            copy.error = (f"cannot write the backing file of "
                          f"{copy.entry.path.decode(errors='replace')}: {what}")
        finally:
            del self._copies[k]
            copy.done.set()

    def close(self) -> None:
        """Flush the backing files written since start, then mark the folder clean."""
        for name in sorted(self._unflushed):
            try:
                fd = os.open(self.root / name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self._unflushed.clear()
        fd = os.open(self.root / _CLEAN, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.root)

    def _files(self) -> list[Path]:
        """The backing files (not the marker, nor files being written)."""
        return [p for p in self.root.iterdir() if p.name != _CLEAN and not p.name.endswith(_TMP)]

    def path(self, entry: Entry) -> Path:
        return self.root / key(entry)

    def ready(self, entry: Entry) -> Path | None:
        """The backing file for `entry`, if it is there and whole: its file object in the
        store, else a copy here."""
        if self.store is not None and (obj := self.store.file_object(key(entry))) is not None:
            return obj
        return self._whole(self.path(entry), entry.size)

    @staticmethod
    def _whole(p: Path, size: int) -> Path | None:
        try:
            return p if p.stat().st_size == size else None
        except FileNotFoundError:
            return None

    def missing(self, entries: Iterable[Entry]) -> list[Entry]:
        """The wanted files of a snapshot that have no backing file yet, each content once."""
        out: dict[str, Entry] = {}
        for e in entries:
            if not wanted(e) or (k := key(e)) in out:
                continue
            if self.store is not None and self.store.file_object(k) is not None:
                continue  # written once, in the store
            if self._whole(self.root / k, e.size) is None:
                out[k] = e
        return list(out.values())

    def write(self, entry: Entry, store: Store,
              checkpoint: Callable[[], None] = lambda: None) -> None:
        """Write one backing file from the store, unless it is there already (blocking: run it
        in a worker thread). Chunks stored raw are copied inside the kernel; compressed ones are
        decoded and verified. `checkpoint` runs before each chunk and may raise to stop (a
        daemon stopping does not wait for a large file). A failure leaves nothing behind."""
        final = self.path(entry)
        if self._whole(final, entry.size) is not None:
            return
        fd, name = tempfile.mkstemp(prefix=final.name + ".", suffix=_TMP, dir=self.root)
        tmp = Path(name)
        try:
            os.fchmod(fd, 0o400)  # read-only, and private
            for cid in entry.chunks:
                checkpoint()
                if not store.copy_raw(cid, fd):
                    data = memoryview(store.get(cid))
                    while data:
                        data = data[os.write(fd, data):]
            written = os.lseek(fd, 0, os.SEEK_CUR)
            if written != entry.size:
                raise OSError(f"{entry.path.decode(errors='replace')}: chunks hold {written} "
                              f"bytes, the manifest says {entry.size}")
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
            self._unflushed.add(final.name)
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)

    def prune(self, keep: set[str]) -> int:
        """Delete backing files no retained version uses; returns how many. An open file keeps
        reading its backing file: the kernel holds it until the last close."""
        removed = 0
        for p in self._files():
            if p.name not in keep:
                p.unlink(missing_ok=True)
                self._unflushed.discard(p.name)
                removed += 1
        return removed

    def usage(self) -> tuple[int, int]:
        """(files, bytes) passthrough can bind: the store's file objects and the copies here
        (the file objects alone if this folder cannot be listed: the copies say why)."""
        objects = self.store.objects.usage() if self.store is not None else (0, 0)
        sizes = []
        try:
            for p in self._files():
                try:
                    sizes.append(p.stat().st_size)
                except FileNotFoundError:
                    pass  # pruned meanwhile
        except OSError:
            return objects
        return len(sizes) + objects[0], sum(sizes) + objects[1]
