"""A scanned folder as a push sees it: its manifest, and where on the dev box to read each
chunk again when a node lacks it (nothing is copied at scan time). A chunk is checked against its
id when it is read, or its file's stat key against the one the scan read it under (Source.key),
so a file edited during a push is caught, never sent as the wrong bytes.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .chunk import chunk_id, spans
from .manifest import Manifest
from .scan_cache import Key, ScanCache, stat_key

# Below this a chunk is hashed again rather than its file's stat taken (a syscall costs more).
TRUST_FROM = 256 * 1024
# Files opened at once to be read ahead (open_ahead, and a scan's batches), at most. The venv
# with the page cache dropped, 3 alternating pairs: sent in 3.35-3.79 s with 64 at once,
# 2.90-3.07 with 256.
AHEAD = 256


def read_ahead(path: bytes, offset: int = 0, length: int = 0) -> int | None:
    """`path` opened, and `length` bytes of it from `offset` (0: to its end) asked of the
    disk now (posix_fadvise WILLNEED), to be read soon; None if it does not open (the read
    says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # only advice: the read does without it
    return fd


def ahead(sharers: int) -> int:
    """How many files each of `sharers` threads opens at once to read ahead: AHEAD, all of
    them together within an eighth of the descriptors this process may hold."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, min(AHEAD, soft // (8 * sharers)))


class SourceChanged(Exception):
    """A source file changed between the scan and the moment its chunk was sent."""



class Source(NamedTuple):
    """Where the dev box reads one chunk from: a piece of one local file. (A named tuple, as
    Entry is: a scan makes one for each chunk of every file.)"""

    path: bytes  # absolute path of the file holding the chunk
    offset: int
    length: int
    unread: bool = False  # the scan did not read the file: its chunk ids came from the cache
    # The file's stat key when the scan read it whole, unchanged and not racily clean
    # (scan_cache.py), for a chunk of TRUST_FROM bytes or more: read again under the same key,
    # its bytes are those the scan hashed, and are not hashed again.
    key: Key | None = None


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
            # A push to a fresh node asks for them all before it sends (the plan's sizes), so
            # this is on its path: a file of one chunk (most) skips spans(), and the path is
            # joined as bytes (os.path.join made it 3-4x slower: 0.13-0.23 s for a venv).
            read, found = self.read, {}
            root = self.root if self.root.endswith(b"/") else self.root + b"/"
            chunk_size = self.manifest.chunk_size
            for e in self.manifest:
                chunks = e.chunks
                if len(chunks) == 1:
                    cid = chunks[0]
                    if cid not in found and cid not in read:
                        found[cid] = Source(root + e.path, 0, e.size, True)
                    continue
                for cid, (off, length) in zip(chunks, spans(e.size, chunk_size)):
                    if cid not in found and cid not in read:
                        found[cid] = Source(root + e.path, off, length, True)
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

    def open_ahead(self, cids: Iterable[bytes], most: int = AHEAD) -> dict[bytes, int]:
        """The source files of `cids` (`most` at most), opened, their chunks' bytes asked for
        now, all at once (posix_fadvise WILLNEED), for read_into to take one by one (`fd`;
        the caller closes those it does not). Read one after the other from a cold disk,
        each small file waited for its own I/O: the torch venv from a warm dev box home to a
        fresh node, page cache dropped, 3 alternating pairs: sent in 4.38-5.01 s before,
        2.71-3.63 s after (about 2.6 s from the page cache); its import done 7.36-8.27 s after
        the push began, then 5.77-6.96 s."""
        out: dict[bytes, int] = {}
        sources = self.sources
        for cid in cids:
            src = sources.get(cid)
            if src is None or cid in out:
                continue
            fd = read_ahead(src.path, src.offset, src.length)
            if fd is None:
                continue  # read_into says why
            out[cid] = fd
            if len(out) >= most:
                break
        return out

    def read_into(self, cid: bytes, lead: int,
                  alloc: Callable[[int], bytearray | memoryview] = bytearray,
                  fd: int | None = None) -> bytearray | memoryview:
        """read_chunk's bytes after `lead` bytes left free for the caller (a blob's codec byte:
        a raw link's 1 GB would otherwise be copied once more to put it in front), in a buffer
        of `alloc(lead + length)` (a pool's: daemon/wire/buffers.py). One open and pread:
        Python's open() adds an fstat and an ioctl per file, and 22k files made it a quarter
        of a push's CPU on the dev box. `fd`: its file, from open_ahead (closed here)."""
        src = self.sources[cid]
        buf = alloc(lead + src.length)
        if fd is None:
            try:
                fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise SourceChanged(f"{os.fsdecode(src.path)} was deleted during the push"
                                    ) from None
        try:
            got = os.preadv(fd, [memoryview(buf)[lead:]], src.offset)
            # Its stat after the read as the scan's: every write moves ctime first, and the
            # key is not racily clean, so these are the bytes the scan hashed.
            same = src.key is not None and stat_key(os.fstat(fd)) == src.key
        finally:
            os.close(fd)
        data = memoryview(buf)[lead:]
        if got == src.length and same:
            return buf
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
