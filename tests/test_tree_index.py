"""fs/inodes.py's Tree made from the version before (the cost of the change): for any edit it is
the index a whole build gives, and its changes are what a whole comparison finds, so the
kernel's invalidations stay exact."""

from __future__ import annotations

import gc
import random

import pytest

from monarch_fs.fs import manifest_edit
from monarch_fs.fs.chunk import chunk_id
from monarch_fs.fs.inodes import Tree, changes
from monarch_fs.fs.manifest import Entry, Kind, Manifest


def cid(n: int) -> bytes:
    return chunk_id(b"chunk-%d" % n)


def start(rng: random.Random, repeats: bool = True) -> dict[bytes, Entry]:
    """A tree of 6 folders of 2 of 3 files; with `repeats`, every file holds the same bytes,
    so folders repeat (one object for several), else none do."""
    tree = {b"": Entry(b"", Kind.DIR, 0o755, 0, 0)}
    for d in range(6):
        folder = b"d%d" % d
        tree[folder] = Entry(folder, Kind.DIR, 0o755, 0, d)
        for sub in range(2):
            inner = folder + b"/s%d" % sub
            tree[inner] = Entry(inner, Kind.DIR, 0o755, 0, sub)
            for f in range(3):
                path = inner + b"/f%d" % f
                r = rng.random()  # (drawn either way: the edits that follow are the same)
                tree[path] = Entry(path, Kind.FILE, 0o644, 5, f,
                                   chunks=(cid(0 if repeats else int(r * 10**9)),))
    tree[b"link"] = Entry(b"link", Kind.SYMLINK, 0o777, 2, 0, b"d0")
    return tree


def below(tree: dict[bytes, Entry], path: bytes) -> list[bytes]:
    return [p for p in tree if p == path or p.startswith(path + b"/")]


def edit(tree: dict[bytes, Entry], rng: random.Random) -> None:
    """One random change of the kinds an edit loop makes."""
    paths = [p for p in tree if p]
    files = [p for p in paths if tree[p].kind == Kind.FILE]
    folders = [p for p in paths if tree[p].kind == Kind.DIR]
    what = rng.choice(["content", "chmod", "add", "remove", "add folder", "remove folder",
                       "move folder", "file to folder", "folder to file", "relink",
                       "folder mtime"])
    n = rng.randrange(10**9)
    if what == "content" and files:
        e = tree[rng.choice(files)]
        tree[e.path] = Entry(e.path, e.kind, e.mode, 6, e.mtime_ns + 1, chunks=(cid(n),))
    elif what == "chmod" and files:
        e = tree[rng.choice(files)]
        tree[e.path] = Entry(e.path, e.kind, 0o600, e.size, e.mtime_ns, chunks=e.chunks)
    elif what == "add":
        parent = rng.choice([b"", *folders])
        path = (parent + b"/" if parent else b"") + b"new%d" % n
        tree[path] = Entry(path, Kind.FILE, 0o644, 1, n, chunks=(cid(n),))
    elif what == "remove" and files:
        del tree[rng.choice(files)]
    elif what == "add folder":
        parent = rng.choice([b"", *folders])
        path = (parent + b"/" if parent else b"") + b"nd%d" % n
        tree[path] = Entry(path, Kind.DIR, 0o755, 0, n)
        tree[path + b"/x"] = Entry(path + b"/x", Kind.FILE, 0o644, 1, 0, chunks=(cid(n),))
    elif what == "remove folder" and folders:
        for p in below(tree, rng.choice(folders)):
            del tree[p]
    elif what == "move folder" and folders:
        src = rng.choice(folders)
        dst = b"moved%d" % n
        for p in below(tree, src):
            e = tree.pop(p)
            q = dst + p[len(src):]
            tree[q] = Entry(q, e.kind, e.mode, e.size, e.mtime_ns, e.target, e.chunks)
    elif what == "file to folder" and files:
        path = rng.choice(files)
        tree[path] = Entry(path, Kind.DIR, 0o755, 0, n)
        tree[path + b"/y"] = Entry(path + b"/y", Kind.FILE, 0o644, 1, 0, chunks=(cid(n),))
    elif what == "folder to file" and folders:
        path = rng.choice(folders)
        for p in below(tree, path):
            del tree[p]
        tree[path] = Entry(path, Kind.FILE, 0o644, 1, n, chunks=(cid(n),))
    elif what == "relink":
        tree[b"link"] = Entry(b"link", Kind.SYMLINK, 0o777, 2, n, b"d%d" % (n % 6))
    elif what == "folder mtime" and folders:
        e = tree[rng.choice(folders)]
        tree[e.path] = Entry(e.path, e.kind, e.mode, 0, e.mtime_ns + 1)


def merged(pairs) -> dict[bytes, tuple]:
    """Changes by path (a path dropped and made again, as a folder that became a file, is one
    change from what was there to what is)."""
    out: dict[bytes, list] = {}
    for a, b in pairs:
        path = (a or b).path
        if path in out:
            out[path][1] = b
        else:
            out[path] = [a, b]
    return {p: (a, b) for p, (a, b) in out.items() if not (a is not None and b is not None
                                                            and a.same_content(b))}


def shape(m: Manifest) -> list:
    """Every folder of `m` as values: entry, object id, children, child folders, span."""
    return [(f.entry, f.oid, f.kids, list(f.sub), f.span) for f in m.folders()]


@pytest.mark.parametrize("seed", range(40))
def test_a_tree_made_from_the_version_before_is_the_whole_build(seed):
    rng = random.Random(seed)
    tree = start(rng, repeats=seed % 2 == 0)
    objects: dict[bytes, bytes] = {}

    def version() -> tuple[bytes, Manifest]:
        m = Manifest(tree.values())
        m.validate()
        objects.update(m.objects())
        return m.id, m

    v, m = version()
    loaded = Manifest.load(v, objects.__getitem__)
    prev = Tree(v, loaded)
    chain = m  # the watch's way: each version edited from the last
    for _ in range(6):
        for _ in range(rng.randint(1, 3)):
            edit(tree, rng)
        v, m = version()
        loaded = Manifest.load(v, objects.__getitem__, known=prev.manifest)
        fast = Tree(v, loaded, prev)
        whole = Tree(v, Manifest.load(v, objects.__getitem__))
        # its folders are the ones a plain load makes, and those it did not read are the
        # version before's own (shared in memory, whole)
        assert loaded.entries == whole.manifest.entries == m.entries
        assert shape(loaded) == shape(whole.manifest) == shape(m)
        read = {id(f) for f in loaded.read_folders}
        for f in loaded.folders():
            if id(f) not in read:
                assert prev.manifest.folder(f.entry.path) is f
        # and so are those of the version before edited in the folders that load read
        edited = chain = manifest_edit.edited(chain, {f.entry.path: (f.entry, f.kids)
                                       for f in loaded.read_folders})
        assert shape(edited) == shape(m) and edited.objects() == m.objects()
        order = {oid: n for n, oid in enumerate(edited.objects())}  # children first
        assert all(order[s.oid] < order[f.oid] for f in edited.folders()
                   for s in f.sub.values())
        assert fast.prev_version == prev.version  # made from it, not built whole
        assert fast.entries.flat() == whole.entries.flat()
        assert fast.children.flat() == whole.children.flat()
        assert fast.total_bytes == whole.total_bytes
        slow = Tree(prev.version, prev.manifest)  # no prev: changes compares whole trees
        assert merged(changes(prev, fast)) == merged(changes(slow, whole))
        prev = fast


def test_an_edit_leaves_no_reference_cycle():
    """A cycle through an edit's closures would keep the index and the entry lists of the whole
    tree alive until a collection (at 100k files, 50 ms to free, in the middle of an edit)."""
    rng = random.Random(7)
    tree = start(rng)
    objects: dict[bytes, bytes] = {}
    m = Manifest(tree.values())
    objects.update(m.objects())
    prev = Tree(m.id, Manifest.load(m.id, objects.__getitem__))
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            edit(tree, rng)
            m = Manifest(tree.values())
            objects.update(m.objects())
            new = Tree(m.id, Manifest.load(m.id, objects.__getitem__, known=prev.manifest), prev)
            assert new.prev_version == prev.version
            changes(prev, new)
            prev = new
            root = {b"": (prev.entries[b""], prev.children[b""])}
            edited = manifest_edit.edited(prev.manifest, root)
            assert edited.id == prev.manifest.id
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_inode_numbers_are_key_hashes_and_collisions_stay_found(monkeypatch):
    """An inode's number is its key's hash; a key whose number is taken gets the next free one,
    and stays found after the node at its home is forgotten (the table keeps no map of every
    key). Every key here hashes to one number, to make the rare case the only case."""
    from monarch_fs.fs import inodes

    table = inodes.InodeTable()
    entry = Entry(b"f", Kind.FILE, 0o644, 1, 0, chunks=(cid(1),))
    a, b, c = (inodes.Node(k, entry, b"ws") for k in (b"key-a", b"key-b", b"key-c"))
    assert table.ino(a) == (inodes._home(b"key-a"), a)  # its hash: the same after a restart
    monkeypatch.setattr(inodes, "_home", lambda key: 5)
    table = inodes.InodeTable()
    assert [table.ino(n)[0] for n in (a, b, c)] == [5, 6, 7]
    assert table.ino(inodes.Node(b"key-b", entry, b"ws")) == (6, b)  # the live node, found
    for n in (a, b, c):
        n.lookups = 1
    table.forget([(5, 1)])  # the one at the home number goes
    assert 5 not in table.nodes
    assert table.ino(b)[0] == 6 and table.known_ino(b"key-c") == 7
    d = inodes.Node(b"key-d", entry, b"ws")
    assert table.ino(d)[0] == 5  # the home number is free again
    table.forget([(6, 1)])
    assert table.known_ino(b"key-b") is None and table.ino(c)[0] == 7
