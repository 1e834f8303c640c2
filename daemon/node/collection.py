"""Collecting a node's store: deleting the chunks that nothing uses, when no push can still
need them, and when commits pause (see COLLECT_DELAY).

Apart from the publisher's phases (publisher.py), which tell it when: a claim while a push was
told what this node has, a commit, a removal, a forgotten file. What it keeps is every chunk of
a retained version, of a version being published (`pinned`) and of a file the kernel holds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

import trio

from ...fs.chunk import CorruptChunk
from ...fs.fuse_ops import SnapshotFS
from ...fs.manifest import Manifest, ManifestError
from ...fs.store import Store
from .events import EventLog
from .refs import Refs

log = logging.getLogger("monarch_fs.daemon")

# A commit's collect waits until commits pause for COLLECT_DELAY seconds. A collect reads every
# retained version's chunk ids and holds the store meanwhile (0.3 s of CPU with 100k files),
# and an edit loop commits several times a second: a collect a second after each commit took
# half of each second on 4 nodes sharing 2 cores. It waits no longer than COLLECT_MAX_WAIT,
# nor once the pushes since the last collect brought COLLECT_BYTES (what they replaced may
# be that much garbage). A removal, a push that went away or a forgotten file collects at once.
# Pushes that brought less than COLLECT_SMALL since the last collect (an edit loop's: a few
# files) mostly replaced as little: their collect waits COLLECT_MAX_WAIT, not COLLECT_DELAY, so
# a person's edits seconds apart do not each cost a pass over every retained version (as
# above: 0.3 s of CPU with 100k files). (A push that deletes a large file is the exception:
# its space comes back that much later.)
COLLECT_DELAY = 1.0
COLLECT_MAX_WAIT = 30.0
COLLECT_BYTES = 256 << 20
COLLECT_SMALL = 1 << 20
UNLOADABLE = (KeyError, CorruptChunk, ManifestError)  # a manifest missing, damaged or refused


class Collection:
    """When to collect and what may go: claims, the collect's schedule, the collect itself and
    cutting the open pack back. `lock`: a collect, the answers to "which chunks do you lack",
    a prepare's check that it has every chunk, durably, and a cut back of the open pack (which
    only drops what is not durable): none of them runs during another."""

    def __init__(self, store: Store, refs: Refs, fs: SnapshotFS, *, counters: dict[str, int],
                 events: EventLog | None, manifest: Callable[[bytes], Awaitable[Manifest]],
                 pinned: Callable[[], Iterable[bytes]]) -> None:
        self.store = store
        self.refs = refs
        self.fs = fs
        self.counters = counters
        self.events = events  # collects are recorded there
        self.manifest = manifest  # a version's manifest (Publisher.manifest)
        self.pinned = pinned  # the versions being published
        self.nursery: trio.Nursery | None = None  # set while the service runs
        self.lock = trio.Lock()
        self.due: float | None = None  # when the next collect starts (trio time)
        self._deferred_since: float | None = None  # commits put the next collect off since
        self._received_at_collect = 0  # counters["bytes_received"] at the last collect
        self.negotiating = 0  # sessions told what this node has, and not committed since

    def claim(self) -> None:
        """A session was told what this node has: nothing is collected until it commits."""
        self.negotiating += 1

    def release_claim(self, committed: bool = False) -> None:
        """A session told what this node has committed (its collect waits for commits to
        pause: COLLECT_DELAY) or went away (it collects at once)."""
        self.negotiating -= 1
        self.start(committed)

    def start(self, committed: bool = False) -> None:
        """After a commit, a released claim, a removal or a forgotten file: once no push is in
        flight, the chunks the last ones left unused can go: at once, or after a commit once
        commits pause (see COLLECT_DELAY). One collect waiting does for every request made
        meanwhile that can wait as long (the kernel forgets files in many batches); one that
        cannot starts a collect of its own."""
        if self.negotiating or self.nursery is None:
            return
        now = trio.current_time()
        brought = self.counters["bytes_received"] - self._received_at_collect
        due = now
        if committed:
            due += COLLECT_DELAY if brought >= COLLECT_SMALL else COLLECT_MAX_WAIT
            if self._deferred_since is not None:
                due = min(due, self._deferred_since + COLLECT_MAX_WAIT)
        if committed and self._deferred_since is not None and self.due is not None:
            if now - self._deferred_since < COLLECT_MAX_WAIT and brought < COLLECT_BYTES:
                self.due = due  # put off again: the waiting task sees it and leaves
                self.nursery.start_soon(self._at, due)
                return
        if committed and self.due is None:
            self._deferred_since = now
        if self.due is None or due < self.due:
            if not committed:
                self._deferred_since = None  # due now: a commit may not put it off
            self.due = due
            self.nursery.start_soon(self._at, due)

    async def _at(self, due: float) -> None:
        await trio.sleep_until(due)
        if self.due is not None and self.due <= due:
            await self.collect()

    async def collect(self) -> None:
        """Delete the store's packs that hold only chunks nothing uses (no retained version, no
        version being published, no file the kernel still holds), and compact those that hold
        mostly such chunks (Store.collect). Skipped while another push has been told what this
        node has (those chunks must stay): its commit collects."""
        async with self.lock:
            self.due = self._deferred_since = None
            self._received_at_collect = self.counters["bytes_received"]
            if self.negotiating:
                return
            if self.refs.held:  # what their versions use is unknown (`status` says why)
                log.warning("not collecting: workspaces not loaded at start: %s",
                            ", ".join(map(repr, self.refs.held)))
                return
            retained = {v for vs in self.refs.workspaces.values() for v in vs}
            versions = retained | set(self.pinned())
            manifests = []
            for v in versions:
                try:
                    manifests.append(await self.manifest(v))
                except UNLOADABLE as e:
                    if v in retained:  # what it uses is unknown: delete nothing
                        log.warning("not collecting: version %s: %s", v.hex()[:12], e)
                        return
                    # else a version being published whose manifest has not arrived
            held = self.fs.held_chunks()

            def live() -> Iterator[Iterable[bytes]]:  # by version: few repeats in each
                yield versions
                yield held
                for m in manifests:
                    yield m.object_ids()
                    yield (c for e in m for c in e.chunks)

            start = trio.current_time()
            try:
                packs, freed = await trio.to_thread.run_sync(self.store.collect, live)
                if self.events is not None:
                    objects, size = await trio.to_thread.run_sync(self.store.usage)
                    self.events.record("store.collected", count=packs, bytes=freed,
                                       seconds=round(trio.current_time() - start, 6))
                    self.events.record("store.size", count=objects, bytes=size)
            except OSError as e:
                log.warning("collecting the store: %s", e)
                return
        if packs:
            self.counters["packs_collected"] += packs
            self.counters["bytes_collected"] += freed
            log.info("collected %d packs, freeing %d bytes no version uses", packs, freed)

    async def cut_back(self) -> None:
        """After a session failed to store a chunk: cut the open pack back to its last durable
        record, so the chunks that failed push did store give their space back now
        (Store.cut_back). A push that fails for another reason keeps them, for the next."""
        async with self.lock:
            try:
                freed = await trio.to_thread.run_sync(self.store.cut_back)
            except OSError as e:
                log.warning("cutting back the open pack after a failed write: %s", e)
                return
        if freed:
            log.info("a write failed: gave back the %d bytes the push had stored since the "
                     "last durable record", freed)

