"""A version made from another by listing some of its folders anew (a push's rescan after
edits, fs/rescan.py): built at the cost of those folders, every other one taken as it is.

Apart from manifest.py, which holds the tree itself, its encoding and its lookups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .chunk import chunk_id
from .entry import Entry, Kind, ManifestError, by_name, check_entry, check_path
from .folder import Folder, folder_blob, folder_record, record
from .layered import derived
from .manifest import Manifest


class _Making:
    """A folder edited() is making: its entry, its children still to place (in name
    order), and its records, children and child folders so far."""

    __slots__ = ("folder", "todo", "records", "kids", "sub", "last")

    def __init__(self, folder: Entry, kids: Iterable[Entry]):
        self.folder = folder
        self.todo = iter(sorted(kids, key=by_name))
        self.records: list[bytes] = []
        self.kids: list[Entry] = []
        self.sub: dict[bytes, Folder] = {}
        self.last: bytes | None = None  # the last child's name

    def add(self, f: Folder) -> None:
        """A child folder, made or taken whole."""
        name = f.entry.name
        self.records.append(folder_record(name, f.oid))
        self.kids.append(f.entry)
        self.sub[name] = f

    def made(self, chunk_size: int) -> tuple[Folder, bytes]:
        """The Folder, and its object."""
        blob = folder_blob(self.folder, self.records, chunk_size)
        span = 1 + len(self.kids) - len(self.sub) + sum(f.span for f in self.sub.values())
        return Folder(self.folder, chunk_id(blob), tuple(self.kids), self.sub, span), blob



def edited(base: Manifest, folders: Mapping[bytes, tuple[Entry, Sequence[Entry]]]) -> Manifest:
    """`base` with each folder in `folders` (path -> its entry and all its children,
    in any order) listed anew, built at the cost of those folders: every other folder,
    its object included, is taken from `base` as it is. A child folder not in
    `folders` must be one `base` has at that path (a new folder is listed there, and
    so is every folder below it). The folders above a listed one get new objects too.
    What is new is checked as validate() would; the rest was checked before."""
    old_root, old = base.root, base.objects()
    listed = dict(folders)
    for path in folders:  # the folders above a listed one list what they listed before
        while path:
            path = path.rpartition(b"/")[0]
            if path in listed:
                break
            was = base.folder(path)
            if was is None:
                raise ManifestError(f"folder {path!r} is neither listed nor in the tree")
            listed[path] = (was.entry, was.kids)
    if b"" not in listed:
        return base
    cs = base.chunk_size
    blobs: dict[bytes, bytes] = {}
    made = 0

    def enter(path: bytes) -> _Making:
        folder, kids = listed[path]
        if folder.path != path or folder.kind != Kind.DIR:
            raise ManifestError(f"folder {path!r} listed with the entry of {folder.path!r}")
        check_path(path)
        check_entry(folder, cs)
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
            was = base.folder(e.path)
            if was is None:
                raise ManifestError(f"folder {e.path!r} is neither listed nor in the tree")
            top.add(was)
            continue
        check_path(e.path)
        check_entry(e, cs)
        top.records.append(record(e, name))
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
    if base._folders is not None:
        m._folders = base._folders - len(gone) + made
    if base._folders == len(old):
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
