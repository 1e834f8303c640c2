"""Cluster-scale push on a local cluster: relay fan-out, nodes at different versions, and nodes,
daemons or the dev box dying mid-push. Every failure leaves each node on a good version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLI_MODULE, Cluster, mfs, tree, wait_for
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.fs.chunk import CorruptChunk
from monarch_fs.fs.store import Store

MiB = 1024 * 1024


def objects(c: Cluster, i: int) -> int:
    """Bytes in node i's packs and file objects (large files, written in place: counted by
    the blocks they hold): grows as chunks land (read from outside, while it runs)."""
    store = c.dir / f"node-{i}" / "state" / "store"
    packs = sum(p.stat().st_size for p in store.glob("packs/*.pack"))
    return packs + sum(p.stat().st_blocks * 512 for p in store.glob("files/*"))


def stats(c: Cluster) -> list[dict]:
    return c.status()


def start_push(c: Cluster, src: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts",
         c.hostfile, "--token-file", c.token_file, "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_mid_push(pid: int) -> None:
    """Freeze the node first, so the push cannot finish before it dies, then kill it."""
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)


def big_tree(root: Path, mb: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "small.txt").write_text("v2\n")
    for i in range(mb // 16):
        (root / f"blob{i}.bin").write_bytes(os.urandom(16 * MiB))


@pytest.mark.mount
@pytest.mark.parametrize("topology, fanout", [("chain", 2), ("tree", 2)])
def test_relay_delivers_identical_bytes(fresh_cluster, tmp_path, topology, fanout):
    c = fresh_cluster(5)
    src = tmp_path / "relay"
    (src / "sub").mkdir(parents=True)
    payload = os.urandom(20 * MiB)
    (src / "sub" / "big.bin").write_bytes(payload)
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("sub/big.bin", src / "link")
    out = c.push_json(src, "--topology", topology, "--fanout", str(fanout))
    assert out["topology"] == topology and out["nodes"] == 5
    # the dev box sent each byte once; the nodes relayed the rest
    assert out["bytes_sent"] < 1.05 * len(payload)
    expected = tree(src)
    for mnt in c.mounts():
        assert tree(mnt / "relay") == expected
    forwarded = [n["chunks_forwarded"] for n in stats(c)]
    if topology == "chain":
        assert forwarded[:4] == [forwarded[0]] * 4 and forwarded[0] > 0 and forwarded[4] == 0
    else:  # heap order: 0 -> 1, 2; 1 -> 3, 4
        assert forwarded[0] == forwarded[1] == 2 * forwarded[0] // 2 > 0
        assert forwarded[2:] == [0, 0, 0]


@pytest.mark.mount
def test_nodes_at_different_versions_receive_only_what_they_lack(fresh_cluster, tmp_path):
    c = fresh_cluster(4)
    src = tmp_path / "mixed"
    src.mkdir()
    (src / "old.bin").write_bytes(os.urandom(8 * MiB))
    # nodes 0 and 1 already hold the old content
    mfs("push", str(src), "--hosts", ",".join(c.hosts[:2]), "--token-file", c.token_file)
    (src / "new.bin").write_bytes(os.urandom(6 * MiB))
    before = stats(c)
    # chain 2 -> 3 -> 0 -> 1: the up-to-date nodes sit at the end of the chain
    order = [c.hosts[2], c.hosts[3], c.hosts[0], c.hosts[1]]
    out = json.loads(mfs("push", str(src), "--hosts", ",".join(order), "--token-file",
                         c.token_file, "--topology", "chain", "--json").stdout)
    after = stats(c)
    received = [a["bytes_received"] - b["bytes_received"] for a, b in zip(after, before)]
    stored = [a["chunks_stored"] - b["chunks_stored"] for a, b in zip(after, before)]
    assert 14 * MiB <= out["bytes_sent"] < 15 * MiB  # the union, once
    assert received[2] >= 14 * MiB and received[3] >= 14 * MiB
    assert 6 * MiB <= received[0] < 7 * MiB and 6 * MiB <= received[1] < 7 * MiB
    assert stored[0] == stored[1] == 3  # two 4 MiB-or-less chunks of new.bin + the manifest
    expected = tree(src)
    for mnt in c.mounts():
        assert tree(mnt / "mixed") == expected


def _push_v1(c: Cluster, tmp_path: Path) -> Path:
    src = tmp_path / "ws"
    src.mkdir()
    (src / "small.txt").write_text("v1\n")
    c.push(src)
    return src


def push_under_way(c: Cluster, tmp_path: Path, mb: int, node: int, arrived: int,
                   *args: str) -> tuple[Path, subprocess.Popen]:
    """Every node on v1, then a push of `mb` MiB of v2 that has delivered `arrived` bytes to
    `node`: the moment the tests below break something."""
    src = _push_v1(c, tmp_path)
    big_tree(src, mb)
    before = objects(c, node)
    push = start_push(c, src, *args)
    wait_for(lambda: objects(c, node) > before + arrived, what=f"node-{node} to receive chunks",
             interval=0.005)
    return src, push


def _on_v1_everywhere(c: Cluster, nodes=None) -> None:
    for i in nodes if nodes is not None else range(len(c.hosts)):
        assert (c.mnt(i) / "ws" / "small.txt").read_text() == "v1\n"
        assert not (c.mnt(i) / "ws" / "blob0.bin").exists()


@pytest.mark.mount
def test_node_killed_mid_push_fails_and_publishes_nothing(fresh_cluster, tmp_path):
    c = fresh_cluster(4)
    src, push = push_under_way(c, tmp_path, 128, 1, 2 * MiB, "--topology", "chain",
                               "--timeout", "10")
    kill_mid_push(c.pid(1))
    _, err = push.communicate(timeout=60)
    assert push.returncode == 1
    assert c.hosts[1] in err and "nothing was published" in err and "Traceback" not in err
    _on_v1_everywhere(c, [0, 2, 3])


@pytest.mark.mount
def test_allow_partial_routes_around_a_dead_node(fresh_cluster, tmp_path):
    c = fresh_cluster(4)
    src, push = push_under_way(c, tmp_path, 128, 1, 2 * MiB, "--topology", "chain",
                               "--timeout", "10", "--allow-partial")
    kill_mid_push(c.pid(1))
    out, err = push.communicate(timeout=60)
    assert push.returncode == 0, err
    result = json.loads(out)
    assert list(result["failed"]) == [c.hosts[1]] and result["nodes"] == 3
    expected = tree(src)
    for i in (0, 2, 3):  # 2 and 3 sat behind the dead node in the chain
        assert tree(c.mnt(i) / "ws") == expected


@pytest.mark.mount
def test_stalled_node_is_detected_by_timeout(fresh_cluster, tmp_path):
    c = fresh_cluster(3)
    src, push = push_under_way(c, tmp_path, 64, 1, 1 * MiB, "--topology", "chain", "--timeout", "3")
    os.kill(c.pid(1), signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        _, err = push.communicate(timeout=60)
        assert push.returncode == 1 and c.hosts[1] in err
        assert "no progress for 3s" in err
        assert time.monotonic() - t0 < 30
    finally:
        os.kill(c.pid(1), signal.SIGCONT)
    _on_v1_everywhere(c)


@pytest.mark.mount
def test_devbox_killed_mid_push_then_next_push_reuses_what_arrived(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    src, push = push_under_way(c, tmp_path, 96, 1, 3 * MiB, "--topology", "chain")
    push.kill()
    push.wait(timeout=10)
    _on_v1_everywhere(c)
    out = c.push_json(src, "--topology", "chain")
    assert out["bytes_sent"] < 96 * MiB  # what arrived before the kill is not sent again
    expected = tree(src)
    for mnt in c.mounts():
        assert tree(mnt / "ws") == expected


@pytest.mark.mount
def test_daemon_sigkilled_mid_push_restarts_on_last_good_version(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    src, push = push_under_way(c, tmp_path, 96, 0, 2 * MiB, "--topology", "chain")
    kill_mid_push(c.pid(0))
    _, err = push.communicate(timeout=60)
    assert push.returncode == 1 and c.hosts[0] in err
    # no corrupt or partial object survived the kill
    store = Store(c.dir / "node-0" / "state" / "store")
    assert len(store) > 1
    for cid in store.ids():
        try:
            store.get(cid)
        except CorruptChunk as e:
            pytest.fail(f"corrupt object after SIGKILL: {e}")
    store.close()
    cluster_mod.restart_node(c.dir, 0)
    _on_v1_everywhere(c)
    out = c.push_json(src)
    expected = tree(src)
    for mnt in c.mounts():
        assert tree(mnt / "ws") == expected
    assert out["nodes"] == 2


def test_auto_topology_relays_as_soon_as_there_are_two_nodes():
    """`auto` sends the dev box's bytes once whenever a second node could relay them: a star
    is kept for one node, or for payloads too small for the uplink to matter."""
    from monarch_fs.daemon.wire.topology import AUTO_STAR_BYTES, choose

    big, small = 512 * MiB, AUTO_STAR_BYTES - 1
    assert choose("auto", 1, big) == "star"
    assert choose("auto", 2, big) == "chain" and choose("auto", 8, big) == "chain"
    assert choose("auto", 8, small) == "star"
    assert choose("tree", 2, small) == "tree"  # an explicit choice is kept


def test_small_files_are_spread_among_large_chunks():
    """A push sends runs of small files between large chunks, in proportion to their bytes,
    so CPU-bound small files and link-bound large chunks overlap; every chunk goes exactly
    once and each kind keeps folder order."""
    from monarch_fs.daemon.client.send_order import LARGE_CHUNK, SMALL_RUN, interleave

    small = [b"s%05d" % i for i in range(8000)]  # 8000 x 10 KiB = ~78 MiB
    large = [b"L%05d" % i for i in range(60)]  # 60 x 4 MiB = 240 MiB
    sizes = {**{c: 10 * 1024 for c in small}, **{c: 4 * MiB for c in large}}
    ids = small + large  # folder order: every small file first
    out = interleave(ids, sizes)
    assert sorted(out) == sorted(ids)
    assert [c for c in out if c in sizes and sizes[c] < LARGE_CHUNK] == small
    assert [c for c in out if sizes[c] >= LARGE_CHUNK] == large
    # Halfway through the large bytes, about half of the small bytes went too ...
    half = out.index(large[30])
    sent_small = sum(sizes[c] for c in out[:half] if c.startswith(b"s"))
    assert 0.4 < sent_small / (8000 * 10 * 1024) < 0.6
    # ... in runs of consecutive small files no longer than SMALL_RUN (plus one file).
    run = longest = 0
    for c in out:
        run = run + sizes[c] if c.startswith(b"s") else 0
        longest = max(longest, run)
    assert SMALL_RUN <= longest < SMALL_RUN + 10 * 1024
    # Only one kind: the order is kept as it is.
    assert interleave(small, sizes) == small and interleave(large, sizes) == large


def test_small_files_lead_while_a_node_places_the_large_ones():
    """Right after the manifest, up to LEAD bytes of small files go first (a node stores them
    while it loads the manifest to place the large files), never a chunk of a large file,
    even one small enough to ride with them (its tail); then the rest, interleaved."""
    from monarch_fs.daemon.client.send_order import LEAD, interleave, lead

    small = [b"s%05d" % i for i in range(9000)]  # 9000 x 10 KiB = ~88 MiB
    big = [b"L%03d" % i for i in range(10)] + [b"Ltail"]  # a large file: 10 x 4 MiB and its tail
    ids = small[:10] + big + small[10:]  # folder order: the large file among the small ones
    sizes = {**{c: 10 * 1024 for c in small}, **{c: 4 * MiB for c in big}, b"Ltail": 7}
    out = lead(ids, sizes, set(big))
    assert sorted(out) == sorted(ids)
    first = out[:out.index(next(c for c in out if c in big))]
    assert first == small[:len(first)]  # small files only, in folder order
    assert LEAD <= sum(sizes[c] for c in first) < LEAD + 10 * 1024
    rest = [c for c in ids if c not in set(first)]
    assert out[len(first):] == interleave(rest, sizes)
    # Nothing but a large file's chunks: interleave() alone.
    assert lead(big, sizes, set(big)) == interleave(big, sizes)
