"""The store gives space back: packs whose chunks no retained version, publish in flight or open
file uses are deleted after a publish. Real daemons and mounts; 1 MiB packs so a few small
pushes fill several."""

from __future__ import annotations

import json
import os
import time

import pytest

from helpers import mfs, tree, wait_for

pytestmark = pytest.mark.mount

MiB = 1 << 20
FILES = 12
SIZE = 200 * 1024  # below the backing-file size: these files are read through the store


def fill(src) -> dict[str, bytes]:
    data = {f"m{i}.py": os.urandom(SIZE) for i in range(FILES)}
    for name, content in data.items():
        (src / name).write_bytes(content)
    return data


def test_packs_of_dropped_versions_are_collected_but_not_an_open_file(small_packs,
                                                                       fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    first = fill(src)
    c.push(src)
    mnt = c.mnt(0) / "ws"
    held = open(mnt / "m0.py", "rb")  # a job keeps one file of the first version open
    try:
        versions = [first]
        for _ in range(3):  # the daemon keeps 3 versions: the first is dropped at the 4th
            versions.append(fill(src))
            c.push(src)
        wait_for(lambda: c.status()[0]["packs_collected"] > 0, 20, "a collect")
        node = c.status()[0]
        assert node["bytes_collected"] >= MiB
        # Retained versions are whole, through the current view and .versions/.
        assert tree(mnt) == tree(src)
        listed = sorted(os.listdir(c.mnt(0) / ".versions" / "ws"))
        assert len(listed) == 3
        for v in listed:
            got = {n: (c.mnt(0) / ".versions" / "ws" / v / n).read_bytes() for n in versions[1]}
            assert got in versions[1:]
        # The open file of the dropped version still reads, from the store, not a cache.
        os.posix_fadvise(held.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert held.read() == first["m0.py"]
    finally:
        held.close()
    # The store shrank by what it collected: about a version's worth, not less.
    assert node["store_bytes"] < 4 * FILES * SIZE


def test_a_push_in_flight_keeps_what_it_was_told_the_node_has(small_packs, fresh_cluster,
                                                              tmp_path):
    """A node that told a push "I have these" keeps them until that push commits, even if a
    publish of another workspace drops the last version using them meanwhile."""
    import trio

    from monarch_fs.daemon.client.push import push
    from monarch_fs.daemon.client.push_options import PushOptions
    from monarch_fs.daemon.wire.auth import load_token
    from monarch_fs.daemon.wire.transport import connect
    from monarch_fs.fs.scan import scan

    c = fresh_cluster(1)
    token = load_token(c.token_file)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    shared = fill(a)  # workspace a holds these chunks...
    c.push(a)
    for name, content in shared.items():
        (b / name).write_bytes(content)  # ...and b will be pushed with the same content

    async def main() -> None:
        snap = await scan(b)
        ids = snap.manifest.chunk_ids()
        chan = await connect(c.hosts[0], token)
        try:
            assert await chan.query_missing(ids) == []  # "I have all of b's chunks"
            for _ in range(3):  # meanwhile a moves on: its first version is dropped
                fill(a)
                await push(a, c.hosts, token, PushOptions(transport="tcp"))
            assert c.status()[0]["packs_collected"] == 0  # the claim held the collect back
            assert await chan.query_missing(ids) == []
        finally:
            await chan.aclose()
        # The claim went with the session: the deferred collect drops the first version of a
        wait_for(lambda: c.status()[0]["packs_collected"] > 0, 20, "the deferred collect")
        await push(b, c.hosts, token, PushOptions(transport="tcp"))  # which sends b's chunks again

    trio.run(main)
    assert tree(c.mnt(0) / "b") == tree(b)


def test_a_pack_left_mostly_dead_is_compacted_and_its_live_file_still_reads(small_packs,
                                                                            fresh_cluster,
                                                                            tmp_path):
    """A file no push changes outlives the version it came with, and the rest of the pack it
    arrived in is given back: its chunk is copied out and the pack deleted, rather than kept
    whole for one live file."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    first = fill(src)
    c.push(src)
    cid = bytes.fromhex(os.getxattr(c.mnt(0) / "ws" / "m0.py", "user.monarch.chunks").decode())
    packs = c.dir / "node-0" / "state" / "store" / "packs"
    first_pack, = [p for p in packs.glob("*.pack") if b"MFSR" + cid in p.read_bytes()]
    for _ in range(3):  # every file but m0 changes; the first version goes at the 4th push
        for i in range(1, FILES):
            (src / f"m{i}.py").write_bytes(os.urandom(SIZE))
        c.push(src)
    wait_for(lambda: not first_pack.exists(), 20, "m0's first pack to be compacted")
    with open(c.mnt(0) / "ws" / "m0.py", "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read from the store
        assert f.read() == first["m0.py"]
    assert tree(c.mnt(0) / "ws") == tree(src)


def test_small_pushes_put_the_collect_off_and_a_large_one_does_not(fresh_cluster, tmp_path,
                                                                    monkeypatch):
    """A collect passes over every retained version: after pushes that brought under 1 MiB
    (an edit loop's) it waits 30 s, so edits seconds apart do not each pay for one; a push that
    brings more collects once publishes pause for 1 s. Seen in the node's `store.collected`
    events, through `monarch-fs query`."""
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")  # events written every 0.2 s
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    fill(src)  # 2.4 MiB

    def collected_since_commit() -> bool:
        """Whether a collect ran after the last commit."""
        out = mfs("query", "SELECT kind FROM events WHERE kind IN ('store.collected', "
                  "'push.committed') ORDER BY ts", "--hosts", c.hostfile, "--token-file",
                  c.token_file, "--json")
        kinds = [r["kind"] for r in json.loads(out.stdout)["rows"]]
        return "push.committed" in kinds and kinds[-1] == "store.collected"

    c.push(src)
    wait_for(collected_since_commit, 20, "the collect after a large push")
    for i in range(2):  # two small edits
        (src / "m0.py").write_bytes(b"edit %d\n" % i)
        c.push(src)
    time.sleep(3)  # past COLLECT_DELAY, twice over
    assert not collected_since_commit()
    fill(src)
    c.push(src)
    wait_for(collected_since_commit, 20, "the collect after a large push again")
