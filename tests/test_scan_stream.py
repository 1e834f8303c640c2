"""Streaming while scanning (issue 34): a new large file's chunks go to the node as the scan
hashes them, into a provisional file object the manifest claims (fs/provisional.py,
daemon/client/scan_stream.py), and small files' chunks in batches, for the node's packs.
Real daemons, real mounts, real sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from helpers import CLI_MODULE, tree, wait_for
from monarch_fs.daemon.client.push import push
from monarch_fs.daemon.client.push_options import PushOptions
from monarch_fs.daemon.wire import bulk
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.stream_file import StreamFile, StreamFileReply
from monarch_fs.daemon.wire.transport import connect
from monarch_fs.fs.chunk import CHUNK_SIZE, RAW, chunk_id

pytestmark = [pytest.mark.mount]

MiB = 1 << 20


def files(c, i: int = 0) -> list[str]:
    return sorted(os.listdir(c.dir / f"node-{i}" / "state" / "store" / "files"))


def disk(folder: Path) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_blocks * 512
               for d, _, names in os.walk(folder) for n in names)


def rchar() -> int:
    """Bytes this process has read through read-like calls (page cache included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def push_here(c, src: Path, **opts):
    return trio.run(lambda: push(src, c.hosts, load_token(c.token_file), PushOptions(**opts)))


def one_file(tmp_path: Path, name: str, data: bytes) -> Path:
    """A workspace folder holding one file."""
    src = tmp_path / "ws"
    src.mkdir()
    (src / name).write_bytes(data)
    return src


def test_a_new_large_file_is_read_once_and_written_once(fresh_cluster, tmp_path):
    """The dev box reads the file once (its chunks leave as the scan hashes them, before the
    manifest), and the node writes it once, into the file object the manifest names."""
    c = fresh_cluster(1)
    big = os.urandom(48 * MiB + 12345)
    src = one_file(tmp_path, "model.bin", big)
    (src / "small.py").write_text("x = 1\n")
    before = rchar()
    result = push_here(c, src, store_dir=tmp_path / "store")
    read = rchar() - before
    assert read < 1.4 * len(big), f"the push read {read} bytes for a {len(big)}-byte file"
    assert result.bytes_sent >= len(big)
    assert (c.mnt(0) / "ws" / "model.bin").read_bytes() == big
    state = c.dir / "node-0" / "state"
    wait_for(lambda: any(n.endswith(".ids") for n in files(c)), 20, "the file object recorded")
    assert not [n for n in files(c) if n.startswith("provisional-")]
    assert disk(state) <= 1.1 * len(big), f"{disk(state)} bytes on the node's disk"


def test_small_files_are_read_once_and_each_sent_once(fresh_cluster, tmp_path):
    """A first push of a tree of small files (a venv) reads each once: their chunks go to the
    node in batches as the scan hashes them, beside larger files' (of one chunk and of several),
    and a chunk that many files hold goes once."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    (src / "pkg").mkdir(parents=True)
    small = {f"pkg/m{i}.py": os.urandom(1000 + 37 * i) for i in range(700)}
    small.update({f"pkg/LICENSE{i}": b"the same license text\n" * 2000 for i in range(200)})
    mid = os.urandom(2 * MiB + 1)  # 256 KiB or more, one chunk: a file object of its own
    big = os.urandom(12 * MiB + 7)
    for name, data in small.items():
        (src / name).write_bytes(data)
    (src / "mid.so").write_bytes(mid)
    (src / "big.so").write_bytes(big)
    small_bytes = sum(map(len, small.values()))
    unique = sum(len(d) for d in {d: 1 for d in small.values()})
    before = rchar()
    result = push_here(c, src)
    read = rchar() - before
    assert read < small_bytes + len(big) + len(mid) + MiB, (
        f"the push read {read} bytes of a {small_bytes + len(big) + len(mid)}-byte tree")
    assert result.bytes_sent < unique + len(big) + len(mid) + 128 * 1024, (  # + folder objects
        f"{result.bytes_sent} bytes sent for {unique + len(big) + len(mid)} distinct bytes")
    mnt = c.mnt(0) / "ws"
    assert all((mnt / name).read_bytes() == data for name, data in small.items())
    assert (mnt / "mid.so").read_bytes() == mid and (mnt / "big.so").read_bytes() == big
    again = push_here(c, src)  # scanned again (no cache here): the node has it all
    assert again.bytes_sent == 0


def test_a_node_killed_while_small_files_stream_leaves_the_other_whole(fresh_cluster, tmp_path):
    """A star push of a new tree of small files, --allow-partial: one node dies while the scan
    streams them. The push names it, and the other node, which got part of the tree while it
    was scanned and the rest after, serves all of it."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "small.txt").write_text("v1\n")
    c.push(src)
    (src / "pkg").mkdir()
    for i in range(12000):
        (src / "pkg" / f"m{i}.py").write_bytes(os.urandom(3000))
    packs = c.dir / "node-1" / "state" / "store" / "packs"
    before = sum(p.stat().st_size for p in packs.glob("*.pack"))
    push = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts", c.hostfile,
         "--token-file", c.token_file, "--json", "--topology", "star", "--timeout", "10",
         "--allow-partial"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: sum(p.stat().st_size for p in packs.glob("*.pack")) > before + MiB, 60,
             "node-1 to receive small files", interval=0.005)
    os.kill(c.pid(1), signal.SIGSTOP)  # frozen first: the push cannot finish before it dies
    os.kill(c.pid(1), signal.SIGKILL)
    out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    assert list(json.loads(out)["failed"]) == [c.hosts[1]] and "Traceback" not in err
    assert tree(c.mnt(0) / "ws") == tree(src)


def test_a_node_is_not_sent_the_chunks_it_has(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    head = os.urandom(6 * CHUNK_SIZE)
    src = one_file(tmp_path, "a.bin", head)
    push_here(c, src)
    tail = os.urandom(2 * CHUNK_SIZE + 777)
    (src / "b.bin").write_bytes(head + tail)  # a new file: its first 6 chunks are a.bin's
    result = push_here(c, src)
    assert result.bytes_sent < len(tail) + 1 * MiB, (
        f"{result.bytes_sent} bytes sent for {len(tail)} new bytes")
    assert (c.mnt(0) / "ws" / "b.bin").read_bytes() == head + tail


def test_a_file_changed_during_the_scan_fails_the_push(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    old = os.urandom(40 * MiB)
    src = one_file(tmp_path, "data.bin", old)
    push_here(c, src)
    (src / "data.bin").write_bytes(os.urandom(40 * MiB))
    stop = threading.Event()

    def scribble() -> None:
        with open(src / "data.bin", "r+b") as f:
            while not stop.is_set():
                f.seek(20 * MiB)
                f.write(os.urandom(4096))
                f.flush()

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        out = c.push(src, check=False)
    finally:
        stop.set()
        writer.join()
    assert out.returncode != 0
    assert "changed" in out.stderr, out.stderr
    assert (c.mnt(0) / "ws" / "data.bin").read_bytes() == old
    wait_for(lambda: not [n for n in files(c) if n.startswith("provisional-")], 20,
             "the provisional file object to go")


def test_a_provisional_file_never_claimed_leaves_nothing(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    data = [os.urandom(CHUNK_SIZE), os.urandom(CHUNK_SIZE // 2)]
    ids = [chunk_id(d) for d in data]
    token = load_token(c.token_file)

    async def stream_and_go() -> None:
        chan = await connect(c.hosts[0], token, encrypt="auto", timeout=10)
        req = StreamFile(1, sum(map(len, data)), CHUNK_SIZE, 0, ids)
        reply = StreamFileReply.from_wire(await chan.request(req.op, **req.to_wire()))
        assert reply.missing == ids
        await chan.send_many(bulk.frames_for([(i, bytes([RAW]) + d) for i, d in zip(ids, data)]))
        await chan.request("flush")  # answered once they are written
        assert await chan.query_missing(ids) == []  # written, in the provisional object
        assert [n for n in files(c) if n.startswith("provisional-")]
        await chan.aclose()

    async def ask() -> list[bytes]:
        chan = await connect(c.hosts[0], token, encrypt="auto", timeout=10)
        try:
            return await chan.query_missing(ids)
        finally:
            await chan.aclose()

    trio.run(stream_and_go)
    wait_for(lambda: not [n for n in files(c) if n.startswith("provisional-")], 20,
             "the unclaimed provisional file object to go")
    assert trio.run(ask) == ids


def test_a_star_push_streams_to_every_node(fresh_cluster, tmp_path):
    """--topology star: every node is a root, each gets the file's chunks as they are hashed
    and writes them once; the dev box still reads the file once."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    big = os.urandom(32 * MiB + 5)
    (src / "model.bin").write_bytes(big)
    before = rchar()
    result = push_here(c, src, topology="star")
    read = rchar() - before
    assert read < 1.4 * len(big), f"the push read {read} bytes for a {len(big)}-byte file"
    assert result.bytes_sent >= 2 * len(big)
    for i in range(2):
        assert (c.mnt(i) / "ws" / "model.bin").read_bytes() == big
        wait_for(lambda i=i: any(n.endswith(".ids") for n in files(c, i)), 20,
                 f"node-{i}'s file object recorded")
        assert not [n for n in files(c, i) if n.startswith("provisional-")]
        used = disk(c.dir / f"node-{i}" / "state")
        assert used <= 1.1 * len(big), f"node-{i}: {used} bytes on disk"


def test_a_node_that_refuses_the_stream_gets_the_file_as_before(lone_daemon, tmp_path):
    """--store-compressed keeps no file objects: the node refuses stream_file, and the push
    sends the file after the manifest, as before."""
    d = lone_daemon("--store-compressed")
    src = tmp_path / "ws"
    src.mkdir()
    big = os.urandom(20 * MiB + 3)
    (src / "model.bin").write_bytes(big)
    result = trio.run(lambda: push(src, [d.addr], load_token(d.token_file), PushOptions()))
    assert result.failed == {}
    assert result.bytes_sent >= len(big)
    assert (d.mnt / "ws" / "model.bin").read_bytes() == big


def test_a_publish_copies_only_its_own_chunks_out_of_another_push_still_streaming(
        fresh_cluster, tmp_path):
    """Two pushes to one node at once (two users): one streams a large file into a provisional
    object while the other publishes. The publish makes durable the chunk of that object it
    counts on (its own file has the same bytes), not the rest: they were all copied into a
    pack at every such publish (7 GB of them cost a node 20 CPU-s). Once the streaming
    session goes, the published file still reads whole."""
    c = fresh_cluster(1)
    data = [os.urandom(CHUNK_SIZE) for _ in range(4)]
    ids = [chunk_id(d) for d in data]
    token = load_token(c.token_file)
    packs = c.dir / "node-0" / "state" / "store" / "packs"

    def packed() -> int:
        return sum(p.stat().st_size for p in packs.glob("*.pack"))

    src = one_file(tmp_path, "shared.bin", data[0])  # the other push's file: chunk 0's bytes
    (src / "small.py").write_text("x = 1\n")
    grew = 0

    async def both() -> None:
        nonlocal grew
        chan = await connect(c.hosts[0], token, encrypt="auto", timeout=10)
        req = StreamFile(1, len(data) * CHUNK_SIZE, CHUNK_SIZE, 0, ids)
        await chan.request(req.op, **req.to_wire())
        await chan.send_many(bulk.frames_for([(i, bytes([RAW]) + d) for i, d in zip(ids, data)]))
        await chan.request("flush")  # written, in the provisional object, still streaming
        before = packed()
        await trio.to_thread.run_sync(lambda: push_here(c, src))
        grew = packed() - before
        await chan.aclose()

    trio.run(both)
    assert grew < 2 * CHUNK_SIZE, f"the publish copied {grew} bytes into packs"
    wait_for(lambda: not [n for n in files(c) if n.startswith("provisional-")], 20,
             "the unclaimed provisional file object to go")
    assert (c.mnt(0) / "ws" / "shared.bin").read_bytes() == data[0]
