"""Where a push keeps what it sent in the dev box store (daemon/client/keeper.py): a chunk that
went raw (a loopback link) is not compressed beside the send, on the cores the send and the nodes
need, but after the publish, so that one push leaves the store whole for the next push to fresh
nodes, however much it sent (the keeper's budget once left part of it to each later push)."""

from __future__ import annotations

import os

import pytest
import trio
from fillers import wait_fillers
from test_controller_store import HALF, make_src, push_from_store

from helpers import tree
from monarch_fs.daemon.client import encoding, keeper
from monarch_fs.daemon.client.controller_store import ControllerStore
from monarch_fs.fs import chunk
from monarch_fs.settings import settings


def test_a_raw_link_gets_no_zstd_on_the_send_path_and_the_fill_keeps_it(tmp_path):
    """Over a raw link, `encoded` compresses nothing and hands the keeper nothing: a chunk
    that compresses is left for the fill after the publish, which keeps it compressed; one
    that does not is only recorded as its own source."""
    texty = [os.urandom(300_000).translate(HALF) for _ in range(3)]
    random = [os.urandom(300_000)]
    data = {chunk.chunk_id(d): d for d in texty + random}

    async def main() -> None:
        cs, why = await ControllerStore.open(tmp_path / "store", 1 << 30)
        assert cs is not None, why
        try:
            blobs, raws, later = encoding.encoded(
                list(data), zstd=False, raw=True, store=cs, objects={},
                read=lambda cid, fd: bytearray(1) + data[cid], fresh=lambda cid: True)
            assert blobs == [] and later == []
            assert [bytes(b) for _, b in raws] == [bytes([chunk.RAW]) + d for d in data.values()]
            assert cs.store.missing(data) == list(data)  # nothing compressed or written yet
            assert cs.is_sourced(chunk.chunk_id(random[0]))

            assert await cs.fill(data, lambda cid: data[cid]) == 3
            assert cs.store.missing(data) == [chunk.chunk_id(random[0])]  # its file is its form
            for d in texty:
                blob = cs.store.get_blob(chunk.chunk_id(d))
                assert blob[0] != chunk.RAW and len(blob) < len(d) * 0.7
                assert bytes(chunk.decode(chunk.chunk_id(d), blob)) == d
        finally:
            cs.close()

    trio.run(main)


def test_a_fill_out_of_time_keeps_folder_objects_and_leaves_the_rest_to_the_next(tmp_path):
    """A push's fill has a time bound (a first push of a large env need not wait for all of
    it): past it, only folder objects (which no file can give again) are still kept; the next
    fill keeps the rest."""
    texty = [os.urandom(300_000).translate(HALF) for _ in range(4)]
    data = {chunk.chunk_id(d): d for d in texty}
    folder = chunk.chunk_id(texty[0])

    async def main() -> None:
        cs, why = await ControllerStore.open(tmp_path / "store", 1 << 30)
        assert cs is not None, why
        try:
            assert await cs.fill(data, lambda cid: data[cid], [folder], seconds=0) == 1
            assert sorted(cs.store.missing(data)) == sorted(set(data) - {folder})
            assert await cs.fill(data, lambda cid: data[cid], [folder]) == 3
            assert cs.store.missing(data) == []
        finally:
            cs.close()

    trio.run(main)


@pytest.mark.mount
def test_one_loopback_push_leaves_the_store_whole(tmp_path, fresh_cluster):
    """A loopback push (raw) of more compressible bytes than the keeper holds at once returns
    with the store lacking them, and the filler it started (store_filler.py) fills them: the
    next push to a fresh node over a zstd link sends every chunk from the store and reads
    nothing of the source."""
    src = make_src(tmp_path / "env", size=keeper.BUDGET + (32 << 20))
    want = tree(src)
    r1 = fresh_cluster(1).push_json(src)
    assert [c["compression"] for c in r1["links"]] == ["none"]
    big = -(-(keeper.BUDGET + (32 << 20)) // chunk.CHUNK_SIZE)
    assert r1["store"]["background_fill"] and r1["store"]["lacking"] >= big
    wait_fillers()
    [line] = (settings.home / "store-fill.log").read_text().splitlines()
    assert f"env {r1['version'][:12]}: kept {r1['store']['lacking']} chunks in" in line
    assert line.endswith("0 lacking [SCHED_IDLE]"), line

    second = fresh_cluster(1)
    r2 = push_from_store(second, src)
    assert r2["bytes_sent"] < r2["bytes"] * 0.7
    assert tree(second.mnt(0) / "env") == want
