"""A node's decoded manifests (daemon/node/manifest_cache.py): a version asked for while it
loads is loaded once. A real store on disk and a real scanned folder."""

from __future__ import annotations

import trio

from monarch_fs.daemon.node.manifest_cache import ManifestCache
from monarch_fs.daemon.node.refs import Refs
from monarch_fs.fs.chunk import encode
from monarch_fs.fs.scan import scan
from monarch_fs.fs.store import Store


def test_a_version_asked_for_while_it_loads_is_loaded_once(tmp_path):
    """push --early's prepare (control channel) asks for the version the data connection's
    session is loading: both get the one Manifest, not two loads of every entry (46k for a
    torch venv, 0.12-0.4 s of the daemon's GIL each)."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    for i in range(50):
        (src / "a" / "b" / f"m{i}.py").write_text(f"x = {i}\n")
    m = trio.run(scan, src).manifest
    store = Store(tmp_path / "store")
    for oid, blob in m.objects().items():
        store.put_blob(oid, encode(blob))
    cache = ManifestCache(store, Refs(tmp_path / "refs.json"), 1000)
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
