"""Real hosts on one machine: daemons in their own network and mount namespaces behind a
bandwidth-limited switch (tests/netns.py). A push from the dev box's namespace reaches every node,
each node serves the same bytes at the same path, and the dev box's kernel counter shows a chain
sends the payload once where a star sends it once per node. Skipped when not root or when this
machine cannot create namespaces."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from netns import NetCluster, NetnsUnsupported, unsupported_reason

MiB = 1024 * 1024
NODES = 4
RATE = "1gbit"  # generous: the test checks bytes, not speed, and must stay well under a minute

pytestmark = [pytest.mark.netns, pytest.mark.mount, pytest.mark.root,
              pytest.mark.skipif(unsupported_reason() is not None,
                                 reason=unsupported_reason() or "")]

# Runs on a node (inside its namespaces): {relative path: [kind, mode, sha256 or link target]}
# for everything under the workspace, read through that node's own /mnt/monarch-fs.
_DIGEST = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]
out = {}
for d, dirs, files in os.walk(root):
    for name in dirs + files:
        p = os.path.join(d, name)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            body = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                body = hashlib.sha256(f.read()).hexdigest()
        else:
            body = None
        out[os.path.relpath(p, root)] = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body]
print(json.dumps(out, sort_keys=True))
"""


def digest(path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _DIGEST, path], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def make_tree(root: Path, seed: int, big_mb: int = 20) -> Path:
    """A small source tree whose bulk is `big_mb` MiB of incompressible bytes (so bytes on the
    wire are payload bytes), plus a few small files, a subfolder and a symlink."""
    rng = random.Random(seed)
    (root / "lib").mkdir(parents=True)
    (root / "weights.bin").write_bytes(rng.randbytes(big_mb * MiB - 3 * 4096))
    for i in range(3):
        (root / "lib" / f"mod{i}.py").write_bytes(rng.randbytes(4096))
    (root / "train.py").write_text(f"print('seed {seed}')\n")
    os.chmod(root / "train.py", 0o755)
    os.symlink("lib/mod0.py", root / "link.py")
    return root


def payload_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def net4():
    try:
        with NetCluster(NODES, rate=RATE) as c:
            yield c
    except NetnsUnsupported as e:
        pytest.skip(str(e))


def push(c: NetCluster, src: Path, topology: str) -> tuple[dict, int]:
    """Push from the dev box; returns the CLI's JSON and the dev box's kernel-counted egress."""
    before = c.devbox_tx_bytes()
    proc = c.run_devbox(c.push_argv(src, "--json", "--topology", topology), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), c.devbox_tx_bytes() - before


def test_chain_push_reaches_every_node_and_leaves_the_dev_box_once(net4, tmp_path):
    src = make_tree(tmp_path / "app", seed=1)
    size = payload_bytes(src)
    result, egress = push(net4, src, "chain")
    assert result["nodes"] == NODES and result["topology"] == "chain"
    want = digest(str(src))
    for i in range(NODES):
        got = json.loads(net4.run_on_node(i, [sys.executable, "-c", _DIGEST,
                                                f"{net4.mount}/app"], check=True).stdout)
        assert got == want, f"node-{i} serves different content"
    assert net4.read_on_node(NODES - 1, f"{net4.mount}/app/train.py") == b"print('seed 1')\n"
    assert egress < 1.3 * size, f"chain: dev box sent {egress} bytes for a {size}-byte payload"


def test_star_push_sends_one_copy_per_node(net4, tmp_path):
    src = make_tree(tmp_path / "other", seed=2)  # new bytes: every node lacks all of them
    size = payload_bytes(src)
    result, egress = push(net4, src, "star")
    assert result["nodes"] == NODES
    assert 0.95 * NODES * size < egress < 1.3 * NODES * size, \
        f"star: dev box sent {egress} bytes, expected about {NODES} x {size}"
    data = net4.read_on_node(0, f"{net4.mount}/other/weights.bin")
    assert data == (src / "weights.bin").read_bytes()


def test_mounts_are_private_to_each_node(net4, tmp_path):
    """Every node mounts at the same path; the host (and the dev box) see none of it."""
    assert not os.path.ismount(net4.mount)
    for i in range(NODES):
        out = net4.run_on_node(i, ["findmnt", "-n", "-o", "FSTYPE", net4.mount], check=True)
        assert out.stdout.strip().startswith("fuse")


def test_teardown_removes_everything_even_when_the_body_raises():
    seen = {}
    try:
        with NetCluster(1, rate=RATE) as c:
            seen.update(namespaces=c.namespaces, pids=c.pids, workdir=c.workdir)
            raise RuntimeError("boom")
    except NetnsUnsupported as e:
        pytest.skip(str(e))
    except RuntimeError as e:
        assert str(e) == "boom"
    namespaces, pids, workdir = seen["namespaces"], seen["pids"], seen["workdir"]
    assert len(namespaces) == 3 and len(pids) == 1  # switch, dev box, node-0; one daemon
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in namespaces if ns in left.split()]
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not workdir.exists()
