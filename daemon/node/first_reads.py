"""What a node reads first after a version is published, per workspace and per chunk: what push
--early sends before it publishes (as Nydus prefetch lists and CernVM-FS preloading do).

After each publish that changes a workspace's version, the daemon records the distinct reads
in it, in order: each file opened, and each chunk of it read through the daemon (wire/
read_lists.py), for RECORD_SECONDS or MAX_PATHS files, whichever ends first: a job's start
(`import torch`) and not what it reads for hours after. `import torch` reads part of
libtorch_cpu.so, not all of it: per chunk, push --early makes the version usable once those
chunks are there, not the whole 400 MB.

A large file opened by passthrough is read by the kernel, past the daemon: what of it was read
is known only from its backing file's pages in the page cache (fs/residency.py), taken when
the recording closes (or when a push asks for it before) and placed after the file's opening.
A file with nothing known of its chunks stays a whole file in the list.

The list is kept in the state folder (one JSON file per workspace) once the recording closes
or a push asks for it, so it outlives the daemon; a push asks every node for it (`first_reads`)
and keeps a merged list on the dev box, so a push to the fresh nodes of a new allocation knows
it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..wire.read_lists import MAX_PATHS, MAX_READS, Read, load_reads, save_reads

log = logging.getLogger("monarch_fs.daemon")

RECORD_SECONDS = 60.0

# (workspace, path) -> the chunks of that file in the page cache, if it is read by passthrough
# (None: it is not, or nothing is known). Blocking: a worker thread.
Resident = Callable[[bytes, bytes], list[int] | None]


@dataclass
class _Recording:
    version: bytes
    started: float
    reads: list[Read] = field(default_factory=list)
    seen: set[Read] = field(default_factory=set)
    paths: set[bytes] = field(default_factory=set)
    saved: bool = False  # saved since it closed: nothing to add
    closed: bool = False


class FirstReads:
    """The recordings, one per workspace; `note` is called by the read path (cheap: a dict
    and a set lookup), `published` by a commit, `reads` by the `first_reads` request."""

    def __init__(self, folder: Path, resident: Resident | None = None) -> None:
        self.folder = folder
        self.resident = resident
        self.nursery: trio.Nursery | None = None  # while serving: recordings close on time
        self._recording: dict[bytes, _Recording] = {}

    def published(self, name: str, version: bytes) -> None:
        """Start recording `name`'s first reads, unless this version is recorded already (a
        push --early commits twice: at usable and at complete)."""
        ws = name.encode()
        rec = self._recording.get(ws)
        if rec is None or rec.version != version:
            rec = self._recording[ws] = _Recording(version, time.monotonic())
            if self.nursery is not None:
                self.nursery.start_soon(self._close_later, name, rec)

    def note(self, ws: bytes, path: bytes, chunk: int | None = None) -> None:
        """Chunk `chunk` of a file of workspace `ws` was read (None: the file was opened)."""
        rec = self._recording.get(ws)
        if rec is None or rec.closed or (path, chunk) in rec.seen:
            return
        if len(rec.reads) >= MAX_READS or time.monotonic() - rec.started > RECORD_SECONDS:
            return
        if path not in rec.paths:
            if len(rec.paths) >= MAX_PATHS:
                return
            rec.paths.add(path)
        rec.seen.add((path, chunk))
        rec.reads.append((path, chunk))

    def _file(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    async def reads(self, name: str) -> list[Read]:
        """The latest recording of `name` that holds anything (this daemon's, saved first, or
        a saved one from before), in order of first read."""
        rec = self._recording.get(name.encode())
        if rec is not None and rec.reads:
            if not rec.closed and (time.monotonic() - rec.started > RECORD_SECONDS
                                   or len(rec.paths) >= MAX_PATHS):
                rec.closed = True
            return await self._save(name, rec)
        return await trio.to_thread.run_sync(self._load, name)

    async def _close_later(self, name: str, rec: _Recording) -> None:
        """Close the recording when its time is up, and keep it."""
        await trio.sleep(RECORD_SECONDS)
        if not rec.closed and self._recording.get(name.encode()) is rec:
            rec.closed = True
            if rec.reads:
                await self._save(name, rec)

    def _load(self, name: str) -> list[Read]:
        try:
            return load_reads(self._file(name))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("first reads of %s: %s", name, e)
            return []

    async def _save(self, name: str, rec: _Recording) -> list[Read]:
        """The recording with what the page cache says of its passthrough files, saved (again,
        unless it was saved closed)."""
        reads = list(rec.reads)
        if rec.saved:
            return reads
        done = rec.closed
        reads = await trio.to_thread.run_sync(self._with_resident, name.encode(), reads)
        try:
            await trio.to_thread.run_sync(save_reads, self._file(name), reads)
            rec.saved = done  # a recording still going is saved again when asked
        except OSError as e:
            log.warning("saving the first reads of %s: %s", name, e)
        if done:
            rec.reads = reads
        return reads

    def _with_resident(self, ws: bytes, reads: list[Read]) -> list[Read]:
        """`reads`, with the chunks in the page cache of each file opened and never read
        through the daemon after its opening. Blocking: a worker thread."""
        if self.resident is None:
            return reads
        read = {p for p, k in reads if k is not None}
        out: list[Read] = []
        for path, k in reads:
            out.append((path, k))
            if k is None and path not in read:
                try:
                    chunks = self.resident(ws, path)
                except OSError as e:
                    log.debug("first reads: pages of %r: %s", path, e)
                    chunks = None
                out += [(path, i) for i in chunks or ()]
        return out[:MAX_READS]
