"""Bad input reaching a node: unsafe manifests, corrupt chunks, garbage frames, a full disk.
Each gets a clear error, and the node keeps serving its last good version."""

from __future__ import annotations

import os
import subprocess

import pytest
import trio

from conftest import mfs, start_cluster, stop_cluster, umount_tmpfs
from monarch_fs.daemon import protocol as p
from monarch_fs.daemon.auth import load_token
from monarch_fs.daemon.transport import RemoteError, connect
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Entry, Kind, Manifest


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


async def send_manifest(c, manifest: Manifest, blobs: dict[bytes, bytes]) -> None:
    """Stage chunks and a manifest by hand, then ask the node to prepare and commit it."""
    chan = await connect(c.hosts[0], load_token(c.token_file))
    async with chan:
        for cid, blob in blobs.items():
            await chan.send(p.PutChunk(cid, blob))
        data = manifest.encode()  # encode() does not validate: this is a hostile client
        await chan.send(p.PutChunk(chunk.chunk_id(data), chunk.encode(data)))
        args = {"name": "ws", "version": chunk.chunk_id(data).hex()}
        try:
            await chan.request("prepare", **args)
        finally:
            with pytest.raises(RemoteError):
                await chan.request("commit", **args)


@pytest.mark.parametrize("bad", [b"../evil", b"a/../../evil", b"/etc/passwd", b"nul\0name"])
async def test_unsafe_path_refused(node, bad):
    payload = b"evil"
    cid = chunk.chunk_id(payload)
    root = Entry(b"", Kind.DIR, 0o755, 0, 0)
    parents = [Entry(b"a", Kind.DIR, 0o755, 0, 0)] if bad.startswith(b"a/") else []
    m = Manifest([root, *parents, Entry(bad, Kind.FILE, 0o644, 4, 0, chunks=(cid,))])
    with pytest.raises(RemoteError, match="unsafe path"):
        await send_manifest(node, m, {cid: chunk.encode(payload)})
    assert serving_good(node)


async def test_corrupt_chunk_refused(node):
    real = b"the real content"
    cid = chunk.chunk_id(real)
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"f", Kind.FILE, 0o644, len(real), 0, chunks=(cid,))])
    with pytest.raises(RemoteError, match="does not match its id"):
        await send_manifest(node, m, {cid: chunk.encode(b"tampered content")})
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


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
def test_full_disk_fails_cleanly(tmp_path):
    state = tmp_path / "cluster" / "node-0" / "state"
    state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(state)], check=True)
    try:
        c = start_cluster(tmp_path / "cluster", 1)
        try:
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
        finally:
            stop_cluster(c)
    finally:
        umount_tmpfs(state)
