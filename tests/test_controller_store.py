"""The dev box store: a push of content pushed before, to fresh nodes, sends it from the store
without reading the source; the store keeps to its bound; a busy store never fails a push; and
each link's compression is chosen and reported, the bytes arriving right either way."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import trio
from fillers import wait_fillers

from helpers import flip_bits, mfs, tree
from monarch_fs.daemon.client import link_codec
from monarch_fs.daemon.wire.auth import resolve_token
from monarch_fs.daemon.wire.transport import connect
from monarch_fs.fs.store import Store
from monarch_fs.settings import settings
from opens import Opens

pytestmark = pytest.mark.mount


# Random bytes of 4 bits each: a library-like file that zstd halves (a random one does not
# compress, and its wire form is its file: test_a_chunk_that_does_not_compress_...).
HALF = bytes(range(256)).translate(bytes(i & 0x0F for i in range(256)))


def make_src(root: Path, seed: int = 0, size: int = 9 << 20, random: int = 0) -> Path:
    """A folder of text-like small files, one large compressible file of several chunks and
    (`random` bytes) one that does not compress, old enough (mtime and ctime) for the scan
    cache to vouch for them."""
    root.mkdir(parents=True)
    (root / "pkg").mkdir()
    for i in range(40):
        (root / "pkg" / f"m{i}.py").write_text(f"# module {seed}.{i}\n" + "x = 1\n" * (200 + i))
    (root / "big.bin").write_bytes(os.urandom(size).translate(HALF))
    if random:
        (root / "random.bin").write_bytes(os.urandom(random))
    os.sync()
    time.sleep(2.2)  # the scan cache records no file changed less than 2 s before a scan
    return root


def resident_bytes(root: Path) -> int:
    """How much of the folder's file content is in the page cache (fincore, util-linux)."""
    files = [str(p) for p in root.rglob("*") if p.is_file()]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def evict(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def store_status() -> dict:
    return json.loads(mfs("status", "--store", "--json").stdout)


def folders(src: Path) -> int:
    """How many folder objects a snapshot of `src` has (one per folder, the root's included)."""
    return 1 + sum(len(dirs) for _, dirs, _ in os.walk(src))


def push_from_store(cluster, src: Path) -> dict:
    """A push of `src` (its pages evicted first) to `cluster`'s fresh node, which must send
    every chunk and folder object from the dev box store and read nothing of the source."""
    os.sync()
    evict(src)
    r = cluster.push_json(src, "--compress", "on")
    assert resident_bytes(src) == 0, "the push read the source"
    assert r["store"]["sent_from_store"] == r["chunks_total"] + folders(src)
    return r


def test_push_to_fresh_nodes_sends_from_the_store_without_reading_the_source(
        tmp_path, fresh_cluster):
    """The second push runs in a new process (the store survives a restart of the client),
    to a node that has nothing, over a zstd link: every chunk comes from the store, and not a
    page of the source is read."""
    src = make_src(tmp_path / "env")
    want = tree(src)
    first = fresh_cluster(1)
    r1 = first.push_json(src, "--compress", "on")
    assert [c["compression"] for c in r1["links"]] == ["zstd"]
    assert r1["bytes_sent"] < r1["bytes"]  # the text compressed
    assert tree(first.mnt(0) / "env") == want
    held = store_status()
    assert [h["version"] for h in held["snapshots"]] == [r1["version"]]

    os.sync()
    evict(src)
    assert resident_bytes(src) == 0
    second = fresh_cluster(1)
    r2 = second.push_json(src, "--compress", "on")
    assert resident_bytes(src) == 0, "the push read the source"
    assert r2["version"] == r1["version"]
    # every chunk, and the manifest: an object per folder
    assert r2["store"]["sent_from_store"] == r2["chunks_sent"] + folders(src) \
        == r2["chunks_total"] + folders(src)
    assert r2["bytes_sent"] == r1["bytes_sent"]
    assert tree(second.mnt(0) / "env") == want

    # Loopback goes raw: chunks of files the scan cache vouches for are read from the source
    # (cheaper than decompressing the stored blob), checked against their ids.
    third = fresh_cluster(1)
    r3 = third.push_json(src)
    [link] = r3["links"]
    assert (link["compression"], link["rate_mib_s"]) == ("none", None)
    assert link["why"].startswith("loopback")
    assert r3["bytes_sent"] >= r3["bytes"]
    assert tree(third.mnt(0) / "env") == want


def test_a_damaged_store_copy_is_replaced_from_the_source(tmp_path, fresh_cluster):
    """Issue 33, finding 7: 4 bytes flipped in a pack of the dev box store made every push to a
    fresh node fail the same way (`rejected chunk ...`), naming neither the store nor a way
    out. Now the failed push names the store, replaces its copy from the source, and the
    next push serves the right bytes."""
    src = make_src(tmp_path / "env")
    want = tree(src)
    fresh_cluster(1).push_json(src, "--compress", "on")
    root = Path(store_status()["path"])
    pack = max(root.glob("packs/*.pack"), key=lambda p: p.stat().st_size)
    middle = pack.stat().st_size // 2
    for i in range(4):
        flip_bits(pack, middle + i, 0xFF)

    second = fresh_cluster(1)
    failed = second.push(src, "--compress", "on", check=False)
    assert failed.returncode != 0
    assert (f"the dev box store {root} held a damaged copy; replaced it from the source; "
            "push again") in failed.stderr, failed.stderr
    second.push_json(src, "--compress", "on")
    assert tree(second.mnt(0) / "env") == want


def test_a_chunk_that_does_not_compress_is_read_from_its_file_not_copied(
        tmp_path, fresh_cluster):
    """A file that does not compress goes raw on every link, so the dev box store does not
    copy it (47% of a push's CPU was that copy): it records its chunks' ids, and a push to a
    fresh node over a zstd link reads them from the file, checked, and nothing else."""
    src = make_src(tmp_path / "env", size=5 << 20, random=9 << 20)
    want = tree(src)
    r1 = fresh_cluster(1).push_json(src, "--compress", "on")
    packs = sum(p.stat().st_size for p in (settings.store_dir / "packs").glob("*.pack"))
    assert packs < 4 << 20  # the compressible files, compressed; not the random one
    sourced = (settings.store_dir / "sourced.ids").read_bytes()
    assert len(sourced) == 3 * 16  # random.bin's three chunks

    os.sync()
    evict(src)
    second = fresh_cluster(1)
    r2 = second.push_json(src, "--compress", "on")
    assert r2["version"] == r1["version"]
    assert resident_bytes(src) == (src / "random.bin").stat().st_size, \
        "the push read more than the file that does not compress"
    assert r2["store"]["sent_from_store"] == r2["chunks_total"] - 3 + folders(src)
    assert r2["bytes_sent"] == r1["bytes_sent"]
    assert tree(second.mnt(0) / "env") == want


def test_a_push_that_sends_nothing_or_little_leaves_the_store_closed(tmp_path, fresh_cluster):
    """Every node serves the version already, then an edit of a few bytes, then no change
    again: the store is not opened (an open reads every pack's index, 50 ms at 100k chunks),
    but the snapshot it holds of the workspace is recorded as pushed now, so the bound drops
    it last. A push to a fresh node later sends the rest from the store, and reads the edited
    file's chunk and the changed folders from the source."""
    src = make_src(tmp_path / "env", size=1 << 20)
    c = fresh_cluster(1)
    r1 = c.push_json(src)
    wait_fillers()  # the store whole: what the first push's filler left
    [before] = store_status()["snapshots"]
    seen = Opens(settings.store_dir / "packs")
    try:
        r2 = c.push_json(src)
        assert seen.files() == []
        assert (r2["version"], r2["chunks_sent"]) == (r1["version"], 0)
        [again] = store_status()["snapshots"]
        assert again["version"] == before["version"] and again["pushed"] > before["pushed"]

        (src / "pkg" / "m0.py").write_text("# edited\n")
        r3 = c.push_json(src)
        assert seen.files() == []
        assert c.push_json(src)["version"] == r3["version"]  # and no change again
        assert seen.files() == []
    finally:
        seen.close()
    assert r3["chunks_sent"] == 1 and r3["version"] != r1["version"]
    assert r2["store"] == r3["store"] == {"path": str(settings.store_dir),
                                          "sent_from_store": 0, "added": 0,
                                          "background_fill": False, "lacking": 0}
    [last] = store_status()["snapshots"]
    assert last["version"] == before["version"] and last["pushed"] > again["pushed"]
    assert tree(c.mnt(0) / "env") == tree(src)

    fresh = fresh_cluster(1)
    r4 = fresh.push_json(src, "--compress", "on")
    assert r4["version"] == r3["version"]
    # every chunk but the edited file's, every folder object but the root's and pkg's
    assert r4["store"]["sent_from_store"] == r4["chunks_sent"] - 1 + folders(src) - 2
    assert tree(fresh.mnt(0) / "env") == tree(src)


def test_bound_drops_the_least_recently_pushed(tmp_path, fresh_cluster, monkeypatch):
    """Over the bound, older snapshots go and the store shrinks below it; the one just pushed
    stays, and is still sent from the store."""
    monkeypatch.setenv("MONARCH_FS_STORE_MIB", "3")
    monkeypatch.setenv("MONARCH_FS_PACK_MIB", "1")
    c = fresh_cluster(1)
    versions = []
    for i in range(4):
        src = make_src(tmp_path / f"ws{i}", seed=i, size=2 << 20)  # ~1 MiB compressed
        versions.append(c.push_json(src, "--name", f"ws{i}")["version"])
        wait_fillers()
    held = store_status()
    kept = [h["version"] for h in held["snapshots"]]
    assert versions[-1] in kept and versions[0] not in kept
    assert len(kept) < 4
    assert held["bound"] == 3 << 20
    packs = sum(p.stat().st_size for p in (settings.store_dir / "packs").glob("*.pack"))
    assert packs == held["bytes"] <= 3 << 20
    line = mfs("status", "--store").stdout
    assert f"ws3={versions[-1][:12]}" in line and "ws0" not in line

    fresh = fresh_cluster(1)
    r = fresh.push_json(tmp_path / "ws3", "--name", "ws3", "--compress", "on")
    assert r["store"]["sent_from_store"] == r["chunks_total"] + folders(tmp_path / "ws3")
    assert tree(fresh.mnt(0) / "ws3") == tree(tmp_path / "ws3")


def test_a_busy_store_does_not_fail_a_push(tmp_path, fresh_cluster):
    """Another push holding the store (push --watch): this one waits briefly, then pushes
    without it and says so in one line."""
    src = make_src(tmp_path / "env", size=1 << 20)
    c = fresh_cluster(1)
    holder = Store(settings.store_dir)
    try:
        out = c.push(src)
    finally:
        holder.close()
    result = json.loads(out.stdout)
    assert result["store"] == {}
    [warning] = [w for w in out.stderr.splitlines() if "dev box store" in w]
    assert "in use by another push; pushed without it" in warning
    assert tree(c.mnt(0) / "env") == tree(src)


def test_no_store_and_compress_off(tmp_path, fresh_cluster):
    src = make_src(tmp_path / "env", size=1 << 20)
    c = fresh_cluster(1)
    r = c.push_json(src, "--no-store", "--compress", "off")
    assert r["store"] == {}
    assert [(x["compression"], x["why"]) for x in r["links"]] == [("none", "--compress off")]
    assert not (settings.store_dir / "packs").exists()
    assert tree(c.mnt(0) / "env") == tree(src)


def test_a_link_off_loopback_is_probed(tmp_path, fresh_cluster):
    """Off loopback, the choice rests on a real probe over the push's session: its measured
    rate is reported, and compared with decompression's (the label is the only thing that is
    not loopback here: the session is a real one to a real daemon)."""
    c = fresh_cluster(1)
    token = resolve_token(c.token_file)

    async def main() -> link_codec.LinkChoice:
        async with await connect(c.hosts[0], token) as chan:
            return await link_codec.choose("auto", "10.0.0.7:7000", chan)

    choice = trio.run(main)
    assert choice.rate_mib_s is not None and choice.rate_mib_s > 0
    limit = link_codec.codec_rate() * link_codec.SAVED / (1 << 20)
    assert choice.compression == ("zstd" if choice.rate_mib_s < limit else "none")
    assert "decompression rate x bytes saved" in choice.why


def test_a_store_with_many_new_chunks_is_sealed_after_a_push(tmp_path):
    """The dev box store opens at every push; an open pack has no index and is read record by
    record, so after a push adds SEAL_RECORDS records the pack is sealed (its index written).
    The store reopened finds every chunk, through the index, and appends to a new pack."""
    from monarch_fs.daemon.client.controller_store import SEAL_RECORDS, ControllerStore
    from monarch_fs.fs.chunk import chunk_id, encode

    async def push_chunks(count: int, seed: int) -> tuple[list[bytes], int]:
        store, busy = await ControllerStore.open(tmp_path / "store", 1 << 30)
        assert store is not None and busy is None
        data = [b"%d-%d" % (seed, i) for i in range(count)]
        ids = [chunk_id(d) for d in data]
        for cid, d in zip(ids, data):
            store.add(cid, encode(d))
        store.finish(ids[0], "w", sum(map(len, data)))
        left = store.store.unsealed
        store.close()
        return ids, left

    few, left = trio.run(push_chunks, 10, 1)
    assert left == 10  # not worth a pack of its own yet
    many, left = trio.run(push_chunks, SEAL_RECORDS, 2)
    assert left == 0
    assert sorted(p.name for p in (tmp_path / "store" / "packs").iterdir()) == [
        "00000001.idx", "00000001.pack", "00000002.pack"]
    store = Store(tmp_path / "store")
    try:
        assert store.missing([*few, *many]) == [] and store.unsealed == 0
    finally:
        store.close()


def test_a_push_that_adds_nothing_to_the_store_does_not_flush_it(tmp_path):
    """A cold push from a whole dev box store appends nothing to it: its finish flushes
    nothing either (it waited for the disk the nodes were flushing to), and records the
    snapshot all the same. One that appends flushes, and moves the durable point."""
    from monarch_fs.daemon.client.controller_store import ControllerStore, read_summary
    from monarch_fs.fs.chunk import chunk_id, encode

    point = tmp_path / "store" / "packs" / "00000001.durable"

    async def push(data: list[bytes]) -> None:
        store, busy = await ControllerStore.open(tmp_path / "store", 1 << 30)
        assert store is not None and busy is None
        for d in data:
            store.add(chunk_id(d), encode(d))
        store.finish(chunk_id(b"v%d" % len(data)), "w", 1)
        store.close()

    trio.run(push, [b"chunk-%d" % i for i in range(10)])
    assert point.exists()
    os.utime(point, ns=(10**9, 10**9))  # as a flush long ago left it
    trio.run(push, [])
    assert point.stat().st_mtime_ns == 10**9
    assert len(read_summary(tmp_path / "store", 1 << 30).snapshots) == 2
    trio.run(push, [b"more"])
    assert point.stat().st_mtime_ns != 10**9
