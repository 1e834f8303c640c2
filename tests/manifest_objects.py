"""Manifests as the manifest tests build them: a sample holding every kind of entry, folder
objects built unchecked as a hostile peer would (raw_tree), and a tree loaded from its objects.
A helper, not a test file."""

from __future__ import annotations

from helpers import folder_object
from monarch_fs.fs.chunk import CHUNK_SIZE, chunk_id
from monarch_fs.fs.manifest import Entry, Kind, Manifest


def raw_tree(entries, chunk_size: int = CHUNK_SIZE) -> dict[bytes, bytes] | None:
    """entries: flat (path, kind, mode, size, mtime_ns, target, chunks), as a hostile peer
    would turn them into folder objects, unchecked: each folder lists its children in the
    given order, and a child folder's record carries whatever size, target and chunks the entry
    has, after its object id. Returns the objects by id, the root last; None when the entries
    cannot be folder objects at all (no root folder first, or an entry without a parent
    folder)."""
    if not entries or entries[0][0] != b"" or entries[0][1] != Kind.DIR:
        return None
    kids: dict[bytes, list] = {}
    for e in entries[1:]:
        if e[0] == b"":
            return None
        kids.setdefault(e[0].rpartition(b"/")[0], []).append(e)
    folders = {e[0] for e in entries if e[1] == Kind.DIR}
    if any(parent not in folders for parent in kids):
        return None
    objects: dict[bytes, bytes] = {}

    def build(folder) -> bytes:
        records = []
        for path, kind, mode, size, mtime, target, chunks in kids.get(folder[0], []):
            name = path.rpartition(b"/")[2]
            if kind == Kind.DIR:
                oid = build((path, kind, mode, size, mtime, target, chunks))
                records.append((kind, 0, size, 0, name, target, (oid, *chunks)))
            else:
                records.append((kind, mode, size, mtime, name, target, chunks))
        blob = folder_object(records, folder[2], folder[4], chunk_size)
        oid = chunk_id(blob)
        objects[oid] = blob
        return oid

    build(entries[0])
    return objects


def load(objects: dict[bytes, bytes], **kw) -> Manifest:
    """Load the tree whose root is the last of `objects`."""
    return Manifest.load(next(reversed(objects)), objects.__getitem__, **kw)


ROOT = (b"", Kind.DIR, 0o755, 0, 0, b"", ())


def cid(n: int) -> bytes:
    return chunk_id(b"chunk-%d" % n)


def sample_manifest(chunk_size: int = CHUNK_SIZE) -> Manifest:
    return Manifest([
        Entry(b"", Kind.DIR, 0o755, 0, 1),
        Entry(b"pkg", Kind.DIR, 0o755, 0, 2),
        Entry(b"pkg/__init__.py", Kind.FILE, 0o644, 10, 3, chunks=(cid(1),)),
        Entry(b"run.sh", Kind.FILE, 0o755, chunk_size + 1, 4, chunks=(cid(2), cid(3))),
        Entry(b"empty", Kind.FILE, 0o600, 0, -5),
        Entry(b"with space", Kind.FILE, 0o644, 3, 6, chunks=(cid(1),)),
        Entry(b"new\nline", Kind.FILE, 0o644, 3, 7, chunks=(cid(4),)),
        Entry(b"latin-\xe9", Kind.DIR, 0o700, 0, 8),
        Entry(b"latin-\xe9/\xff\xfe", Kind.SYMLINK, 0o777, 13, 9, target=b"/etc/hostname"),
        Entry(b"pkg/up", Kind.SYMLINK, 0o777, 11, 10, target=b"../../../x\n"),
        Entry(b"setuid", Kind.FILE, 0o7777, 1, 11, chunks=(cid(5),)),
    ], chunk_size)
