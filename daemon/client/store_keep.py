"""What a push keeps in the dev box store after the publish, and what it leaves to a filler.

The store should end whole (every chunk of the snapshot, in its wire form) so that the next push
to fresh nodes sends from it; what went raw to the nodes and compresses is not in it yet. A first
push of the torch venv from a fresh dev box home spent 2.73 s of its 6.55 s compressing that
(keep), after every node had the version. So by default (MONARCH_FS_STORE_FILL=background) the
push keeps inline only what must be kept now: the folder objects, which no file can give again
(what the keeper wrote beside the send is in already). It records the snapshot, closes the store
and, if the store still lacks chunks of it (or a filler a push stopped left some of another),
starts a filler (store_filler.py) that reads them again from the folder, at the lowest CPU
priority, with no deadline; the command returns once the version is published and the
snapshot recorded. `inline` fills before returning, bounded
(at least KEEP_SECONDS, at most as long again as the push took: the rest waits for the next
push); `off` keeps only what must be.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ...fs.snapshot import SourceChanged
from . import filler_control
from .controller_store import ControllerStore

# What an inline fill may spend after the publish, at least (and at most as long as the push
# took before it): a first push of a large env does not wait for it all.
KEEP_SECONDS = 2.0


@dataclass
class Kept:
    """What keep() did: lines to report, and how many chunks of the snapshot the store lacks
    still (a background filler's work)."""

    lines: list[str] = field(default_factory=list)
    lacking: int = 0
    background: bool = False  # whether a filler is to fill them (MONARCH_FS_STORE_FILL)
    pending: bool = False  # whether an earlier filler, stopped, left some for the next
    filler: int | None = None  # the pid of the filler started for them


async def keep(store: ControllerStore, mode: str, ids: Collection[bytes],
               objects: Collection[bytes], read: Callable[[bytes], bytes | memoryview],
               started: float, version: bytes, name: str, content_bytes: int) -> Kept:
    """After publishing: add to the store what `mode` says (see the module docstring), record
    the snapshot and apply the bound; `ids` the snapshot's chunks, `objects` its folder
    objects, `read` a chunk's bytes checked against its id, `started` the push's start."""
    kept = Kept()
    try:
        if mode == "inline":
            # At most as long again as the push took so far: the rest waits for the next push.
            store.added = await store.fill([*ids, *objects], read, objects,
                                           seconds=max(KEEP_SECONDS, time.monotonic() - started))
        else:
            store.added = await store.fill(list(objects), read, objects)
    except (SourceChanged, OSError) as e:  # published already: the next push reads it again
        kept.lines.append(f"the dev box store misses some chunks of this push: {e}")
    kept.lines += await trio.to_thread.run_sync(store.finish, version, name, content_bytes)
    kept.lacking = await trio.to_thread.run_sync(store.lacks, ids)
    kept.background = mode == "background"
    kept.pending = bool(filler_control.read_pending(store.root))
    return kept


def filler_spec(home: Path, store: Path, bound: int, src: str | os.PathLike[str],
                excludes: Sequence[str], cache_dir: str | os.PathLike[str] | None,
                version: bytes, name: str) -> dict:
    """What a filler is told (store_filler.py): where the store and its home are, and the
    push's folder, scan options and version."""
    return {"home": str(home), "store": str(store), "bound": bound,
            "src": os.path.abspath(src), "excludes": list(excludes),
            "cache": None if cache_dir is None else os.path.abspath(cache_dir),
            "version": version.hex(), "name": name}


async def start_filler(kept: Kept, spec: dict) -> list[str]:
    """Start the filler for what `keep` left, if it is to (the store closed: it takes the
    store's lock); the lines to report."""
    if not (kept.background and (kept.lacking or kept.pending)):
        return []
    try:
        kept.filler = await trio.to_thread.run_sync(filler_control.start, spec,
                                                    Path(spec["home"]))
    except OSError as e:  # the push is done all the same: the next push fills the store
        return [f"the dev box store's filler could not start ({e}); the next push reads "
                "what it lacks from the source"]
    return []
