"""Durability off the push's critical path (issue 34): a node publishes a version once its chunks
are written and verified, and flushes them to disk after (`daemon --durable background`). A
crash that loses the page cache past the durable point never serves wrong bytes: the node
serves the last whole version, says which version it lost and how many chunks (`status`, the
event log), and a push repairs it. `--durable sync` flushes before every publish, as before.
Real daemons, real mounts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from helpers import mfs, stop_node, tree, wait_for
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.fs import durable
from monarch_fs.fs.pack import pack_path
from monarch_fs.fs.store import Store

MiB = 1 << 20


def packs(c, i: int = 0) -> Path:
    return c.dir / f"node-{i}" / "state" / "store" / "packs"


def open_pack(folder: Path) -> int:
    """The number of the pack being appended to (the last one, with no index)."""
    return max(int(p.stem) for p in folder.glob("*.pack"))


def unflushed_objects(c, i: int = 0) -> list[Path]:
    """The data of the file objects a publish counts on that are not flushed yet."""
    files = c.dir / f"node-{i}" / "state" / "store" / "files"
    return [files / (p.name[:-len(".settled")] + ".part") for p in files.glob("*.settled")]


def events(c, kind: str) -> list[dict]:
    out = mfs("query", f"SELECT * FROM events WHERE kind = '{kind}'", "--hosts", c.hostfile,
              "--token-file", c.token_file, "--json")
    return json.loads(out.stdout)["rows"]


def damage_past_the_durable_point(c, how: str) -> None:
    """What a power cut does to what was only in the page cache: the open pack past its
    durable point, and the unflushed file objects, cut off or scrambled."""
    folder = packs(c)
    n = open_pack(folder)
    path = pack_path(folder, n)
    point, size = durable.read_point(folder, n), path.stat().st_size
    assert point < size, "the second version's records lie past the durable point"
    objects = unflushed_objects(c)
    assert objects, "the second version's large file is not flushed yet"
    if how == "truncate":
        os.truncate(path, point)
        for p in objects:
            os.truncate(p, 0)
        return
    if how == "scramble":
        with open(path, "r+b") as f:
            f.seek(point)
            f.write(os.urandom(size - point))
    for p in objects:  # "scramble", "file-object": the large file's bytes, not its size
        with open(p, "r+b") as f:
            f.write(os.urandom(p.stat().st_size))


@pytest.mark.mount
@pytest.mark.parametrize("damage", ["none", "file-object", "truncate", "scramble"])
def test_a_crash_past_the_durable_point_serves_the_last_whole_version(
        fresh_cluster, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("MONARCH_FS_FLUSH_SECONDS", "3600")  # flushed only by a clean stop
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("A = 1\n")
    (src / "pkg" / "m.py").write_text("M = 1\n")
    (src / "big.bin").write_bytes(os.urandom(9 * MiB))
    c.push(src)
    first = tree(src)
    v1 = c.status()[0]["workspaces"]["ws"][0]
    stop_node(c)  # a clean stop flushes: the first version is durable
    cluster_mod.restart_node(c.dir, 0)
    n = open_pack(packs(c))
    assert durable.read_point(packs(c), n) == pack_path(packs(c), n).stat().st_size
    assert not unflushed_objects(c)

    (src / "a.py").write_text("A = 2\n")
    for i in range(20):
        (src / "pkg" / f"new{i}.py").write_text(f"N = {i}\n")
    (src / "big2.bin").write_bytes(os.urandom(9 * MiB))  # 3 chunks, in a file object
    c.push(src)
    second = tree(src)
    [node] = c.status()
    v2 = node["workspaces"]["ws"][0]
    assert v2 != v1 and node["durable"] == "background"
    assert tree(c.mnt(0) / "ws") == second  # published before it is flushed
    pid = c.pid(0)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not cluster_mod.running_node(c.dir, 0), 20, "node-0 to die")
    try:
        os.waitpid(pid, 0)  # restarted by this process: gone once collected
    except ChildProcessError:
        pass
    if damage != "none":
        damage_past_the_durable_point(c, damage)
    cluster_mod.restart_node(c.dir, 0)

    [node] = c.status()
    if damage == "none":  # the kernel kept the writes: verified, flushed, and served
        assert node["workspaces"]["ws"][0] == v2 and node["lost"] == {}, node
        assert tree(c.mnt(0) / "ws") == second
        assert not unflushed_objects(c) and not node["problems"]
        return
    assert node["workspaces"]["ws"][0] == v1, node  # the last whole version
    assert tree(c.mnt(0) / "ws") == first  # every byte of it, nothing of the lost one
    lost = node["lost"]["ws"]
    assert lost["version"] == v2 and lost["serving"] == v1, lost
    # The large file's 3 chunks; with the pack's tail gone, the manifest went too (unknown).
    assert lost["chunks"] == (3 if damage == "file-object" else None), lost
    assert any(v2[:12] in p and "a push of it repairs it" in p for p in node["problems"])
    wait_for(lambda: events(c, "version.lost"), 10, "the loss in the event log")
    [event] = events(c, "version.lost")
    assert event["version"] == v2 and event["workspace"] == "ws"
    assert event["count"] == lost["chunks"]

    out = c.push_json(src)  # the repair: the node says what it lacks
    assert out["version"] == v2 and out["bytes_sent"] >= 9 * MiB, out
    assert tree(c.mnt(0) / "ws") == second
    [node] = c.status()
    assert node["workspaces"]["ws"][0] == v2 and node["lost"] == {} and not node["problems"]


@pytest.mark.mount
def test_durable_sync_flushes_before_the_publish(lone_daemon, tmp_path, monkeypatch):
    """Today's floor, kept as an option: with --durable sync the pack is durable up to its end
    when the push returns; with background (no flush for an hour) it is not."""
    monkeypatch.setenv("MONARCH_FS_FLUSH_SECONDS", "3600")
    src = tmp_path / "ws"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    (src / "big.bin").write_bytes(os.urandom(5 * MiB))
    for mode in ("sync", "background"):
        d = lone_daemon("--durable", mode)
        mfs("push", str(src), "--hosts", d.addr, "--token-file", d.token_file)
        folder = d.dir / "state" / "store" / "packs"
        n = open_pack(folder)
        flushed = durable.read_point(folder, n) == pack_path(folder, n).stat().st_size
        assert flushed == (mode == "sync"), mode
        files = d.dir / "state" / "store" / "files"
        assert bool(list(files.glob("*.settled"))) == (mode == "background"), mode


def test_a_store_cuts_what_does_not_verify_past_its_durable_point(tmp_path):
    """The store's own check at open: records before the durable point are trusted, those
    after it verified, and the first that does not verify is cut off with what follows."""
    store = Store(tmp_path / "store")
    kept = [store.put(os.urandom(1000)) for _ in range(3)]
    store.flush()
    later = [store.put(os.urandom(1000)) for _ in range(3)]
    point = durable.read_point(store.packs, store._cur)
    path, off, length = store.locate(later[1])
    store.close()
    assert 0 < point < off
    with open(path, "r+b") as f:  # the middle later record's last byte, as a lost page would
        f.seek(off + length - 1)
        byte = f.read(1)
        f.seek(off + length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    store = Store(tmp_path / "store")
    try:
        assert store.lost == 2 and store.lost_bytes > 0
        assert [store.has(c) for c in kept + later] == [True] * 4 + [False] * 2
        for c in kept + later[:1]:
            assert len(store.get(c)) == 1000
        assert durable.read_point(store.packs, store._cur) == path.stat().st_size
    finally:
        store.close()
    store = Store(tmp_path / "store")  # checked once: nothing past the point any more
    try:
        assert store.lost == 0 and len(store) == 4
    finally:
        store.close()


def test_a_full_pack_is_sealed_at_the_next_flush_or_at_start(tmp_path):
    """--durable background: a full pack is not flushed on the append path; the next flush
    seals it (its index written), and after a crash before that the next start does."""
    store = Store(tmp_path / "store", pack_limit=64 << 10, flush_later=True)
    ids = [store.put(os.urandom(20_000)) for _ in range(8)]  # fills 2 packs, opens a third
    assert not list(store.packs.glob("*.idx")) and len(store.seals.pending) == 2
    store.flush()
    assert len(list(store.packs.glob("*.idx"))) == 2 and not store.seals.pending
    more = [store.put(os.urandom(20_000)) for _ in range(4)]
    assert store.seals.pending  # a crash now: no index for it
    store.close()
    store = Store(tmp_path / "store", pack_limit=64 << 10, flush_later=True)
    try:
        assert store.lost == 0 and all(len(store.get(c)) == 20_000 for c in ids + more)
        assert len(list(store.packs.glob("*.idx"))) == 3  # verified and sealed at start
        sealed = {p.stem for p in store.packs.glob("*.idx")}
        assert not sealed & {p.stem for p in store.packs.glob("*.durable")}  # none left over
    finally:
        store.close()
