"""Scanning a source folder into a snapshot: a manifest plus where to read each chunk.

The walk reads only metadata; file contents are hashed in worker threads (xxh3 releases the GIL),
small files in batches so the per-thread-call cost does not dominate trees of many tiny files.
With a ScanCache (scan_cache.py), a file whose stat key is cached is not read at all: the walk
takes its chunk ids from the cache, and only new or changed files are hashed, so a scan of an
unchanged tree is one walk in one worker thread. Nothing is copied: the push reads each chunk
again from its source file when it is sent, and checks it still hashes to its id.
"""

from __future__ import annotations

import fnmatch
import operator
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import trio

from .chunk import CHUNK_SIZE, chunk_id, spans
from .manifest import Entry, Kind, Manifest, sort_key
from .scan_cache import Key, ScanCache, stat_key

_BATCH_BYTES = 8 * 1024 * 1024
_BATCH_FILES = 256


class SourceChanged(Exception):
    """A source file changed between the scan and the moment its chunk was sent."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where the dev box reads one chunk from: a piece of one local file."""

    path: bytes  # absolute path of the file holding the chunk
    offset: int
    length: int
    cached: Key | None = None  # the file's stat key, when its chunk ids came from the scan cache


@dataclass
class Snapshot:
    """A scanned folder: its manifest and where to read each of its chunks."""

    root: bytes
    manifest: Manifest
    sources: dict[bytes, Source]  # chunk id -> one place to read it
    warnings: list[str] = field(default_factory=list)
    cache: ScanCache | None = None
    hashed_files: int = 0  # files read and hashed by the scan
    hashed_bytes: int = 0
    cached_files: int = 0  # files whose chunk ids came from the cache, unread

    def read_chunk(self, cid: bytes) -> bytes | bytearray:
        """The raw bytes of a chunk, read again from its source and checked against its id."""
        return self.read_into(cid, 0)

    def read_into(self, cid: bytes, lead: int) -> bytearray:
        """read_chunk's bytes after `lead` bytes left free for the caller (a blob's codec byte:
        a raw link's 1 GB would otherwise be copied once more to put it in front). One
        open and pread: Python's open() adds an fstat and an ioctl per file, and 22k files
        made it a quarter of a push's CPU on the dev box."""
        src = self.sources[cid]
        buf = bytearray(lead + src.length)
        try:
            fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SourceChanged(f"{os.fsdecode(src.path)} was deleted during the push") from None
        try:
            got = os.preadv(fd, [memoryview(buf)[lead:]], src.offset)
        finally:
            os.close(fd)
        data = memoryview(buf)[lead:]
        if got != src.length or chunk_id(data) != cid:
            if src.cached is not None and self._key(src.path) == src.cached:
                # Not an edit during the push: the file changed without its size, mtime or
                # ctime changing, so the cache cannot tell. Forget it, or every push would fail.
                if self.cache is not None:
                    self.cache.discard()
                raise SourceChanged(
                    f"{os.fsdecode(src.path)} does not hold the bytes the scan cache recorded, "
                    "although its size, mtime and ctime are unchanged; the scan cache of "
                    f"{os.fsdecode(self.root)} was cleared: push again")
            raise SourceChanged(f"{os.fsdecode(src.path)} changed during the push; push again")
        return buf

    @staticmethod
    def _key(path: bytes) -> Key | None:
        try:
            return stat_key(os.stat(path))
        except OSError:
            return None


@dataclass(slots=True)
class _File:
    path: bytes  # relative
    abspath: bytes
    mode: int
    stat: Key

    @property
    def key(self) -> tuple[int, int]:
        """(st_dev, st_ino): hard links are hashed once."""
        return self.stat[:2]

    @property
    def size(self) -> int:
        return self.stat[2]

    @property
    def mtime_ns(self) -> int:
        return self.stat[3]


def _excluded(rel: bytes, patterns: Sequence[str]) -> bool:
    if not patterns:
        return False
    name = os.fsdecode(rel.rpartition(b"/")[2])
    path = os.fsdecode(rel)
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(path, p) for p in patterns)


def is_excluded(rel: bytes, patterns: Sequence[str]) -> bool:
    """Whether the scan leaves out `rel` (a path relative to the root), itself or by leaving
    out a folder above it."""
    if not patterns or not rel:
        return False
    parts = rel.split(b"/")
    return any(_excluded(b"/".join(parts[:i]), patterns) for i in range(1, len(parts) + 1))


_S_IFMT, _S_IFDIR, _S_IFREG, _S_IFLNK = 0o170000, stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK
_name = operator.attrgetter("name")


@dataclass
class _Walk:
    entries: list[Entry]  # folders, symlinks, and files whose chunk ids came from the cache
    files: list[_File]  # files to hash
    sources: dict[bytes, Source]  # of the cached files
    warnings: list[str]
    cached_files: int = 0


def _is_folder(path: bytes) -> bool:
    """A folder itself, not a link to one (whose target is outside the snapshot's tree)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _folder(root: bytes, rel: bytes) -> Entry:
    """The entry of folder `rel` (b"": the root), from a fresh lstat."""
    st = os.lstat(os.path.join(root, rel) if rel else root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{os.fsdecode(os.path.join(root, rel))} is not a directory")
    return Entry(rel, Kind.DIR, stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns)


def _list(root: bytes, rel_dir: bytes, excludes: Sequence[str], cache: ScanCache | None,
          chunk_size: int, out: _Walk) -> list[bytes]:
    """Add the entries of folder `rel_dir`'s children to `out` (a file the cache does not
    know goes to out.files, for hashing); its subfolders, to list next."""
    abs_dir = os.path.join(root, rel_dir) if rel_dir else root
    lookup = cache.lookup if cache is not None else None
    entries, files, sources = out.entries, out.files, out.sources
    folders = []
    with os.scandir(abs_dir) as it:
        children = sorted(it, key=_name)
    for d in children:
        rel = rel_dir + b"/" + d.name if rel_dir else d.name
        if excludes and _excluded(rel, excludes):
            continue
        st = d.stat(follow_symlinks=False)
        fmt = st.st_mode & _S_IFMT
        mode = st.st_mode & 0o7777
        if fmt == _S_IFDIR:
            entries.append(Entry(rel, Kind.DIR, mode, 0, st.st_mtime_ns))
            folders.append(rel)
        elif fmt == _S_IFREG:
            # The walk's hot loop: on a re-scan this is all the work a file costs.
            chunks = lookup(st) if lookup is not None else None
            if chunks is None:
                files.append(_File(rel, d.path, mode, stat_key(st)))
                continue
            out.cached_files += 1
            size = st.st_size
            entries.append(Entry(rel, Kind.FILE, mode, size, st.st_mtime_ns, b"", chunks))
            key = None
            for cid, (off, length) in zip(chunks, spans(size, chunk_size)):
                if cid not in sources:
                    key = key or stat_key(st)
                    sources[cid] = Source(d.path, off, length, key)
        elif fmt == _S_IFLNK:
            target = os.readlink(d.path)
            entries.append(Entry(rel, Kind.SYMLINK, mode, len(target), st.st_mtime_ns,
                                 target))
        else:
            out.warnings.append(f"skipped {os.fsdecode(rel)}: not a file, folder or symlink "
                                f"({stat.filemode(st.st_mode)[0]})")
    return folders


def _walk(root: bytes, excludes: Sequence[str], cache: ScanCache | None = None,
          chunk_size: int = CHUNK_SIZE, top: bytes = b"", out: _Walk | None = None) -> _Walk:
    """Metadata of folder `top` (b"": the root) and every entry below it, added to `out`;
    regular files the cache does not know are returned for hashing."""
    out = out or _Walk([], [], {}, [])
    out.entries.append(_folder(root, top))
    stack = [top]
    while stack:
        stack += _list(root, stack.pop(), excludes, cache, chunk_size, out)
    return out


def _rewalk(prev: Snapshot, changed: Iterable[bytes], excludes: Sequence[str],
            chunk_size: int) -> tuple[_Walk, frozenset[int]]:
    """`prev`'s entries after the paths `changed` (relative) changed: the folders holding them
    are listed again (a folder that is new is walked whole), and nothing else is looked at.
    Also the ids of the entries kept from `prev` (checked when it was made)."""
    root = prev.root
    kept = {e.path: e for e in prev.manifest.entries}
    below: dict[bytes, list[bytes]] = {}  # folder -> its children in `kept`
    for path in kept:
        if path:
            below.setdefault(path.rpartition(b"/")[0], []).append(path)

    def drop(path: bytes) -> None:
        """Forget `path` and everything below it."""
        if kept.pop(path, None) is not None:
            for child in below.pop(path, ()):
                drop(child)

    def known_folder(path: bytes) -> bytes:
        """The nearest folder, `path` or above it, that the tree has and that still is one:
        listing it again finds what changed at `path` (a new folder is walked from there)."""
        while path and not (getattr(kept.get(path), "kind", None) == Kind.DIR
                            and _is_folder(os.path.join(root, path))):
            path = path.rpartition(b"/")[0]
        return path

    out = _Walk([], [], {}, [])
    walked: list[bytes] = []  # new folders, walked whole
    for d in sorted({known_folder(p) for p in changed}, key=sort_key):
        if d and d not in kept or any(d.startswith(w + b"/") for w in walked):
            continue  # dropped or walked by a folder above it, listed before it
        fresh = _Walk([], [], {}, [])
        folders = set(_list(root, d, excludes, prev.cache, chunk_size, fresh))
        listed = {e.path for e in fresh.entries} | {f.path for f in fresh.files}
        for child in below.get(d, []):
            old = kept.get(child)
            if old is not None and (child not in listed
                                    or (child in folders) != (old.kind == Kind.DIR)):
                drop(child)
        kept[d] = _folder(root, d)
        for e in fresh.entries:
            if e.kind == Kind.DIR and e.path not in kept:
                walked.append(e.path)
                _walk(root, excludes, prev.cache, chunk_size, e.path, out)
            elif e.kind == Kind.DIR:
                kept[e.path] = e
            else:
                kept.pop(e.path, None)
                out.entries.append(e)
        for f in fresh.files:
            kept.pop(f.path, None)
        out.files += fresh.files
        out.sources.update(fresh.sources)
        out.warnings += fresh.warnings
        out.cached_files += fresh.cached_files
    before = {id(e) for e in prev.manifest.entries}
    checked = frozenset(id(e) for e in kept.values() if id(e) in before)
    out.entries += kept.values()
    # The chunks kept are read from where prev read them, unless that file changed: then
    # from another file that holds them.
    gone = tuple(os.path.join(root, p) for p in changed)
    below_gone = tuple(g + b"/" for g in gone)
    lost = set()
    for cid, src in prev.sources.items():
        if src.path in gone or src.path.startswith(below_gone):
            lost.add(cid)
        else:
            out.sources.setdefault(cid, src)
    if lost:
        for e in kept.values():
            for cid, (off, length) in zip(e.chunks, spans(e.size, chunk_size)):
                if cid in lost and cid not in out.sources:
                    out.sources[cid] = Source(os.path.join(root, e.path), off, length)
    return out, checked


_Hashed = tuple[int, list[tuple[bytes, Source]], bool]


def _hash_file(f: _File, buf: memoryview) -> _Hashed:
    """(size actually read, [(chunk id, source)], unchanged): reads to EOF, so a file that grew
    is whole; `unchanged` when the file's stat key after reading is still the walk's, so what
    was read is what the key describes (a file written meanwhile is not cached).

    Reads go into `buf` (one chunk long, reused): a `read(chunk_size)` per small file would
    allocate, fault in and free a whole chunk each time."""
    out = []
    offset = 0
    with open(f.abspath, "rb", buffering=0) as fh:
        while True:
            n = _fill(fh, buf)
            if not n:
                break
            out.append((chunk_id(buf[:n]), Source(f.abspath, offset, n)))
            offset += n
            if n < len(buf):
                break
        unchanged = stat_key(os.fstat(fh.fileno())) == f.stat and offset == f.size
    return offset, out, unchanged


def _fill(fh, buf: memoryview) -> int:
    """Read until `buf` is full or the file ends."""
    got = 0
    while got < len(buf):
        n = fh.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def _hash_batch(batch: list[_File], chunk_size: int) -> list[_Hashed]:
    buf = memoryview(bytearray(chunk_size))
    return [_hash_file(f, buf) for f in batch]


def _finish(entries: list[Entry], chunk_size: int, cache: ScanCache | None,
            checked: frozenset[int] | None) -> Manifest:
    """The manifest of `entries`; with `checked` (a rescan), those entries were checked before
    and the cache is not saved (it keeps what the last whole scan saw)."""
    manifest = Manifest(entries, chunk_size)
    manifest.validate(checked or frozenset())
    if cache is not None and checked is None:
        cache.save()
    return manifest


async def scan(
    root: str | os.PathLike[str],
    excludes: Sequence[str] = (),
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[int, int], None] | None = None,
    cache: ScanCache | None = None,
) -> Snapshot:
    """Scan `root` into a Snapshot. `progress(done, total)` reports bytes hashed so far (with
    a cache: of the files it did not know). `cache` is loaded, used, and saved when it changed."""
    broot = os.fsencode(os.path.abspath(root))
    started = time.time_ns()  # before any stat: the reference for racily clean files

    def walk() -> _Walk:
        if cache is not None:
            cache.begin(chunk_size, started)
        return _walk(broot, tuple(excludes), cache, chunk_size)

    return await _complete(broot, await trio.to_thread.run_sync(walk), chunk_size, progress,
                           cache)


async def rescan(prev: Snapshot, changed: Iterable[bytes], excludes: Sequence[str] = (),
                 chunk_size: int = CHUNK_SIZE) -> Snapshot:
    """`prev` again, after the paths `changed` (relative to its root; a file watcher's) have
    changed: only the folders that hold them are listed and only what changed is hashed, so
    an edit costs the same in a tree of 100k files as in one of 100. What a watcher missed is
    missed here too: a whole `scan` is the check (push --watch runs one when it is idle)."""
    walk, checked = await trio.to_thread.run_sync(_rewalk, prev, set(changed), tuple(excludes),
                                                  chunk_size)
    return await _complete(prev.root, walk, chunk_size, None, prev.cache, checked)


async def _complete(broot: bytes, walk: _Walk, chunk_size: int,
                    progress: Callable[[int, int], None] | None, cache: ScanCache | None,
                    checked: frozenset[int] | None = None) -> Snapshot:
    """Hash the files the walk could not take from the cache, and make the snapshot."""
    entries, files, sources = walk.entries, walk.files, walk.sources

    # One hash per distinct inode: hard links are the same content.
    unique: dict[tuple[int, int], _File] = {}
    for f in files:
        unique.setdefault(f.key, f)
    batches: list[list[_File]] = []
    cur: list[_File] = []
    cur_bytes = 0
    for f in unique.values():
        cur.append(f)
        cur_bytes += f.size
        if cur_bytes >= _BATCH_BYTES or len(cur) >= _BATCH_FILES:
            batches.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        batches.append(cur)

    hashed: dict[tuple[int, int], _Hashed] = {}
    total = sum(f.size for f in unique.values())
    done = 0
    limiter = trio.CapacityLimiter(max(2, os.cpu_count() or 2))

    async def run(batch: list[_File]) -> None:
        results = await trio.to_thread.run_sync(_hash_batch, batch, chunk_size, limiter=limiter)
        nonlocal done
        for f, res in zip(batch, results):
            hashed[f.key] = res
            done += f.size
        if progress:
            progress(done, total)

    if progress:
        progress(0, total)
    async with trio.open_nursery() as nursery:
        for batch in batches:
            nursery.start_soon(run, batch)

    for f in files:
        size, chunks, unchanged = hashed[f.key]
        for cid, src in chunks:
            sources.setdefault(cid, src)
        ids = tuple(c for c, _ in chunks)
        entries.append(Entry(f.path, Kind.FILE, f.mode, size, f.mtime_ns, chunks=ids))
        if cache is not None and unchanged:
            cache.record(f.stat, ids)
    manifest = await trio.to_thread.run_sync(_finish, entries, chunk_size, cache, checked)
    return Snapshot(broot, manifest, sources, walk.warnings, cache, hashed_files=len(unique),
                    hashed_bytes=sum(h[0] for h in hashed.values()), cached_files=walk.cached_files)
