"""File objects: the chunks of a large file stored once, as the plain file, at their offsets.

A large file used to be written twice on a node: chunk by chunk into a pack, then copied whole
into a backing file for passthrough (1.72x the content on disk, and a second write of every
byte). A file object is both: the store serves its chunks from it (each verified against its id
on every read, as from a pack) and passthrough binds it as the backing file.

    store/files/<key>.part   being written: chunks land at their offsets as they arrive
    store/files/<key>        complete, renamed once every chunk is in
    store/files/<key>.ids    its record: (chunk id, offset, length) per chunk, written after
                             the data is flushed; what makes the file object trusted at start
    store/files/<key>.settled the same record, not flushed, written when a publish counts on
                             the object before it is flushed (--durable background): at start
                             its chunks are verified, and it is recorded or dropped

`key` is the backing file's name (backing.key: a digest of the file's chunk ids). A node learns
where each chunk goes from the manifest, which a push sends first (`expect`). A chunk that
arrives for a file object is written there only (`place`), raw, and is readable at once, even
while the rest of the file is still arriving.

Durability follows the store's: `sync` (before a prepare succeeds) fills any chunk an object
lacks from the rest of the store (chunks already on the node before this push), flushes, renames
and records it; an object that cannot be completed has the chunks it holds copied to the open
pack instead, so no chunk a prepare counted on lives only in an unrecorded file. With --durable
background, `settle` fills them and writes their `.settled` record, and `flush` (later, in the
background) flushes and records them. At start only recorded objects are trusted, and settled
ones whose every chunk verifies; other `.part` files and unrecorded ones are deleted, so a crash
at any moment never exposes a torn file. `cut_back` (a full disk) drops the unsettled ones.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .chunk import chunk_id
from .pack import IDX
from .private_files import PRIVATE_FILE, fsync_dir, private_dir

PART = ".part"
IDS = ".ids"
SETTLED = ".settled"
_TMP = ".tmp"
_DIRECT = 4096  # O_DIRECT alignment of buffer, offset and length asked for here


@dataclass(eq=False)
class FileObject:
    """One large file's content on disk, written in place as its chunks arrive."""

    key: str
    size: int
    fd: int
    direct: int  # the same file opened with O_DIRECT (-1: none): see _write
    spans: list[tuple[bytes, int, int]]  # (chunk id, offset, length), in file order
    written: set[int] = field(default_factory=set)  # offsets written
    recorded: bool = False  # complete, flushed, and its .ids record durable
    settled: bool = False  # complete, and a publish counts on it (its .settled record)
    renamed: bool = False  # complete and flushed, under its final name
    provisional: bool = False  # no manifest names it yet (fs/provisional.py): never flushed

    @property
    def complete(self) -> bool:
        return len(self.written) == len(self.spans)


class FileObjects:
    """The store's file objects (see the module docstring) and where each chunk is in them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        private_dir(root)
        self._lock = threading.Lock()
        self.objects: dict[str, FileObject] = {}
        self.index: dict[bytes, tuple[FileObject, int, int]] = {}  # id -> (object, offset, length)
        self._pending: dict[bytes, list[tuple[FileObject, int, int]]] = {}  # expected, not in
        # Descriptors of dropped objects, closed at the next collect: a read that found the
        # object just before must not read another file that reused the number.
        self._retired: list[int] = []
        self.provisional: dict[str, FileObject] = {}  # fs/provisional.py's, by their key
        self.problems: list[str] = []
        self.lost = 0  # chunks of settled objects a crash took (they did not verify at start)
        for p in root.glob("*" + SETTLED):
            self.lost += self._verify_settled(p.name[:-len(SETTLED)])
        recorded = {p.name[:-len(IDS)] for p in root.glob("*" + IDS)}
        for p in root.iterdir():  # anything not recorded may be torn: it goes
            name = p.name
            if not (name in recorded or (name.endswith(IDS) and name[:-len(IDS)] in recorded)):
                p.unlink(missing_ok=True)
        for key in sorted(recorded):
            try:
                self._load(key)
            except (OSError, ValueError) as e:
                self.problems.append(f"file object {root / key} dropped: {e}")
                (root / (key + IDS)).unlink(missing_ok=True)
                (root / key).unlink(missing_ok=True)

    def _verify_settled(self, key: str) -> int:
        """At start, a settled object that was not flushed before the stop: recorded if every
        chunk verifies against its id (the kernel kept the writes), else left to be deleted;
        how many of its chunks were lost."""
        settled = self.root / (key + SETTLED)
        data = settled.read_bytes()
        spans = list(IDX.iter_unpack(data)) if data and not len(data) % IDX.size else []
        path = next((p for p in (self.root / (key + PART), self.root / key) if p.exists()), None)
        if path is None or not spans:
            settled.unlink()
            return len({cid for cid, _, _ in spans})
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            bad = {cid for cid, off, length in spans
                   if off + length > size or chunk_id(os.pread(f.fileno(), length, off)) != cid}
            if not bad:
                os.fdatasync(f.fileno())
        if not bad:
            os.rename(path, self.root / key)
            fsync_dir(self.root)
            os.rename(settled, self.root / (key + IDS))
            fsync_dir(self.root)
            return 0
        settled.unlink()
        return len({cid for cid, _, _ in spans})

    def _load(self, key: str) -> None:
        data = (self.root / (key + IDS)).read_bytes()
        if not data or len(data) % IDX.size:
            raise ValueError("damaged record")
        spans = list(IDX.iter_unpack(data))
        size = spans[-1][1] + spans[-1][2]
        fd = os.open(self.root / key, os.O_RDONLY)
        if os.fstat(fd).st_size != size:
            os.close(fd)
            raise ValueError(f"its size is not the {size} bytes its record says")
        obj = FileObject(key, size, fd, -1, spans, {off for _, off, _ in spans}, recorded=True)
        self.objects[key] = obj
        for cid, off, length in spans:
            self.index.setdefault(cid, (obj, off, length))

    # ---- writing ------------------------------------------------------------------------

    def expect(self, key: str, size: int, chunks: Sequence[bytes], chunk_size: int,
               have: Callable[[bytes], bool]) -> bool:
        """Prepare the file object `key` (unless it exists): its chunks not in the store yet
        (`have`) will be written there as they arrive. False if nothing is to arrive for it
        (every chunk is in the store already: the backing copy builds it, if wanted)."""
        with self._lock:
            if key in self.objects:
                return False
            spans = [(cid, i * chunk_size, min(chunk_size, size - i * chunk_size))
                     for i, cid in enumerate(chunks)]
            if self._claim(key, spans):  # its chunks arrived before the manifest
                return True
            if all(have(cid) for cid, _, _ in spans):
                return False
            fd, direct = open_part(self.root / (key + PART))
            obj = self.objects[key] = FileObject(key, size, fd, direct, spans)
            for cid, off, length in spans:
                self._pending.setdefault(cid, []).append((obj, off, length))
            return True

    def _claim(self, key: str, spans: list[tuple[bytes, int, int]]) -> bool:
        """A provisional object (fs/provisional.py) holding exactly `spans` becomes the file
        object `key`: renamed, not written again. Holds self._lock."""
        size = spans[-1][1] + spans[-1][2] if spans else -1
        obj = next((o for o in self.provisional.values()
                    if o.spans == spans and o.size == size), None)
        if obj is None:
            return False
        os.rename(self.root / (obj.key + PART), self.root / (key + PART))
        del self.provisional[obj.key], self.objects[obj.key]
        obj.key, obj.provisional = key, False
        self.objects[key] = obj
        return True

    def wants(self, cid: bytes) -> bool:
        return cid in self._pending

    def place(self, cid: bytes, data: bytes | memoryview) -> bool:
        """Write a verified chunk at every place a file object expects it; False if none
        does (or its length is not what the manifest implies: then it goes to a pack)."""
        with self._lock:
            places = self._pending.pop(cid, None)
        if not places:
            return False
        if any(len(data) != length for _, _, length in places):
            return False
        try:
            for obj, off, _ in places:
                _write(obj, data, off)
        except BaseException:
            with self._lock:  # expected again: a later arrival (or sync's fill) writes it
                self._pending.setdefault(cid, []).extend(places)
            raise
        with self._lock:
            for obj, off, _ in places:
                obj.written.add(off)
            self.index.setdefault(cid, places[0])
        return True

    # ---- reading ------------------------------------------------------------------------

    def read(self, cid: bytes) -> bytes:
        obj, off, length = self.index[cid]
        return os.pread(obj.fd, length, off)

    def where(self, cid: bytes) -> tuple[int, int, int]:
        """(descriptor, offset, length) of a chunk in a file object."""
        obj, off, length = self.index[cid]
        return obj.fd, off, length

    def will_need(self, ids: Iterable[bytes]) -> int:
        """Start reading these chunks into the page cache (posix_fadvise WILLNEED), for
        readers about to come: O_DIRECT wrote them past it, and push --early publishes its
        first reads' chunks right before they are read. The bytes asked for."""
        asked = 0
        for cid in ids:
            place = self.index.get(cid)
            if place is not None:
                obj, off, length = place
                os.posix_fadvise(obj.fd, off, length, os.POSIX_FADV_WILLNEED)
                asked += length
        return asked

    def path(self, key: str) -> Path | None:
        """The file object `key`, if it is complete (for passthrough). Recorded or not: every
        chunk in it was verified as it was written, and one not yet recorded is only not
        trusted after a crash (push --early binds a large file as soon as it is whole, while
        the rest of the version streams; a crash makes that version lack it again). A reader
        that opens it as it is renamed finds it under its new name next time."""
        obj = self.objects.get(key)
        if obj is None or not obj.complete:
            return None
        return self.root / (key if obj.renamed or obj.recorded else key + PART)

    # ---- durability ---------------------------------------------------------------------

    def sync(self, fill: Callable[[bytes], bytes | memoryview | None],
             spill: Callable[[bytes, bytes], None] | None,
             needed: Callable[[bytes], bool] | None = None) -> None:
        """Make every unrecorded file object durable and recorded. A chunk it lacks is taken
        from the rest of the store (`fill`: its verified bytes, or None); one that cannot be
        completed has the chunks it holds that a publish counts on (`needed`) copied elsewhere
        (`spill`, to the open pack), and stays unrecorded (deleted at the next start). Without
        `spill` (an early prepare: daemon/node/incomplete.py) they stay, not durable."""
        for obj in self._fill_all(fill) + list(self.provisional.values()):
            if spill is not None and (not obj.complete or obj.provisional):
                self._spill(obj, spill, needed)
        self.flush()

    def _spill(self, obj: FileObject, spill: Callable[[bytes, bytes], None],
               needed: Callable[[bytes], bool] | None) -> None:
        """Copy the chunks only `obj` holds that a publish counts on (`needed`; None: all) to
        `spill`; not all: another push's files still streaming were, 7 GB for 20 CPU-s."""
        for cid, off, length in obj.spans:
            if off in obj.written and self.index.get(cid, (None,))[0] is obj and (
                    needed is None or needed(cid)):
                spill(cid, os.pread(obj.fd, length, off))

    def settle(self, fill: Callable[[bytes], bytes | memoryview | None],
               spill: Callable[[bytes, bytes], None],
               needed: Callable[[bytes], bool] | None = None) -> None:
        """Complete the unrecorded objects (as `sync`) and write each complete one's `.settled`
        record, unflushed, which a publish counts on until `flush` (--durable background)."""
        for prov in list(self.provisional.values()):
            self._spill(prov, spill, needed)
        for obj in self._fill_all(fill):
            if obj.complete and not obj.settled:
                tmp = self.root / (obj.key + SETTLED + _TMP)
                _write_record(tmp, obj.spans, fsync=False)
                os.rename(tmp, self.root / (obj.key + SETTLED))
                obj.settled = True

    def flush(self) -> None:
        """Flush and record every complete, unrecorded object."""
        done = [o for o in list(self.objects.values())
                if o.complete and not o.recorded and not o.provisional]
        for obj in done:
            self._flush(obj)
        self._record(done)

    def _fill_all(self, fill: Callable[[bytes], bytes | memoryview | None]
                  ) -> list[FileObject]:
        """Write into each unrecorded object the chunks it lacks that the store has (`fill`);
        the unrecorded objects."""
        objs = [o for o in list(self.objects.values()) if not o.recorded and not o.provisional]
        for obj in objs:
            for cid, off, length in obj.spans:
                if off in obj.written:
                    continue
                data = fill(cid)
                if data is None or len(data) != length:
                    continue
                _pwrite_all(obj.fd, data, off)
                with self._lock:
                    obj.written.add(off)
                    self._unexpect(cid, obj, off)
        return objs

    def _flush(self, obj: FileObject) -> None:
        """A complete object's data to disk, under its final name."""
        os.fdatasync(obj.fd)
        if obj.direct >= 0:
            os.close(obj.direct)
            obj.direct = -1
        os.rename(self.root / (obj.key + PART), self.root / obj.key)
        obj.renamed = True

    def _record(self, done: list[FileObject]) -> None:
        """Write the records of flushed objects, after their names: trusted from then on."""
        if not done:
            return
        fsync_dir(self.root)  # the data's names before the records that trust them
        for obj in done:
            tmp = self.root / (obj.key + IDS + _TMP)
            _write_record(tmp, obj.spans, fsync=True)
            os.rename(tmp, self.root / (obj.key + IDS))
        fsync_dir(self.root)
        for obj in done:
            obj.recorded = True
            if obj.settled:
                (self.root / (obj.key + SETTLED)).unlink(missing_ok=True)

    def _unexpect(self, cid: bytes, obj: FileObject, off: int) -> None:
        places = [p for p in self._pending.get(cid, []) if not (p[0] is obj and p[1] == off)]
        if places:
            self._pending[cid] = places
        else:
            self._pending.pop(cid, None)
        self.index.setdefault(cid, (obj, off, next(ln for c, o, ln in obj.spans if o == off)))

    def cut_back(self) -> int:
        """Drop every unrecorded file object no publish counts on (a push failed on a full
        disk); bytes freed."""
        return self.drop([o for o in self.objects.values() if not o.recorded and not o.settled])

    def drop(self, objs: Iterable[FileObject]) -> int:
        """Delete file objects (record first, then data): their chunks leave the index unless
        another object holds them too. Bytes freed."""
        freed = 0
        gone = list(objs)
        with self._lock:
            for obj in gone:
                del self.objects[obj.key]
                self.provisional.pop(obj.key, None)
                for cid, _, _ in obj.spans:
                    places = [p for p in self._pending.get(cid, []) if p[0] is not obj]
                    if places:
                        self._pending[cid] = places
                    else:
                        self._pending.pop(cid, None)
            for cid in [c for c, (o, _, _) in self.index.items() if o in gone]:
                del self.index[cid]
            for obj in self.objects.values():  # a chunk another object holds stays findable
                for cid, off, length in obj.spans:
                    if off in obj.written:
                        self.index.setdefault(cid, (obj, off, length))
        for obj in gone:
            (self.root / (obj.key + IDS)).unlink(missing_ok=True)
            for name in (obj.key + SETTLED, obj.key, obj.key + PART):
                (self.root / name).unlink(missing_ok=True)
            self._retired += [fd for fd in (obj.fd, obj.direct) if fd >= 0]
            freed += obj.size if obj.written else 0
        if gone:
            fsync_dir(self.root)
        return freed

    def collect(self, live: Iterable[Iterable[bytes]]) -> tuple[int, int]:
        """Delete the recorded (or settled: published, not flushed yet) file objects none of
        whose chunks is live; (objects, bytes)."""
        for fd in self._retired:  # any read that used them finished long ago
            os.close(fd)
        self._retired.clear()
        index = self.index
        used = {cid for group in live for cid in group if cid in index}
        dead = [o for o in self.objects.values()
                if (o.recorded or o.settled) and not any(cid in used for cid, _, _ in o.spans)]
        return len(dead), self.drop(dead)

    def usage(self) -> tuple[int, int]:
        """(complete objects a publish counted on, their bytes)."""
        done = [o.size for o in list(self.objects.values()) if o.recorded or o.settled]
        return len(done), sum(done)

    def close(self) -> None:
        for obj in self.objects.values():
            self._retired += [fd for fd in (obj.fd, obj.direct) if fd >= 0]
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
        self.objects.clear()
        self.index.clear()


def open_part(path: Path) -> tuple[int, int]:
    """Create a file object's `.part` file: (descriptor, O_DIRECT descriptor or -1)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    os.fchmod(fd, 0o400)  # read-only (it is only ever written through these fds)
    try:
        direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered writes
        direct = -1
    return fd, direct


def _write(obj: FileObject, data: bytes | memoryview, off: int) -> None:
    """Write a chunk at `off`: with O_DIRECT when its buffer, offset and length allow it.

    A buffered write copies every byte into the page cache, and that copy was most of a node's
    CPU per ingested byte (1.8 CPU-s per GiB here, against 0.2 s with O_DIRECT, which the disk
    reads by DMA from the receive buffer: daemon/wire/connection.py places a chunk's bytes on a
    page). The file's pages are then not in memory after a push: its first reads come from disk,
    like those of any file on the node's disk."""
    if obj.direct >= 0 and off % _DIRECT == 0 and len(data) % _DIRECT == 0 and data:
        view = memoryview(data)
        try:
            aligned = ctypes.addressof(ctypes.c_char.from_buffer(view)) % _DIRECT == 0
        except TypeError:  # read-only (a decrypted or decompressed chunk)
            aligned = False
        finally:
            view.release()
        if aligned:
            try:
                _pwrite_all(obj.direct, data, off)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise  # EINVAL: this device wants a larger alignment; write it buffered
    _pwrite_all(obj.fd, data, off)


def _write_record(path: Path, spans: list[tuple[bytes, int, int]], fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        _pwrite_all(fd, b"".join(IDX.pack(*s) for s in spans), 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n
