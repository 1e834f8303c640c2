"""fs/manifest.py: the snapshot manifest as a tree of folder objects: a valid one's round trip,
the objects' layout, order and ids, edits and what a version shares with the one before, and
what validate and ids_beyond skip of a known version. Everything validate and load refuse,
fuzzed too: test_manifest_refusals.py."""

from __future__ import annotations

import pytest

from helpers import SMALL, folder_object
from manifest_objects import ROOT, cid, load, raw_tree, sample_manifest
from monarch_fs.fs import manifest_edit
from monarch_fs.fs.chunk import CHUNK_SIZE, chunk_id
from monarch_fs.fs.entry import UnsafePath
from monarch_fs.fs.manifest import Entry, Kind, Manifest, ManifestError


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
