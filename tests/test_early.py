"""push --early: a version is served as soon as every node holds its manifest and the chunks
its first reads need; a read of a chunk that has not arrived fetches it ahead of the stream,
and one that cannot be had fails with EIO, never with wrong bytes.

Real daemons, real mounts, real pushes (the CLI in a subprocess this test starts); every read
is made from this process, never from a daemon's serving thread."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from test_protocol import ready_pair

from helpers import CLI_MODULE, Cluster, stop_node, tree, wait_for
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.wire import frames
from monarch_fs.daemon.wire.protocol import ProtocolError, Want

MiB = 1 << 20
CHUNK = 4 * MiB


def start_early_push(c: Cluster, src: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts", c.hostfile,
         "--token-file", c.token_file, "--json", "--early", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_usable(push: subprocess.Popen) -> dict:
    """The push's first line: {"event": "usable", ...}."""
    assert push.stdout is not None
    line = push.stdout.readline()
    if not line:
        raise AssertionError(f"push ended before usable: {push.wait()} {push.stderr.read()}")
    event = json.loads(line)
    assert event["event"] == "usable", event
    return event


def finish(push: subprocess.Popen) -> dict:
    out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def make_tree(src: Path, big_mib: int) -> bytes:
    """A small file (sent first) and a large random file (streamed after the publish)."""
    src.mkdir()
    (src / "small.txt").write_text("hello\n")
    big = os.urandom(big_mib * MiB)
    (src / "big.bin").write_bytes(big)
    return big


def read_at(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


# The stream is paced (push --bwlimit) so that the large file's last chunk arrives seconds
# after the version is usable: a read of it right then must want it, on any machine.
BIG_MIB = 64
RATE_MIB_S = 12  # the last chunk streams about 5 s after the start
PACED = ("--bwlimit", str(RATE_MIB_S))


def early_read_of_the_last_chunk(c: Cluster, tmp_path: Path, node: int,
                                 *args: str) -> tuple[Path, bytes, dict]:
    """Push a tree with --early (paced) and read its large file's last chunk on `node` right
    after usable, while it is still missing: (source, the file's bytes, the push's result)."""
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    push = start_early_push(c, src, *PACED, *args)
    try:
        wait_usable(push)
        last = len(big) - CHUNK
        assert read_at(c.mnt(node) / "ws" / "big.bin", last, CHUNK) == big[last:]
    finally:
        out = finish(push)
    return src, big, out


def incomplete(c: Cluster) -> list[list[str]]:
    return [n.get("incomplete", []) for n in c.status()]


def test_want_goes_node_to_pusher_only_with_whole_ids():
    w = ready_pair()
    want = Want([b"\x01" * 16, b"\x02" * 16])
    assert w.deliver(w.server, want) == want  # the node (server) asks the pusher (client)
    with pytest.raises(ProtocolError):
        w.client.send(want)
    with pytest.raises(ProtocolError, match="16 bytes"):
        w.server.send(Want([b"short"]))
    with pytest.raises(ProtocolError, match="not a list of ids"):
        frames.decode(frames.FrameType.WANT, b"\x01" * 17)


@pytest.mark.mount
def test_early_read_of_a_late_chunk_is_fetched_and_correct(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src, big, out = early_read_of_the_last_chunk(c, tmp_path, 0)
    assert out["nodes"] == 1
    assert out["chunks_wanted"] >= 1, out  # the read came before the stream brought it
    assert out["complete_seconds"] >= BIG_MIB / RATE_MIB_S * 0.8, out  # paced: --bwlimit holds
    assert out["usable_seconds"] <= out["complete_seconds"]
    assert (c.mnt(0) / "ws" / "small.txt").read_text() == "hello\n"
    assert incomplete(c) == [[]]
    assert read_at(c.mnt(0) / "ws" / "big.bin", 0, len(big)) == big


@pytest.mark.mount
def test_dev_box_killed_mid_stream_gives_eio_never_wrong_bytes(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    push = start_early_push(c, src, *PACED)
    wait_usable(push)
    os.kill(push.pid, signal.SIGSTOP)  # frozen, so it cannot finish before it dies
    os.kill(push.pid, signal.SIGKILL)
    push.communicate()
    f = c.mnt(0) / "ws" / "big.bin"
    failed = 0
    for off in range(len(big) - CHUNK, -1, -CHUNK):  # the latest chunks first
        t0 = time.monotonic()
        try:
            data = read_at(f, off, CHUNK)
        except OSError as e:
            assert e.errno == errno.EIO, e
            failed += 1
        else:
            assert data == big[off:off + CHUNK], f"wrong bytes at {off}"
        assert time.monotonic() - t0 < 10, "a read of a missing chunk must fail promptly"
    assert failed, "the dev box died before the end: some chunk must be missing"
    assert (c.mnt(0) / "ws" / "small.txt").read_text() == "hello\n"  # present: still read
    assert incomplete(c) == [["ws"]]
    log = (c.dir / "node-0" / "log").read_text(errors="replace")
    assert "node-0: chunk " in log and "is not available" in log, log[-2000:]
    # A normal push of the same version completes it.
    out = c.push_json(src)
    assert out["nodes"] == 1
    assert incomplete(c) == [[]]
    assert read_at(f, 0, len(big)) == big


@pytest.mark.mount
def test_want_on_a_chain_child_is_served_through_its_parent(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    # node 1 is the chain's child: its only upstream is node 0's relay session
    src, big, out = early_read_of_the_last_chunk(c, tmp_path, 1, "--topology", "chain")
    assert out["topology"] == "chain" and out["nodes"] == 2
    assert out["chunks_wanted"] >= 1, out  # the parent lacked it too and wanted it upstream
    assert incomplete(c) == [[], []]
    for i in range(2):
        assert tree(c.mnt(i) / "ws") == tree(src)


@pytest.mark.mount
def test_first_reads_of_earlier_publishes_go_first(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "small.txt").write_text("hello\n")
    first = os.urandom(8 * MiB)
    (src / "first.bin").write_bytes(first)
    (src / "later.bin").write_bytes(os.urandom(8 * MiB))
    c.push(src)
    assert (c.mnt(0) / "ws" / "first.bin").read_bytes() == first  # the job's first read
    (src / "new.bin").write_bytes(os.urandom(8 * MiB))
    out = finish(start_early_push(c, src))
    assert out["first_reads"] == 1, out  # first.bin, not the small files
    kept = Path(os.environ["MONARCH_FS_HOME"]) / "first-reads" / "ws.json"
    assert json.loads(kept.read_text())["paths"] == ["first.bin"]
    # Fresh nodes know nothing; the dev box still does.
    fresh = fresh_cluster(1)
    out = finish(start_early_push(fresh, src))
    assert out["first_reads"] == 1, out
    assert tree(fresh.mnt(0) / "ws") == tree(src)


@pytest.mark.mount
def test_an_early_version_cut_short_stays_incomplete_across_a_restart(fresh_cluster, tmp_path):
    """Issue 33, finding 2: a push --early killed once usable, then the node restarted. The
    version is still known to lack chunks (`status`; `current` says no), never taken for a whole
    one, so a later push, even one without the scan cache or the dev box store, sends what it
    lacks and completes it."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    big = {f"big{i}.bin": os.urandom(16 * MiB) for i in range(8)}
    for name, data in big.items():
        (src / name).write_bytes(data)
    for i in range(50):
        (src / f"small{i}.txt").write_text(f"small {i}\n")
    push = start_early_push(c, src, "--bwlimit", "10")
    wait_usable(push)
    os.kill(push.pid, signal.SIGKILL)
    push.communicate()
    mnt = c.mnt(0) / "ws"

    def unreadable() -> list[str]:
        out = []
        for name, data in big.items():
            try:
                assert (mnt / name).read_bytes() == data, f"wrong bytes in {name}"
            except OSError as e:
                assert e.errno == errno.EIO, e
                out.append(name)
        return out

    assert unreadable(), "at 10 MiB/s the large files cannot all be here yet"
    lacks = []
    for restarted in (False, True):
        if restarted:
            stop_node(c, 0)
            cluster_mod.restart_node(c.dir, 0)
        status = c.status()[0]
        assert status["incomplete"] == ["ws"], f"restarted: {restarted}: {status}"
        assert status["backing_error"] is None, status  # partial files are not backed
        lacks.append(status.get("incomplete_chunks", {}).get("ws"))
    assert all(n is not None and n > 0 for n in lacks), lacks
    assert unreadable()
    assert (mnt / "small3.txt").read_text() == "small 3\n"
    out = c.push_json(src, "--no-cache", "--no-store")
    assert out["bytes_sent"] >= 16 * MiB, out  # not "sent 0 B": the node said what it lacks
    assert unreadable() == []
    assert incomplete(c) == [[]]
    assert c.push_json(src)["bytes_sent"] == 0  # whole now: nothing more to send


@pytest.mark.mount
def test_a_large_file_is_passthrough_once_whole_while_the_rest_streams(fresh_cluster, tmp_path):
    """push --early: a large file is read through the daemon while it is partial (passthrough
    of it would read holes), and bound by passthrough from the first open after its last
    chunk arrived, before the version is complete."""
    c = fresh_cluster(1)
    if c.status()[0]["fuse"] != "passthrough":
        pytest.skip("passthrough needs root and Linux 6.9+ (this mount: "
                    f"{c.status()[0]['fuse']})")
    src = tmp_path / "ws"
    src.mkdir()
    first = os.urandom(8 * MiB)
    (src / "a.bin").write_bytes(first)  # streamed first (folder order), whole after ~1 s
    (src / "a2.bin").write_bytes(first)  # the same content: one file object for both
    (src / "b.bin").write_bytes(os.urandom(BIG_MIB * MiB))  # then ~5 s of this one
    push = start_early_push(c, src, *PACED)
    try:
        wait_usable(push)
        f = c.mnt(0) / "ws" / "a.bin"
        wait_for(lambda: b"user.monarch.backing" in map(os.fsencode, os.listxattr(f)), 20,
                 "a.bin to be bound once whole")
        assert incomplete(c) == [["ws"]]  # b.bin still streams
        before = int(os.getxattr(c.mnt(0), "user.monarch.passthrough_opens"))
        assert f.read_bytes() == first
        assert int(os.getxattr(c.mnt(0), "user.monarch.passthrough_opens")) == before + 1
        assert (c.mnt(0) / "ws" / "a2.bin").read_bytes() == first
    finally:
        finish(push)
    assert incomplete(c) == [[]]


def test_refs_keep_which_versions_are_early_in_the_publish_that_saves_them(tmp_path):
    from monarch_fs.daemon.node.refs import Refs

    a, b = b"\x0a" * 16, b"\x0b" * 16
    refs = Refs(tmp_path / "refs.json")
    trio.run(refs.publish, "ws", [a], None, None, [a])
    assert Refs(tmp_path / "refs.json").early == {"ws": [a]}
    trio.run(refs.publish, "ws", [b, a], None, None, [a])  # b whole, a still early
    assert Refs(tmp_path / "refs.json").early == {"ws": [a]}
    trio.run(refs.publish, "ws", [b], None, None, [])  # a no longer retained
    assert Refs(tmp_path / "refs.json").early == {}
    # An unreadable list: no version of it may be taken for a whole one.
    data = json.loads((tmp_path / "refs.json").read_text())
    data["early"] = {"ws": ["not hex"]}
    (tmp_path / "refs.json").write_text(json.dumps(data))
    damaged = Refs(tmp_path / "refs.json")
    assert damaged.early == {"ws": [b]} and "early versions" in damaged.problems[0]


@pytest.mark.mount
def test_first_reads_are_recorded_per_chunk_and_only_those_chunks_go_first(fresh_cluster,
                                                                          tmp_path):
    """`import torch` reads part of libtorch_cpu.so: the nodes record first reads per chunk
    (a passthrough file's from its page cache, a file read through the daemon from its reads),
    and push --early sends those chunks first, not the whole file."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    c.push(src)
    f = c.mnt(0) / "ws" / "big.bin"
    for k in (5, 11):  # a page in the middle of two chunks
        assert read_at(f, k * CHUNK + MiB, 4096) == big[k * CHUNK + MiB:][:4096]
    assert (c.mnt(0) / "ws" / "small.txt").read_text() == "hello\n"
    finish(start_early_push(c, src))  # nothing to send: it learns what was read
    kept = Path(os.environ["MONARCH_FS_HOME"]) / "first-reads" / "ws.json"

    def chunks_read() -> set[int]:
        data = json.loads(kept.read_text())
        return {k for i, k in data["reads"] if data["paths"][i] == "big.bin" and k >= 0}

    got = chunks_read()
    assert {5, 11} <= got and len(got) <= 4, got  # (readahead may take the next one)
    fresh = fresh_cluster(1)
    push = start_early_push(fresh, src, *PACED)
    try:
        wait_usable(push)
        g = fresh.mnt(0) / "ws" / "big.bin"
        assert read_at(g, 13 * CHUNK + MiB, 4096) == big[13 * CHUNK + MiB:][:4096]  # wanted
    finally:
        out = finish(push)
    assert out["first_reads"] == 2, out
    # Each chunk read and the one after it (read through the daemon before it is whole, a file
    # is read ahead past the end of the chunk: daemon/client/plan.py).
    sent_first = got | {k + 1 for k in got if k + 1 < BIG_MIB * MiB // CHUNK}
    assert out["first_read_bytes"] == len(sent_first) * CHUNK + len("hello\n"), out
    finish(start_early_push(fresh, src))  # learns what the fresh node read, through itself
    assert 13 in chunks_read()
