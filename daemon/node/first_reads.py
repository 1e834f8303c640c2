"""The files a node reads first after a version is published, per workspace: what push --early
sends before it publishes (as Nydus prefetch lists and CernVM-FS preloading do).

After each publish that changes a workspace's version, the daemon records the distinct paths
opened or read in it, in order of first read, for RECORD_SECONDS or MAX_PATHS, whichever ends
first: a job's start (`import torch`) and not what it reads for hours after. The list is kept
in the state folder (one JSON file per workspace), so it outlives the daemon; a push asks every
node for it (`first_reads`) and keeps a merged list on the dev box, so a push to the fresh
nodes of a new allocation knows it too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..wire.path_lists import MAX_PATHS, load_paths, save_paths

log = logging.getLogger("monarch_fs.daemon")

RECORD_SECONDS = 60.0


@dataclass
class _Recording:
    version: bytes
    started: float
    paths: list[bytes] = field(default_factory=list)
    seen: set[bytes] = field(default_factory=set)
    saved: bool = False


class FirstReads:
    """The recordings, one per workspace; `note` is called by the read path (cheap: a dict
    and a set lookup), `published` by a commit, `paths` by the `first_reads` request."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._recording: dict[bytes, _Recording] = {}

    def published(self, name: str, version: bytes) -> None:
        """Start recording `name`'s first reads, unless this version is recorded already (a
        push --early commits twice: at usable and at complete)."""
        ws = name.encode()
        rec = self._recording.get(ws)
        if rec is None or rec.version != version:
            self._recording[ws] = _Recording(version, time.monotonic())

    def note(self, ws: bytes, path: bytes) -> None:
        """A file of workspace `ws` was opened or read."""
        rec = self._recording.get(ws)
        if rec is None or path in rec.seen or len(rec.paths) >= MAX_PATHS:
            return
        if time.monotonic() - rec.started > RECORD_SECONDS:
            return
        rec.seen.add(path)
        rec.paths.append(path)

    def _file(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    async def paths(self, name: str) -> list[bytes]:
        """The latest recording of `name` that holds anything (this daemon's, saved first, or
        a saved one from before), in order of first read."""
        rec = self._recording.get(name.encode())
        if rec is not None and rec.paths:
            await self._save(name, rec)
            return list(rec.paths)
        return await trio.to_thread.run_sync(self._load, name)

    def _load(self, name: str) -> list[bytes]:
        try:
            return load_paths(self._file(name))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("first reads of %s: %s", name, e)
            return []

    async def _save(self, name: str, rec: _Recording) -> None:
        if rec.saved:
            return
        done = time.monotonic() - rec.started > RECORD_SECONDS or len(rec.paths) >= MAX_PATHS
        paths = list(rec.paths)

        try:
            await trio.to_thread.run_sync(save_paths, self._file(name), paths)
            rec.saved = done  # a recording still going is saved again when asked
        except OSError as e:
            log.warning("saving the first reads of %s: %s", name, e)
