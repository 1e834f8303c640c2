"""What a snapshot holds: its entries (files, folders, symlinks), the limits each is held to,
and the errors a malformed manifest raises.

Every field is held to what the kernel accepts, and every path to what cannot escape the mount
(no absolute names, `..`, `/` or NUL inside a name), both where a manifest is built and where
one is loaded, so a hostile peer cannot place either.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

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


class ManifestError(ValueError):
    """A manifest is malformed."""


class UnsafePath(ManifestError):
    """An entry's path could escape the mount (absolute, `..`, `/` or NUL inside a name)."""


class TooManyEntries(ManifestError):
    """A manifest has more entries than the reader accepts (checked before any is decoded)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"manifest has at least {count:,} entries, more than the limit of "
                         f"{limit:,}")
        self.count = count
        self.limit = limit



class MissingObject(KeyError):
    """A folder object a version names is not here (yet): `oid` is which, `path` where."""

    def __init__(self, oid: bytes, path: bytes):
        super().__init__(f"folder {path!r}: object {oid.hex()[:12]} not here")
        self.oid = oid
        self.path = path


class Kind(enum.IntEnum):
    """What an entry is; nothing else (devices, FIFOs, sockets) is ever served."""

    DIR = 1
    FILE = 2
    SYMLINK = 3


class Entry(NamedTuple):
    """One file, folder or symlink of a snapshot, as every node serves it (names are bytes).
    A named tuple: immutable, as versions share entries, and made in a third of a frozen
    dataclass's time (0.24 against 0.72 us; a scan makes one per file, a node one per entry it
    loads)."""

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
        return self[1:] == other[1:]


KINDS = {k.value: k for k in Kind}  # by the number a record holds
_TYPES = frozenset(Kind)


def by_name(e: Entry) -> bytes:
    return e.name


def sort_key(path: bytes) -> bytes:
    """Parents sort before their children, and each directory's subtree is contiguous: the
    order of the paths' tuples of names, as bytes (NUL, below any byte of a name, between
    them), which sort in a third of the time."""
    return path.replace(b"/", b"\0")


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


def check_entry(e: Entry, chunk_size: int) -> None:
    """Raise, saying what is wrong, unless an entry's own fields are within what the kernel
    accepts: the common case in one expression (a node checks every entry it loads)."""
    kind, size, target = e.kind, e.size, e.target
    if not (0 <= e.mode <= 0o7777 and e.mtime_ns in MTIME_RANGE and (
            (kind is Kind.FILE and not target and 0 <= size <= MAX_FILE_SIZE
             and len(e.chunks) == -(-size // chunk_size))
            or (kind is Kind.DIR and not size and not target and not e.chunks)
            or (kind is Kind.SYMLINK and not e.chunks and size == len(target)
                and 0 < size <= MAX_TARGET and b"\0" not in target))):
        _check_fields(e, chunk_size)


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

