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
import gc
import operator
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import trio

from .chunk import CHUNK_SIZE, chunk_id, spans
from .layered import derived
from .manifest import Entry, Kind, Manifest, sort_key
from .scan_cache import Key, ScanCache, stat_key

_BATCH_BYTES = 8 * 1024 * 1024
_BATCH_FILES = 256


class SourceChanged(Exception):
    """A source file changed between the scan and the moment its chunk was sent."""


class ScanStopped(Exception):
    """A scan given up because its `stop` event was set (push --watch: an edit came in).
    `found`: what the walk had found, for the catcher to drop when it suits it (take it and
    set it to None: this exception's frames are a reference cycle, and what it holds would be
    left to the collector, 270k objects at 100k files, 0.2 s)."""

    def __init__(self, found: object = None):
        super().__init__("scan stopped")
        self.found = found


class Source(NamedTuple):
    """Where the dev box reads one chunk from: a piece of one local file. (A named tuple, as
    Entry is: a scan makes one for each chunk of every file.)"""

    path: bytes  # absolute path of the file holding the chunk
    offset: int
    length: int
    unread: bool = False  # the scan did not read the file: its chunk ids came from the cache


class Sources(Mapping[bytes, Source]):
    """Where each chunk of a snapshot is read from. Those of the files the scan read are in
    `read`, made as it hashed them. Those of the files it did not read (the scan cache knew
    them) are found in the manifest the first time one is asked for: a push asks only for the
    chunks some node lacks, mostly none of those, and making them all in the walk took 0.37 s
    of the 1.05 s scan of an unchanged tree of 100k files."""

    def __init__(self, root: bytes, manifest: Manifest, read: MutableMapping[bytes, Source]):
        self.root, self.manifest, self.read = root, manifest, read
        self._unread: dict[bytes, Source] | None = None

    def _others(self) -> dict[bytes, Source]:
        if self._unread is None:
            read, found = self.read, {}
            for e in self.manifest:
                for cid, (off, length) in zip(e.chunks, spans(e.size, self.manifest.chunk_size)):
                    if cid not in found and cid not in read:
                        found[cid] = Source(os.path.join(self.root, e.path), off, length, True)
            self._unread = found  # (two threads asking at once both make it: either is right)
        return self._unread

    def __getitem__(self, cid: bytes) -> Source:
        src = self.read.get(cid)
        return src if src is not None else self._others()[cid]

    def __contains__(self, cid: object) -> bool:
        return cid in self.read or cid in self._others()

    def __iter__(self) -> Iterator[bytes]:
        yield from self.read
        yield from self._others()

    def __len__(self) -> int:
        return len(self.read) + len(self._others())


@dataclass
class Snapshot:
    """A scanned folder: its manifest and where to read each of its chunks."""

    root: bytes
    manifest: Manifest
    sources: Sources  # chunk id -> one place to read it
    warnings: list[str] = field(default_factory=list)
    cache: ScanCache | None = None
    hashed_files: int = 0  # files read and hashed by the scan
    hashed_bytes: int = 0
    cached_files: int = 0  # files whose chunk ids came from the cache, unread
    # How many files hold each chunk (made when a rescan first needs it): a rescan keeps a
    # chunk's source only while some file holds it.
    refs: MutableMapping[bytes, int] | None = None
    # A rescan's: the version it was rescanned from, and the chunks and folder objects it has
    # that that one may not (what a push asks the nodes about, when they hold that version).
    since: bytes | None = None
    added: set[bytes] | None = None

    def holds(self, cid: bytes) -> bool:
        """Whether `cid` is one of this snapshot's chunks or folder objects."""
        return cid in self.chunk_refs() or cid in self.manifest.objects()

    def chunk_refs(self) -> MutableMapping[bytes, int]:
        if self.refs is None:
            refs: dict[bytes, int] = {}
            for e in self.manifest:
                for cid in e.chunks:
                    refs[cid] = refs.get(cid, 0) + 1
            self.refs = refs
        return self.refs

    def read_chunk(self, cid: bytes) -> bytes | bytearray | memoryview:
        """The raw bytes of a chunk, read again from its source and checked against its id."""
        return self.read_into(cid, 0)

    def read_into(self, cid: bytes, lead: int,
                  alloc: Callable[[int], bytearray | memoryview] = bytearray
                  ) -> bytearray | memoryview:
        """read_chunk's bytes after `lead` bytes left free for the caller (a blob's codec byte:
        a raw link's 1 GB would otherwise be copied once more to put it in front), in a buffer
        of `alloc(lead + length)` (a pool's: daemon/wire/buffers.py). One open and pread:
        Python's open() adds an fstat and an ioctl per file, and 22k files made it a quarter
        of a push's CPU on the dev box."""
        src = self.sources[cid]
        buf = alloc(lead + src.length)
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
            if src.unread and self.cache is not None and self.cache.vouches(src.path, cid):
                # Not an edit during the push: the file changed without its size, mtime or
                # ctime changing, so the cache cannot tell. Forget it, or every push would fail.
                self.cache.discard()
                raise SourceChanged(
                    f"{os.fsdecode(src.path)} does not hold the bytes the scan cache recorded, "
                    "although its size, mtime and ctime are unchanged; the scan cache of "
                    f"{os.fsdecode(self.root)} was cleared: push again")
            raise SourceChanged(f"{os.fsdecode(src.path)} changed during the push; push again")
        return buf


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
    warnings: list[str]
    cached_files: int = 0

    def moved(self) -> _Walk:
        """A walk with what this one found, this one left empty."""
        moved = _Walk(self.entries, self.files, self.warnings, self.cached_files)
        self.entries, self.files, self.warnings = [], [], []
        return moved


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
          out: _Walk) -> list[bytes]:
    """Add the entries of folder `rel_dir`'s children to `out` (a file the cache does not
    know goes to out.files, for hashing); its subfolders, to list next."""
    abs_dir = os.path.join(root, rel_dir) if rel_dir else root
    lookup = cache.lookup if cache is not None else None
    entries, files = out.entries, out.files
    folders = []
    cached = 0
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
            cached += 1
            entries.append(Entry(rel, Kind.FILE, mode, st.st_size, st.st_mtime_ns, b"", chunks))
        elif fmt == _S_IFLNK:
            target = os.readlink(d.path)
            entries.append(Entry(rel, Kind.SYMLINK, mode, len(target), st.st_mtime_ns,
                                 target))
        else:
            out.warnings.append(f"skipped {os.fsdecode(rel)}: not a file, folder or symlink "
                                f"({stat.filemode(st.st_mode)[0]})")
    out.cached_files += cached
    return folders


def _walk(root: bytes, excludes: Sequence[str], cache: ScanCache | None = None,
          top: bytes = b"", out: _Walk | None = None,
          stop: threading.Event | None = None) -> _Walk:
    """Metadata of folder `top` (b"": the root) and every entry below it, added to `out`;
    regular files the cache does not know are returned for hashing. Raises ScanStopped
    between two folders once `stop` is set."""
    out = out or _Walk([], [], [])
    out.entries.append(_folder(root, top))
    stack = [top]
    while stack:
        if stop is not None and stop.is_set():  # (what it found goes with the exception,
            raise ScanStopped(out.moved())  # not with the frames: see ScanStopped)
        stack += _list(root, stack.pop(), excludes, cache, out)
    return out


@dataclass
class _Rewalk:
    """What a rescan found: the walk of what it listed, and what of the tree that replaces."""

    walk: _Walk
    listed: dict[bytes, Entry]  # folders listed again (each with its fresh entry) or new
    replaced: list[Entry]  # the tree's entries that the walk's stand for (chunk counts)
    stale: list[Entry]  # of those, the ones gone or changed (their files may hold other bytes)


def _rewalk(prev: Snapshot, changed: Iterable[bytes], excludes: Sequence[str]) -> _Rewalk:
    """List again the folders of `prev` that hold the paths `changed` (relative), walk whole
    the folders that are new, and look at nothing else."""
    root, tree = prev.root, prev.manifest
    found = _Rewalk(_Walk([], [], []), {}, [], [])
    out, listed = found.walk, found.listed

    def known_folder(path: bytes) -> bytes:
        """The nearest folder, `path` or above it, that the tree has and that still is one:
        listing it again finds what changed at `path` (a new folder is walked from there)."""
        while path and not (tree.folder(path) is not None
                            and _is_folder(os.path.join(root, path))):
            path = path.rpartition(b"/")[0]
        return path

    def drop(e: Entry) -> None:  # a path of the tree that is gone, and all below it
        folder = tree.folder(e.path)
        assert folder is not None
        below = list(folder.walk())
        found.replaced += below
        found.stale += below

    todo = sorted({known_folder(p) for p in changed}, key=sort_key)  # parents first
    while todo:
        d = todo.pop(0)
        if d in listed:
            continue
        fresh = _Walk([], [], [])
        _list(root, d, excludes, prev.cache, fresh)
        listed[d] = _folder(root, d)
        now = {e.path: e for e in fresh.entries}
        hashed = {f.path for f in fresh.files}
        folder = tree.folder(d)
        assert folder is not None
        for old in folder.kids:
            new = now.get(old.path)
            if old.kind == Kind.DIR:
                if new is None or new.kind != Kind.DIR:
                    drop(old)
                elif (new.mode, new.mtime_ns) != (old.mode, old.mtime_ns) and \
                        old.path not in todo:  # its own entry changed: list it too
                    todo.append(old.path)
                    todo.sort(key=sort_key)
                continue
            found.replaced.append(old)
            if old.path in hashed or new != old:
                found.stale.append(old)
        for e in fresh.entries:
            if e.kind == Kind.DIR and tree.folder(e.path) is None:
                before = len(out.entries)  # a new folder: walked whole
                _walk(root, excludes, prev.cache, e.path, out)
                listed.update((f.path, f) for f in out.entries[before:] if f.kind == Kind.DIR)
            else:
                out.entries.append(e)
        out.files += fresh.files
        out.warnings += fresh.warnings
        out.cached_files += fresh.cached_files
    return found


def _without_stale(prev: Snapshot, found: _Rewalk) -> MutableMapping[bytes, Source]:
    """The sources of the files `prev` read, but for those of files that changed (the rescan
    hashes them again). Derived from `prev`'s (fs/layered.py): a copy of 100k sources cost
    2.4 ms an edit."""
    sources = derived(prev.sources.read)
    changed = {os.path.join(prev.root, e.path) for e in found.stale}
    for e in found.stale:
        for cid in e.chunks:
            src = sources.get(cid)
            if src is not None and src.path in changed:
                del sources[cid]
    return sources


def _edited(prev: Snapshot, found: _Rewalk, entries: list[Entry],
            sources: MutableMapping[bytes, Source]
            ) -> tuple[Manifest, MutableMapping[bytes, int]]:
    """The manifest after a rescan, made from `prev`'s at the cost of what was listed, and
    the chunks' reference counts. `sources` loses the chunks nothing holds any more (one
    that a file that changed held, and an unchanged one still does, is found in the manifest:
    Sources)."""
    kids: dict[bytes, list[Entry]] = {}
    for e in entries:
        if e.path:
            kids.setdefault(e.parent, []).append(e)
    manifest = prev.manifest.edited(
        {path: (folder, kids.get(path, [])) for path, folder in found.listed.items()})
    refs = derived(prev.chunk_refs())
    for e in found.replaced:
        for cid in e.chunks:
            refs[cid] -= 1
    for e in entries:
        for cid in e.chunks:
            refs[cid] = refs.get(cid, 0) + 1
    for cid in [cid for e in found.replaced for cid in e.chunks if refs.get(cid, 1) <= 0]:
        del refs[cid]
        sources.pop(cid, None)
    files, size = prev.manifest.file_totals()
    for sign, group in ((-1, found.replaced), (1, entries)):
        for e in group:
            if e.kind == Kind.FILE:
                files += sign
                size += sign * e.size
    manifest.totals = (files, size)
    return manifest, refs


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
            validate: bool = True) -> Manifest:
    """The manifest of a whole scan's `entries` (validated, unless not `validate`, but for
    the folders the cache says were validated before); the cache is saved."""
    manifest = Manifest(entries, chunk_size)
    if validate:
        manifest.validate(cache.checked if cache is not None else ())
        if cache is not None:
            cache.keep_checked(manifest.object_ids())
    if cache is not None:
        cache.save()
    return manifest


async def scan(
    root: str | os.PathLike[str],
    excludes: Sequence[str] = (),
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[int, int], None] | None = None,
    cache: ScanCache | None = None,
    validate: bool = True,
    stop: threading.Event | None = None,
) -> Snapshot:
    """Scan `root` into a Snapshot. `progress(done, total)` reports bytes hashed so far (with
    a cache: of the files it did not know). `cache` is loaded, used, and saved when it changed.
    Not `validate`: the caller validates the manifest before it pushes it (push --watch's
    check, which mostly finds the tree it has, skips that pass over every entry). `stop`: set
    from another thread, it ends the walk with ScanStopped (the watch's check gives way to an
    edit)."""
    broot = os.fsencode(os.path.abspath(root))
    started = time.time_ns()  # before any stat: the reference for racily clean files

    def walk() -> _Walk:
        if cache is not None:
            cache.begin(chunk_size, started)
        return _walk(broot, tuple(excludes), cache, stop=stop)

    return await _complete(broot, await trio.to_thread.run_sync(walk), chunk_size, progress,
                           cache, validate=validate)


@contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic collector off, for a whole scan: it makes an object for every entry,
    and the scan cache three for every file it knows, and the collector's passes over them
    find no cycle but cost 0.16-0.26 s of a 0.8 s scan of 100k files. `freeze`: they live as
    long as the process (a one-shot push), and are frozen out of its passes (gc.freeze)
    rather than passed over once when it is on again (85 ms at 100k files)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was:
            gc.enable()


async def rescan(prev: Snapshot, changed: Iterable[bytes], excludes: Sequence[str] = (),
                 chunk_size: int = CHUNK_SIZE) -> Snapshot:
    """`prev` again, after the paths `changed` (relative to its root; a file watcher's) have
    changed: only the folders that hold them are listed, only what changed is hashed, and the
    manifest is `prev`'s with those folders replaced, so an edit costs the same in a tree of
    100k files as in one of 100. What a watcher missed is missed here too: a whole `scan` is
    the check (push --watch runs one when it is idle). The scan cache is not saved: it keeps
    what the last whole scan saw."""
    found = await trio.to_thread.run_sync(_rewalk, prev, set(changed), tuple(excludes))
    read = _without_stale(prev, found)
    refs: MutableMapping[bytes, int] = {}
    added: set[bytes] = set()

    def build(entries: list[Entry]) -> Manifest:
        nonlocal refs
        manifest, refs = _edited(prev, found, entries, read)
        manifest.known_ids = refs  # its keys: every chunk once
        added.update(manifest.new_objects, (c for e in entries for c in e.chunks))
        return manifest

    snap = await _complete(prev.root, found.walk, chunk_size, None, prev.cache, build, read=read)
    snap.refs, snap.since, snap.added = refs, prev.manifest.id, added
    return snap


async def _complete(broot: bytes, walk: _Walk, chunk_size: int,
                    progress: Callable[[int, int], None] | None, cache: ScanCache | None,
                    build: Callable[[list[Entry]], Manifest] | None = None,
                    validate: bool = True,
                    read: MutableMapping[bytes, Source] | None = None) -> Snapshot:
    """Hash the files the walk could not take from the cache, and make the snapshot (`read`:
    the sources of files read before, a rescan's)."""
    entries, files = walk.entries, walk.files
    sources = {} if read is None else read

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
    manifest = await trio.to_thread.run_sync(
        (lambda: _finish(entries, chunk_size, cache, validate)) if build is None else
        (lambda: build(entries)))
    return Snapshot(broot, manifest, Sources(broot, manifest, sources), walk.warnings, cache,
                    hashed_files=len(unique), hashed_bytes=sum(h[0] for h in hashed.values()),
                    cached_files=walk.cached_files)
