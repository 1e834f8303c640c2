"""Bad input reaching a node: unsafe manifests, corrupt chunks, garbage frames, a full disk.
Each gets a clear error, and the node keeps serving its last good version."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from helpers import (
    FOLDER_HEAD,
    FOLDER_MAGIC,
    RECORD,
    Cluster,
    folder_object,
    staged,
    start_cluster,
    stop_cluster,
    tree,
    umount_tmpfs,
)
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Entry, Kind, Manifest

pytestmark = pytest.mark.mount

MiB = 1 << 20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("refuse"), 1)
    src = tmp_path_factory.mktemp("good") / "ws"
    src.mkdir()
    (src / "f").write_text("good")
    c.push(src)
    yield c
    stop_cluster(c)


def serving_good(c) -> bool:
    return (c.mnt(0) / "ws" / "f").read_text() == "good"


async def send_manifest(c, manifest: Manifest | list[bytes], blobs: dict[bytes, bytes]
                        ) -> None:
    """Stage chunks and a manifest (or folder objects built by hand, the root last), then ask
    the node to prepare and commit it."""
    chan = await connect(c.hosts[0], load_token(c.token_file))
    async with chan:
        version, objects = staged(manifest)
        for cid, blob in {**blobs, **objects}.items():
            await chan.send(p.PutChunk(cid, blob))
        args = {"name": "ws", "version": version}
        try:
            await chan.request("prepare", **args)
        finally:
            with pytest.raises(RemoteError):
                await chan.request("commit", **args)


@pytest.mark.parametrize("bad", [b"..", b".", b"../evil", b"/etc/passwd", b"nul\0name"])
async def test_unsafe_path_refused(node, bad):
    """A name that could escape the mount, in a folder object a hostile client built."""
    payload = b"evil"
    cid = chunk.chunk_id(payload)
    root = folder_object([(Kind.FILE, 0o644, 4, 0, bad, b"", (cid,))])
    with pytest.raises(RemoteError, match="unsafe path"):
        await send_manifest(node, [root], {cid: chunk.encode(payload)})
    assert serving_good(node)


@pytest.mark.parametrize("size", [16, 4 * MiB], ids=["small", "received-in-place"])
async def test_corrupt_chunk_refused(node, size):
    """A 4 MiB raw chunk is hashed as it arrives (daemon/wire/arriving.py), a small one by
    the store: either way a chunk whose bytes are not its id's is refused, and not stored."""
    real, tampered = os.urandom(size), os.urandom(size)
    cid = chunk.chunk_id(real)
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"f", Kind.FILE, 0o644, len(real), 0, chunks=(cid,))])
    with pytest.raises(RemoteError, match="does not match its id"):
        await send_manifest(node, m, {cid: chunk.encode(tampered)})
    assert serving_good(node)
    chan = await connect(node.hosts[0], load_token(node.token_file))
    async with chan:  # the tampered chunk was not stored
        await chan.send(p.QueryMissing([cid]))
        assert (await chan.receive()).ids == [cid]


async def test_missing_chunks_refused(node):
    cid = chunk.chunk_id(b"never sent")
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"f", Kind.FILE, 0o644, 10, 0, chunks=(cid,))])
    with pytest.raises(RemoteError, match="1 chunks missing"):
        await send_manifest(node, m, {})
    assert serving_good(node)


async def test_garbage_frames_do_not_hurt_the_daemon(node):
    host, port = node.hosts[0].rsplit(":", 1)
    for garbage in (b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\x00\x00\x00\x10\x02" + b"x" * 16):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(garbage)
            with trio.fail_after(5):
                while await stream.receive_some(4096):  # the daemon says why and hangs up
                    pass
    # still serving, and still taking pushes
    assert serving_good(node)
    assert node.status()[0]["reachable"]


def flat_manifest(files: int) -> bytes:
    """A root folder object holding `files` empty files, built without Entry objects (a
    million of them would cost this process what the node is meant to be spared)."""
    names = [b"f%07d" % i for i in range(files)]  # zero-padded: already in name order
    record = RECORD.pack(Kind.FILE, 0o644, 0, 0, 8, 0, 0)
    return b"".join([FOLDER_HEAD.pack(FOLDER_MAGIC, chunk.CHUNK_SIZE, 0o755, 0, files),
                     *(record + name for name in names)])


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


async def test_a_manifest_over_the_entry_limit_is_refused_before_it_is_decoded(node):
    """Finding 9: a manifest of a million entries was accepted and kept 455 MB of the node's
    memory. A node accepts 500,000 by default, and checks the count a folder object's header
    gives before it decodes a single entry."""
    data = flat_manifest(999_999)  # a million entries with the root
    pid = node.pid(0)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS
    base = peak_rss(pid)
    with pytest.raises(RemoteError, match=r"has at least 1,000,000 entries, more than this "
                                          r"node accepts \(500,000: its --max-entries"):
        await send_manifest(node, [data], {})
    # The manifest's bytes (40 MB here) passed through; its million entries were never built.
    assert peak_rss(pid) - base < 200 * MiB
    assert serving_good(node)


def test_the_entry_limit_is_a_setting_and_push_checks_it_first(fresh_cluster, tmp_path,
                                                               monkeypatch):
    """A node tells a client its limit when it connects: a push of a larger snapshot is refused
    naming each node before any chunk is sent."""
    monkeypatch.setenv("MONARCH_FS_MAX_ENTRIES", "50")
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    for i in range(60):
        (src / f"f{i}").write_text(str(i))
    out = c.push(src, check=False)
    assert out.returncode == 1
    assert "nothing was published" in out.stderr
    for h in c.hosts:
        assert (f"{h}: the snapshot has 61 entries, more than this node accepts (50: its "
                "--max-entries or MONARCH_FS_MAX_ENTRIES)") in out.stderr
    assert [(n["workspaces"], n["bytes_received"]) for n in c.status()] == [({}, 0)] * 2
    assert not (c.mnt(0) / "ws").exists()
    for i in range(20):
        (src / f"f{i}").unlink()
    c.push(src)  # 41 entries
    assert tree(c.mnt(1) / "ws") == tree(src)


@contextlib.contextmanager
def small_state(tmp_path: Path, size: str) -> Iterator[tuple[Cluster, Path]]:
    """A one-node cluster whose state folder is a tmpfs of `size`: a push can fill it."""
    state = tmp_path / "cluster" / "node-0" / "state"
    state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(state)],
                   check=True)
    try:
        c = start_cluster(tmp_path / "cluster", 1)
        try:
            yield c, state
        finally:
            stop_cluster(c)
    finally:
        umount_tmpfs(state)


@pytest.mark.root
@needs_root
def test_full_disk_fails_cleanly(tmp_path):
    with small_state(tmp_path, "3m") as (c, state):
        src = tmp_path / "ws"
        src.mkdir()
        (src / "f").write_text("good")
        c.push(src)
        (src / "big").write_bytes(os.urandom(6 * 1024 * 1024))
        out = c.push(src, check=False)
        assert out.returncode != 0
        assert c.hosts[0] in out.stderr and "No space left on device" in out.stderr
        assert "nothing was published" in out.stderr
        assert (c.mnt(0) / "ws" / "f").read_text() == "good"
        assert not (c.mnt(0) / "ws" / "big").exists()


@pytest.mark.root
@needs_root
def test_a_push_that_fills_the_disk_gives_its_space_back(tmp_path):
    """Finding 10: the chunks a push stored before the disk filled stayed in the open pack,
    which a collect never rewrites, so the disk stayed full and the next push failed too. The
    open pack is cut back to its last durable record when the push fails."""
    with small_state(tmp_path, "4m") as (c, state):
        src = tmp_path / "ws"
        src.mkdir()
        (src / "f").write_text("good")
        c.push(src)
        pack = max((state / "store" / "packs").glob("*.pack"))
        size, free = pack.stat().st_size, os.statvfs(state).f_bavail
        # 4 MiB and 2 MiB chunks: the first cannot fit, the second can (and did stay).
        (src / "big").write_bytes(os.urandom(6 * MiB))
        out = c.push(src, check=False)
        assert out.returncode == 1 and "No space left on device" in out.stderr
        assert pack.stat().st_size == size
        assert os.statvfs(state).f_bavail == free
        # 2.4 MiB fits in what came back (not in what was left without it).
        (src / "big").unlink()
        for i in range(12):
            (src / f"m{i}.py").write_bytes(os.urandom(200 * 1024))
        c.push(src)
        assert tree(c.mnt(0) / "ws") == tree(src)
