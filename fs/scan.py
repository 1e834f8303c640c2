"""Scanning a source folder into a snapshot: a manifest plus where to read each chunk.

The walk reads only metadata; file contents are hashed in worker threads (xxh3 releases the GIL),
small files in batches so the per-thread-call cost does not dominate trees of many tiny files.
Nothing is copied: the push reads each chunk again from its source file when it is sent, and
checks it still hashes to its id.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from .chunk import CHUNK_SIZE, chunk_id
from .manifest import Entry, Kind, Manifest

_BATCH_BYTES = 8 * 1024 * 1024
_BATCH_FILES = 256


class SourceChanged(Exception):
    """A source file changed between the scan and the moment its chunk was sent."""


@dataclass(frozen=True, slots=True)
class Source:
    path: bytes  # absolute path of the file holding the chunk
    offset: int
    length: int


@dataclass
class Snapshot:
    root: bytes
    manifest: Manifest
    sources: dict[bytes, Source]  # chunk id -> one place to read it
    warnings: list[str] = field(default_factory=list)

    def read_chunk(self, cid: bytes) -> bytes:
        """The raw bytes of a chunk, read again from its source and checked against its id."""
        src = self.sources[cid]
        try:
            with open(src.path, "rb") as f:
                f.seek(src.offset)
                data = f.read(src.length)
        except FileNotFoundError:
            raise SourceChanged(f"{os.fsdecode(src.path)} was deleted during the push") from None
        if len(data) != src.length or chunk_id(data) != cid:
            raise SourceChanged(f"{os.fsdecode(src.path)} changed during the push; push again")
        return data


@dataclass
class _File:
    path: bytes  # relative
    abspath: bytes
    mode: int
    mtime_ns: int
    size: int
    key: tuple[int, int]  # (st_dev, st_ino): hard links are hashed once


def _excluded(rel: bytes, patterns: Sequence[str]) -> bool:
    if not patterns:
        return False
    name = os.fsdecode(rel.rpartition(b"/")[2])
    path = os.fsdecode(rel)
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(path, p) for p in patterns)


def _walk(root: bytes, excludes: Sequence[str]) -> tuple[list[Entry], list[_File], list[str]]:
    """Metadata of every entry below root; regular files are returned for hashing."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{os.fsdecode(root)} is not a directory")
    dirs = [Entry(b"", Kind.DIR, stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns)]
    files: list[_File] = []
    warnings: list[str] = []
    stack = [b""]
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        with os.scandir(abs_dir) as it:
            children = sorted(it, key=lambda d: d.name)
        for d in children:
            rel = rel_dir + b"/" + d.name if rel_dir else d.name
            if _excluded(rel, excludes):
                continue
            st = d.stat(follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                dirs.append(Entry(rel, Kind.DIR, mode, 0, st.st_mtime_ns))
                stack.append(rel)
            elif stat.S_ISREG(st.st_mode):
                files.append(_File(rel, d.path, mode, st.st_mtime_ns, st.st_size,
                                   (st.st_dev, st.st_ino)))
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(d.path)
                dirs.append(Entry(rel, Kind.SYMLINK, mode, len(target), st.st_mtime_ns, target))
            else:
                warnings.append(f"skipped {os.fsdecode(rel)}: not a file, folder or symlink "
                                f"({stat.filemode(st.st_mode)[0]})")
    return dirs, files, warnings


def _hash_file(f: _File, chunk_size: int) -> tuple[int, list[tuple[bytes, Source]]]:
    """(size actually read, [(chunk id, source)]): reads to EOF, so a file that grew is whole."""
    out = []
    offset = 0
    with open(f.abspath, "rb") as fh:
        while True:
            data = fh.read(chunk_size)
            if not data:
                break
            out.append((chunk_id(data), Source(f.abspath, offset, len(data))))
            offset += len(data)
            if len(data) < chunk_size:
                break
    return offset, out


def _hash_batch(batch: list[_File], chunk_size: int) -> list[tuple[int, list[tuple[bytes, Source]]]]:
    return [_hash_file(f, chunk_size) for f in batch]


async def scan(
    root: str | os.PathLike[str],
    excludes: Sequence[str] = (),
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> Snapshot:
    """Scan `root` into a Snapshot. `progress(done, total)` reports bytes hashed so far."""
    broot = os.fsencode(os.path.abspath(root))
    entries, files, warnings = await trio.to_thread.run_sync(_walk, broot, tuple(excludes))

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

    hashed: dict[tuple[int, int], tuple[int, list[tuple[bytes, Source]]]] = {}
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

    sources: dict[bytes, Source] = {}
    for f in files:
        size, chunks = hashed[f.key]
        for cid, src in chunks:
            sources.setdefault(cid, src)
        entries.append(Entry(f.path, Kind.FILE, f.mode, size, f.mtime_ns,
                             chunks=tuple(c for c, _ in chunks)))
    manifest = Manifest(entries, chunk_size)
    manifest.validate()
    return Snapshot(broot, manifest, sources, warnings)
