"""A push's control tree (push --control tree): the dev box talks to a few roots, every node
asks its children, and chunks follow the same tree. Real daemons on a local cluster of 7
(--control-fanout 2: roots 0 and 1; 0 above 2 and 3; 1 above 4 and 5; 2 above 6)."""

from __future__ import annotations

import signal

import pytest

from helpers import peer_ports, reads, stop_node, tree, watcher
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.wire import topology

TREE = ("--control", "tree", "--control-fanout", "2")


def make_tree(src):
    for d in range(3):
        (src / f"pkg{d}").mkdir(parents=True, exist_ok=True)
        for i in range(4):
            (src / f"pkg{d}" / f"mod{i}.py").write_text(f"VALUE = {d * 10 + i}\n")


def test_the_control_tree_covers_every_node_once_in_log_k_hops():
    for n, k in [(1, 16), (7, 2), (16, 16), (17, 16), (1024, 16), (1000, 3)]:
        hosts = [f"h{i}" for i in range(n)]
        roots = topology.forest(hosts, k)
        assert len(roots) == min(n, k)
        reached = [a for r in roots for a in topology.subtree(r)]
        assert sorted(reached) == sorted(hosts)  # every node, once
        assert all(len(r["children"]) <= k for r in roots)
        hops = 1 + max(topology.depth(r) for r in roots)
        assert k ** (hops - 1) < n * k and hops <= 1 + (n - 1).bit_length()
    assert 1 + max(topology.depth(r) for r in topology.forest([str(i) for i in range(1024)],
                                                            16)) == 3
    # auto: the star up to 16 nodes, the tree above; --early keeps the star
    assert topology.control("auto", 16) == "star" and topology.control("auto", 17) == "tree"
    assert topology.control("auto", 1024, early=True) == "star"
    assert topology.control("star", 1024) == "star" and topology.control("tree", 2) == "tree"
    with pytest.raises(ValueError, match="--early"):
        topology.control("tree", 4, early=True)
    with pytest.raises(ValueError, match="unknown control"):
        topology.control("ring", 4)


@pytest.mark.mount
def test_a_push_down_the_control_tree_reaches_every_node(fresh_cluster, tmp_path):
    c = fresh_cluster(7)
    src = tmp_path / "ws"
    make_tree(src)
    out = c.push_json(src, *TREE)
    assert out["nodes"] == 7 and not out["failed"] and out["topology"] == "control tree"
    # the dev box sent each chunk to the two roots only; the tree carried it to the rest
    assert out["chunks_sent"] == 2 * out["chunks_total"]
    want = tree(src)
    for m in c.mounts():
        assert tree(m / "ws") == want
    (src / "pkg1" / "mod2.py").write_text("VALUE = 'edited'\n")
    out = c.push_json(src, *TREE)
    assert out["nodes"] == 7 and out["chunks_sent"] == 2  # the edited file, to each root
    for m in c.mounts():
        assert reads(m / "ws" / "pkg1" / "mod2.py") == b"VALUE = 'edited'\n"
    again = c.push_json(src, *TREE)  # no change: settled by asking, down the tree
    assert again["chunks_sent"] == 0 and again["version"] == out["version"]
    assert again["nodes"] == 7 and "negotiate" not in again["phases"]


@pytest.mark.mount
def test_a_failed_inner_node_fails_its_subtree_and_nothing_is_published(fresh_cluster,
                                                                         tmp_path):
    c = fresh_cluster(7)
    src = tmp_path / "ws"
    make_tree(src)
    c.push(src, *TREE)
    stop_node(c, 2)  # node 6 is reached only through node 2
    (src / "pkg0" / "mod0.py").write_text("VALUE = 'v2'\n")
    out = c.push(src, *TREE, check=False)
    assert out.returncode == 1
    assert "nothing was published" in out.stderr
    assert f"{c.hosts[2]}: connection refused" in out.stderr
    assert f"{c.hosts[6]}: not reached: its relay parent {c.hosts[2]} failed" in out.stderr
    for i in (0, 1, 3, 4, 5, 6):  # two-phase: nobody switched
        assert reads(c.mnt(i) / "ws" / "pkg0" / "mod0.py") == b"VALUE = 0\n"
    # --allow-partial publishes on the nodes the tree still reaches, and names the others
    out = c.push(src, *TREE, "--allow-partial")
    assert out.returncode == 0, out.stderr
    assert f"{c.hosts[6]} left behind" in out.stderr and f"{c.hosts[2]} left behind" in out.stderr
    for i in (0, 1, 3, 4, 5):
        assert reads(c.mnt(i) / "ws" / "pkg0" / "mod0.py") == b"VALUE = 'v2'\n"
    assert reads(c.mnt(6) / "ws" / "pkg0" / "mod0.py") == b"VALUE = 0\n"


@pytest.mark.mount
def test_watch_keeps_its_control_tree_and_reaches_a_restarted_inner_node(fresh_cluster,
                                                                          tmp_path):
    """push --watch holds sessions with the two roots only, keeps them (and the relays
    below) across edits, and an inner node restarted meanwhile is connected again by its
    parent within the next push, which succeeds on every node."""
    c = fresh_cluster(7)
    ports = {int(h.rsplit(":", 1)[1]) for h in c.hosts}
    src = tmp_path / "ws"
    make_tree(src)
    w = watcher(c, src, tmp_path, *TREE)
    try:
        assert w.push()["nodes"] == 7
        sessions = peer_ports(w.proc.pid, ports)
        assert {port for _, port in sessions} == {int(h.rsplit(":", 1)[1]) for h in c.hosts[:2]}
        for n in (1, 2):
            (src / "pkg2" / "mod3.py").write_text(f"VALUE = 'edit {n}'\n")
            out = w.push()
            assert out["nodes"] == 7 and not out["failed"]
            assert peer_ports(w.proc.pid, ports) == sessions  # the same two sessions
            for m in c.mounts():
                assert reads(m / "ws" / "pkg2" / "mod3.py") == f"VALUE = 'edit {n}'\n".encode()
        stop_node(c, 2)
        cluster_mod.restart_node(c.dir, 2)
        (src / "pkg2" / "mod3.py").write_text("VALUE = 'after the restart'\n")
        out = w.push()
        assert out["nodes"] == 7 and not out["failed"]
        for m in c.mounts():
            assert reads(m / "ws" / "pkg2" / "mod3.py") == b"VALUE = 'after the restart'\n"
        assert not any("push failed" in ln for ln in w.stderr())
        assert w.stop(signal.SIGTERM) == 0
    finally:
        w.kill()
