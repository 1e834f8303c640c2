"""What a node does at start with the versions it saved: serve each workspace's newest whole
version, and say what a crash took.

The store has already verified what lay past its durable points and dropped what did not verify
(fs/durable.py, fs/file_objects.py); here every retained version is checked against it. A
version published early may lack chunks by design (incomplete.py); any other that lacks an
object lost it in a crash before the flush (--durable background: flusher.py) or to damage.
A current version that lost chunks, or folder objects of its manifest, gives way to the newest
whole retained version, and `status` and the event log say which version and how many chunks
(lost.py). A workspace whose current version does not load and has no whole one to serve
instead is not served at all but kept in refs.json (Refs.hold); an older version that is not
whole is dropped. Each is a problem in `status`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ...fs.chunk import CorruptChunk
from ...fs.manifest import Manifest, ManifestError
from ...fs.store import Store
from .events import EventLog
from .lost import LostVersion

if TYPE_CHECKING:
    from .publisher import Publisher


async def load(publisher: Publisher) -> None:
    """Serve the saved workspaces (see the module docstring); Publisher.load."""
    record(publisher.store, publisher.events)
    for name, versions in list(publisher.refs.workspaces.items()):
        loaded, problems, lost = [], [], None
        for v in versions:
            manifest, chunks, why = await check_whole(publisher, v)
            if manifest is not None:
                loaded.append((v, manifest))
            elif v == versions[0] and (chunks is not None or isinstance(why, KeyError)):
                lost = (v, chunks, why)  # served instead: the newest whole version
            elif v == versions[0]:
                problems.append(f"workspace {name!r} not served: its current version "
                                f"{v.hex()[:12]} does not load: {_why(why)}")
                break
            else:
                problems.append(f"workspace {name!r}: older version {v.hex()[:12]} "
                                f"dropped: {_why(why) if why else f'it lacks {chunks} chunks'}")
        if lost is not None:
            problems += note_lost(publisher, name, *lost, loaded[0][0] if loaded else None)
        if problems:
            publisher.workspace_problems[name] = problems
        if not loaded:
            publisher.refs.hold(name)
            continue
        publisher.refs.workspaces[name] = [v for v, _ in loaded]
        await publisher.fs.set_workspace(name.encode(), loaded)
    publisher.incomplete.settle_loaded(await publisher.lacking(publisher.refs.early))


def _why(e: Exception | None) -> str:
    return "manifest not in the store" if isinstance(e, KeyError) else str(e)


def record(store: Store, events: EventLog | None) -> None:
    """Record what the store's check past its durable points dropped at start, if anything."""
    if events is not None and (store.lost or store.lost_bytes):
        events.record("store.recovered", count=store.lost, bytes=store.lost_bytes,
                      text="objects past the durable points that did not verify were dropped")


async def check_whole(publisher: Publisher, version: bytes
                      ) -> tuple[Manifest | None, int | None, Exception | None]:
    """(its manifest, None, None) if `version` is whole or published early; (None, chunks
    it lacks, None) if its manifest loads but chunks are missing; (None, None, why) if its
    manifest does not load (a KeyError: an object of it is not in the store)."""
    try:
        manifest = await publisher.manifest(version)
    except (KeyError, CorruptChunk, ManifestError, OSError) as e:
        return None, None, e
    if publisher.incomplete.has(version):
        return manifest, None, None
    lacking = await trio.to_thread.run_sync(publisher.incomplete.lacking, publisher.store,
                                            manifest)
    return (manifest, None, None) if not lacking else (None, lacking, None)


def note_lost(publisher: Publisher, name: str, version: bytes, chunks: int | None,
         why: Exception | None, serving: bytes | None) -> list[str]:
    """Note that workspace `name`'s current `version` lacks `chunks` (None: its manifest does
    not load, `why`), `serving` the newest whole version instead (None: none); the problems
    to list in `status` beside the loss."""
    if serving is None and chunks is None:  # nothing to serve instead: as any other failure
        return [f"workspace {name!r} not served: its current version {version.hex()[:12]} "
                f"does not load: manifest not in the store"]
    loss = LostVersion(version, chunks, serving)
    publisher.losses.note(name, loss)
    if publisher.events is not None:
        publisher.events.record("version.lost", workspace=name, version=version.hex(),
                                count=chunks, text=loss.describe(name),
                                detail={"serving": serving.hex() if serving else None,
                                        "manifest_lost": chunks is None})
    return []
