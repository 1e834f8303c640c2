"""Snapshot manifests: the tree of a pushed folder, as a flat, sorted list of entries.

A manifest is encoded deterministically, so its xxh3_128 id is the version: two pushes of the
same tree give the same version, and the manifest travels and is stored as an ordinary chunk.
Names are bytes (they need not be UTF-8). Entries that could escape the mount are refused when a
manifest is built and again when one is decoded, so a hostile peer cannot place them.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .chunk import CHUNK_SIZE, ID_SIZE, MAX_CHUNK_SIZE, chunk_id

MAGIC = b"MFSM\x01"
MAX_ENTRIES = 10_000_000  # what the format allows
# What a node accepts by default (its --max-entries, $MONARCH_FS_MAX_ENTRIES). A decoded entry
# costs a node about 450 bytes per version it serves (455 MB for a million, twice that once
# listed): 500,000 is 20 times a torch venv (23k entries) and 5 times the 100k-file tree `make
# bench` serves in 145 MB, and keeps a version at the limit near 230 MB.
DEFAULT_MAX_ENTRIES = 500_000
MAX_NAME = 255
MAX_PATH = 4096
# What the kernel takes (validate() holds every entry to it, so no FUSE reply can overflow):
# st_size is a signed 64-bit off_t, times are signed 64-bit nanoseconds (st_mtime_ns), and
# readlink answers at most PATH_MAX - 1 bytes (the kernel's buffer keeps one for the NUL).
MAX_FILE_SIZE = 2**63 - 1
MTIME_RANGE = range(-(2**63), 2**63)
MAX_TARGET = 4095
_HEAD = struct.Struct("<5sII")  # magic, chunk size, entry count
_ENTRY = struct.Struct("<BIQqHHI")  # kind, mode, size, mtime_ns, path len, target len, chunks


class ManifestError(ValueError):
    """A manifest is malformed."""


class UnsafePath(ManifestError):
    """An entry's path could escape the mount (absolute, `..`, `/` or NUL inside a name)."""


class TooManyEntries(ManifestError):
    """A manifest has more entries than the reader accepts (checked before any is decoded)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"manifest has {count:,} entries, more than the limit of {limit:,}")
        self.count = count
        self.limit = limit


class Kind(enum.IntEnum):
    """What an entry is; nothing else (devices, FIFOs, sockets) is ever served."""

    DIR = 1
    FILE = 2
    SYMLINK = 3


@dataclass(frozen=True, slots=True)
class Entry:
    """One file, folder or symlink of a snapshot, as every node serves it (names are bytes)."""

    path: bytes  # relative to the snapshot root, components joined by b"/"; b"" is the root
    kind: Kind
    mode: int  # permission bits, 0o7777 at most
    size: int
    mtime_ns: int
    target: bytes = b""  # symlinks: the target, verbatim
    chunks: tuple[bytes, ...] = ()  # regular files: chunk ids, in order

    @property
    def name(self) -> bytes:
        return self.path.rpartition(b"/")[2]

    @property
    def parent(self) -> bytes:
        return self.path.rpartition(b"/")[0]

    def same_content(self, other: Entry) -> bool:
        """True when a reader could not tell the two apart (everything but the path)."""
        return (self.kind, self.mode, self.size, self.mtime_ns, self.target, self.chunks) == (
            other.kind, other.mode, other.size, other.mtime_ns, other.target, other.chunks)


_KINDS = {k.value: k for k in Kind}


def _record(e: Entry) -> bytes:
    """An entry as the manifest encodes it."""
    return b"".join([_ENTRY.pack(e.kind, e.mode, e.size, e.mtime_ns, len(e.path),
                                 len(e.target), len(e.chunks)), e.path, e.target, *e.chunks])
_TYPES = frozenset(Kind)


def sort_key(path: bytes) -> tuple[bytes, ...]:
    """Parents sort before their children, and each directory's subtree is contiguous."""
    return tuple(path.split(b"/")) if path else ()


def check_path(path: bytes) -> None:
    if path == b"":
        return
    parts = path.split(b"/")
    # The common case in a few C-level passes (a daemon checks every entry of every manifest);
    # the loop below only runs to say what is wrong.
    if (len(path) <= MAX_PATH and b"\0" not in path and b"" not in parts and b"." not in parts
            and b".." not in parts and max(map(len, parts)) <= MAX_NAME):
        return
    if len(path) > MAX_PATH:
        raise UnsafePath(f"path too long ({len(path)} bytes): {path[:64]!r}...")
    for part in parts:
        if part in (b"", b".", b".."):
            raise UnsafePath(f"unsafe path {path!r}: empty, '.' or '..' component (or absolute)")
        if b"\0" in part:
            raise UnsafePath(f"unsafe path {path!r}: NUL inside a name")
        if len(part) > MAX_NAME:
            raise UnsafePath(f"unsafe path {path!r}: name longer than {MAX_NAME} bytes")


def _check_fields(e: Entry, chunk_size: int) -> None:
    """Raise, saying what is wrong, unless an entry's own fields are each within what the
    kernel accepts and consistent with its kind. (Chunk ids are ID_SIZE bytes by decoding.)"""
    if e.kind not in _TYPES:
        raise ManifestError(f"entry {e.path!r}: unknown kind {e.kind!r}")
    if not 0 <= e.mode <= 0o7777:
        raise ManifestError(f"entry {e.path!r}: bad mode {e.mode:o} (permission bits only)")
    if e.mtime_ns not in MTIME_RANGE:
        raise ManifestError(
            f"entry {e.path!r}: mtime {e.mtime_ns} ns out of the signed 64-bit range")
    if e.kind == Kind.FILE:
        if not 0 <= e.size <= MAX_FILE_SIZE:
            raise ManifestError(f"entry {e.path!r}: size {e.size} out of range (0 to 2^63-1)")
        if len(e.chunks) != -(-e.size // chunk_size):
            raise ManifestError(f"entry {e.path!r}: {len(e.chunks)} chunks for {e.size} bytes")
    elif e.chunks:
        raise ManifestError(f"entry {e.path!r}: only files have chunks")
    if e.kind == Kind.SYMLINK:
        if not e.target or b"\0" in e.target or len(e.target) > MAX_TARGET:
            raise ManifestError(f"symlink {e.path!r}: bad target (empty, NUL inside, or longer "
                                f"than {MAX_TARGET} bytes)")
        if e.size != len(e.target):
            raise ManifestError(f"symlink {e.path!r}: size {e.size} is not the length of its "
                                f"target ({len(e.target)})")
    elif e.target:
        raise ManifestError(f"entry {e.path!r}: only symlinks have targets")
    if e.kind == Kind.DIR and e.size != 0:
        raise ManifestError(f"directory {e.path!r}: size {e.size}, must be 0")


class Manifest:
    """A snapshot's tree, sorted parents first: encoded, it is content-addressed, and its id
    is the version."""

    def __init__(self, entries: Iterable[Entry], chunk_size: int = CHUNK_SIZE):
        self.chunk_size = chunk_size
        self.entries = sorted(entries, key=lambda e: sort_key(e.path))
        self._by_path: dict[bytes, Entry] | None = None

    def validate(self, checked: frozenset[int] = frozenset()) -> None:
        """Refuse anything the mount could not serve as is: every field is held to what the
        kernel accepts, so a FUSE reply never has to convert a value that does not fit (a
        directory of size 2^64-1 once took the daemon down at the first `ls`). Entries whose
        id() is in `checked` passed these checks before: only their place in the tree is."""
        if not (64 * 1024 <= self.chunk_size <= MAX_CHUNK_SIZE):
            raise ManifestError(f"chunk size {self.chunk_size} out of range")
        if not self.entries or self.entries[0].path != b"" or self.entries[0].kind != Kind.DIR:
            raise ManifestError("manifest has no root directory")
        seen: dict[bytes, Kind] = {}
        cs, mtimes = self.chunk_size, MTIME_RANGE
        DIR, FILE, SYMLINK = Kind.DIR, Kind.FILE, Kind.SYMLINK
        for e in self.entries:
            if id(e) in checked:
                if e.path in seen or (e.path and seen.get(e.parent) != DIR):
                    raise ManifestError(f"entry {e.path!r} is a duplicate or has no parent "
                                        "directory")
                seen[e.path] = e.kind
                continue
            check_path(e.path)
            if e.path in seen:
                raise ManifestError(f"duplicate entry {e.path!r}")
            if e.path and seen.get(e.parent) != DIR:
                raise ManifestError(f"entry {e.path!r} has no parent directory")
            kind, size, target = e.kind, e.size, e.target
            # The common case in one expression (a daemon checks every entry of every
            # manifest); _check_fields says what is wrong.
            if not (0 <= e.mode <= 0o7777 and e.mtime_ns in mtimes and (
                    (kind is FILE and not target and 0 <= size <= MAX_FILE_SIZE
                     and len(e.chunks) == -(-size // cs))
                    or (kind is DIR and not size and not target and not e.chunks)
                    or (kind is SYMLINK and not e.chunks and size == len(target)
                        and 0 < size <= MAX_TARGET and b"\0" not in target))):
                _check_fields(e, cs)
            seen[e.path] = kind

    def encode(self) -> bytes:
        return b"".join([_HEAD.pack(MAGIC, self.chunk_size, len(self.entries)),
                         *map(_record, self.entries)])

    @classmethod
    def decode(cls, data: bytes | memoryview, max_entries: int | None = None,
               known: Manifest | None = None) -> Manifest:
        """Parse and validate; every length is checked against what is left before it is used.
        A manifest of more than `max_entries` entries (default: what the format allows) is
        refused from its header: decoding costs ~450 bytes of memory per entry.

        `known`: a manifest decoded before (a node passes the version it decoded last).
        Successive versions are mostly the same, so an entry whose bytes equal one of its
        entries' is that entry: shared (a node holds several versions in memory), and neither
        parsed nor checked again, only placed in the tree."""
        view = memoryview(data)
        if len(view) < _HEAD.size:
            raise ManifestError("manifest truncated")
        magic, chunk_size, count = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise ManifestError("not a monarch-fs manifest (bad magic)")
        if max_entries is not None and count > max_entries:
            raise TooManyEntries(count, max_entries)
        if count > MAX_ENTRIES or count * _ENTRY.size > len(view):
            raise ManifestError(f"manifest claims {count} entries, more than it holds")
        pos = _HEAD.size
        entries = []
        old = ({_record(e): e for e in known.entries}
               if known is not None and known.chunk_size == chunk_size else {})
        checked: set[int] = set()
        try:
            for _ in range(count):
                start = pos
                kind, mode, size, mtime, plen, tlen, nchunks = _ENTRY.unpack_from(view, pos)
                pos += _ENTRY.size
                end = pos + plen + tlen + nchunks * ID_SIZE
                if end > len(view):
                    raise ManifestError("manifest truncated inside an entry")
                e = old.get(bytes(view[start:end])) if old else None
                if e is not None:
                    entries.append(e)
                    checked.add(id(e))
                    pos = end
                    continue
                path = bytes(view[pos:pos + plen])
                target = bytes(view[pos + plen:pos + plen + tlen]) if tlen else b""
                base = pos + plen + tlen
                if nchunks == 1:  # most files
                    chunks: tuple[bytes, ...] = (bytes(view[base:end]),)
                else:
                    raw = bytes(view[base:end])
                    chunks = tuple(raw[i:i + ID_SIZE] for i in range(0, len(raw), ID_SIZE))
                pos = end
                if kind not in _KINDS:
                    raise ManifestError(f"entry {path!r}: unknown kind {kind}")
                entries.append(Entry(path, _KINDS[kind], mode, size, mtime, target, chunks))
        except (struct.error, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed manifest entry: {e}") from None
        if pos != len(view):
            raise ManifestError("trailing bytes after the last entry")
        keys = [sort_key(e.path) for e in entries]
        if any(a > b for a, b in zip(keys, keys[1:])):  # (a duplicate: validate names it)
            raise ManifestError("manifest entries are not in canonical order")
        m = cls((), chunk_size)
        m.entries = entries  # in order, checked just above
        m.validate(frozenset(checked))
        return m

    @property
    def id(self) -> bytes:
        return chunk_id(self.encode())

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, path: bytes) -> Entry | None:
        if self._by_path is None:
            self._by_path = {e.path: e for e in self.entries}
        return self._by_path.get(path)

    def chunk_ids(self) -> list[bytes]:
        """Every chunk id the snapshot needs, once each, in file order."""
        return list(dict.fromkeys(c for e in self.entries for c in e.chunks))

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == Kind.FILE)
