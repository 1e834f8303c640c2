"""Snapshot manifests: the tree of a pushed folder, as git and CernVM-FS keep one.

Each folder is a content-addressed object (fs/folder.py): its own mode and mtime, then a record
per child in name order (a child folder's record names its object). The root's id is the
version: two pushes of the same tree give the same version, and a change gives new objects only
for the folders on its path, so a push sends, and a node loads, only those
(`Manifest.load(known=...)` takes the rest from the version it loaded before). Objects travel
and are stored as ordinary chunks.

In memory a version is a tree of Folder values, shared whole between the versions that have a
folder unchanged, so an edit costs the folders on its path in memory too; the flat list of
entries in tree order (parents first, each subtree contiguous) is what a scan makes, and is made
from the tree only where a whole pass needs it. What an entry is, and the limits and checks
each is held to, live in fs/entry.py (what the node and client use re-exported here); a
version made from another by listing some folders anew, in fs/manifest_edit.py.
"""

from __future__ import annotations

import bisect
import struct
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from .chunk import CHUNK_SIZE, MAX_CHUNK_SIZE, chunk_id
from .entry import (
    DEFAULT_MAX_ENTRIES,
    MAX_ENTRIES,
    MAX_PATH,
    Entry,
    Kind,
    ManifestError,
    MissingObject,
    TooManyEntries,
    by_name,
    check_entry,
    check_path,
    sort_key,
)
from .folder import _ENTRY, MAGIC, Folder, folder_blob, folder_record, read_tree, record

# What the node and the client take from here; the entry's own limits and path checks are
# fs/entry.py's.
__all__ = ["DEFAULT_MAX_ENTRIES", "MAGIC", "MAX_ENTRIES", "MAX_PATH", "Entry", "Folder", "Kind",
           "Manifest", "ManifestError", "MissingObject", "TooManyEntries", "check_path",
           "sort_key"]


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
            check_entry(e, self.chunk_size)
            seen[e.path] = e.kind

    def _validate_folders(self, known: Collection[bytes]) -> None:
        """validate() of a built manifest, but for the folders whose object id is `known`."""
        entries, root = self.entries, self.root
        longest = max(entries, key=lambda e: len(e.path))
        if len(longest.path) > MAX_PATH:
            check_path(longest.path)
        check_entry(root.entry, self.chunk_size)
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
                check_entry(e, self.chunk_size)
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
        return folder_blob(f.entry, [folder_record(e.name, f.sub[e.name].oid) if e.kind == Kind.DIR
                               else record(e, e.name) for e in f.kids], self.chunk_size)

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
                blob = folder_blob(e, records, cs)
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
        i = bisect.bisect_left(kids, name, key=by_name)
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
        root, chunk_size, read = read_tree(version, get, limit, k_root,
                                           known.chunk_size if known is not None else 0)
        m = cls._of(root, chunk_size)
        m.read_folders = read
        if known is not None and k_root is not None:
            m.base = weakref.ref(known)
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
