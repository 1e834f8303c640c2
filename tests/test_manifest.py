"""fs/manifest.py: the snapshot manifest as a tree of folder objects, their layout, and
everything validate and load refuse (unsafe names, malformed records, fields past the kernel's
limits, absurd counts, trees that expand without bound), with hypothesis fuzzing of valid,
arbitrary and mutated objects."""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import FOLDER_HEAD, FOLDER_MAGIC, FUZZ, SMALL, folder_object
from monarch_fs.fs import manifest_edit
from monarch_fs.fs.chunk import CHUNK_SIZE, ID_SIZE, MAX_CHUNK_SIZE, chunk_id
from monarch_fs.fs.entry import MAX_NAME, MAX_PATH, UnsafePath, check_path
from monarch_fs.fs.manifest import (
    Entry,
    Kind,
    Manifest,
    ManifestError,
    MissingObject,
    TooManyEntries,
)


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


def test_load_of_an_edit_takes_every_unchanged_folder_from_the_version_before():
    """A node loads each version knowing the one before: an unchanged folder's subtree is
    taken whole (its entries are the same objects, read from no object), only the folders on
    the edit's path are read, and the result is what a plain load gives."""
    m = sample_manifest()
    known = load(m.objects())
    edited = Manifest([e if e.path != b"pkg/__init__.py" else Entry(e.path, e.kind, e.mode, 11,
                                                                    12, chunks=(cid(9),))
                       for e in m.entries])
    objects = edited.objects()
    read: list[bytes] = []

    def get(oid: bytes) -> bytes:
        read.append(oid)
        return objects[oid]

    back = Manifest.load(edited.id, get, known=known)
    assert back.entries == load(objects).entries == edited.entries and back.id == edited.id
    assert set(read) == set(objects) - set(m.objects())  # the root and pkg: what changed
    assert len(read) == 2
    for path in (b"run.sh", b"latin-\xe9", b"latin-\xe9/\xff\xfe", b"pkg"):
        assert back.get(path) is known.get(path)  # pkg: the same mode and mtime
    assert back.get(b"pkg/__init__.py").chunks == (cid(9),)
    # The same folder elsewhere is not the same subtree: its entries have its new paths.
    moved = Manifest([Entry(b"moved" + e.path[len(b"latin-\xe9"):], *e_rest(e))
                      if e.path.startswith(b"latin-\xe9") else e for e in m.entries])
    back = Manifest.load(moved.id, {**m.objects(), **moved.objects()}.__getitem__, known=known)
    assert back.entries == moved.entries and back.get(b"moved/\xff\xfe").target == b"/etc/hostname"
    # A subtree it does not share is read and checked whole, whatever the known version holds.
    bad = raw_tree([ROOT, (b"pkg", Kind.DIR, 0o755, 0, 2, b"", ()),
                    (b"pkg/__init__.py", Kind.FILE, 0o10644, 10, 3, b"", (cid(1),))])
    with pytest.raises(ManifestError, match="bad mode"):
        load(bad, known=known)


def e_rest(e: Entry) -> tuple:
    return (e.kind, e.mode, e.size, e.mtime_ns, e.target, e.chunks)


def test_manifest_round_trip_keeps_every_field():
    m = sample_manifest()
    m.validate()
    objects = m.objects()
    assert len(objects) == 3 and next(reversed(objects)) == m.id  # a folder each, root last
    back = load(objects)
    assert back.entries == m.entries
    assert back.chunk_size == m.chunk_size and back.id == m.id
    assert back.objects() == objects and back.object_ids() == m.object_ids()
    assert Manifest.load(m.id, lambda oid: memoryview(objects[oid])).entries == m.entries
    assert Manifest.load(m.id, lambda oid: bytearray(objects[oid])).entries == m.entries
    assert back.get(b"latin-\xe9/\xff\xfe").target == b"/etc/hostname"
    assert back.get(b"new\nline").chunks == (cid(4),)
    assert back.get(b"missing") is None
    assert back.get(b"empty").mtime_ns == -5
    assert back.get(b"latin-\xe9").mode == 0o700 and back.get(b"").mtime_ns == 1


def test_folder_objects_match_the_documented_layout():
    m = sample_manifest()
    objects = m.objects()
    latin = folder_object([(Kind.SYMLINK, 0o777, 13, 9, b"\xff\xfe", b"/etc/hostname", ())],
                          0o700, 8)
    pkg = folder_object([(Kind.FILE, 0o644, 10, 3, b"__init__.py", b"", (cid(1),)),
                         (Kind.SYMLINK, 0o777, 11, 10, b"up", b"../../../x\n", ())], 0o755, 2)
    files = {e.name: e for e in m.entries if e.parent == b"" and e.path}
    records = []
    for name in sorted(files):
        e = files[name]
        if e.kind == Kind.DIR:
            oid = chunk_id(latin if name == b"latin-\xe9" else pkg)
            records.append((Kind.DIR, 0, 0, 0, name, b"", (oid,)))
        else:
            records.append((e.kind, e.mode, e.size, e.mtime_ns, name, e.target, e.chunks))
    root = folder_object(records, 0o755, 1)
    assert list(objects.values()) == [pkg, latin, root] or list(objects.values()) == [
        latin, pkg, root]
    assert m.id == chunk_id(root)


def test_manifest_orders_parents_first_and_subtrees_contiguously():
    m = Manifest([
        Entry(b"a-b", Kind.FILE, 0o644, 0, 0),
        Entry(b"a/z", Kind.FILE, 0o644, 0, 0),
        Entry(b"a", Kind.DIR, 0o755, 0, 0),
        Entry(b"", Kind.DIR, 0o755, 0, 0),
        Entry(b"a/b", Kind.DIR, 0o755, 0, 0),
        Entry(b"a/b/c", Kind.FILE, 0o644, 0, 0),
    ])
    m.validate()
    assert [e.path for e in m] == [b"", b"a", b"a/b", b"a/b/c", b"a/z", b"a-b"]


def test_manifest_id_is_deterministic_and_content_sensitive():
    m = sample_manifest()
    shuffled = Manifest(list(reversed(m.entries)), m.chunk_size)
    assert shuffled.objects() == m.objects() and shuffled.id == m.id
    changes = [
        lambda e: Entry(e.path, e.kind, e.mode, e.size, e.mtime_ns + 1, e.target, e.chunks),
        lambda e: Entry(e.path, e.kind, e.mode ^ 0o100, e.size, e.mtime_ns, e.target, e.chunks),
        lambda e: Entry(e.path, e.kind, e.mode, e.size, e.mtime_ns, e.target, (cid(99),)),
        lambda e: Entry(e.path + b"2", e.kind, e.mode, e.size, e.mtime_ns, e.target, e.chunks),
    ]
    ids = {m.id}
    for change in changes:
        entries = [change(e) if e.path == b"pkg/__init__.py" else e for e in m.entries]
        ids.add(Manifest(entries, m.chunk_size).id)
    assert len(ids) == 1 + len(changes)
    assert Manifest(m.entries, SMALL).id != m.id


def test_manifest_helpers():
    m = sample_manifest()
    assert len(m) == len(m.entries) == 11
    # In canonical file order; cid(1) is used by two files and listed once.
    assert m.chunk_ids() == [cid(4), cid(1), cid(2), cid(3), cid(5)]
    assert m.total_bytes == 10 + CHUNK_SIZE + 1 + 3 + 3 + 1
    e = m.get(b"latin-\xe9/\xff\xfe")
    assert e.name == b"\xff\xfe" and e.parent == b"latin-\xe9"
    assert m.get(b"pkg/__init__.py").same_content(m.get(b"pkg/__init__.py"))
    assert not m.get(b"with space").same_content(m.get(b"new\nline"))


UNSAFE_PATHS = [
    b"/abs", b"/", b"..", b"../x", b"a/../b", b"a/..", b".", b"./a", b"a/./b",
    b"a//b", b"a/", b"a\0b", b"\0", b"x" * (MAX_NAME + 1), b"a/" + b"y" * (MAX_NAME + 1),
    b"/".join([b"d" * 200] * 21),  # every name legal, but longer than MAX_PATH
]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_check_path_refuses_paths_that_could_escape(path):
    with pytest.raises(UnsafePath):
        check_path(path)


def test_check_path_accepts_odd_but_safe_names():
    for path in [b"a", b"...", b".hidden", b"a..b", b"x" * MAX_NAME, b"new\nline",
                 b"with space", b"\xff\xfe", b"a/b/c", b"/".join([b"d" * 200] * 20)]:
        check_path(path)
    assert len(b"/".join([b"d" * 200] * 20)) <= MAX_PATH


def test_a_version_shares_its_unchanged_folders_objects():
    """An edit deep in a tree gives new objects only for the folders on its path."""
    entries = [Entry(b"", Kind.DIR, 0o755, 0, 0)]
    for d in range(20):
        entries.append(Entry(b"d%02d" % d, Kind.DIR, 0o755, 0, 0))
        entries += [Entry(b"d%02d/f%d" % (d, i), Kind.FILE, 0o644, 1, 0,
                          chunks=(cid(10 * d + i),)) for i in range(10)]
    before = Manifest(entries)
    edited = Manifest([e if e.path != b"d07/f3" else Entry(e.path, e.kind, e.mode, 1, 1,
                                                           chunks=e.chunks) for e in entries])
    new = set(edited.objects()) - set(before.objects())
    assert len(before.objects()) == len(edited.objects()) == 21
    assert len(new) == 2 and edited.id in new  # d07 and the root
    # Folders with the same contents are one object, wherever they are.
    twins = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), Entry(b"a", Kind.DIR, 0o755, 0, 0),
                      Entry(b"b", Kind.DIR, 0o755, 0, 0)])
    assert len(twins.objects()) == 2 and len(twins.object_ids()) == 3



def test_an_edited_manifest_is_the_whole_build_and_refuses_a_bad_listing():
    """manifest_edit.edited (a rescan's): the folders listed anew, the rest spliced, gives the
    manifest a whole build gives; a listing that names a child twice or one of another folder
    is refused."""
    entries = [Entry(b"", Kind.DIR, 0o755, 0, 0)]
    for d in range(5):
        entries.append(Entry(b"d%d" % d, Kind.DIR, 0o755, 0, 0))
        entries.append(Entry(b"d%d/s" % d, Kind.DIR, 0o755, 0, 0))
        entries += [Entry(b"d%d/s/f%d" % (d, i), Kind.FILE, 0o644, 1, 0,
                          chunks=(cid(10 * d + i),)) for i in range(3)]
    before = Manifest(entries)
    before.validate()
    by_path = {e.path: e for e in entries}
    by_path[b"d2/s/f1"] = Entry(b"d2/s/f1", Kind.FILE, 0o644, 1, 5, chunks=(cid(99),))
    by_path[b"d2/s/new"] = Entry(b"d2/s/new", Kind.DIR, 0o700, 0, 0)
    del by_path[b"d3/s/f0"]
    after = Manifest(sorted(by_path.values(), key=lambda e: e.path.split(b"/")))
    after.validate()

    def listing(path: bytes) -> tuple[Entry, list[Entry]]:
        return by_path[path], [e for e in by_path.values() if e.path and e.parent == path]

    edited = manifest_edit.edited(before, {p: listing(p) for p in (b"d2/s", b"d2/s/new", b"d3/s")})
    assert edited.id == after.id and edited.entries == after.entries
    assert edited.objects() == after.objects()
    assert edited.new_objects == set(after.objects()) - set(before.objects())
    folder, kids = listing(b"d2/s")
    with pytest.raises(ManifestError, match="twice"):
        manifest_edit.edited(before, {b"d2/s": (folder, kids + kids[:1])})
    with pytest.raises(ManifestError, match="listed in folder"):
        manifest_edit.edited(before, {b"d2/s": (folder, kids + [by_path[b"d1/s/f0"]])})


def _with_parents(path: bytes) -> list[tuple]:
    """ROOT, a DIR entry for every proper prefix of `path` (that is itself safe), and `path`."""
    out, parts = [ROOT], path.split(b"/")
    for i in range(1, len(parts)):
        prefix = b"/".join(parts[:i])
        try:
            check_path(prefix)
        except UnsafePath:
            break
        if not prefix:  # "/abs": its parent is the root itself
            break
        out.append((prefix, Kind.DIR, 0o755, 0, 0, b"", ()))
    out.append((path, Kind.FILE, 0o644, 0, 0, b"", ()))
    return out


UNSAFE_NAMES = [b"", b".", b"..", b"a/b", b"/abs", b"../x", b"a\0b", b"x" * (MAX_NAME + 1)]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
@pytest.mark.parametrize("depth", [0, 2])
def test_unsafe_names_are_refused_by_load_in_any_folder(name, depth):
    """A hostile peer's folder object, at the root or deeper, names a child that could
    escape the mount or that the kernel cannot take."""
    records = [(Kind.FILE, 0o644, 0, 0, name, b"", ())]
    objects: dict[bytes, bytes] = {}
    for _ in range(depth):
        inner = folder_object(records)
        objects[chunk_id(inner)] = inner
        records = [(Kind.DIR, 0, 0, 0, b"sub", b"", (chunk_id(inner),))]
    root = folder_object(records)
    objects[chunk_id(root)] = root
    with pytest.raises(ManifestError, match="unsafe path|duplicate"):
        load(objects)


def test_a_path_longer_than_the_kernel_takes_is_refused():
    """Every name is legal, but nesting makes the path longer than MAX_PATH."""
    name = b"d" * 200
    objects: dict[bytes, bytes] = {}
    records = [(Kind.FILE, 0o644, 0, 0, b"f", b"", ())]
    for _ in range(21):
        blob = folder_object(records)
        objects[chunk_id(blob)] = blob
        records = [(Kind.DIR, 0, 0, 0, name, b"", (chunk_id(blob),))]
    root = folder_object(records)
    objects[chunk_id(root)] = root
    with pytest.raises(UnsafePath, match="too long"):
        load(objects)


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_unsafe_paths_are_refused_by_validate(path):
    entries = _with_parents(path)
    m = Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries])
    with pytest.raises(UnsafePath):
        m.validate()


def test_unsafe_path_is_a_manifest_error_and_a_value_error():
    assert issubclass(UnsafePath, ManifestError) and issubclass(ManifestError, ValueError)


def _bad(entries, **kw) -> None:
    """validate() refuses `entries`, and so does load() of the folder objects a hostile peer
    would build from them (when they can be folder objects at all)."""
    chunk_size = kw.get("chunk_size", CHUNK_SIZE)
    for known in ((), {cid(999)}):  # the whole check, and the one that skips known folders
        with pytest.raises(ManifestError):
            Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries],
                     chunk_size).validate(known)
    objects = raw_tree(entries, chunk_size)
    if objects is not None:
        with pytest.raises(ManifestError):
            load(objects)


def test_missing_or_wrong_parents_are_refused():
    _bad([ROOT, (b"a/b", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 0, 0, b"", ()), (b"f/x", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 1, 0, b"d", ()),
          (b"l/x", Kind.FILE, 0o644, 0, 0, b"", ())])
    with pytest.raises(ManifestError, match="no parent"):  # nothing to be listed in
        Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), Entry(b"a/b", Kind.FILE, 0o644, 0, 0)]
                 ).objects()


def test_missing_or_wrong_root_is_refused():
    _bad([])
    _bad([(b"a", Kind.DIR, 0o755, 0, 0, b"", ())])
    _bad([(b"", Kind.FILE, 0o644, 0, 0, b"", ())])
    with pytest.raises(ManifestError, match="no root"):
        Manifest([Entry(b"a", Kind.DIR, 0o755, 0, 0)]).objects()


def test_duplicates_are_refused():
    f = (b"a", Kind.FILE, 0o644, 0, 0, b"", ())
    _bad([ROOT, f, f])
    _bad([ROOT, ROOT])
    _bad([ROOT, (b"a", Kind.DIR, 0o755, 0, 0, b"", ()), f])
    with pytest.raises(ManifestError, match=r"duplicate entry b'a'"):
        load(raw_tree([ROOT, f, f]))


@pytest.mark.parametrize("size,nchunks", [(1, 0), (0, 1), (CHUNK_SIZE + 1, 1),
                                          (CHUNK_SIZE, 2), (3 * CHUNK_SIZE, 4)])
def test_wrong_chunk_counts_are_refused(size, nchunks):
    _bad([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(cid(i) for i in range(nchunks)))])


def test_right_chunk_counts_are_accepted():
    for size, n in [(0, 0), (1, 1), (SMALL, 1), (SMALL + 1, 2), (3 * SMALL, 3)]:
        objects = raw_tree([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(
            cid(i) for i in range(n)))], SMALL)
        assert load(objects).get(b"f").size == size


def test_other_malformed_entries_are_refused():
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 0, 0, b"", (cid(1),))])  # chunks on a dir
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 1, 0, b"x", (cid(1),))])  # chunks on a link
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 0, 0, b"target", ())])  # target on a file
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 0, 0, b"", ())])  # empty target
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 3, 0, b"a\0b", ())])  # NUL in target
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 0, 0, b"t" * (MAX_PATH + 1), ())])
    _bad([ROOT, (b"f", Kind.FILE, 0o10644, 0, 0, b"", ())])  # mode beyond 0o7777
    _bad([ROOT], chunk_size=SMALL - 1)
    _bad([ROOT], chunk_size=MAX_CHUNK_SIZE + 1)
    for kind in (0, 4, 255):
        with pytest.raises(ManifestError):
            load(raw_tree([ROOT, (b"x", kind, 0o644, 0, 0, b"", ())]))


def test_fields_past_what_the_kernel_takes_are_refused():
    """Issue 16, finding 4: a directory of size 2^64-1 passed, and the first `ls` of it raised
    OverflowError inside a FUSE handler. Every field is now held to the kernel's limits."""
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 2**64 - 1, 0, b"", ())])
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 4096, 0, b"", ())])  # a directory's size is 0
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 2**64 - 1, 0, b"t", ())])
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 2, 0, b"t", ())])  # size = the target's length
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 4096, 0, b"t" * 4096, ())])  # readlink: < PATH_MAX
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 2**64 - 1, 0, b"", (cid(1),))])
    _bad([ROOT, (b"f", Kind.FILE, 2**32 - 1, 0, 0, b"", ())])
    for bad in (Entry(b"f", Kind.FILE, 0o644, 0, 2**63),
                Entry(b"f", Kind.FILE, 0o644, 0, -(2**63) - 1),
                Entry(b"f", Kind.FILE, -1, 0, 0), Entry(b"f", Kind.FILE, 0o644, -1, 0)):
        with pytest.raises(ManifestError, match="b'f'"):  # not encodable: validate() only
            Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), bad]).validate()
    with pytest.raises(ManifestError, match=r"directory b'd': size 18446744073709551615"):
        Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"d", Kind.DIR, 0o755, 2**64 - 1, 0)]).validate()
    with pytest.raises(ManifestError, match=r"directory b'd': a folder's record"):
        load(raw_tree([ROOT, (b"d", Kind.DIR, 0o755, 2**64 - 1, 0, b"", ())]))


def test_fields_at_the_kernel_limits_are_accepted():
    m = load(raw_tree([
        (b"", Kind.DIR, 0o7777, 0, -(2**63), b"", ()),
        (b"l", Kind.SYMLINK, 0, 4095, 2**63 - 1, b"t" * 4095, ()),
        (b"n" * MAX_NAME, Kind.FILE, 0o7777, SMALL + 1, 0, b"", (cid(1), cid(2))),
    ], SMALL))
    assert [e.size for e in m] == [0, 4095, SMALL + 1]


def test_every_truncation_and_any_trailing_bytes_are_refused():
    objects = sample_manifest().objects()
    for oid, blob in objects.items():  # the root and a folder inside
        for n in range(len(blob)):
            with pytest.raises(ManifestError):
                load({**objects, oid: blob[:n]})
        with pytest.raises(ManifestError):
            load({**objects, oid: blob + b"\0"})


def test_bad_magic_is_refused():
    objects = sample_manifest().objects()
    for oid, blob in objects.items():
        for magic in (b"MFSD\x02", b"MFSM\x01", b"\0" * 5):
            with pytest.raises(ManifestError, match="magic"):
                load({**objects, oid: magic + blob[5:]})


def test_non_canonical_order_is_refused():
    a = (Kind.FILE, 0o644, 0, 0, b"a", b"", ())
    b = (Kind.FILE, 0o644, 0, 0, b"b", b"", ())

    def root(*records) -> dict[bytes, bytes]:
        blob = folder_object(list(records))
        return {chunk_id(blob): blob}

    assert [e.path for e in load(root(a, b))] == [b"", b"a", b"b"]
    with pytest.raises(ManifestError, match="order"):
        load(root(b, a))
    d = (b"d", Kind.DIR, 0o755, 0, 0, b"", ())
    dx = (b"d/x", Kind.FILE, 0o644, 0, 0, b"", ())
    dash = (b"d-", Kind.FILE, 0o644, 0, 0, b"", ())  # byte order would put it before d/x
    assert [e.path for e in load(raw_tree([ROOT, d, dx, dash]))] == [b"", b"d", b"d/x", b"d-"]
    with pytest.raises(ManifestError, match="order"):
        load(raw_tree([ROOT, dash, d, dx]))  # the root lists d- before d


def test_a_folder_of_another_chunk_size_is_refused():
    inner = folder_object([], chunk_size=SMALL)
    root = folder_object([(Kind.DIR, 0, 0, 0, b"d", b"", (chunk_id(inner),))])
    with pytest.raises(ManifestError, match="chunk size"):
        load({chunk_id(inner): inner, chunk_id(root): root})


_ABSURD = r"""
import resource, struct, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))
from monarch_fs.fs.chunk import chunk_id
from monarch_fs.fs.manifest import MAGIC, Kind, Manifest, ManifestError
HEAD, ENTRY, CS = struct.Struct("<5sIIqI"), struct.Struct("<BIQqHHI"), 4 << 20
def head(count):
    return HEAD.pack(MAGIC, CS, 0o755, 0, count)
cases = {
    "10M children in 20 bytes": head(10_000_000) + bytes(7),
    "4G children, no body": head(2**32 - 1),
    "4G chunk ids": head(1) + ENTRY.pack(Kind.FILE, 0o644, 0, 0, 1, 0, 2**32 - 1) + bytes(64),
    "64K name and target": head(1) + ENTRY.pack(Kind.FILE, 0o644, 0, 0, 65535, 65535, 0)
                           + bytes(64),
    "1000 records of 4G chunks": head(1000) + ENTRY.pack(Kind.FILE, 0o644, 2**64 - 1, 0, 0, 0,
                                                         2**32 - 1) * 1000,
}
for name, data in cases.items():
    tracemalloc.start()
    t = time.perf_counter()
    try:
        Manifest.load(chunk_id(data), lambda oid: data)
    except ManifestError:
        pass
    else:
        sys.exit(f"{name}: accepted")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if time.perf_counter() - t > 0.5 or peak > 1 << 20:
        sys.exit(f"{name}: {time.perf_counter() - t:.2f} s, {peak} bytes allocated")
"""


def test_absurd_counts_fail_fast_without_allocating():
    """Headers and records that claim far more than the object holds fail at once, without
    allocating for the claim (in a child with a 1 GiB address-space limit and a timeout, so a
    regression fails the test instead of exhausting the machine)."""
    proc = subprocess.run([sys.executable, "-c", _ABSURD], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_a_tree_that_names_one_folder_many_times_stops_at_the_entry_limit():
    """Objects are content-addressed, so a hostile tree can name one folder many times: 100
    folders of 100 folders of 100 files is a million entries from three small objects. The
    entries are counted as they are made, and the load stops at the limit."""
    leaf = folder_object([(Kind.FILE, 0o644, 0, 0, b"f%03d" % i, b"", ()) for i in range(100)])
    mid = folder_object([(Kind.DIR, 0, 0, 0, b"m%03d" % i, b"", (chunk_id(leaf),))
                         for i in range(100)])
    root = folder_object([(Kind.DIR, 0, 0, 0, b"r%03d" % i, b"", (chunk_id(mid),))
                          for i in range(100)])
    objects = {chunk_id(b): b for b in (leaf, mid, root)}
    with pytest.raises(TooManyEntries, match="more than the limit of 50,000"):
        load(objects, max_entries=50_000)


def test_a_missing_object_is_named_with_its_folder():
    m = sample_manifest()
    objects = dict(m.objects())
    pkg = next(oid for oid, blob in objects.items() if b"__init__.py" in blob)
    del objects[pkg]
    with pytest.raises(MissingObject) as e:
        load(objects)
    assert e.value.oid == pkg and e.value.path == b"pkg" and isinstance(e.value, KeyError)


# Hypothesis: valid manifests, their objects, and arbitrary or mutated objects.

_names = st.binary(min_size=1, max_size=16).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
_ids = st.binary(min_size=ID_SIZE, max_size=ID_SIZE)


@st.composite
def manifests(draw) -> Manifest:
    chunk_size = draw(st.sampled_from([SMALL, CHUNK_SIZE, MAX_CHUNK_SIZE]))
    mtimes = st.integers(-(2**63), 2**63 - 1)
    entries = [Entry(b"", Kind.DIR, draw(st.integers(0, 0o7777)), 0, draw(mtimes))]
    dirs, seen = [b""], {b""}
    for _ in range(draw(st.integers(0, 10))):
        parent = draw(st.sampled_from(dirs))
        name = draw(_names)
        path = parent + b"/" + name if parent else name
        if path in seen:
            continue
        seen.add(path)
        kind = draw(st.sampled_from(Kind))
        mode = draw(st.integers(0, 0o7777))
        mtime = draw(mtimes)
        if kind == Kind.DIR:
            entries.append(Entry(path, kind, mode, 0, mtime))
            dirs.append(path)
        elif kind == Kind.FILE:
            n = draw(st.integers(0, 3))
            size = draw(st.integers((n - 1) * chunk_size + 1, n * chunk_size)) if n else 0
            chunks = tuple(draw(_ids) for _ in range(n))
            entries.append(Entry(path, kind, mode, size, mtime, chunks=chunks))
        else:
            target = draw(st.binary(min_size=1, max_size=40).filter(lambda b: b"\0" not in b))
            entries.append(Entry(path, kind, mode, len(target), mtime, target))
    order = draw(st.permutations(range(len(entries))))
    return Manifest([entries[i] for i in order], chunk_size)


@pytest.mark.slow
@FUZZ
@given(manifests())
def test_fuzz_valid_manifests_round_trip(m):
    m.validate()
    back = load(m.objects())
    assert back.entries == m.entries and back.chunk_size == m.chunk_size
    assert back.objects() == m.objects() and back.id == m.id


def _load_only_manifest_errors(root: bytes, objects: dict[bytes, bytes]) -> None:
    """Load a tree whose root object is `root` (stored under the id it claims to have, as a
    store that did not check would): only a ManifestError, or a MissingObject for a folder it
    names that is not there. Whatever is accepted is canonical: it encodes back to `root`."""
    oid = chunk_id(b"claimed")
    try:
        m = Manifest.load(oid, {**objects, oid: root}.__getitem__)
    except (ManifestError, MissingObject):
        return
    again = Manifest(m.entries, m.chunk_size).objects()
    assert list(again.values())[-1] == bytes(root)


@FUZZ
@given(st.one_of(st.binary(max_size=400),
                 st.binary(max_size=400).map(lambda b: FOLDER_MAGIC + b),
                 st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                           st.binary(max_size=400)).map(
                     lambda t: FOLDER_HEAD.pack(FOLDER_MAGIC, t[0], 0o755, 0, t[1]) + t[2])))
def test_fuzz_load_of_arbitrary_bytes_raises_only_manifest_error(data):
    _load_only_manifest_errors(data, {})


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=24)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.sampled_from(
        [0, 1, 255, 256, 4095, 4096, 65535, 2**31, 2**32 - 1])),
    st.tuples(st.just("u16"), st.integers(0, 10**6), st.sampled_from([0, 1, 255, 256, 65535])),
)


def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, arg in ops:
        i = pos % (len(b) + 1)
        if op == "flip" and i < len(b):
            b[i] ^= arg
        elif op == "cut":
            del b[i:i + arg % 64 + 1]
        elif op == "insert":
            b[i:i] = arg
        elif op == "u32" and i + 4 <= len(b):
            b[i:i + 4] = struct.pack("<I", arg)
        elif op == "u16" and i + 2 <= len(b):
            b[i:i + 2] = struct.pack("<H", arg)
    return bytes(b)


@pytest.mark.slow
@FUZZ
@given(manifests(), st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_load_of_mutated_objects_raises_only_manifest_error(m, ops):
    objects = m.objects()
    root = _mutate(objects[m.id], ops)
    tracemalloc.start()
    try:
        _load_only_manifest_errors(root, objects)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 20 * sum(map(len, objects.values()))


def test_validate_skips_known_folders_but_not_what_changed():
    """validate(known): the folders an earlier check passed are not checked again, yet a bad
    entry in a changed folder is refused, and so is a path that a renamed parent made too
    long (its own folder unchanged and known)."""
    def tree(top: bytes, extra: list[Entry] = ()) -> Manifest:
        return Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), Entry(top, Kind.DIR, 0o755, 0, 0),
                         Entry(top + b"/" + b"n" * 200, Kind.DIR, 0o755, 0, 0),
                         Entry(top + b"/" + b"n" * 200 + b"/f", Kind.FILE, 0o644, 1, 0,
                               chunks=(cid(1),)),
                         Entry(b"other", Kind.DIR, 0o755, 0, 0), *extra])
    before = tree(b"a")
    before.validate()
    known = set(before.object_ids())
    after = tree(b"a", [Entry(b"other/g", Kind.FILE, 0o644, 0, 0)])
    after.validate(known)  # a valid edit passes
    assert len(set(after.object_ids()) - known) == 2  # "other" and the root: what was checked
    bad = tree(b"a", [Entry(b"other/g", Kind.FILE, 0o644, 5, 0)])  # 5 bytes in no chunk
    with pytest.raises(ManifestError, match="other/g"):
        bad.validate(known)
    deep = b"/".join([b"d" * 250] * 16)  # "a", renamed deep down: its paths pass MAX_PATH
    moved = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0)] + [
        Entry(deep[:i], Kind.DIR, 0o755, 0, 0) for i in range(250, len(deep), 251)
    ] + tree(deep).entries[1:4])
    assert before.object_ids()[1] in moved.object_ids()  # "a"'s object, unchanged and known
    with pytest.raises(UnsafePath, match="too long"):
        moved.validate(known)


def test_ids_beyond_another_version_are_its_new_folders_and_their_files_chunks():
    """What a push asks nodes that serve an earlier version about: the folder objects that
    version lacks, and the chunks of the files directly in them, found without walking the
    unchanged subtrees."""
    def tree(extra: list[Entry]) -> Manifest:
        return Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                         Entry(b"a", Kind.DIR, 0o755, 0, 0),
                         Entry(b"a/f", Kind.FILE, 0o644, 1, 0, chunks=(cid(1),)),
                         Entry(b"a/g", Kind.FILE, 0o644, 1, 0, chunks=(cid(2),)),
                         Entry(b"b", Kind.DIR, 0o755, 0, 0),
                         Entry(b"b/h", Kind.FILE, 0o644, 1, 0, chunks=(cid(3),)), *extra])
    before = tree([])
    after = tree([Entry(b"b/new", Kind.FILE, 0o644, 1, 0, chunks=(cid(4),))])
    root, a, b = after.object_ids()
    assert a in before.object_ids() and b not in before.object_ids()
    assert set(after.ids_beyond(set(before.object_ids()))) == {root, b, cid(3), cid(4)}
    assert after.ids_beyond(set(after.object_ids())) == []
    assert set(after.ids_beyond(set())) == {*after.objects(), *after.chunk_ids()}


def _children_first(m: Manifest) -> bool:
    """Whether every folder's object comes after its child folders' in m.objects()."""
    order = {oid: n for n, oid in enumerate(m.objects())}
    return all(order[s.oid] < order[f.oid] for f in m.folders() for s in f.sub.values())


def test_an_edit_drops_the_objects_of_what_it_replaced_and_keeps_a_shared_one():
    """manifest_edit.edited's objects are the whole build's, children first: a folder the edit
    removed takes its object with it, unless another folder has the same object."""
    root = Entry(b"", Kind.DIR, 0o755, 0, 0)

    def folder(name: bytes, mtime: int) -> list[Entry]:
        return [Entry(name, Kind.DIR, 0o755, 0, mtime),
                Entry(name + b"/f", Kind.FILE, 0o644, 1, 0, chunks=(cid(1),))]

    for b_mtime in (5, 6):  # b the same as a (one object for both), or not
        m = Manifest([root, *folder(b"a", 5), *folder(b"b", b_mtime), *folder(b"c", 7)])
        m.objects()
        edited = manifest_edit.edited(m, {b"": (root, [m.get(b"b"), m.get(b"c")])})  # a removed
        whole = Manifest([root, *folder(b"b", b_mtime), *folder(b"c", 7)])
        assert dict(edited.objects()) == whole.objects() and edited.id == whole.id
        assert _children_first(edited)
        again = manifest_edit.edited(edited, {b"c": (edited.get(b"c"), [
            Entry(b"c/g", Kind.FILE, 0o644, 1, 0, chunks=(cid(2),))])})
        assert dict(again.objects()) == Manifest(
            [root, *folder(b"b", b_mtime), Entry(b"c", Kind.DIR, 0o755, 0, 7),
             Entry(b"c/g", Kind.FILE, 0o644, 1, 0, chunks=(cid(2),))]).objects()
        assert _children_first(again)
