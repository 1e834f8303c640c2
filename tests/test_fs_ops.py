"""fs/fuse_ops.py's SnapshotFS without a mount (as S3QL's tests/t3_fs_api.py does): built over a
real Store holding the chunks of real manifests scanned from a folder, its request handlers
called directly under trio. Nothing is mounted (`mounted` stays False, so a version change
invalidates nothing in a kernel); what the kernel would see is what the handlers answer.

readdir answers through pyfuse3.readdir_reply into the kernel's buffer (a token only a real
request has): here readdir_reply is replaced by a recorder, which stands for that buffer."""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest

from helpers import SMALL, flip_bits
from monarch_fs.fs import fuse_ops, handler_guard
from monarch_fs.fs.fuse_ops import SnapshotFS
from monarch_fs.fs.inodes import VERSIONS
from monarch_fs.fs.manifest import Manifest
from monarch_fs.fs.scan import scan
from monarch_fs.fs.store import Store

ROOT = pyfuse3.ROOT_INODE
BIG = os.urandom(3 * SMALL + 17)  # four chunks, the last one 17 bytes
T0 = 1_700_000_000_000_000_000  # fixed mtimes (ns): which entries changed is then exact


def make_source(src: Path) -> None:
    """A folder with every kind of entry, with fixed mtimes."""
    (src / "pkg").mkdir(parents=True)
    files = {"hello.txt": b"hello\n", "big.bin": BIG, "empty": b"", "private": b"secret",
             "pkg/__init__.py": b"VALUE = 1\n", "pkg/mod.py": b"x = 1\n"}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    (src / "private").chmod(0o600)
    os.symlink("pkg/mod.py", src / "link")
    for i, rel in enumerate([*files, "link", "pkg", "."]):
        os.utime(src / rel, ns=(T0, T0 + i), follow_symlinks=False)


async def snapshot(src: Path, store: Store) -> tuple[bytes, Manifest]:
    """Scan `src`, put its chunks in `store`: (version, manifest), as a publish leaves them."""
    snap = await scan(src, chunk_size=SMALL)
    for cid in snap.manifest.chunk_ids():
        assert store.put(snap.read_chunk(cid)) == cid
    return snap.manifest.id, snap.manifest


@dataclass
class Served:
    fs: SnapshotFS
    store: Store
    src: Path
    v1: tuple[bytes, Manifest]

    async def edit_and_publish(self) -> tuple[bytes, Manifest]:
        """Version 2 of `ws`: pkg/mod.py changed, `empty` removed, new.txt added, the rest as
        it was; served with version 1 kept under .versions."""
        v2 = await self.edit()
        await self.fs.set_workspace(b"ws", [v2, self.v1])
        return v2

    async def edit(self) -> tuple[bytes, Manifest]:
        src = self.src
        (src / "pkg" / "mod.py").write_bytes(b"x = 2\n")
        (src / "empty").unlink()
        (src / "new.txt").write_bytes(b"new\n")
        for rel, ns in [("pkg/mod.py", T0 + 100), ("new.txt", T0 + 101), ("pkg", T0 + 7),
                        (".", T0 + 102)]:
            os.utime(src / rel, ns=(T0, ns))
        return await snapshot(src, self.store)


@pytest.fixture
async def served(tmp_path):
    """Workspace `ws` at version 1 (make_source), served by a SnapshotFS over a real Store."""
    src = tmp_path / "src"
    make_source(src)
    store = Store(tmp_path / "store")
    try:
        fs = SnapshotFS(store.get, None, store.get_if_cached)
        v1 = await snapshot(src, store)
        await fs.set_workspace(b"ws", [v1])
        yield Served(fs, store, src, v1)
    finally:
        store.close()


async def lookup(fs: SnapshotFS, path: bytes, parent: int = ROOT) -> pyfuse3.EntryAttributes:
    """Look `path` up one name at a time, as the kernel does; fail if a name is absent."""
    attr, ino = None, parent
    for name in path.split(b"/"):
        attr = await fs.lookup(ino, name)
        assert attr.st_ino, f"{path!r}: {name!r} is absent"
        ino = attr.st_ino
    return attr


async def ino_of(fs: SnapshotFS, path: bytes) -> int:
    return (await lookup(fs, path)).st_ino


async def read(fs: SnapshotFS, ino: int, off: int = 0, size: int = 1 << 20) -> bytes:
    return bytes(await fs.read(ino, off, size))


async def fuse_errno(call) -> int:
    """The errno a handler answers with (it must answer with one)."""
    with pytest.raises(pyfuse3.FUSEError) as e:
        await call
    return e.value.errno


# ---- lookup, getattr, readlink -------------------------------------------------------------

@pytest.mark.parametrize("rel", ["hello.txt", "big.bin", "empty", "private", "link", "pkg",
                                 "pkg/mod.py"])
async def test_lookup_and_getattr_show_each_entry_as_the_source_has_it(served, rel):
    fs = served.fs
    attr = await lookup(fs, b"ws/" + rel.encode())
    st = os.lstat(served.src / rel)
    for a in (attr, await fs.getattr(attr.st_ino)):
        assert a.st_mode == st.st_mode
        assert a.st_size == (0 if stat.S_ISDIR(st.st_mode) else st.st_size)
        assert a.st_mtime_ns == st.st_mtime_ns
        assert a.st_nlink == (2 if stat.S_ISDIR(st.st_mode) else 1)
        assert (a.st_uid, a.st_gid) == (os.getuid(), os.getgid())
        assert a.st_ino == attr.st_ino
        # Snapshots never change: the kernel may cache for long (changes are invalidated).
        assert a.entry_timeout == a.attr_timeout == fuse_ops.TIMEOUT


async def test_the_root_holds_the_workspaces_and_versions(served):
    fs = served.fs
    root = await fs.getattr(ROOT)
    assert stat.S_ISDIR(root.st_mode) and root.st_ino == ROOT
    assert stat.S_ISDIR((await lookup(fs, VERSIONS)).st_mode)
    version = served.v1[0].hex().encode()
    by_version = await lookup(fs, b".versions/ws/" + version + b"/hello.txt")
    assert await read(fs, by_version.st_ino) == b"hello\n"
    assert (await fs.lookup(ROOT, b".")).st_ino == ROOT


async def test_lookup_errors(served):
    fs = served.fs
    hello = await ino_of(fs, b"ws/hello.txt")
    assert await fuse_errno(fs.lookup(hello, b"x")) == errno.ENOTDIR
    assert await fuse_errno(fs.lookup(ROOT, b"..")) == errno.ENOENT  # the kernel resolves '..'
    unknown = 12345
    assert unknown not in fs.table.nodes
    assert await fuse_errno(fs.lookup(unknown, b"x")) == errno.ENOENT
    assert await fuse_errno(fs.getattr(unknown)) == errno.ENOENT
    assert await fuse_errno(fs.read(unknown, 0, 10)) == errno.ENOENT
    # An absent name is a negative entry the kernel keeps (Python's imports probe many names)
    ws = await ino_of(fs, b"ws")
    for parent, name in [(ws, b"nope"), (ROOT, b"nope"), (await ino_of(fs, b".versions"), b"x")]:
        absent = await fs.lookup(parent, name)
        assert absent.st_ino == 0 and absent.entry_timeout == fuse_ops.TIMEOUT
    assert (await fs.lookup(ws, b".")).st_ino == ws
    assert fs.ops["failed"] == 0


async def test_readlink(served):
    fs = served.fs
    assert await fs.readlink(await ino_of(fs, b"ws/link"), None) == b"pkg/mod.py"
    hello = await ino_of(fs, b"ws/hello.txt")
    assert await fuse_errno(fs.readlink(hello, None)) == errno.EINVAL


# ---- open, read --------------------------------------------------------------------------------

async def test_open_is_read_only_and_only_for_files(served):
    fs = served.fs
    hello = await ino_of(fs, b"ws/hello.txt")
    info = await fs.open(hello, os.O_RDONLY, None)
    assert info.fh == hello and info.keep_cache  # the handle is the inode; pages are kept
    await fs.release(hello)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_APPEND, os.O_RDONLY | os.O_TRUNC,
                  os.O_WRONLY | os.O_CREAT):
        assert await fuse_errno(fs.open(hello, flags, None)) == errno.EROFS
    assert await fuse_errno(fs.open(await ino_of(fs, b"ws/pkg"), os.O_RDONLY, None)) == \
        errno.EISDIR
    assert await fuse_errno(fs.open(await ino_of(fs, b"ws/link"), os.O_RDONLY, None)) == \
        errno.EINVAL
    # opendir: only directories; with no-opendir the kernel keeps listings itself
    pkg = await ino_of(fs, b"ws/pkg")
    assert await fs.opendir(pkg, None) == pkg
    assert await fuse_errno(fs.opendir(hello, None)) == errno.ENOTDIR
    fs.no_open = fs.no_opendir = True
    assert await fuse_errno(fs.open(hello, os.O_RDONLY, None)) == errno.ENOSYS
    assert await fuse_errno(fs.opendir(pkg, None)) == errno.ENOSYS


@pytest.mark.parametrize("off, size", [
    (0, 1 << 20),  # the whole file in one request
    (0, SMALL),  # exactly the first chunk
    (SMALL - 5, 10),  # across a chunk boundary
    (SMALL, SMALL),  # exactly the second chunk
    (SMALL - 1, 2 * SMALL + 2),  # three chunks
    (3 * SMALL, 100),  # the short last chunk, asked for more than it holds
    (3 * SMALL + 16, 5),  # its last byte
    (3 * SMALL + 17, 10),  # at the end
    (10 * SMALL, 10),  # past the end
])
async def test_read_answers_the_bytes_at_any_offset(served, off, size):
    fs = served.fs
    big = await ino_of(fs, b"ws/big.bin")
    assert await read(fs, big, off, size) == BIG[off:off + size]


async def test_read_of_small_and_empty_files(served):
    fs = served.fs
    assert await read(fs, await ino_of(fs, b"ws/empty")) == b""
    assert await read(fs, await ino_of(fs, b"ws/pkg/mod.py")) == b"x = 1\n"
    assert await read(fs, await ino_of(fs, b"ws/hello.txt"), 2, 2) == b"ll"


async def test_a_damaged_chunk_is_an_eio_never_wrong_bytes(served):
    fs = served.fs
    (cid,) = served.v1[1].get(b"hello.txt").chunks
    path, off, length = served.store.locate(cid)
    flip_bits(path, off + length - 1, 0x01)
    hello = await ino_of(fs, b"ws/hello.txt")
    assert await fuse_errno(fs.read(hello, 0, 100)) == errno.EIO
    assert fs.ops["failed"] == 0  # refused by read itself, not by the guard
    assert await read(fs, await ino_of(fs, b"ws/pkg/mod.py")) == b"x = 1\n"  # the rest reads


# ---- extended attributes, statfs -----------------------------------------------------------

async def test_xattrs_tell_what_is_read(served):
    fs = served.fs
    version, manifest = served.v1
    hello = await ino_of(fs, b"ws/hello.txt")
    expected = {b"user.monarch.workspace": b"ws",
                b"user.monarch.version": version.hex().encode(),
                b"user.monarch.chunks": " ".join(
                    c.hex() for c in manifest.get(b"hello.txt").chunks).encode()}
    assert set(await fs.listxattr(hello, None)) == set(expected)
    for name, value in expected.items():
        assert await fs.getxattr(hello, name, None) == value
    big = await ino_of(fs, b"ws/big.bin")
    assert len((await fs.getxattr(big, b"user.monarch.chunks", None)).split()) == 4
    pkg = await ino_of(fs, b"ws/pkg")
    assert set(await fs.listxattr(pkg, None)) == {b"user.monarch.workspace",
                                                  b"user.monarch.version"}
    assert await fuse_errno(fs.getxattr(hello, b"user.other", None)) == pyfuse3.ENOATTR
    # the root tells what is served and how busy the mount has been
    assert await fs.getxattr(ROOT, b"user.monarch.workspaces", None) == \
        b"ws=" + version.hex().encode()
    await read(fs, hello)
    ops = dict(kv.split(b"=") for kv in (await fs.getxattr(ROOT, b"user.monarch.ops", None))
               .split())
    assert int(ops[b"read"]) == 1 and int(ops[b"lookup"]) >= 2 and b"failed" not in ops


async def test_statfs_counts_what_is_served(served):
    fs = served.fs
    manifest = served.v1[1]
    s = await fs.statfs(None)
    assert s.f_bsize == s.f_frsize == 4096
    assert s.f_blocks == (manifest.total_bytes + 4095) // 4096 > 0
    assert s.f_files == len(manifest.entries)
    assert s.f_bfree == s.f_bavail == s.f_ffree == 0  # read-only: nothing free
    assert s.f_namemax == 255


# ---- forget ----------------------------------------------------------------------------------

async def test_forget_drops_an_inode_once_every_lookup_is_forgotten(served):
    fs = served.fs
    hello = await ino_of(fs, b"ws/hello.txt")
    assert await ino_of(fs, b"ws/hello.txt") == hello  # two lookups now
    await fs.forget([(hello, 1)])
    assert (await fs.getattr(hello)).st_size == 6
    await fs.forget([(hello, 1)])
    assert await fuse_errno(fs.getattr(hello)) == errno.ENOENT
    # looked up again, it gets the same number (a hash of what it is)
    assert await ino_of(fs, b"ws/hello.txt") == hello
    await fs.forget([(ROOT, 10), (987654321, 1)])  # the root stays; an unknown inode is no error
    assert (await fs.getattr(ROOT)).st_ino == ROOT


# ---- version changes ---------------------------------------------------------------------------

async def test_unchanged_files_keep_their_inode_across_versions_changed_ones_get_a_new_one(
        served):
    fs = served.fs
    before = {p: await ino_of(fs, b"ws/" + p) for p in
              [b"hello.txt", b"big.bin", b"link", b"pkg", b"pkg/__init__.py", b"pkg/mod.py"]}
    v2 = await served.edit_and_publish()
    after = {p: await ino_of(fs, b"ws/" + p) for p in before}
    # The kernel's page cache of an unchanged file survives the update; a directory of the
    # current view keeps its inode.
    for p in [b"hello.txt", b"big.bin", b"link", b"pkg", b"pkg/__init__.py"]:
        assert after[p] == before[p], p
    assert after[b"pkg/mod.py"] != before[b"pkg/mod.py"]
    assert await read(fs, after[b"pkg/mod.py"]) == b"x = 2\n"
    # a reader that holds the old inode keeps reading the old content
    assert await read(fs, before[b"pkg/mod.py"]) == b"x = 1\n"
    ws = await ino_of(fs, b"ws")
    assert (await fs.lookup(ws, b"empty")).st_ino == 0
    assert await read(fs, await ino_of(fs, b"ws/new.txt")) == b"new\n"
    assert await fs.getxattr(before[b"hello.txt"], b"user.monarch.version", None) == \
        v2[0].hex().encode()
    assert await fs.getxattr(ROOT, b"user.monarch.workspaces", None) == \
        b"ws=" + v2[0].hex().encode()


async def test_older_versions_stay_readable_under_versions(served):
    fs = served.fs
    second = await served.edit_and_publish()
    v1, v2 = served.v1[0].hex().encode(), second[0].hex().encode()
    wsv = await ino_of(fs, b".versions/ws")
    assert [name for name, _ in fs.table.listing(fs.table.nodes[wsv])] == [v2, v1]  # current first
    old = await ino_of(fs, b".versions/ws/" + v1 + b"/pkg/mod.py")
    assert await read(fs, old) == b"x = 1\n"
    assert await read(fs, await ino_of(fs, b".versions/ws/" + v1 + b"/empty")) == b""
    new = await ino_of(fs, b".versions/ws/" + v2 + b"/pkg/mod.py")
    assert await read(fs, new) == b"x = 2\n"
    # the same file (path and content) is one inode in every view: one page cache
    assert new == await ino_of(fs, b"ws/pkg/mod.py")
    # a directory is its view's own
    assert await ino_of(fs, b".versions/ws/" + v2 + b"/pkg") != await ino_of(fs, b"ws/pkg")
    # dropping version 1 drops its name
    await fs.set_workspace(b"ws", [second])
    assert (await fs.lookup(wsv, v1)).st_ino == 0
    assert [name for name, _ in fs.table.listing(fs.table.nodes[wsv])] == [v2]


async def test_stage_serves_nothing_until_switch(served):
    fs = served.fs
    mod = await ino_of(fs, b"ws/pkg/mod.py")
    v2 = await served.edit()
    staged = await fs.stage(b"ws", [v2, served.v1])
    assert {(a or b).path for a, b in staged.changed} == {b"", b"pkg/mod.py", b"empty",
                                                          b"new.txt"}
    changed = {(a or b).path: (a, b) for a, b in staged.changed}
    assert changed[b"empty"][1] is None and changed[b"new.txt"][0] is None
    # nothing served changed yet
    assert await ino_of(fs, b"ws/pkg/mod.py") == mod
    assert (await fs.lookup(await ino_of(fs, b"ws"), b"new.txt")).st_ino == 0
    assert [t.version for t in fs.workspaces[b"ws"]] == [served.v1[0]]
    await fs.switch(staged)
    assert await read(fs, await ino_of(fs, b"ws/pkg/mod.py")) == b"x = 2\n"
    assert [t.version for t in fs.workspaces[b"ws"]] == [v2[0], served.v1[0]]
    # publishing the version already served changes nothing
    assert (await fs.stage(b"ws", [v2, served.v1])).changed == []


async def test_a_removed_workspace_leaves_the_mount_but_held_files_still_read(served):
    fs = served.fs
    forgotten = []
    fs.on_orphan_forgotten = lambda: forgotten.append(1)
    hello = await ino_of(fs, b"ws/hello.txt")
    (cid,) = served.v1[1].get(b"hello.txt").chunks
    await fs.remove_workspace(b"ws")
    assert (await fs.lookup(ROOT, b"ws")).st_ino == 0
    assert [name for name, _ in fs.table.listing(fs.table.nodes[ROOT])] == [VERSIONS]
    assert await read(fs, hello) == b"hello\n"
    assert cid in fs.held_chunks()  # kept in the store while the kernel holds the file
    await fs.forget([(hello, 1)])
    assert cid not in fs.held_chunks() and forgotten == [1]
    await fs.remove_workspace(b"ws")  # again: nothing to do


# ---- listings and readdir ----------------------------------------------------------------------

async def test_listings_hold_every_name_in_order(served):
    fs = served.fs
    assert [n for n, _ in fs.table.listing(fs.table.nodes[ROOT])] == [VERSIONS, b"ws"]
    ws = await ino_of(fs, b"ws")
    names = [n for n, _ in fs.table.listing(fs.table.nodes[ws])]
    assert names == sorted(os.fsencode(n) for n in os.listdir(served.src))
    pkg = await ino_of(fs, b"ws/pkg")
    assert [n for n, _ in fs.table.listing(fs.table.nodes[pkg])] == [b"__init__.py", b"mod.py"]
    await served.edit_and_publish()
    assert [n for n, _ in fs.table.listing(fs.table.nodes[ws])] == sorted(
        os.fsencode(n) for n in os.listdir(served.src))


class Replies:
    """Stands for the kernel's readdir buffer: records what readdir_reply is handed (the
    attributes object is reused by readdir, so its inode is copied out), and is full after
    `room` entries."""

    def __init__(self, room: int = 1000):
        self.room = room
        self.got: list[tuple[bytes, int, int]] = []

    def __call__(self, token, name, attr, next_id):
        assert token is self
        if len(self.got) >= self.room:
            return False
        self.got.append((name, attr.st_ino, next_id))
        return True


async def test_readdir_lists_dot_dotdot_and_every_entry_and_resumes_where_it_stopped(
        served, monkeypatch):
    fs = served.fs
    ws = await ino_of(fs, b"ws")
    everything = Replies()
    monkeypatch.setattr(pyfuse3, "readdir_reply", everything)
    await fs.readdir(ws, 0, everything)
    names = sorted(os.fsencode(n) for n in os.listdir(served.src))
    assert [n for n, _, _ in everything.got] == [b".", b"..", *names]
    assert [i for _, _, i in everything.got] == list(range(1, len(names) + 3))
    assert everything.got[0][1] == ws and everything.got[1][1] == ROOT
    for name, ino, _ in everything.got[2:]:
        assert ino == await ino_of(fs, b"ws/" + name), name  # the same inode as a lookup

    # A buffer with room for 3 at a time: each call resumes after the last entry it took.
    got, start = [], 0
    while True:
        part = Replies(room=3)
        monkeypatch.setattr(pyfuse3, "readdir_reply", part)
        await fs.readdir(ws, start, part)
        if not part.got:
            break
        got += part.got
        start = part.got[-1][2]
    assert got == everything.got


# ---- the guard ----------------------------------------------------------------------------------

async def test_an_unexpected_error_in_a_handler_answers_eio_and_is_logged_once(
        served, monkeypatch, caplog):
    fs = served.fs
    hello = await ino_of(fs, b"ws/hello.txt")

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(fs, "_attr", broken)
    with caplog.at_level(logging.ERROR, logger=handler_guard.__name__):
        assert await fuse_errno(fs.getattr(hello)) == errno.EIO
    assert fs.ops["failed"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"FUSE getattr on inode {hello} failed (answered EIO): RuntimeError: a bug"]
    monkeypatch.undo()
    assert (await fs.getattr(hello)).st_size == 6  # and the filesystem goes on

    # forget has no reply: a failure there is only logged, never raised
    fs.on_orphan_forgotten = lambda: broken()
    await fs.remove_workspace(b"ws")
    await fs.forget([(hello, 1)])
    assert fs.ops["failed"] == 2
