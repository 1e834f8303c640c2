"""Scanning a source folder into a snapshot: a manifest plus where to read each chunk.

The walk reads only metadata; file contents are hashed in worker threads (xxh3 releases the GIL),
small files in batches so the per-thread-call cost does not dominate trees of many tiny files.
With a ScanCache (scan_cache.py), a file whose stat key is cached is not read at all: the walk
takes its chunk ids from the cache, and only new or changed files are hashed, so a scan of an
unchanged tree is one walk in one worker thread. Nothing is copied: the push reads each chunk
again from its source file when it is sent, and checks that it still hashes to its id, or, for
a large chunk of a file the scan read whole and unchanged, that the file's stat key is still
the one the scan read it under (snapshot.py: one hash per byte, not two).
"""

from __future__ import annotations

import fnmatch
import operator
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from .chunk import CHUNK_SIZE, chunk_id
from .manifest import Entry, Kind, Manifest
from .scan_cache import RACY_NS, Key, ScanCache, stat_key
from .snapshot import AHEAD, TRUST_FROM, Snapshot, Source, Sources, ahead, read_ahead

_BATCH_BYTES = 8 * 1024 * 1024
_BATCH_FILES = 256


class ScanStopped(Exception):
    """A scan given up because its `stop` event was set (push --watch: an edit came in).
    `found`: what the walk had found, for the catcher to drop when it suits it (take it and
    set it to None: this exception's frames are a reference cycle, and what it holds would be
    left to the collector, 270k objects at 100k files, 0.2 s)."""

    def __init__(self, found: object = None):
        super().__init__("scan stopped")
        self.found = found


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
class Walk:
    entries: list[Entry]  # folders, symlinks, and files whose chunk ids came from the cache
    files: list[_File]  # files to hash
    warnings: list[str]
    cached_files: int = 0

    def moved(self) -> Walk:
        """A walk with what this one found, this one left empty."""
        moved = Walk(self.entries, self.files, self.warnings, self.cached_files)
        self.entries, self.files, self.warnings = [], [], []
        return moved


def is_folder(path: bytes) -> bool:
    """A folder itself, not a link to one (whose target is outside the snapshot's tree)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def folder_entry(root: bytes, rel: bytes) -> Entry:
    """The entry of folder `rel` (b"": the root), from a fresh lstat."""
    st = os.lstat(os.path.join(root, rel) if rel else root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{os.fsdecode(os.path.join(root, rel))} is not a directory")
    return Entry(rel, Kind.DIR, stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns)


def list_folder(root: bytes, rel_dir: bytes, excludes: Sequence[str], cache: ScanCache | None,
          out: Walk) -> list[bytes]:
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


def walk_tree(root: bytes, excludes: Sequence[str], cache: ScanCache | None = None,
          top: bytes = b"", out: Walk | None = None,
          stop: threading.Event | None = None) -> Walk:
    """Metadata of folder `top` (b"": the root) and every entry below it, added to `out`;
    regular files the cache does not know are returned for hashing. Raises ScanStopped
    between two folders once `stop` is set."""
    out = out or Walk([], [], [])
    out.entries.append(folder_entry(root, top))
    stack = [top]
    while stack:
        if stop is not None and stop.is_set():  # (what it found goes with the exception,
            raise ScanStopped(out.moved())  # not with the frames: see ScanStopped)
        stack += list_folder(root, stack.pop(), excludes, cache, out)
    return out


_Hashed = tuple[int, list[tuple[bytes, Source]], bool]


class FileSink(Protocol):
    """Where a tapped file's chunks go as they are hashed (`Tap`); called on the hashing
    thread, and may block there (a bounded window)."""

    def buffer(self, size: int) -> memoryview | None:
        """Where to read the next chunk (`size` bytes, handed over by `chunk`); None: the scan's."""

    def chunk(self, cid: bytes, buf: memoryview, length: int) -> None:
        """The chunk just read into `buf` (its first `length` bytes) hashes to `cid`."""

    def done(self, unchanged: bool) -> None:
        """The file is read (`unchanged`: its stat key after the read is the walk's)."""


# A scan's tap: given a file's path and size, a sink for its chunks, or None (not tapped).
Tap = Callable[[bytes, int], FileSink | None]


def _hash_file(f: _File, buf: memoryview, tap: Tap | None = None, fd: int | None = None
               ) -> _Hashed:
    """(size actually read, [(chunk id, source)], unchanged): reads to EOF, so a file that grew
    is whole; `unchanged` when the file's stat key after reading is still the walk's, so what
    was read is what the key describes (a file written meanwhile is not cached).

    Reads go into `buf` (one chunk long, reused): a `read(chunk_size)` per small file would
    allocate, fault in and free a whole chunk each time. A file the `tap` takes is read into
    its sink's buffers instead, each handed over once hashed (push: streaming while
    scanning, daemon/client/scan_stream.py). `fd`: the file, opened already (closed here)."""
    out = []
    offset = 0
    sink = tap(f.abspath, f.size) if tap is not None else None
    unchanged = False
    after: Key | None = None  # its stat key once read, if taken in the loop
    try:
        if fd is None:
            fd = os.open(f.abspath, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while True:
                into = sink.buffer(len(buf)) if sink is not None else None
                if into is None:
                    into = buf
                n = _fill(fd, into, f.size - offset)
                if not n:
                    break
                cid = chunk_id(into[:n])
                out.append((cid, Source(f.abspath, offset, n)))
                if sink is not None:
                    sink.chunk(cid, into, n)
                offset += n
                if n < len(buf):
                    if offset == f.size:
                        after = stat_key(os.fstat(fd))
                        if after != f.stat:
                            after = None
                            continue  # it grew: read on to its end after all
                    break
            if after is None:
                after = stat_key(os.fstat(fd))
            unchanged = after == f.stat and offset == f.size
        finally:
            os.close(fd)
    finally:
        if sink is not None:
            sink.done(unchanged)
    if unchanged and max(f.mtime_ns, f.stat[4]) < time.time_ns() - RACY_NS:
        # Not racily clean: the push may trust this key instead of hashing again (Source.key)
        out = [(c, src._replace(key=f.stat) if src.length >= TRUST_FROM else src)
               for c, src in out]
    return offset, out, unchanged


def _fill(fd: int, buf: memoryview, expect: int) -> int:
    """Read until `buf` is full or the file ends, or (short of a full buffer) once the `expect`
    bytes the walk saw are in: no read that only finds the end (a venv's 42k small files made
    42k of them). A file that grew since is read on by _hash_file, whose stat after the read
    says so."""
    got = 0
    while got < len(buf):
        n = os.readv(fd, [buf[got:]])
        if not n:
            break
        got += n
        if got == expect:
            break
    return got


_buffers = threading.local()


def _buffer(chunk_size: int) -> memoryview:
    """This worker thread's read buffer, kept for its next batch: a new 4 MiB one per batch
    cost its page faults each time."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) != chunk_size:
        buf = _buffers.buf = memoryview(bytearray(chunk_size))
    return buf


def _hash_batch(batch: list[_File], chunk_size: int, tap: Tap | None = None,
                most: int = AHEAD) -> list[_Hashed]:
    """Each file of `batch` hashed. A batch of small files is opened and its bytes asked for
    at once first (posix_fadvise WILLNEED), as a push's reads are (Snapshot.open_ahead): read
    one after the other from a cold disk, each waited for its own I/O. The torch venv
    hashed whole, page cache dropped: 4.5-4.7 s before, 2.5-3.3 s after (1.8-2.0 s from the
    page cache, before and after). `most`: files open at once (snapshot.ahead)."""
    buf = _buffer(chunk_size)
    if len(batch) == 1:  # mostly a large file: read in order, the kernel's own readahead
        # keeps up, and asking for all of it at once would fill the page cache with gigabytes
        return [_hash_file(batch[0], buf, tap)]
    fds = [read_ahead(f.abspath) for f in batch[:most]]  # None: _hash_file says why
    fds += [None] * (len(batch) - len(fds))
    try:
        out = []
        for i, f in enumerate(batch):
            fd, fds[i] = fds[i], None
            out.append(_hash_file(f, buf, tap, fd))
        return out
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def _batches(files: Iterable[_File]) -> tuple[list[list[_File]], list[list[_File]]]:
    """The files to hash in batches worth a thread hop: (large files, one a batch; the rest,
    up to _BATCH_BYTES or _BATCH_FILES a batch), each in walk order."""
    large: list[list[_File]] = []
    small: list[list[_File]] = []
    cur: list[_File] = []
    cur_bytes = 0
    for f in files:
        if f.size >= _BATCH_BYTES:
            large.append([f])
            continue
        cur.append(f)
        cur_bytes += f.size
        if cur_bytes >= _BATCH_BYTES or len(cur) >= _BATCH_FILES:
            small.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        small.append(cur)
    return large, small


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
    tap: Tap | None = None,
) -> Snapshot:
    """Scan `root` into a Snapshot. `progress(done, total)` reports bytes hashed so far (with
    a cache: of the files it did not know). `cache` is loaded, used, and saved when it changed.
    Not `validate`: the caller validates the manifest before it pushes it (push --watch's
    check, which mostly finds the tree it has, skips that pass over every entry). `stop`: set
    from another thread, it ends the walk with ScanStopped (the watch's check gives way to an
    edit). `tap`: files whose chunks go somewhere as they are hashed (see _hash_file)."""
    broot = os.fsencode(os.path.abspath(root))
    started = time.time_ns()  # before any stat: the reference for racily clean files

    def walk() -> Walk:
        if cache is not None:
            cache.begin(chunk_size, started)
        return walk_tree(broot, tuple(excludes), cache, stop=stop)

    return await complete(broot, await trio.to_thread.run_sync(walk), chunk_size, progress,
                           cache, validate=validate, tap=tap)


async def complete(broot: bytes, walk: Walk, chunk_size: int,
                    progress: Callable[[int, int], None] | None, cache: ScanCache | None,
                    build: Callable[[list[Entry]], Manifest] | None = None,
                    validate: bool = True,
                    read: MutableMapping[bytes, Source] | None = None,
                    tap: Tap | None = None) -> Snapshot:
    """Hash the files the walk could not take from the cache, and make the snapshot (`read`:
    the sources of files read before, a rescan's)."""
    entries, files = walk.entries, walk.files
    sources = {} if read is None else read

    # One hash per distinct inode: hard links are the same content.
    unique: dict[tuple[int, int], _File] = {}
    for f in files:
        unique.setdefault(f.key, f)
    large, small = _batches(unique.values())
    hashed: dict[tuple[int, int], _Hashed] = {}
    total = sum(f.size for f in unique.values())
    done = 0
    workers = max(2, os.cpu_count() or 2)
    # Two lanes when there are both: a large file's hashing waits mostly on its bytes (sent
    # as hashed, or read from disk), a small file's is Python on this process's cores. In one
    # queue they took turns: an 8 GiB env hashed its venv's 43k small files, then streamed
    # its .so files, one after the other (1.6 s + 4.8 s of a 6.2 s scan).
    both = bool(large and small)
    most = ahead(workers)  # files each worker opens at once to read ahead
    large_workers = trio.CapacityLimiter(workers - workers // 2 if both else workers)
    small_workers = trio.CapacityLimiter(workers // 2 if both else workers)

    async def run(batch: list[_File], limiter: trio.CapacityLimiter) -> None:
        results = await trio.to_thread.run_sync(_hash_batch, batch, chunk_size, tap, most,
                                                limiter=limiter)
        nonlocal done
        for f, res in zip(batch, results):
            hashed[f.key] = res
            done += f.size
        if progress:
            progress(done, total)

    async def lane(batches: list[list[_File]], limiter: trio.CapacityLimiter,
                   other: trio.CapacityLimiter) -> None:
        async with trio.open_nursery() as nursery:
            for batch in batches:
                nursery.start_soon(run, batch, limiter)
        other.total_tokens = workers  # this lane is done: the other has every worker

    if progress:
        progress(0, total)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane, large, large_workers, small_workers)
        nursery.start_soon(lane, small, small_workers, large_workers)

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
