"""A fresh node places a push's large files from the folder objects' records (fs/placement.py)
while the version itself loads behind, once (daemon/node/manifest_cache.py). Real scans, a
real store on disk; the whole push path is tests/test_ingest.py's."""

from __future__ import annotations

import os

import pytest
import trio

from monarch_fs.daemon.node.manifest_cache import ManifestCache
from monarch_fs.daemon.node.refs import Refs
from monarch_fs.fs.backing import MIN_SIZE, wanted
from monarch_fs.fs.chunk import RAW, encode
from monarch_fs.fs.entry import MissingObject, TooManyEntries
from monarch_fs.fs.placement import large_files
from monarch_fs.fs.scan import scan
from monarch_fs.fs.store import Store

CHUNK = 64 * 1024


def tree(root) -> None:
    """Large files at several depths (one a chunk multiple, one not), small ones, a symlink."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "big.bin").write_bytes(os.urandom(MIN_SIZE + 5))
    (root / "a" / "exact.bin").write_bytes(os.urandom(8 * CHUNK))
    (root / "a" / "b" / "deep.so").write_bytes(os.urandom(MIN_SIZE * 3 + 1))
    (root / "a" / "small.py").write_text("x = 1\n")
    (root / "a" / "b" / "under.bin").write_bytes(os.urandom(MIN_SIZE - 1))
    os.symlink("big.bin", root / "link")


def snapshot(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    tree(src)
    return trio.run(scan, src, (), CHUNK).manifest


def test_the_large_files_read_from_records_are_those_the_loaded_version_has(tmp_path):
    m = snapshot(tmp_path)
    objects = m.objects()
    chunk_size, files = large_files(m.id, objects.__getitem__, 1000)
    assert chunk_size == CHUNK
    assert sorted(files) == sorted(e for e in m if wanted(e))
    assert {e.path for e in files} == {b"big.bin", b"a/exact.bin", b"a/b/deep.so"}


def test_a_missing_folder_object_and_too_many_records_are_refused(tmp_path):
    m = snapshot(tmp_path)
    objects = dict(m.objects())
    del objects[m.root.sub[b"a"].sub[b"b"].oid]
    with pytest.raises(MissingObject, match="a/b"):
        large_files(m.id, objects.__getitem__, 1000)
    with pytest.raises(TooManyEntries):
        large_files(m.id, m.objects().__getitem__, len(m) - 2)


def cache_with(tmp_path, m, *, root: bool):
    """A node's store holding `m`'s folder objects (the root too, with `root`), and its
    ManifestCache, which has loaded nothing."""
    store = Store(tmp_path / "store")
    for oid, blob in m.objects().items():
        if root or oid != m.id:  # in a push, the root arrives last, in the frame at hand
            store.put_blob(oid, encode(blob))
    return store, ManifestCache(store, Refs(tmp_path / "refs.json"), 1000)


def test_a_version_asked_for_while_it_loads_is_loaded_once(tmp_path):
    """Two prepares (or a prepare and the load behind a fresh node's placement) asking for the
    same version at once get the one Manifest loaded, not two loads of 46k entries."""
    m = snapshot(tmp_path)
    store, cache = cache_with(tmp_path, m, root=True)
    got: list = []

    async def main() -> None:
        async def ask() -> None:
            got.append(await cache.get(m.id))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)

    trio.run(main)
    assert got[0] is got[1] is cache.decoded[m.id]
    assert got[0].entries == m.entries
    store.close()


def test_a_fresh_node_places_the_large_files_then_loads_the_version_behind(tmp_path):
    m = snapshot(tmp_path)
    store, cache = cache_with(tmp_path, m, root=False)
    root = m.objects()[m.id]
    got = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            got["placed"] = await cache.place(m.id, bytes([RAW]) + root, nursery)
            got["loaded"] = dict(cache.decoded)  # nothing yet: it loads behind
            store.put_blob(m.id, encode(root))  # as the session writes it meanwhile
        got["prepare"] = await cache.get(m.id)

    trio.run(main)
    assert got["placed"] == 3 and got["loaded"] == {}
    assert all(store.objects.wants(e.chunks[0]) for e in m if wanted(e))
    assert got["prepare"] is cache.decoded[m.id] and got["prepare"].entries == m.entries
    store.close()
