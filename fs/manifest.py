"""Snapshot manifests: the tree of a pushed folder, as git and CernVM-FS keep one.

Each folder is a content-addressed object: its own mode and mtime, then a record per child in
name order (a child folder's record names its object). The root's id is the version: two pushes
of the same tree give the same version, and a change gives new objects only for the folders on
its path, so a push sends, and a node loads, only those (`Manifest.load(known=...)` takes the
rest from the version it loaded before). Objects travel and are stored as ordinary chunks.

In memory a manifest is the flat list of entries in tree order (parents first, each subtree
contiguous), which is what the mount, backing files and collection use. Names are bytes (they
need not be UTF-8). Names that could escape the mount are refused when a manifest is built and
again when one is loaded, so a hostile peer cannot place them.
"""

from __future__ import annotations

import enum
import struct
import weakref
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import NamedTuple

from .chunk import CHUNK_SIZE, ID_SIZE, MAX_CHUNK_SIZE, chunk_id
from .layered import derived

MAGIC = b"MFSD\x01"  # a folder object
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
# A folder object: the head, then one record per child in name order. A child folder's record
# has kind DIR, zero mode, size and mtime, no target and one "chunk": the folder's object id.
_HEAD = struct.Struct("<5sIIqI")  # magic, chunk size, the folder's mode, its mtime_ns, children
_ENTRY = struct.Struct("<BIQqHHI")  # kind, mode, size, mtime_ns, name len, target len, chunks


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


_KINDS = {k.value: k for k in Kind}


def _record(e: Entry, name: bytes) -> bytes:
    """A file or symlink as its folder's object lists it."""
    return b"".join([_ENTRY.pack(e.kind, e.mode, e.size, e.mtime_ns, len(name),
                                 len(e.target), len(e.chunks)), name, e.target, *e.chunks])


def _folder_record(name: bytes, oid: bytes) -> bytes:
    return b"".join([_ENTRY.pack(Kind.DIR, 0, 0, 0, len(name), 0, 1), name, oid])
_TYPES = frozenset(Kind)


def _by_name(e: Entry) -> bytes:
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


def _check_entry(e: Entry, chunk_size: int) -> None:
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


class MissingObject(KeyError):
    """A folder object a version names is not here (yet): `oid` is which, `path` where."""

    def __init__(self, oid: bytes, path: bytes):
        super().__init__(f"folder {path!r}: object {oid.hex()[:12]} not here")
        self.oid = oid
        self.path = path


def _parse(oid: bytes, blob: bytes | memoryview, path: bytes, counted: int, limit: int
           ) -> tuple[int, int, int, list[tuple[int, int, int, int, bytes, bytes, tuple]]]:
    """A folder object's (chunk size, mode, mtime_ns, child records), each record (kind, mode,
    size, mtime_ns, name, target, chunks). Only the layout is checked here: every length
    against what is left before it is used, and the children's count, with the `counted`
    entries before them, against `limit` before a single one is parsed."""
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise ManifestError(f"folder {path!r}: object {oid.hex()[:12]} truncated")
    magic, chunk_size, mode, mtime, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ManifestError(f"folder {path!r}: not a monarch-fs folder object (bad magic)")
    if counted + count > limit:
        raise TooManyEntries(counted + count, limit)
    if count * _ENTRY.size > len(view) - _HEAD.size:
        raise ManifestError(f"folder {path!r}: claims {count} children, more than it holds")
    records = []
    pos = _HEAD.size
    for _ in range(count):
        if pos + _ENTRY.size > len(view):
            raise ManifestError(f"folder {path!r}: object truncated inside a record")
        kind, cmode, size, cmtime, nlen, tlen, nchunks = _ENTRY.unpack_from(view, pos)
        pos += _ENTRY.size
        end = pos + nlen + tlen + nchunks * ID_SIZE
        if end > len(view):
            raise ManifestError(f"folder {path!r}: object truncated inside a record")
        name = bytes(view[pos:pos + nlen])
        target = bytes(view[pos + nlen:pos + nlen + tlen]) if tlen else b""
        base = pos + nlen + tlen
        if nchunks == 1:  # most files, and every folder
            chunks: tuple[bytes, ...] = (bytes(view[base:end]),)
        else:
            raw = bytes(view[base:end])
            chunks = tuple(raw[i:i + ID_SIZE] for i in range(0, len(raw), ID_SIZE))
        records.append((kind, cmode, size, cmtime, name, target, chunks))
        pos = end
    if pos != len(view):
        raise ManifestError(f"folder {path!r}: trailing bytes after the last record")
    return chunk_size, mode, mtime, records


class _Lists:
    """The three lists of a version being made (entries, folder object ids, spans), in tree
    order, from runs of another version's (`base`) and items of its own between them.

    A run costs nothing until `lists()`, which copies the base's lists once and puts the own
    items in place of what lay between the runs. Copying each run as it comes (a slice, then
    an extend) wrote every entry's reference count three times; this writes it once, and
    the writes are most of what an edit costs at 100k files (the entries lie all over the
    heap). Runs come in the base's order and do not overlap: unchanged subtrees, found by
    name in their unchanged order."""

    def __init__(self, base: tuple[list[Entry], list[bytes | None], array[int]] | None = None):
        self.base = base
        self.entries: list[Entry] = []  # own items
        self.oids: list[bytes | None] = []
        self.spans = array("I")
        self.runs: list[tuple[int, int, int]] = []  # (own items before it, base start, end)
        self.n = 0  # the version's length so far

    def take(self, k: int, span: int) -> None:
        """The base's subtree at `k`, whole."""
        self.runs.append((len(self.entries), k, k + span))
        self.n += span

    def add(self, e: Entry) -> int:
        """An own item (its object id and span set later, for a folder): its own index."""
        self.entries.append(e)
        self.oids.append(None)
        self.spans.append(1)
        self.n += 1
        return len(self.entries) - 1

    def gaps(self) -> Iterator[int]:
        """The base's indices outside every run: what the version made no longer has as it
        was (once every run is taken)."""
        at = 0
        for _, start, end in self.runs:
            yield from range(at, start)
            at = end
        if self.base is not None:
            yield from range(at, len(self.base[0]))

    def lists(self) -> tuple[list[Entry], list[bytes | None], array[int]]:
        if not self.runs:
            return self.entries, self.oids, self.spans
        assert self.base is not None
        b_entries, b_oids, b_spans = self.base
        entries, oids, spans = b_entries.copy(), b_oids.copy(), array("I", b_spans)
        own, at = len(self.entries), len(b_entries)  # what is left to place, and where
        for before, start, end in reversed(self.runs):  # from the end: indices stay valid
            entries[end:at] = self.entries[before:own]
            oids[end:at] = self.oids[before:own]
            spans[end:at] = self.spans[before:own]
            own, at = before, start
        entries[:at] = self.entries[:own]
        oids[:at] = self.oids[:own]
        spans[:at] = self.spans[:own]
        return entries, oids, spans


class Manifest:
    """A snapshot's tree, sorted parents first. Its folders, encoded, are content-addressed
    objects (`objects()`), and the root's id is the version (`id`)."""

    def __init__(self, entries: Iterable[Entry], chunk_size: int = CHUNK_SIZE):
        self.chunk_size = chunk_size
        self.entries = sorted(entries, key=lambda e: e.path.replace(b"/", b"\0"))  # sort_key
        self._by_path: dict[bytes, Entry] | None = None
        self._objects: Mapping[bytes, bytes] | None = None
        self._folders: int | None = None  # how many folders (objects() has fewer: repeats)
        # The tree, one item per entry: a folder's object id (None for a file or symlink), and
        # how many entries its subtree spans (itself included). Lengths, not positions, so a
        # subtree's items are copied between versions as slices, unchanged. The spans are an
        # array of 4-byte counts: half what a list's pointers take (0.4 MB at 100k entries).
        self._oids: list[bytes | None] | None = None
        self._spans: array[int] | None = None
        # Loaded knowing another version (`load`'s `known`): that one, and the indices of the
        # folders read from objects (the rest was taken from it), so an index of this version
        # can be made from that one's at the cost of what changed (fs/inodes.py).
        self.base: weakref.ref[Manifest] | None = None
        self.read_folders: list[int] = []
        self.known_ids: Collection[bytes] | None = None  # chunk_ids(), when already counted
        self.totals: tuple[int, int] | None = None  # file_totals()
        self.new_objects: set[bytes] = set()  # edited(): the objects its base does not have

    def validate(self, known: Collection[bytes] = ()) -> None:
        """Refuse anything the mount could not serve as is: every field is held to what the
        kernel accepts, so a FUSE reply never has to convert a value that does not fit (a
        directory of size 2^64-1 once took the daemon down at the first `ls`).

        `known`: ids of folder objects validated before (the dev box's scan cache keeps those
        of its last scan). Their children are not checked again, since a folder's object holds
        its children's names and fields and, through their ids, its whole subtree; only every
        path's length is, as it depends on where a folder sits. A one-file edit then checks
        the few folders on its path, not every entry (22 ms at 15k files)."""
        if not (64 * 1024 <= self.chunk_size <= MAX_CHUNK_SIZE):
            raise ManifestError(f"chunk size {self.chunk_size} out of range")
        if not self.entries or self.entries[0].path != b"" or self.entries[0].kind != Kind.DIR:
            raise ManifestError("manifest has no root directory")
        if known:
            try:
                self.objects()  # (which refuses an entry outside any folder)
            except struct.error:
                pass  # a field no record holds: the whole check below says which
            else:
                self._validate_folders(known)
                return
        seen: dict[bytes, Kind] = {}
        for e in self.entries:
            check_path(e.path)
            if e.path in seen:
                raise ManifestError(f"duplicate entry {e.path!r}")
            if e.path and seen.get(e.parent) != Kind.DIR:
                raise ManifestError(f"entry {e.path!r} has no parent directory")
            _check_entry(e, self.chunk_size)
            seen[e.path] = e.kind

    def _validate_folders(self, known: Collection[bytes]) -> None:
        """validate() of a built manifest, but for the folders whose object id is `known`."""
        entries, oids, spans = self.entries, self._oids, self._spans
        assert oids is not None and spans is not None
        longest = max(entries, key=lambda e: len(e.path))
        if len(longest.path) > MAX_PATH:
            check_path(longest.path)
        _check_entry(entries[0], self.chunk_size)
        if spans[0] != len(entries):  # only a second root is outside the root's subtree
            raise ManifestError(f"duplicate entry {entries[1].path!r}")
        for i, oid in enumerate(oids):
            if oid is None or oid in known:
                continue
            j, end, last = i + 1, i + spans[i], None
            while j < end:
                e = entries[j]
                check_path(e.path)
                if e.name == last:
                    raise ManifestError(f"duplicate entry {e.path!r}")
                _check_entry(e, self.chunk_size)
                last = e.name
                j += spans[j]

    # ---- the tree of objects ----------------------------------------------------------------

    def objects(self) -> Mapping[bytes, bytes]:
        """Every folder's object by id, children before their parents: the root, last, is the
        version. Built once; it checks nothing (validate does) but that each entry has a
        parent folder, since an entry without one has no object to be in."""
        if self._objects is None:
            self._build()
        assert self._objects is not None
        return self._objects

    def _build(self) -> None:
        entries, cs = self.entries, self.chunk_size
        if not entries or entries[0].path != b"" or entries[0].kind != Kind.DIR:
            raise ManifestError("manifest has no root directory")
        oids: list[bytes | None] = [None] * len(entries)
        spans = array("I", [1]) * len(entries)
        objects: dict[bytes, bytes] = {}
        below: dict[bytes, list[bytes]] = {}  # folder path -> its children's records, reversed
        spanned: dict[bytes, int] = {}  # folder path -> entries below it
        pack, folder = _ENTRY.pack, Kind.DIR
        for i in range(len(entries) - 1, -1, -1):  # children before their parent
            path, kind, mode, size, mtime, target, chunks = entries[i]
            parent, _, name = path.rpartition(b"/")
            if kind == folder:
                records = below.pop(path, [])
                records.reverse()
                blob = b"".join([_HEAD.pack(MAGIC, cs, mode, mtime, len(records)), *records])
                oid = oids[i] = chunk_id(blob)
                objects[oid] = blob
                spans[i] += spanned.pop(path, 0)
                record = b"".join([pack(folder, 0, 0, 0, len(name), 0, 1), name, oid])
            else:  # (_record, inline: this loop runs once per entry of every scan)
                record = b"".join([pack(kind, mode, size, mtime, len(name), len(target),
                                        len(chunks)), name, target, *chunks])
            if path:
                below.setdefault(parent, []).append(record)
                spanned[parent] = spanned.get(parent, 0) + spans[i]
        if below:
            orphan = min(below)
            raise ManifestError(f"entries under {orphan!r} have no parent directory")
        self._objects, self._oids, self._spans = objects, oids, spans
        self._folders = len(oids) - oids.count(None)

    @property
    def id(self) -> bytes:
        """The version: the root folder's object id."""
        if self._oids is None:
            self._build()
        assert self._oids is not None and self._oids[0] is not None
        return self._oids[0]

    def folders(self) -> Iterator[tuple[int, bytes]]:
        """(index, object id) of every folder, the root first."""
        if self._oids is None:
            self._build()
        assert self._oids is not None
        return ((i, oid) for i, oid in enumerate(self._oids) if oid is not None)

    def ids_beyond(self, objects: Collection[bytes]) -> list[bytes]:
        """What this version may hold that one whose folder objects are `objects` does not:
        its folder objects not among them, and the chunks of the files directly inside those.
        Only the folders that differ are walked (a one-file edit: the few on its path)."""
        if self._oids is None:
            self._build()
        entries, oids, spans = self.entries, self._oids, self._spans
        assert oids is not None and spans is not None
        out: dict[bytes, None] = {}
        stack = [0]
        while stack:
            i = stack.pop()
            oid = oids[i]
            assert oid is not None
            if oid in objects:
                continue
            out[oid] = None
            j, end = i + 1, i + spans[i]
            while j < end:
                if oids[j] is not None:
                    stack.append(j)
                else:
                    out.update(dict.fromkeys(entries[j].chunks))
                j += spans[j]
        return list(out)

    def object_ids(self) -> list[bytes]:
        """Every folder's object id, the root's first."""
        if self._oids is None:
            self._build()
        assert self._oids is not None
        return [o for o in self._oids if o is not None]

    @classmethod
    def load(cls, version: bytes, get: Callable[[bytes], bytes | memoryview],
             max_entries: int | None = None, known: Manifest | None = None) -> Manifest:
        """The version whose root object is `version`, its objects read with `get(id)` (which
        checks each against its id, and raises KeyError for one it lacks: MissingObject says
        which). Every record is checked, in tree order, so an error names the first entry the
        mount could not serve. More than `max_entries` entries (default: what the format
        allows) are refused as soon as they are counted.

        `known`: a version loaded before (a node passes the one it loaded last). A folder whose
        object id is the one `known` has at the same path is that subtree: its entries are
        taken as they are (shared in memory, and checked when they were loaded), so loading
        an edit costs the folders on its path, not the tree."""
        limit = MAX_ENTRIES if max_entries is None else min(max_entries, MAX_ENTRIES)
        k_entries: list[Entry] = []  # known's, when it has a tree (else no folder is known)
        k_oids: list[bytes | None] = []
        k_spans = array("I")
        if known is not None and known._oids is not None and known._spans is not None:
            k_entries, k_oids, k_spans = known.entries, known._oids, known._spans
        out = _Lists((k_entries, k_oids, k_spans))
        chunk_size = 0
        read: list[int] = []

        def open_folder(path: bytes, oid: bytes, k: int | None):
            """Enter the folder at `path` (known's index `k`): None when known's subtree is
            taken whole, else (its records, its index and own index, its known children by
            name)."""
            nonlocal chunk_size
            if k is not None and k_oids[k] == oid:
                out.take(k, k_spans[k])
                if out.n > limit:
                    raise TooManyEntries(out.n, limit)
                return None
            try:
                blob = get(oid)
            except KeyError:
                raise MissingObject(oid, path) from None
            size, mode, mtime, records = _parse(oid, blob, path, out.n + 1, limit)
            if not chunk_size:
                if not (64 * 1024 <= size <= MAX_CHUNK_SIZE):
                    raise ManifestError(f"chunk size {size} out of range")
                chunk_size = size
            elif size != chunk_size:
                raise ManifestError(f"folder {path!r}: chunk size {size}, the root's is "
                                    f"{chunk_size}")
            e = Entry(path, Kind.DIR, mode, 0, mtime)
            _check_entry(e, chunk_size)
            if k is not None and k_entries[k] == e:
                e = k_entries[k]  # the same folder with new contents: one object in memory
            at = out.n
            read.append(at)
            mine = out.add(e)
            out.oids[mine] = oid
            kids: dict[bytes, int] = {}
            if k is not None:  # known's children of this folder, by name
                j, end = k + 1, k + k_spans[k]
                while j < end:
                    kids[k_entries[j].name] = j
                    j += k_spans[j]
            return iter(records), (at, mine), kids, path, b""

        stack = [open_folder(b"", version, 0 if k_entries else None)]
        while stack:
            records, (at, mine), kids, path, last = stack[-1]
            record = next(records, None)
            if record is None:
                out.spans[mine] = out.n - at
                stack.pop()
                continue
            kind, mode, size, mtime, name, target, chunks = record
            child = path + b"/" + name if path else name
            if b"/" in name:  # check_path would see two names
                raise UnsafePath(f"unsafe path {child!r}: '/' inside a name")
            check_path(child)
            if name <= last:
                raise ManifestError(f"duplicate entry {child!r}" if name == last else
                                    f"folder {path!r}: children not in name order at {child!r}")
            stack[-1] = (records, (at, mine), kids, path, name)
            k = kids.get(name)
            if kind == Kind.DIR:
                if mode or size or mtime or target or len(chunks) != 1:
                    raise ManifestError(f"directory {child!r}: a folder's record has only "
                                        "its object id")
                if k is not None and k_entries[k].kind != Kind.DIR:
                    k = None
                inner = open_folder(child, chunks[0], k)
                if inner is not None:
                    stack.append(inner)
                continue
            if kind not in _KINDS:
                raise ManifestError(f"entry {child!r}: unknown kind {kind}")
            e = Entry(child, _KINDS[kind], mode, size, mtime, target, chunks)
            if k is not None and k_entries[k] == e:
                e = k_entries[k]  # unchanged: checked when it was loaded
            else:
                _check_entry(e, chunk_size)
            out.add(e)
            if out.n > limit:
                raise TooManyEntries(out.n, limit)
        m = cls((), chunk_size)
        m.entries, m._oids, m._spans = out.lists()  # in tree order by construction
        m.read_folders = read
        if known is not None and k_entries:
            m.base = weakref.ref(known)
        return m

    def edited(self, folders: dict[bytes, tuple[Entry, list[Entry]]]) -> Manifest:
        """This tree with each folder in `folders` (path -> its entry and all its children,
        in any order) listed anew, built at the cost of those folders: every other subtree,
        its folder objects included, is taken from this one as it is. A child folder not in
        `folders` must be one this tree has at that path (a new folder is listed there, and
        so is every folder below it). The folders above a listed one get new objects too.
        What is new is checked as validate() would; the rest was checked before."""
        if self._oids is None or self._spans is None or self._objects is None:
            self._build()
        p_entries, p_oids, p_spans = self.entries, self._oids, self._spans
        assert p_oids is not None and p_spans is not None and self._objects is not None
        listed = dict(folders)
        for path in folders:  # the folders above a listed one list what they listed before
            while path:
                path = path.rpartition(b"/")[0]
                if path in listed:
                    break
                i = self.find(path)
                if i is None or p_entries[i].kind != Kind.DIR:
                    raise ManifestError(f"folder {path!r} is neither listed nor in the tree")
                listed[path] = (p_entries[i], self.children(i))
        if b"" not in listed:
            return self
        cs = self.chunk_size
        out = _Lists((p_entries, p_oids, p_spans))
        blobs: dict[bytes, bytes] = {}

        def enter(path: bytes) -> tuple[Iterator[Entry], list[bytes], tuple[int, int], bytes,
                                        bytes | None]:
            """Emit the listed folder at `path`: its children to go, its records, its index
            and own index, its path and the last child's name."""
            folder, kids = listed[path]
            if folder.path != path or folder.kind != Kind.DIR:
                raise ManifestError(f"folder {path!r} listed with the entry of {folder.path!r}")
            check_path(path)
            _check_entry(folder, cs)
            at = out.n
            return iter(sorted(kids, key=_by_name)), [], (at, out.add(folder)), path, None

        # Depth first with a stack (as load does): a closure that called itself would be a
        # reference cycle holding these lists until a collection (dozens of ms at 100k files).
        stack = [enter(b"")]
        while stack:
            kids, records, (at, mine), path, last = stack[-1]
            e = next(kids, None)
            if e is None:  # the folder is done: its object, and its record in its parent's
                folder = out.entries[mine]
                blob = b"".join([_HEAD.pack(MAGIC, cs, folder.mode, folder.mtime_ns,
                                            len(records)), *records])
                oid = out.oids[mine] = chunk_id(blob)
                blobs[oid] = blob
                out.spans[mine] = out.n - at
                stack.pop()
                if stack:
                    stack[-1][1].append(_folder_record(folder.name, oid))
                continue
            name = e.name
            if e.parent != path or name == last:
                raise ManifestError(f"entry {e.path!r} listed in folder {path!r} twice "
                                    "or in the wrong folder" if name == last else
                                    f"entry {e.path!r} listed in folder {path!r}")
            stack[-1] = (kids, records, (at, mine), path, name)
            if e.kind == Kind.DIR:
                if e.path in listed:
                    stack.append(enter(e.path))
                    continue
                i = self.find(e.path)
                if i is None or p_entries[i].kind != Kind.DIR:
                    raise ManifestError(f"folder {e.path!r} is neither listed nor in the tree")
                out.take(i, p_spans[i])
                taken = p_oids[i]
                assert taken is not None
                records.append(_folder_record(name, taken))
                continue
            check_path(e.path)
            _check_entry(e, cs)
            records.append(_record(e, name))
            out.add(e)

        m = Manifest((), cs)
        m.entries, m._oids, m._spans = out.lists()
        old = self._objects
        gone = [o for j in out.gaps() if (o := p_oids[j]) is not None]  # replaced folders
        if self._folders is not None:
            m._folders = self._folders - len(gone) + len(out.oids) - out.oids.count(None)
        if self._folders == len(old):
            # No two folders share an object, so a replaced folder's object is gone unless the
            # edit made it again: this version's are the last one's, less those, plus the new
            # (children still before their parents), made at the cost of the change.
            objects = derived(old)
            for o in gone:
                if o not in blobs:
                    del objects[o]
            objects.update(blobs)
            m._objects = objects
        else:  # (an object shared by two folders: whether it is still used takes a pass)
            m._objects = {oid: blobs.get(oid) or old[oid]  # children before parents
                          for oid in reversed(m._oids) if oid is not None}
        m.new_objects = {oid for oid in blobs if oid not in old}
        return m

    def find(self, path: bytes) -> int | None:
        """The index of the entry at `path`, found down the tree (no index of every path)."""
        if self._spans is None:
            self._build()
        assert self._spans is not None
        i = 0
        for name in path.split(b"/") if path else ():
            if self.entries[i].kind != Kind.DIR:
                return None
            j, end = i + 1, i + self._spans[i]
            while j < end and self.entries[j].name != name:
                j += self._spans[j]
            if j >= end:
                return None
            i = j
        return i

    def added_entries(self) -> list[Entry]:
        """The entries of the folders `load` read: with every other subtree taken from its base
        (Manifest.base), the only ones this version may have that the base does not. All of
        them when it was not loaded against a base."""
        if self.base is None:
            return self.entries
        return [e for i in self.read_folders for e in self.children(i)]

    def added_chunk_ids(self) -> list[bytes] | None:
        """The chunks of added_entries(); None if it was not loaded against a base."""
        if self.base is None:
            return None
        return list(dict.fromkeys(c for e in self.added_entries() for c in e.chunks))

    def span(self, i: int) -> int:
        """How many entries the subtree at index `i` holds, itself included."""
        if self._spans is None:
            self._build()
        assert self._spans is not None
        return self._spans[i]

    def children(self, i: int) -> list[Entry]:
        """The entries directly inside the folder at index `i`, in name order."""
        assert self._spans is not None
        out, j, end = [], i + 1, i + self._spans[i]
        while j < end:
            out.append(self.entries[j])
            j += self._spans[j]
        return out

    # ---- lookups ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, path: bytes) -> Entry | None:
        if self._by_path is None:
            self._by_path = {e.path: e for e in self.entries}
        return self._by_path.get(path)

    def chunk_ids(self) -> Collection[bytes]:
        """Every chunk id the snapshot needs, once each, in file order (or as `known_ids`
        says, when a rescan counted them: its counts by id, whose length costs nothing)."""
        if self.known_ids is not None:
            return self.known_ids
        return list(dict.fromkeys(c for e in self.entries for c in e.chunks))

    @property
    def total_bytes(self) -> int:
        return self.file_totals()[1]

    def file_totals(self) -> tuple[int, int]:
        """(files, bytes), counted once (or set by a rescan from the change: `totals`)."""
        if self.totals is None:
            files = [e.size for e in self.entries if e.kind == Kind.FILE]
            self.totals = (len(files), sum(files))
        return self.totals
