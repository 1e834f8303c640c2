"""Snapshot manifests: the tree of a pushed folder, as git and CernVM-FS keep one.

Each folder is a content-addressed object: its own mode and mtime, then a record per child in
name order (a child folder's record names its object). The root's id is the version: two pushes
of the same tree give the same version, and a change gives new objects only for the folders on
its path, so a push sends, and a node loads, only those (`Manifest.load(known=...)` takes the
rest from the version it loaded before). Objects travel and are stored as ordinary chunks.

In memory a version is a tree of Folder values, shared whole between the versions that have a
folder unchanged, so an edit costs the folders on its path in memory too; the flat list of
entries in tree order (parents first, each subtree contiguous) is what a scan makes, and is made
from the tree only where a whole pass needs it. Names are bytes (they
need not be UTF-8). Names that could escape the mount are refused when a manifest is built and
again when one is loaded, so a hostile peer cannot place them.
"""

from __future__ import annotations

import bisect
import enum
import struct
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
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


class Folder:
    """A folder of a version with all that is below it: its entry, its object id, its children
    in name order (`kids`; a child folder is there by its entry, and in `sub` by name) and how
    many entries its subtree holds (`span`, itself included).

    Never changed once its version is made, so versions share every folder they have
    unchanged, whole: loading or making an edit makes the folders on its path and takes the
    others as they are. A version as one flat list had to copy the list for every edit, and
    free the last one's, each O(tree) (a few ms a version at 100k files)."""

    __slots__ = ("entry", "oid", "kids", "sub", "span")

    def __init__(self, entry: Entry, oid: bytes, kids: tuple[Entry, ...],
                 sub: dict[bytes, Folder], span: int):
        self.entry = entry
        self.oid = oid
        self.kids = kids
        self.sub = sub  # in name order too
        self.span = span

    def walk(self) -> Iterator[Entry]:
        """Every entry of the subtree, in tree order (this folder's first)."""
        yield self.entry
        stack = [(iter(self.kids), self.sub)]
        while stack:
            kids, sub = stack[-1]
            for e in kids:
                if e.kind == Kind.DIR:
                    f = sub[e.name]
                    yield f.entry
                    stack.append((iter(f.kids), f.sub))
                    break
                yield e
            else:
                stack.pop()

    def folders(self) -> Iterator[Folder]:
        """This folder and every folder below it, parents first."""
        stack = [self]
        while stack:
            f = stack.pop()
            yield f
            stack.extend(reversed(f.sub.values()))


def _blob(folder: Entry, records: list[bytes], chunk_size: int) -> bytes:
    """A folder's object: its head, then its children's records."""
    return b"".join([_HEAD.pack(MAGIC, chunk_size, folder.mode, folder.mtime_ns, len(records)),
                     *records])


class _Making:
    """A folder Manifest.edited is making: its entry, its children still to place (in name
    order), and its records, children and child folders so far."""

    __slots__ = ("folder", "todo", "records", "kids", "sub", "last")

    def __init__(self, folder: Entry, kids: Iterable[Entry]):
        self.folder = folder
        self.todo = iter(sorted(kids, key=_by_name))
        self.records: list[bytes] = []
        self.kids: list[Entry] = []
        self.sub: dict[bytes, Folder] = {}
        self.last: bytes | None = None  # the last child's name

    def add(self, f: Folder) -> None:
        """A child folder, made or taken whole."""
        name = f.entry.name
        self.records.append(_folder_record(name, f.oid))
        self.kids.append(f.entry)
        self.sub[name] = f

    def made(self, chunk_size: int) -> tuple[Folder, bytes]:
        """The Folder, and its object."""
        blob = _blob(self.folder, self.records, chunk_size)
        span = 1 + len(self.kids) - len(self.sub) + sum(f.span for f in self.sub.values())
        return Folder(self.folder, chunk_id(blob), tuple(self.kids), self.sub, span), blob


class Manifest:
    """A snapshot's tree: a Folder per folder (`root`), or, as a scan makes it, the flat list
    of its entries in tree order (parents first, each subtree contiguous), each made from the
    other when first needed. Its folders, encoded, are content-addressed objects
    (`objects()`), and the root's id is the version (`id`)."""

    def __init__(self, entries: Iterable[Entry] = (), chunk_size: int = CHUNK_SIZE):
        self.chunk_size = chunk_size
        self._entries: list[Entry] | None = sorted(
            entries, key=lambda e: e.path.replace(b"/", b"\0"))  # sort_key
        self._root: Folder | None = None
        self._objects: Mapping[bytes, bytes] | None = None
        self._folders: int | None = None  # how many folders (objects() has fewer: repeats)
        # Loaded knowing another version (`load`'s `known`): that one, and the folders read
        # from objects (the others were taken from it), so an index of this version can be
        # made from that one's at the cost of what changed (fs/inodes.py).
        self.base: weakref.ref[Manifest] | None = None
        self.read_folders: list[Folder] = []
        self.known_ids: Collection[bytes] | None = None  # chunk_ids(), when already counted
        self.totals: tuple[int, int] | None = None  # file_totals()
        self.new_objects: set[bytes] = set()  # edited(): the objects its base does not have

    @classmethod
    def _of(cls, root: Folder, chunk_size: int) -> Manifest:
        m = cls((), chunk_size)
        m._entries, m._root = None, root
        return m

    @property
    def entries(self) -> list[Entry]:
        """Every entry in tree order (made from the folders once, when a version was loaded or
        edited: what runs for every version iterates the manifest instead)."""
        if self._entries is None:
            self._entries = list(self.root.walk())
        return self._entries

    @property
    def root(self) -> Folder:
        if self._root is None:
            self._build()
        assert self._root is not None
        return self._root

    def validate(self, known: Collection[bytes] = ()) -> None:
        """Refuse anything the mount could not serve as is: every field is held to what the
        kernel accepts, so a FUSE reply never has to convert a value that does not fit (a
        directory of size 2^64-1 once took the daemon down at the first `ls`).

        `known`: ids of folder objects validated before (the dev box's scan cache keeps those
        of its last scan). Their subtrees are not checked again, since a folder's object holds
        its children's names and fields and, through their ids, its whole subtree; only every
        path's length is, as it depends on where a folder sits. A one-file edit then checks
        the few folders on its path, not every entry (22 ms at 15k files)."""
        if not (64 * 1024 <= self.chunk_size <= MAX_CHUNK_SIZE):
            raise ManifestError(f"chunk size {self.chunk_size} out of range")
        entries = self.entries
        if not entries or entries[0].path != b"" or entries[0].kind != Kind.DIR:
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
        for e in entries:
            check_path(e.path)
            if e.path in seen:
                raise ManifestError(f"duplicate entry {e.path!r}")
            if e.path and seen.get(e.parent) != Kind.DIR:
                raise ManifestError(f"entry {e.path!r} has no parent directory")
            _check_entry(e, self.chunk_size)
            seen[e.path] = e.kind

    def _validate_folders(self, known: Collection[bytes]) -> None:
        """validate() of a built manifest, but for the folders whose object id is `known`."""
        entries, root = self.entries, self.root
        longest = max(entries, key=lambda e: len(e.path))
        if len(longest.path) > MAX_PATH:
            check_path(longest.path)
        _check_entry(root.entry, self.chunk_size)
        if root.span != len(entries):  # only a second root is outside the root's subtree
            raise ManifestError(f"duplicate entry {entries[1].path!r}")
        stack = [root]
        while stack:
            f = stack.pop()
            if f.oid in known:
                continue
            last = None
            for e in f.kids:
                check_path(e.path)
                if e.name == last:
                    raise ManifestError(f"duplicate entry {e.path!r}")
                _check_entry(e, self.chunk_size)
                last = e.name
            stack.extend(f.sub.values())

    # ---- the tree of objects ----------------------------------------------------------------

    def objects(self) -> Mapping[bytes, bytes]:
        """Every folder's object by id, children before their parents: the root, last, is the
        version. Built once; it checks nothing (validate does) but that each entry has a
        parent folder, since an entry without one has no object to be in."""
        if self._objects is None:
            if self._root is None:
                self._build()
            else:  # loaded: encoded again (a node asks only for the ids: object_ids)
                self._objects = {f.oid: self._encode(f) for f in reversed(list(
                    self._root.folders()))}
        assert self._objects is not None
        return self._objects

    def _encode(self, f: Folder) -> bytes:
        return _blob(f.entry, [_folder_record(e.name, f.sub[e.name].oid) if e.kind == Kind.DIR
                               else _record(e, e.name) for e in f.kids], self.chunk_size)

    def _build(self) -> None:
        """The folders and their objects, from the entries (a scan's)."""
        entries, cs = self._entries, self.chunk_size
        if not entries or entries[0].path != b"" or entries[0].kind != Kind.DIR:
            raise ManifestError("manifest has no root directory")
        objects: dict[bytes, bytes] = {}
        # folder path -> its children's records and entries, and its child folders by name
        below: dict[bytes, tuple[list[bytes], list[Entry], dict[bytes, Folder]]] = {}
        spanned: dict[bytes, int] = {}  # folder path -> entries below it
        pack, folder, root, count = _ENTRY.pack, Kind.DIR, None, 0
        for i in range(len(entries) - 1, -1, -1):  # children before their parent
            e = entries[i]
            path, kind, mode, size, mtime, target, chunks = e
            parent, _, name = path.rpartition(b"/")
            if kind == folder:
                records, kids, sub = below.pop(path, ([], [], {}))
                records.reverse()
                kids.reverse()
                blob = _blob(e, records, cs)
                oid = chunk_id(blob)
                objects[oid] = blob
                f = Folder(e, oid, tuple(kids), dict(reversed(sub.items())),  # (name order)
                           1 + spanned.pop(path, 0))
                count += 1
                span = f.span
                record = b"".join([pack(folder, 0, 0, 0, len(name), 0, 1), name, oid])
            else:  # (_record, inline: this loop runs once per entry of every scan)
                span = 1
                record = b"".join([pack(kind, mode, size, mtime, len(name), len(target),
                                        len(chunks)), name, target, *chunks])
            if path:
                lists = below.get(parent)
                if lists is None:
                    lists = below[parent] = ([], [], {})
                lists[0].append(record)
                lists[1].append(e)
                if kind == folder:
                    lists[2][name] = f
                spanned[parent] = spanned.get(parent, 0) + span
            elif kind == folder:
                root = f
        if below:
            orphan = min(below)
            raise ManifestError(f"entries under {orphan!r} have no parent directory")
        self._objects, self._root, self._folders = objects, root, count

    @property
    def id(self) -> bytes:
        """The version: the root folder's object id."""
        return self.root.oid

    def folders(self) -> Iterator[Folder]:
        """Every folder, parents first (the root first)."""
        return self.root.folders()

    def folder(self, path: bytes) -> Folder | None:
        """The folder at `path`, found down the tree; None when there is none."""
        f = self.root
        for name in path.split(b"/") if path else ():
            sub = f.sub.get(name)
            if sub is None:
                return None
            f = sub
        return f

    def get(self, path: bytes) -> Entry | None:
        """The entry at `path`, found down the tree."""
        parent, _, name = path.rpartition(b"/")
        f = self.folder(parent) if path else None
        if f is None:
            return self.root.entry if not path else None
        sub = f.sub.get(name)
        if sub is not None:
            return sub.entry
        kids = f.kids
        i = bisect.bisect_left(kids, name, key=_by_name)
        return kids[i] if i < len(kids) and kids[i].name == name else None

    def ids_beyond(self, objects: Collection[bytes]) -> list[bytes]:
        """What this version may hold that one whose folder objects are `objects` does not:
        its folder objects not among them, and the chunks of the files directly inside those.
        Only the folders that differ are walked (a one-file edit: the few on its path)."""
        out: dict[bytes, None] = {}
        stack = [self.root]
        while stack:
            f = stack.pop()
            if f.oid in objects:
                continue
            out[f.oid] = None
            for e in f.kids:
                if e.kind == Kind.DIR:
                    stack.append(f.sub[e.name])
                else:
                    out.update(dict.fromkeys(e.chunks))
        return list(out)

    def object_ids(self) -> list[bytes]:
        """Every folder's object id, the root's first."""
        return [f.oid for f in self.root.folders()]

    @classmethod
    def load(cls, version: bytes, get: Callable[[bytes], bytes | memoryview],
             max_entries: int | None = None, known: Manifest | None = None) -> Manifest:
        """The version whose root object is `version`, its objects read with `get(id)` (which
        checks each against its id, and raises KeyError for one it lacks: MissingObject says
        which). Every record is checked, in tree order, so an error names the first entry the
        mount could not serve. More than `max_entries` entries (default: what the format
        allows) are refused as soon as they are counted.

        `known`: a version loaded before (a node passes the one it loaded last). A folder whose
        object id is the one `known` has at the same path is that subtree, taken as it is
        (shared in memory, and checked when it was loaded), so loading an edit costs the
        folders on its path, not the tree."""
        limit = MAX_ENTRIES if max_entries is None else min(max_entries, MAX_ENTRIES)
        k_root = known._root if known is not None else None
        chunk_size = 0
        count = 0  # entries so far
        read: list[Folder] = []

        def open_folder(path: bytes, oid: bytes, k: Folder | None) -> Folder | list:
            """Enter the folder at `path` (known's there: `k`): known's whole when its object
            is the same, else a frame: [its records, the Folder made, its kids so far, `k`,
            k's children by name, its path, the last child's name, the count before it]."""
            nonlocal chunk_size, count
            if k is not None and k.oid == oid:
                count += k.span
                if count > limit:
                    raise TooManyEntries(count, limit)
                return k
            try:
                blob = get(oid)
            except KeyError:
                raise MissingObject(oid, path) from None
            size, mode, mtime, records = _parse(oid, blob, path, count + 1, limit)
            if not chunk_size:
                if not (64 * 1024 <= size <= MAX_CHUNK_SIZE):
                    raise ManifestError(f"chunk size {size} out of range")
                chunk_size = size
            elif size != chunk_size:
                raise ManifestError(f"folder {path!r}: chunk size {size}, the root's is "
                                    f"{chunk_size}")
            e = Entry(path, Kind.DIR, mode, 0, mtime)
            _check_entry(e, chunk_size)
            if k is not None and k.entry == e:
                e = k.entry  # the same folder with new contents: one object in memory
            f = Folder(e, oid, (), {}, 0)
            read.append(f)
            count += 1
            kids = {c.name: c for c in k.kids} if k is not None else {}
            return [iter(records), f, [], k, kids, path, b"", count - 1]

        top = open_folder(b"", version, k_root)
        if isinstance(top, Folder):  # the version known is
            assert known is not None
            chunk_size = known.chunk_size
        stack = [top] if isinstance(top, list) else []
        while stack:
            frame = stack[-1]
            records, f, kids, k_folder, k_kids, path, last, start = frame
            record = next(records, None)
            if record is None:
                f.kids, f.span = tuple(kids), count - start
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
            frame[6] = name
            if kind == Kind.DIR:
                if mode or size or mtime or target or len(chunks) != 1:
                    raise ManifestError(f"directory {child!r}: a folder's record has only "
                                        "its object id")
                k = k_folder.sub.get(name) if k_folder is not None else None
                inner = open_folder(child, chunks[0], k)
                sub = inner if isinstance(inner, Folder) else inner[1]
                kids.append(sub.entry)
                f.sub[name] = sub
                if isinstance(inner, list):
                    stack.append(inner)
                continue
            if kind not in _KINDS:
                raise ManifestError(f"entry {child!r}: unknown kind {kind}")
            e = Entry(child, _KINDS[kind], mode, size, mtime, target, chunks)
            was = k_kids.get(name)
            if was is not None and was == e:
                e = was  # unchanged: checked when it was loaded
            else:
                _check_entry(e, chunk_size)
            kids.append(e)
            count += 1
            if count > limit:
                raise TooManyEntries(count, limit)
        m = cls._of(top if isinstance(top, Folder) else top[1], chunk_size)
        m.read_folders = read
        if known is not None and k_root is not None:
            m.base = weakref.ref(known)
        return m

    def edited(self, folders: dict[bytes, tuple[Entry, Sequence[Entry]]]) -> Manifest:
        """This tree with each folder in `folders` (path -> its entry and all its children,
        in any order) listed anew, built at the cost of those folders: every other folder,
        its object included, is taken from this one as it is. A child folder not in
        `folders` must be one this tree has at that path (a new folder is listed there, and
        so is every folder below it). The folders above a listed one get new objects too.
        What is new is checked as validate() would; the rest was checked before."""
        old_root, old = self.root, self.objects()
        listed = dict(folders)
        for path in folders:  # the folders above a listed one list what they listed before
            while path:
                path = path.rpartition(b"/")[0]
                if path in listed:
                    break
                was = self.folder(path)
                if was is None:
                    raise ManifestError(f"folder {path!r} is neither listed nor in the tree")
                listed[path] = (was.entry, was.kids)
        if b"" not in listed:
            return self
        cs = self.chunk_size
        blobs: dict[bytes, bytes] = {}
        made = 0

        def enter(path: bytes) -> _Making:
            folder, kids = listed[path]
            if folder.path != path or folder.kind != Kind.DIR:
                raise ManifestError(f"folder {path!r} listed with the entry of {folder.path!r}")
            check_path(path)
            _check_entry(folder, cs)
            return _Making(folder, kids)

        # Depth first with a stack (as load does): a closure that called itself would be a
        # reference cycle, held until a collection.
        stack = [enter(b"")]
        root = None
        while stack:
            top = stack[-1]
            e = next(top.todo, None)
            if e is None:  # the folder is done: its object, and its place in its parent
                f, blob = top.made(cs)
                blobs[f.oid] = blob
                made += 1
                stack.pop()
                if stack:
                    stack[-1].add(f)
                else:
                    root = f
                continue
            name, path = e.name, top.folder.path
            if e.parent != path or name == top.last:
                raise ManifestError(f"entry {e.path!r} listed in folder {path!r} twice "
                                    "or in the wrong folder" if name == top.last else
                                    f"entry {e.path!r} listed in folder {path!r}")
            top.last = name
            if e.kind == Kind.DIR:
                if e.path in listed:
                    stack.append(enter(e.path))
                    continue
                was = self.folder(e.path)
                if was is None:
                    raise ManifestError(f"folder {e.path!r} is neither listed nor in the tree")
                top.add(was)
                continue
            check_path(e.path)
            _check_entry(e, cs)
            top.records.append(_record(e, name))
            top.kids.append(e)

        assert root is not None
        m = Manifest._of(root, cs)
        gone = []  # the folders of this version the new one does not share
        pairs: list[tuple[Folder, Folder | None]] = [(old_root, root)]
        while pairs:
            was, now = pairs.pop()
            if now is was:
                continue
            gone.append(was.oid)
            pairs.extend((s, now.sub.get(n) if now is not None else None)
                         for n, s in was.sub.items())
        if self._folders is not None:
            m._folders = self._folders - len(gone) + made
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
            m._objects = {f.oid: blobs.get(f.oid) or old[f.oid]  # children before parents
                          for f in reversed(list(root.folders()))}
        m.new_objects = {oid for oid in blobs if oid not in old}
        return m

    def added_entries(self) -> list[Entry]:
        """The entries of the folders `load` read: with every other folder taken from its
        base (Manifest.base), the only ones this version may have that the base does not. All
        of them when it was not loaded against a base."""
        if self.base is None:
            return list(self)
        return [e for f in self.read_folders for e in f.kids]

    def added_chunk_ids(self) -> list[bytes] | None:
        """The chunks of added_entries(); None if it was not loaded against a base."""
        if self.base is None:
            return None
        return list(dict.fromkeys(c for e in self.added_entries() for c in e.chunks))

    # ---- lookups ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Entry]:
        """The entries in tree order, without making the list of them."""
        return iter(self._entries) if self._entries is not None else self.root.walk()

    def __len__(self) -> int:
        return len(self._entries) if self._entries is not None else self.root.span

    def chunk_ids(self) -> Collection[bytes]:
        """Every chunk id the snapshot needs, once each, in file order (or as `known_ids`
        says, when a rescan counted them: its counts by id, whose length costs nothing)."""
        if self.known_ids is not None:
            return self.known_ids
        return list(dict.fromkeys(c for e in self for c in e.chunks))

    @property
    def total_bytes(self) -> int:
        return self.file_totals()[1]

    def file_totals(self) -> tuple[int, int]:
        """(files, bytes), counted once (or set by a rescan from the change: `totals`)."""
        if self.totals is None:
            files = [e.size for e in self if e.kind == Kind.FILE]
            self.totals = (len(files), sum(files))
        return self.totals
