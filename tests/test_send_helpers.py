"""Helper processes share a push's small files (daemon/client/send_helpers.py): each sends its
share on connections of its own, the push sends the rest, and a helper that dies costs time,
never a file. Real daemons, real mounts, real processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import trio

from helpers import mfs, tree, wait_for, write_files
from monarch_fs.daemon.client import send_helpers
from monarch_fs.daemon.client.push import push
from monarch_fs.daemon.client.push_options import PushOptions
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.fs.chunk import chunk_id
from monarch_fs.fs.scan import scan
from monarch_fs.fs.scan_cache import RACY_NS, ScanCache

pytestmark = [pytest.mark.mount]

FILES = send_helpers.HELP_FROM + 600  # enough small files for a push to start helpers


@pytest.fixture
def fast_events(monkeypatch):
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")


def venv_like(folder: Path, first: int = 0, count: int = FILES) -> Path:
    """Many small files in many folders (distinct bytes each), a large file and a few
    medium ones, as a venv has."""
    files: dict[str, str | bytes] = {
        f"pkg{i // 100}/mod{i}.py": f"VALUE = {i}\n" + "#" * (i % 3000) + "\n"
        for i in range(first, first + count)}
    files[f"lib/libbig{first}.so"] = os.urandom(5 << 20)
    files.update({f"lib/medium{first}-{i}.so": os.urandom(300 << 10) for i in range(3)})
    return write_files(folder, files)


def known(src: Path, cache: Path) -> None:
    """Let the scan cache know every file of `src`, so a push sends them after its scan (a
    file written in the last RACY_NS is hashed again, and streams while the scan runs)."""
    time.sleep(RACY_NS / 1e9 + 0.1)
    scanned = trio.run(lambda: scan(src, cache=ScanCache.for_folder(cache, src)))
    assert scanned.hashed_files > 0


def push_to(c, hosts: list[str], src: Path, **opts):
    return trio.run(lambda: push(src, hosts, load_token(c.token_file), PushOptions(**opts)))


def received(c, version: str) -> dict[str, list[dict]]:
    """The push.received rows of `version`, per host, once every node has one per session
    that sent it chunks (a push's own, and its helper's)."""
    rows: list[dict] = []

    def ready() -> bool:
        nonlocal rows
        out = mfs("query", f"SELECT host, peer, count, bytes FROM events WHERE "
                  f"kind = 'push.received' AND version = '{version}'", "--hosts", c.hostfile,
                  "--token-file", c.token_file, "--json")
        rows = json.loads(out.stdout)["rows"]
        return all(sum(r["host"] == h for r in rows) >= 2 for h in c.hosts)

    wait_for(ready, 20, "both sessions' push.received on every node", interval=0.2)
    return {h: [r for r in rows if r["host"] == h] for h in c.hosts}


def test_a_helper_sends_part_of_the_small_files_to_each_node_that_lacks_them(
        fresh_cluster, fast_events, tmp_path):
    """A push whose scan cache knows the tree (so nothing streams while it scans) to two
    nodes, one of which holds half of it: a helper sends small files on sessions of its own,
    each node gets only what it lacks, and both serve the whole tree."""
    cache = tmp_path / "cache"
    half = venv_like(tmp_path / "half")
    src = venv_like(tmp_path / "ws")
    venv_like(src, first=FILES)  # the tree is twice as large, half of it as in `half`
    known(src, cache)
    c = fresh_cluster(2)
    push_to(c, c.hosts[:1], half, name="half", cache_dir=cache)  # node 0 holds half
    result = push_to(c, c.hosts, src, cache_dir=cache, helpers=1, topology="star")
    for mnt in c.mounts():
        assert tree(mnt / "ws") == tree(src)
    assert result.helpers["processes"] == 1 and result.helpers["chunks"] > 0, result.helpers
    assert result.chunks_sent >= result.helpers["chunks"]
    rows = received(c, result.version)
    new = 2 * FILES + 8  # the tree's distinct chunks (its 5 MiB files are two each)
    counts = {h: sorted(r["count"] for r in got) for h, got in rows.items()}
    lacking0, lacking1 = sum(counts[c.hosts[0]]), sum(counts[c.hosts[1]])
    assert lacking1 >= new, counts  # every chunk, and the manifest's folders
    assert FILES <= lacking0 < new * 0.6, counts  # the half it lacked, not the whole
    for host, got in counts.items():  # two sessions sent it chunks, neither all of them
        assert len(got) == 2 and got[0] > 0, (host, counts)


def helper_pids() -> list[int]:
    """This process's children that are push helpers."""
    out = []
    for task in os.listdir("/proc/self/task"):
        try:
            kids = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for pid in map(int, kids):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"send_helpers" in cmd:
                out.append(pid)
    return out


def test_a_helper_killed_mid_push_costs_a_warning_not_a_file(fresh_cluster, tmp_path):
    """The push's helper is SIGKILLed as soon as it exists: the push sends its share itself,
    publishes the whole tree on every node and says what happened."""
    cache = tmp_path / "cache"
    src = venv_like(tmp_path / "ws")
    known(src, cache)
    c = fresh_cluster(2)
    killed: list[int] = []
    done = threading.Event()

    def killer() -> None:
        while not done.is_set() and not killed:
            for pid in helper_pids():
                os.kill(pid, signal.SIGKILL)  # our own child: the push started it
                killed.append(pid)
            done.wait(0.002)

    watcher = threading.Thread(target=killer)
    watcher.start()
    try:
        result = push_to(c, c.hosts, src, cache_dir=cache, helpers=1, topology="star")
    finally:
        done.set()
        watcher.join()
    assert killed, "the push started no helper"
    assert result.helpers["processes"] == 1, result.helpers
    assert any("send helper failed" in w for w in result.warnings), result.warnings
    for mnt in c.mounts():
        assert tree(mnt / "ws") == tree(src)


def test_a_helper_sends_nothing_that_is_not_what_the_scan_hashed(tmp_path):
    """A file changed or gone since the scan is not sent by a helper: the push's own
    stream reads it again and says it changed."""
    same, changed, gone = (tmp_path / n for n in ("same", "changed", "gone"))
    for p in (same, changed, gone):
        p.write_bytes(b"scanned bytes of " + p.name.encode())
    items = [(chunk_id(p.read_bytes()), os.fsencode(p), 0, p.stat().st_size, 1)
             for p in (same, changed, gone)]
    changed.write_bytes(b"scanned bytes of chang3d")
    gone.unlink()
    unsent: list[bytes] = []
    got = send_helpers._read(items, unsent)
    assert [(cid, bytes(buf[1:])) for cid, buf, _ in got] == [(items[0][0], same.read_bytes())]
    assert unsent == [items[1][0], items[2][0]]
