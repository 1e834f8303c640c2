"""Pushes of tree manifests against real daemons: only the folders that changed travel, a node
that missed versions catches up in one push, a damaged or missing folder object is named and
healed by the next push, and neither a tree edited mid-push nor a restart between prepare and
commit leaves half a version visible."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from helpers import CLI_MODULE, flip_bits, staged, stop_node, tree
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Manifest
from monarch_fs.fs.scan import scan
from monarch_fs.fs.store import Store

pytestmark = pytest.mark.mount


def make_tree(src: Path, folders: int = 6, files: int = 5) -> None:
    for d in range(folders):
        (src / f"pkg{d}" / "sub").mkdir(parents=True, exist_ok=True)
        for i in range(files):
            (src / f"pkg{d}" / f"mod{i}.py").write_text(f"# {d}.{i}\nVALUE = {d * 100 + i}\n")
        (src / f"pkg{d}" / "sub" / "data.txt").write_text(f"data {d}\n")


def served(c, tmp_path: Path) -> tuple:
    """(c, src, what node 0 serves): a tree made in tmp_path/ws and pushed to cluster c."""
    src = tmp_path / "ws"
    make_tree(src)
    c.push(src)
    return c, src, tree(c.mnt(0) / "ws")


def manifest_of(src: Path) -> Manifest:
    return trio.run(scan, src).manifest


def held(m: Manifest) -> set[bytes]:
    """What a node that serves `m` holds of it: its chunks and its folder objects."""
    return set(m.chunk_ids()) | set(m.objects())


def stored(c, i: int) -> int:
    return c.status()[i]["chunks_stored"]


def test_an_edit_sends_only_the_folders_on_its_path(fresh_cluster, tmp_path):
    c, src, _ = served(fresh_cluster(2), tmp_path)
    before = manifest_of(src)
    (src / "pkg3" / "sub" / "data.txt").write_text("edited\n")
    after = manifest_of(src)
    new = held(after) - held(before)
    # the file's chunk, and the objects of pkg3/sub, pkg3 and the root: 4 of 13 objects
    assert len(set(after.objects()) - set(before.objects())) == 3 and len(new) == 4
    was = [stored(c, i) for i in range(2)]
    c.push(src)
    assert [stored(c, i) - was[i] for i in range(2)] == [len(new)] * 2
    for mnt in c.mounts():
        assert tree(mnt / "ws") == tree(src)


def test_a_node_that_missed_several_versions_catches_up_in_one_push(fresh_cluster, tmp_path):
    c, src, _ = served(fresh_cluster(2), tmp_path)
    v1 = manifest_of(src)
    for n in range(3):  # three versions node-0 gets and node-1 misses
        (src / f"pkg{n}" / "mod0.py").write_text(f"# version {n + 2}\n")
        (src / f"new{n}").mkdir()
        (src / f"new{n}" / "f.py").write_text(f"NEW = {n}\n")
        c.push(src, "--hosts", c.hosts[0])
    (src / "pkg5" / "sub").rename(src / "pkg5" / "moved")
    v5 = manifest_of(src)
    was = stored(c, 1)
    out = c.push_json(src)
    assert out["version"] == v5.id.hex()
    # node-1 was sent exactly what it lacked since version 1, in this one push
    assert stored(c, 1) - was == len(held(v5) - held(v1))
    for mnt in c.mounts():
        assert tree(mnt / "ws") == tree(src)
    assert os.getxattr(c.mnt(1) / "ws", "user.monarch.version").decode() == v5.id.hex()


async def publish_by_hand(c, objects: dict[bytes, bytes], version: str,
                          blobs: dict[bytes, bytes], commit: bool = True) -> dict:
    """Stage chunks and folder objects through the protocol, prepare, and (unless not
    `commit`) commit them as workspace "ws" on node 0."""
    chan = await connect(c.hosts[0], load_token(c.token_file))
    async with chan:
        for cid, blob in {**blobs, **objects}.items():
            await chan.send(p.PutChunk(cid, blob))
        reply = await chan.request("prepare", name="ws", version=version)
        return await chan.request("commit", name="ws", version=version) if commit else reply


async def test_a_missing_folder_object_is_named_and_the_last_version_serves(fresh_cluster,
                                                                          tmp_path):
    c, src, good = served(fresh_cluster(1), tmp_path)
    (src / "pkg2" / "extra").mkdir()
    (src / "pkg2" / "extra" / "x.py").write_text("X = 1\n")
    m = (await scan(src)).manifest
    version, objects = staged(m)
    inner = next(oid for oid, blob in m.objects().items() if b"x.py" in blob)
    del objects[inner]  # a client that never sends pkg2/extra's object
    with pytest.raises(RemoteError, match=r"manifest not received whole \(folder b'pkg2/extra'"):
        await publish_by_hand(c, objects, version, {})
    assert tree(c.mnt(0) / "ws") == good
    c.push(src)  # the real client asks what the node lacks, and sends it
    assert tree(c.mnt(0) / "ws") == tree(src)


def test_a_damaged_folder_object_is_reported_and_the_next_push_heals_it(fresh_cluster,
                                                                       tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    make_tree(src)
    c.push(src)
    m = manifest_of(src)
    inner = next(oid for oid, blob in m.objects().items() if b"data.txt" in blob)
    stop_node(c)
    store = Store(c.dir / "node-0" / "state" / "store")
    try:
        pack, offset, length = store.locate(inner)
    finally:
        store.close()
    flip_bits(pack, offset + length - 1, 0x40)  # the object's last byte, as a bad disk would
    cluster_mod.restart_node(c.dir, 0)
    [node] = c.status()
    problems = "\n".join(node["problems"])
    assert "workspace 'ws' not served" in problems and inner.hex() in problems
    assert sorted(os.listdir(c.mnt(0))) == [".versions"]
    out = c.push_json(src)  # the same tree: the node says it lacks the damaged object
    assert out["version"] == m.id.hex()
    assert tree(c.mnt(0) / "ws") == tree(src)
    assert not any("'ws'" in p for p in c.status()[0]["problems"])


async def test_a_restart_between_prepare_and_commit_leaves_the_last_version(fresh_cluster,
                                                                          tmp_path):
    c, src, good = served(fresh_cluster(1), tmp_path)
    (src / "pkg1" / "mod1.py").write_text("EDITED = True\n")
    snap = await scan(src)
    version, objects = staged(snap.manifest)
    edited = snap.manifest.get(b"pkg1/mod1.py").chunks[0]
    await publish_by_hand(c, objects, version,
                          {edited: chunk.encode(snap.read_chunk(edited))}, commit=False)
    stop_node(c)
    cluster_mod.restart_node(c.dir, 0)
    assert tree(c.mnt(0) / "ws") == good  # prepared, never committed: not visible
    out = c.push_json(src)  # the client's next push completes it
    assert out["version"] == version
    assert tree(c.mnt(0) / "ws") == tree(src)


def test_a_tree_edited_mid_push_fails_that_push_and_changes_nothing(fresh_cluster, tmp_path):
    """The files are read after the scan: one edited before its chunks are read fails the
    push with a message naming it, and every node keeps the version it served. The next push
    takes the new tree whole."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    make_tree(src)
    c.push(src)
    good = tree(c.mnt(0) / "ws")
    for i in range(16):  # 16 MiB at 4 MiB/s: about 4 s of sending
        (src / "pkg0" / f"blob{i:02d}.bin").write_bytes(os.urandom(1 << 20))
    push = subprocess.Popen([sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts",
                             c.hostfile, "--token-file", c.token_file, "--bwlimit", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        for i in range(16):  # the ones not read yet were scanned with other content
            (src / "pkg0" / f"blob{i:02d}.bin").write_bytes(os.urandom(1 << 20))
        out, err = push.communicate(timeout=60)
    finally:
        if push.poll() is None:
            push.kill()
            push.wait()
    assert push.returncode == 1, (out, err)
    assert "changed" in err and "blob" in err and "Traceback" not in err
    for mnt in c.mounts():
        assert tree(mnt / "ws") == good
    c.push(src)
    for mnt in c.mounts():
        assert tree(mnt / "ws") == tree(src)
