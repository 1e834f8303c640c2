"""The content-addressed store: chunk blobs appended to pack files, found through an index.

One file per chunk made every small file of a Python environment cost a file creation, a rename
and a directory entry on every node (~300 us each here); appending to a pack costs a write.

    store/packs/00000001.pack  records (fs/pack.py): b"MFSR", chunk id, blob length, blob
    store/packs/00000001.idx   (sealed packs) id, offset, length per record
    store/packs/00000002.durable  (unsealed) how much of it is on disk (fs/durable.py)
    store/files/<key>          large files, written once, in place (fs/file_objects.py)
    store/lock                 held by the one process that owns the store

An object exists once its whole record is in a pack: the in-memory index is only updated after
the append. `collect` (fs/collect.py) deletes the sealed packs in which no object is live any
more (the chunks of versions no node keeps), and those mostly dead after their live objects are
copied to the open pack and made durable; packs are never rewritten in place, so a crash
mid-collect loses nothing live. After a crash, packs without an index are scanned and a torn
record at the end is cut off, and what lies past its durable point verified (`lost`: what did
not). Every blob is verified against its id before it is appended and whenever it is read: a
damaged record is an error, never wrong bytes. Durability is batched: `sync()` flushes before a
version is published (`--durable sync`), or `settle()` before and `flush()` after, in the
background. `cut_back()` gives back what was appended since (a push that failed, disk full).

The store holds the bytes of every pushed file whatever its mode, so its folders are 0700 and
its files 0600, whatever the umask (fs/private_files.py): the mount is the only way other users
read content.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import collect as collection
from . import durable, pack
from .chunk import (
    ID_SIZE,
    MAX_CHUNK_SIZE,
    RAW,
    CorruptChunk,
    chunk_id,
    decode,
    encode,
    raw_size,
)
from .file_objects import FileObjects
from .pack import PACK_SHIFT, loc, unloc
from .private_files import PRIVATE_FILE, private_dir
from .store_durability import RAW_CODEC, StoreDurability
from .store_lock import StoreBusy, lock

PACK_LIMIT = 256 * 1024 * 1024
# A small blob read from a pack brings the pack's next READ_AROUND bytes into the page cache:
# files pushed together (a folder's modules) are read together, and a read that finds its
# blob in memory is answered without a worker thread (get_if_cached). A cold replay of the
# files `import torch` opens took 0.82 s without it, 0.77 s with 1 MiB (medians of 6).
READ_AROUND = 1 << 20
NOWAIT_MAX = 256 << 10  # get_if_cached decodes on the caller's thread: keep that short
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class Store(StoreDurability):
    """The node's content-addressed chunk store: append-only pack files and an index of where
    each chunk is, verified against its id on the way in and on the way out."""

    def __init__(self, root: str | os.PathLike[str], pack_limit: int = PACK_LIMIT,
                 flush_later: bool = False):
        self.root = Path(root)
        self.packs = self.root / "packs"
        for folder in (self.root, self.packs):
            private_dir(folder)
        self.pack_limit = pack_limit
        self._lockfd = lock(self.root)
        self._index: dict[bytes, int] = {}  # id -> pack.loc(pack, offset, length)
        self.objects = FileObjects(self.root / "files")  # large files, stored once as the file
        self._readers: dict[int, int] = {}
        self._retired: list[int] = []  # readers of deleted packs, closed at the next collect
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one flush at a time (the flusher, a prepare, collect)
        self._cuts = 0  # cut backs so far: a flush that raced one records no durable point
        # Objects (and bytes) a crash took past the durable points, found at start; full packs
        # sealed at the next flush if `flush_later` (fs/durable.py)
        self.lost, self.lost_bytes = self.objects.lost, 0
        self.flush_later, self.seals = flush_later, durable.Seals()
        # Packs that could not be read at start: reported, never written to or collected (what
        # they hold may come back once the fault is fixed); their objects count as missing.
        self.problems: list[str] = list(self.objects.problems)
        self._unreadable: set[int] = set()
        numbers = []
        for p in self.packs.glob("*.pack"):
            if p.stem.isdigit():
                numbers.append(int(p.stem))
            else:
                self.problems.append(f"{p}: not a pack name; ignored")
        numbers.sort()
        found: list[tuple[bytes, int]] = []  # the last pack's records
        for n in numbers:
            try:
                listed = pack.read_index(self.packs, n)
                if listed is None:  # no index: verified past its durable point
                    listed, tail = durable.scan_unsealed(self.packs, n)
                    self.lost += tail.dropped
                    self.lost_bytes += tail.cut
                    if n != numbers[-1]:  # a seal a crash cut short: verified, done now
                        durable.seal_checked(self.packs, n, listed)
                found = listed
                self._index.update(found)
            except OSError as e:
                self.problems.append(f"pack {self._pack_path(n)} cannot be read, its objects are "
                                     f"missing: {e.strerror or e}")
                self._unreadable.add(n)
                for cid in [c for c, at in self._index.items() if at >> PACK_SHIFT == n]:
                    del self._index[cid]  # those an index listed before the failure
        # Append to the last pack unless it is sealed (has an index), full or unreadable.
        last = numbers[-1] if numbers else 0
        if not last or last in self._unreadable or pack.idx_path(self.packs, last).exists():
            self._open_pack(last + 1)
        else:  # reopened: the records pack.scan found go into its index when it is sealed
            self._open_pack(last)
            self._records.extend(found)

    # ---- layout -------------------------------------------------------------------------

    def _pack_path(self, n: int) -> Path:
        return pack.pack_path(self.packs, n)

    def _open_pack(self, n: int) -> None:
        self._cur = n
        self._fd = os.open(self._pack_path(n), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                           PRIVATE_FILE)
        self._size = os.fstat(self._fd).st_size
        self._durable = self._size  # what cut_back() keeps: found on disk, or synced since
        self._settled = self._size  # ... and what a publish counts on (settle)
        # The current pack's records, (id, location) in append order: its index once sealed.
        self._records: list[tuple[bytes, int]] = []

    def _seal(self) -> None:
        """Make the full pack durable and write its index, then start the next one. If the
        index cannot be written (a full disk), the pack stays open and the error propagates:
        the next append tries again. With flush_later, only started: durable.Seals."""
        n = self._cur
        if self.flush_later:
            self.seals.defer(n, self._fd, self._records)
        else:
            os.fsync(self._fd)
            self._durable = self._size
            pack.write_index(self.packs, n, self._records)
            durable.drop_point(self.packs, n)
            os.close(self._fd)
        self._open_pack(n + 1)

    @property
    def unsealed(self) -> int:
        """Records in the open pack, which has no index yet: what opening the store reads."""
        return len(self._records)

    def seal(self) -> None:
        """Seal the open pack now, if it holds anything, so that a collect may reach it
        (after `monarch-fs rm` it may hold nothing but the removed workspace)."""
        with self._lock:
            if self._size:
                self._seal()

    # ---- objects ------------------------------------------------------------------------

    def has(self, cid: bytes) -> bool:
        return cid in self._index or cid in self.objects.index

    def missing(self, ids: Iterable[bytes]) -> list[bytes]:
        index, objects = self._index, self.objects.index
        return [cid for cid in ids if cid not in index and cid not in objects]

    def __len__(self) -> int:
        return len(self._index) + sum(c not in self._index for c in self.objects.index)

    def ids(self) -> list[bytes]:
        return list({**dict.fromkeys(self._index), **dict.fromkeys(self.objects.index)})

    def forget(self, cid: bytes) -> None:
        """Drop a chunk found damaged from the index: the next push sends it again (a restart
        indexes the newer record); the damaged one goes with its pack's next compaction."""
        with self._lock:
            self._index.pop(cid, None)

    def expect_file(self, key: str, size: int, chunks: Sequence[bytes], chunk_size: int
                    ) -> bool:
        """A large file's chunks that arrive from now on are written once, into its file
        object (fs/file_objects.py), not a pack; False if none is to arrive."""
        return self.objects.expect(key, size, chunks, chunk_size, self.has)

    def will_need(self, ids: Iterable[bytes]) -> int:
        """Start reading those of `ids` in file objects into the page cache; bytes asked."""
        return self.objects.will_need(ids)

    def file_object(self, key: str) -> Path | None:
        """The complete file object `key` (passthrough binds it), if there is one."""
        return self.objects.path(key)

    def put_blob(self, cid: bytes, blob: bytes | memoryview, *, raw: bool = False,
                 verified: bool = False) -> bool:
        """Verify `blob` against `cid` and append it; False (a no-op) when the object exists.

        With `raw`, a compressed blob is stored decompressed: verifying it decompressed it
        anyway, and reads of raw objects cost a hash instead of a decompression. `verified`
        skips the check for a blob the caller has just encoded from bytes it hashed (the dev
        box's store, daemon/client/controller_store.py); never for bytes from a peer."""
        done = self.put_blobs([(cid, blob)], raw=raw, verified=verified)[0]
        if isinstance(done, CorruptChunk):
            raise done
        return done

    def put_blobs(self, blobs: Sequence[tuple[bytes, bytes | memoryview]], *, raw: bool = False,
                  verified: bool = False, digests: Sequence[bytes | None] | None = None
                  ) -> list[bool | CorruptChunk]:
        """put_blob of each (id, blob), their records appended in one write (a write and a lock
        per small chunk were most of a node's work per small file): what each did, or why it
        was refused. OSError (a full disk): no record of them was appended. `digests`: the
        xxh3_128 of each raw blob's bytes where the receiver hashed them as they arrived
        (daemon/wire/arriving.py), compared with the id instead of hashing them again."""
        out: list[bool | CorruptChunk] = []
        todo: dict[bytes, tuple[int, list[bytes | memoryview]]] = {}
        for i, (cid, blob) in enumerate(blobs):
            digest = digests[i] if digests is not None else None
            try:
                parts = None if cid in todo else self._parts(cid, blob, raw, verified, digest)
            except CorruptChunk as e:
                out.append(e)
                continue
            if parts:
                todo[cid] = (len(out), parts)
            out.append(parts is not None)  # [] once placed in its file object
        with self._lock:
            for cid, (i, _) in todo.items():
                out[i] = not self.has(cid)
            if new := [(cid, parts) for cid, (i, parts) in todo.items() if out[i]]:
                self._append_all(new)
        return out

    def _parts(self, cid: bytes, blob: bytes | memoryview, raw: bool, verified: bool,
               digest: bytes | None = None) -> list[bytes | memoryview] | None:
        """A verified blob's record parts; None if the object exists, [] once written raw at
        its offset in its file object (readable from then on)."""
        if len(cid) != ID_SIZE:
            raise CorruptChunk(f"chunk id {cid.hex()} is not {ID_SIZE} bytes")
        if self.has(cid):
            return None
        if verified and not raw and not self.objects.wants(cid):
            return [blob]
        data = decode(cid, blob) if digest is None else _hashed(cid, blob, digest)
        if self.objects.wants(cid) and self.objects.place(cid, data):
            return []
        return [RAW_CODEC, data] if raw and blob[0] != RAW else [blob]

    def _append(self, cid: bytes, parts: list[bytes | memoryview]) -> None:
        """Append one record to the open pack and point the index at it. Holds self._lock."""
        self._append_all([(cid, parts)])

    def _append_all(self, records: list[tuple[bytes, list[bytes | memoryview]]]) -> None:
        """Append records to the open pack in one write (pack.append) and point the index at
        them. Holds self._lock."""
        places = pack.append(self._fd, self._size, records)
        for (cid, _), (off, length) in zip(records, places):
            self._index[cid] = at = loc(self._cur, off, length)
            self._records.append((cid, at))
        self._size = places[-1][0] + places[-1][1]
        if self._size >= self.pack_limit:
            self._seal()

    def put(self, data: bytes) -> bytes:
        cid = chunk_id(data)
        if cid not in self._index:
            self.put_blob(cid, encode(data))
        return cid

    def locate(self, cid: bytes) -> tuple[Path, int, int]:
        """(pack file, offset, length) of an object's blob: for checks and repairs."""
        n, off, length = unloc(self._index[cid])
        return self._pack_path(n), off, length

    def _reader(self, cid: bytes) -> tuple[int, int, int]:
        """(read descriptor of its pack, offset, length) of an object's blob."""
        for _ in range(2):
            try:
                n, off, length = unloc(self._index[cid])
            except KeyError:
                raise KeyError(cid.hex()) from None
            fd = self._readers.get(n)
            if fd is None:
                with self._lock:
                    fd = self._readers.get(n)
                    if fd is None:
                        try:
                            fd = self._readers[n] = os.open(self._pack_path(n), os.O_RDONLY)
                        except FileNotFoundError:
                            continue  # compacted since the index was read: it has moved
            return fd, off, length
        raise KeyError(cid.hex())

    def get_blob(self, cid: bytes) -> bytes:
        """The chunk as it is stored and sent: a pack's record, or (a chunk of a file object,
        checked against its id) its raw form."""
        data = self._from_object(cid)
        if data is not None:
            return RAW_CODEC + bytes(data)
        fd, off, length = self._reader(cid)
        blob = os.pread(fd, length, off)
        if len(blob) != length:
            raise CorruptChunk(f"chunk {cid.hex()}: a pack is shorter than its index says")
        if length < READ_AROUND:  # asynchronous: the kernel starts the reads and returns
            os.posix_fadvise(fd, off + length, READ_AROUND, os.POSIX_FADV_WILLNEED)
        return blob

    def get_if_cached(self, cid: bytes) -> bytes | memoryview | None:
        """What `get` returns, if the chunk is small, its pack already open and its blob in the
        page cache (RWF_NOWAIT), else None (then `get` it in a worker thread). Never blocks, so
        the FUSE thread calls it directly: a hand-off to a worker and back costs two wake-ups
        (~60 us each across CPUs here)."""
        at = self._index.get(cid)
        if at is None:
            return None
        n, off, length = unloc(at)
        fd = self._readers.get(n)
        if fd is None or length > NOWAIT_MAX:
            return None
        blob = bytearray(length)
        try:
            if os.preadv(fd, [blob], off, os.RWF_NOWAIT) != length:
                return None  # partly in memory
        except OSError:  # not in memory (EAGAIN), or a filesystem without RWF_NOWAIT
            return None
        if not 0 <= raw_size(blob) <= NOWAIT_MAX:
            return None
        return decode(cid, blob)

    def copy_raw(self, cid: bytes, dst_fd: int) -> bool:
        """Append a chunk stored raw to `dst_fd`, copied inside the kernel (it was verified
        when it arrived); False, copying nothing, if it is stored compressed or the kernel
        cannot copy between these two files."""
        if cid in self.objects.index:
            fd, off, left = self.objects.where(cid)
            length = left + 1
        else:
            fd, off, length = self._reader(cid)
            if os.pread(fd, 1, off) != RAW_CODEC:
                return False
            off, left = off + 1, length - 1
        while left:
            try:
                n = os.copy_file_range(fd, dst_fd, left, off)
            except OSError as e:  # across filesystems, or not supported: the caller copies
                if left == length - 1 and e.errno in _NO_COPY_RANGE:
                    return False
                raise
            if n == 0:
                raise CorruptChunk(f"chunk {cid.hex()}: a pack is shorter than its index says")
            off, left = off + n, left - n
        return True

    def get(self, cid: bytes) -> bytes | memoryview:
        """The verified raw bytes of a chunk. KeyError if absent, CorruptChunk if damaged."""
        data = self._from_object(cid)
        if data is not None:
            return data
        return decode(cid, self.get_blob(cid))

    def _from_object(self, cid: bytes) -> bytes | None:
        """A chunk's bytes from its file object, checked against its id; None if it is in none
        (or no longer: it may still be in a pack)."""
        if cid not in self.objects.index:
            return None
        try:
            data = self.objects.read(cid)
        except KeyError:  # dropped meanwhile
            return None
        if chunk_id(data) != cid:
            raise CorruptChunk(f"chunk {cid.hex()}: its file object holds other bytes")
        return data

    def collect(self, live: collection.Live) -> tuple[int, int]:
        """Free the space of objects outside `live()`; (packs deleted, bytes freed): see
        fs/collect.py. Blocking: run it in a worker thread."""
        with self._sync_lock:  # full packs are sealed first (durable.Seals)
            self.seals.finish(self.packs)
        packs, freed = collection.collect(self, live)
        with self._sync_lock:  # not while a flush records one
            objects, more = self.objects.collect(live())
        return packs + objects, freed + more

    def usage(self) -> tuple[int, int]:
        """(objects, bytes of packs on disk). File objects are counted as backing files
        (BackingFiles.usage): they are what passthrough binds."""
        return len(self), sum(p.stat().st_size for p in self.packs.glob("*.pack"))

    def close(self) -> None:
        self.objects.close()
        self.seals.close()
        for fd in [self._fd, *self._readers.values(), *self._retired, self._lockfd]:
            os.close(fd)
        self._readers.clear()
        self._retired.clear()


__all__ = ["Store", "StoreBusy", "CorruptChunk"]


def _hashed(cid: bytes, blob: bytes | memoryview, digest: bytes) -> memoryview:
    """A raw blob's bytes, checked against `cid` by the `digest` its receiver computed of
    them. Raises CorruptChunk, never wrong bytes."""
    if not len(blob) or blob[0] != RAW:
        raise CorruptChunk(f"chunk {cid.hex()}: a digest is only taken of a raw blob")
    if len(blob) - 1 > MAX_CHUNK_SIZE or digest != cid:
        raise CorruptChunk(f"chunk {cid.hex()}: content does not match its id")
    return memoryview(blob)[1:]
