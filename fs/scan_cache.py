"""The dev box's scan cache: what each source file hashed to last time, so an unchanged file is
never read again and a one-file edit hashes one file.

An entry maps a file's stat key (st_dev, st_ino, size, mtime_ns, ctime_ns) to its chunk ids. The
key includes ctime, which no system call can set back: writing a file (even one that then gets
its old mtime back with `touch -d` or os.utime), renaming it or changing its mode all move it, and
an editor that saves by rename makes a new inode. So a key that still matches means the content
was not changed through the file system, and the cached ids are trusted without reading a byte.

Racily clean files (git's term): a file written within the timestamp granularity of the moment
it was hashed could change again without its key changing. Entries whose mtime or ctime is less
than `racy_ns` (2 s, the coarsest granularity in common use) before the scan started are
therefore not stored: such a file is hashed again next time, which costs only recently touched
files.

The trust is git's and make's: content changed without ctime moving (a raw block-device write,
the clock set back) is not seen. The push reads every chunk it sends from its source and checks
its id, so a stale entry whose chunk must be sent fails the push (SourceChanged naming the cache,
which is cleared) and never sends wrong bytes; a stale entry whose old chunk every node already
holds publishes the file's previous content. `push --no-cache` hashes everything.

Beside it, what was worked out about the folder objects of the last scan, by object id: which
were validated, and which hold modules without bytecode (`checked`, `bytecode`); and the last
version pushed to every node, with its folder objects (`pushed`, `pushed_objects`), so that the
next push asks the nodes that serve it only about what is new (the file `<cache file>.folders`).
A folder object's id is its content, so none of these can go stale: a one-file edit checks
again only the folders on its path.

One cache file per source folder, `<cache_dir>/<xxh3_64 of the absolute path>`, in a compact
binary format checked by a hash, written atomically (temporary file + rename). A file that is
missing, truncated, corrupt, from another version or for another chunk size is ignored (the
folder is scanned in full), never an error. It is rewritten when a scan recorded something, or
left more than an eighth of its entries unused; entries for files the scan no longer saw are
dropped then (an unused entry matches no file).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Collection, Sequence

import xxhash

from .chunk import ID_SIZE
from .private_files import replace_file

MAGIC = b"MFSSCAN1"
FOLDERS_MAGIC = b"MFSFOLD1"
FOLDERS = ".folders"  # the folder facts' file: the cache file's name and this
RACY_NS = 2_000_000_000
MAX_FOLDERS = 256  # cache files kept per cache folder; the least recently used go first
UNUSED_SHARE = 8  # a scan that recorded nothing rewrites the file past 1/8 of it unused
_HEAD = struct.Struct("<8sIIQI16s")  # magic, chunk size, entries, ids, path length, xxh3_128
_REC = struct.Struct("<QQQqqI")  # st_dev, st_ino, size, mtime_ns, ctime_ns, number of chunks
# magic, checked ids, pushed objects, bytecode facts, pushed version (zeros: none), xxh3_128
_FOLDERS_HEAD = struct.Struct("<8sIII16s16s")
_FACT = struct.Struct("<HIH")  # key length, modules without bytecode, first one's name length

Key = tuple[int, int, int, int, int]  # st_dev, st_ino, size, mtime_ns, ctime_ns
Cached = dict[tuple[int, int], tuple[int, int, int, tuple[bytes, ...]]]  # (dev, ino) -> size,
# mtime_ns, ctime_ns, chunk ids


def stat_key(st: os.stat_result) -> Key:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cache_file(cache_dir: str | os.PathLike[str], folder: str | os.PathLike[str] | bytes) -> str:
    """Where the cache of source `folder` lives inside `cache_dir`."""
    path = os.fsencode(os.path.abspath(os.fsdecode(folder)))
    return os.path.join(os.fspath(cache_dir), xxhash.xxh3_64_hexdigest(path))


class ScanCache:
    """The cache of one source folder. `scan()` loads it, looks files up, records what it
    hashed and saves it; `path=None` gives an in-memory cache (nothing is read or written)."""

    def __init__(self, path: str | os.PathLike[str] | None, folder: str | os.PathLike[str] | bytes,
                 racy_ns: int = RACY_NS):
        self.path = os.fspath(path) if path is not None else None
        self.folder = os.fsencode(os.path.abspath(os.fsdecode(folder)))
        self.racy_ns = racy_ns
        self.chunk_size = 0
        self._old: Cached = {}
        self._new: Cached = {}
        self._dirty = False
        self._since_ns = 0
        self.loaded = 0  # entries the file holds (read now, or kept from the last read or write)
        self.hits = 0
        self.stored = 0  # entries recorded by this scan
        # Facts about folder objects, by id (see the module docstring); kept for the folders
        # of the last scan only, and saved with the cache when they changed.
        self.checked: set[bytes] = set()  # folder objects validated (Manifest.validate)
        # key -> (modules without bytecode, the first one's name): bytecode.py's
        self.bytecode: dict[bytes, tuple[int, bytes]] = {}
        self.pushed: bytes | None = None  # the version last pushed to every node from here
        self.pushed_objects: set[bytes] = set()  # its folder objects
        self._facts_loaded = False
        self._facts_dirty = False
        # The file as this cache last read or wrote it (dev, ino, size, ctime): while it is
        # that file, `_old` holds what it says (or less: entries the last scan did not use,
        # which match no file), and the next scan does not read and decode it again (push
        # --watch's checks): at 100k files, 96 ms and 300k objects the collector tracks.
        self._file: tuple[int, int, int, int] | None = None
        self._in_file = 0  # how many entries it holds

    @classmethod
    def for_folder(cls, cache_dir: str | os.PathLike[str], folder: str | os.PathLike[str],
                   racy_ns: int = RACY_NS) -> ScanCache:
        return cls(cache_file(cache_dir, folder), folder, racy_ns)

    # ---- one scan: begin, lookup/record, save ---------------------------------------------

    def begin(self, chunk_size: int, started_ns: int | None = None) -> None:
        """Start a scan with `chunk_size`: load the file (or start empty). Files changed after
        `started_ns - racy_ns` (default: now) will not be recorded."""
        started_ns = time.time_ns() if started_ns is None else started_ns
        self._since_ns = started_ns - self.racy_ns
        if self.path is not None:
            if chunk_size != self.chunk_size or self._file is None \
                    or self._file != file_key(self.path):
                self._old = self._read(self.path, chunk_size)
                self._in_file = len(self._old)
            self._file = self._touch(self.path) if self._old else None
        elif chunk_size != self.chunk_size:
            self._old = {}
        if self.path is not None and not self._facts_loaded:
            (self.checked, self.bytecode, self.pushed,
             self.pushed_objects) = _read_facts(self.path + FOLDERS)
        self._facts_loaded = True
        self.chunk_size = chunk_size
        self._new = {}
        self.hits = self.stored = 0
        self.loaded = self._in_file
        self._dirty = False

    def lookup(self, st: os.stat_result) -> tuple[bytes, ...] | None:
        """The chunk ids of a file whose stat is `st`, if it is cached with exactly that key."""
        ino = (st.st_dev, st.st_ino)
        e = self._old.get(ino)
        if e is None or e[0] != st.st_size or e[1] != st.st_mtime_ns or e[2] != st.st_ctime_ns:
            return None
        self._new[ino] = e
        self.hits += 1
        return e[3]

    def vouches(self, path: bytes, cid: bytes) -> bool:
        """Whether this cache says that the file at `path`, as it is now, holds chunk `cid`."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        ino = (st.st_dev, st.st_ino)
        e = self._new.get(ino) or self._old.get(ino)
        return e is not None and e[:3] == (st.st_size, st.st_mtime_ns, st.st_ctime_ns) \
            and cid in e[3]

    def record(self, key: Key, chunks: Sequence[bytes]) -> bool:
        """Remember what a file with stat `key` hashed to; False when it changed too recently
        to be trusted later (racily clean) and was not recorded."""
        dev, ino, size, mtime, ctime = key
        if max(mtime, ctime) >= self._since_ns:
            return False
        self._new[(dev, ino)] = (size, mtime, ctime, tuple(chunks))
        self._dirty = True
        self.stored += 1
        return True

    def keep_checked(self, oids: Collection[bytes]) -> None:
        """The folder objects of the scan's manifest, all validated: the next scan's `known`."""
        if len(oids) != len(self.checked) or not self.checked.issuperset(oids):
            self.checked = set(oids)
            self._facts_dirty = True

    def keep_bytecode(self, facts: dict[bytes, tuple[int, bytes]]) -> None:
        """bytecode.py's facts for the folders of the scan's manifest (the others are dropped)."""
        if facts != self.bytecode:
            self.bytecode = facts
            self._facts_dirty = True

    def save(self) -> bool:
        """Write what this scan saw (only those files: deleted ones are dropped), if it recorded
        anything or many of the file's entries went unused; atomically, and the folder facts
        beside it if they changed. True when the cache file was written. Errors are swallowed:
        a cache that cannot be written only costs time.

        A few unused entries are not worth a rewrite (8 ms at 15k files): a file just edited
        is not recorded (racily clean) and its old entry no longer matches it, so every push of
        an edit would rewrite the cache for it. An unused entry matches no file."""
        unused = self._in_file - len(self._new) if not self._dirty else 0
        changed = self._dirty or unused > self._in_file // UNUSED_SHARE
        self._old, self._new, self._dirty = self._new, dict(self._new), False
        self.save_facts()
        if self.path is None or not changed:
            return False
        try:
            self._write(self.path)
        except OSError:
            return False
        return True

    def keep_pushed(self, version: bytes, oids: Collection[bytes]) -> None:
        """Every node now serves `version`, whose folder objects are `oids`."""
        if version != self.pushed:
            self.pushed, self.pushed_objects = version, set(oids)
            self._facts_dirty = True

    def save_facts(self) -> None:
        """Write the folder facts, if they changed (atomically; errors only cost time)."""
        if self.path is not None and self._facts_dirty:
            self._facts_dirty = False
            try:
                _write_facts(self.path + FOLDERS, self.checked, self.bytecode, self.pushed,
                             self.pushed_objects)
            except OSError:
                pass

    def discard(self) -> None:
        """Forget everything, on disk too: an entry was found stale."""
        self._old, self._new, self._file = {}, {}, None
        if self.path is not None:
            for path in (self.path, self.path + FOLDERS):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # ---- the file -------------------------------------------------------------------------

    def _read(self, path: str, chunk_size: int) -> Cached:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return {}
        try:
            return self._decode(data, chunk_size)
        except (struct.error, ValueError):
            return {}

    @staticmethod
    def _touch(path: str) -> tuple[int, int, int, int] | None:
        """Mark the file recently used (not pruned); its key after that."""
        try:
            os.utime(path)
        except OSError:
            return None
        return file_key(path)

    def _decode(self, data: bytes, chunk_size: int) -> Cached:
        if len(data) < _HEAD.size:
            raise ValueError("truncated")
        magic, csize, count, nids, plen, digest = _HEAD.unpack_from(data)
        if magic != MAGIC or csize != chunk_size:
            raise ValueError("other version or chunk size")
        body = memoryview(data)[_HEAD.size:]
        if len(body) != plen + count * _REC.size + nids * ID_SIZE:
            raise ValueError("bad length")
        if xxhash.xxh3_128_digest(body) != digest:
            raise ValueError("bad checksum")
        if bytes(body[:plen]) != self.folder:
            raise ValueError("another folder")
        recs_end = plen + count * _REC.size
        ids = bytes(body[recs_end:])
        out: Cached = {}
        pos = 0
        for dev, ino, size, mtime, ctime, n in _REC.iter_unpack(body[plen:recs_end]):
            if n != -(-size // chunk_size):
                raise ValueError("bad chunk count")
            end = pos + n * ID_SIZE
            chunks: tuple[bytes, ...]
            if n == 1:
                chunks = (ids[pos:end],)
            else:
                chunks = tuple(ids[i:i + ID_SIZE] for i in range(pos, end, ID_SIZE))
            out[(dev, ino)] = (size, mtime, ctime, chunks)
            pos = end
        if pos != len(ids):
            raise ValueError("bad id count")
        return out

    def _encode(self) -> bytes:
        recs: list[bytes] = []
        ids: list[bytes] = []
        rec = _REC.pack
        for (dev, ino), (size, mtime, ctime, chunks) in self._old.items():
            recs.append(rec(dev, ino, size, mtime, ctime, len(chunks)))
            ids.extend(chunks)
        body = b"".join([self.folder, *recs, *ids])
        return _HEAD.pack(MAGIC, self.chunk_size, len(recs), len(ids), len(self.folder),
                          xxhash.xxh3_128_digest(body)) + body

    def _write(self, path: str) -> None:
        data = self._encode()
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        replace_file(path, data, f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
        self._file, self._in_file = file_key(path), len(self._old)
        _prune(folder)


def file_key(path: str) -> tuple[int, int, int, int] | None:
    """What tells a cache file from any other at `path` (a write replaces it: a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


Facts = tuple[set[bytes], dict[bytes, tuple[int, bytes]], bytes | None, set[bytes]]


def _read_facts(path: str) -> Facts:
    """The folder facts kept at `path` (checked, bytecode, pushed, pushed_objects); none when
    it is missing, truncated or corrupt."""
    none: Facts = (set(), {}, None, set())
    try:
        with open(path, "rb") as f:
            data = f.read()
        magic, nchecked, npushed, nfacts, pushed, digest = _FOLDERS_HEAD.unpack_from(data)
        body = memoryview(data)[_FOLDERS_HEAD.size:]
        if magic != FOLDERS_MAGIC or xxhash.xxh3_128_digest(body) != digest:
            return none
        ids = [bytes(body[i:i + ID_SIZE]) for i in range(0, (nchecked + npushed) * ID_SIZE,
                                                           ID_SIZE)]
        end = len(ids) * ID_SIZE
        facts: dict[bytes, tuple[int, bytes]] = {}
        for _ in range(nfacts):
            klen, count, nlen = _FACT.unpack_from(body, end)
            start = end + _FACT.size
            end = start + klen + nlen
            facts[bytes(body[start:start + klen])] = (count, bytes(body[start + klen:end]))
        if end != len(body):
            return none
        version = pushed if npushed and any(pushed) else None
        return set(ids[:nchecked]), facts, version, set(ids[nchecked:]) if version else set()
    except (OSError, struct.error, ValueError):
        return none


def _write_facts(path: str, checked: set[bytes], facts: dict[bytes, tuple[int, bytes]],
                 pushed: bytes | None, pushed_objects: set[bytes]) -> None:
    objects = pushed_objects if pushed is not None else set()
    records = [b"".join([_FACT.pack(len(k), count, len(name)), k, name])
               for k, (count, name) in facts.items()]
    body = b"".join([*checked, *objects, *records])
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    replace_file(path, _FOLDERS_HEAD.pack(FOLDERS_MAGIC, len(checked), len(objects), len(facts),
                                          pushed or bytes(ID_SIZE),
                                          xxhash.xxh3_128_digest(body)) + body,
                 f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")


def _prune(folder: str, keep: int = MAX_FOLDERS) -> None:
    """Keep the `keep` most recently used cache files of `folder` (with their folder facts)."""
    try:
        with os.scandir(folder) as it:
            files = [(e.stat().st_mtime_ns, e.path) for e in it
                     if e.is_file() and not e.name.endswith(FOLDERS)]
    except OSError:
        return
    if len(files) <= keep:
        return
    files.sort()
    for _, path in files[:len(files) - keep]:
        for old in (path, path + FOLDERS):
            try:
                os.unlink(old)
            except OSError:
                pass
