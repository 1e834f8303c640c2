"""Everything that changes what a node serves: the two-phase publish and removal. The phases
are here; what they keep in step is apart: the decoded manifests (manifest_cache.py), the
backing files (backing_upkeep.py) and the store's garbage collection (collection.py).

A push is staged, then published in two phases: chunks land in the store as they arrive (never
visible in the mount); `prepare` checks that the manifest and every chunk it names are present
and makes the store durable (which records the large files written once, in place, as file
objects: fs/file_objects.py); `commit` switches the workspace, starts copying the backing files
that have no file object (their chunks were on the node before the manifest said where they go:
fs/backing.py), and returns once the kernel has dropped every changed entry. A failed or
abandoned push leaves the last good version serving; what it sent is reused, except after this
node failed to store a chunk (a full disk): then the open pack is cut back to its last durable
record and unrecorded file objects are dropped, so the space comes back at once.

Blocking work (manifest decodes, the store's and refs.json's fsyncs, backing file copies)
runs on worker threads: the trio thread also answers every FUSE request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import trio

from ...fs import readahead
from ...fs.backing import BackingFiles
from ...fs.backing import wanted as backing_wanted
from ...fs.chunk import CorruptChunk
from ...fs.fuse_ops import SnapshotFS
from ...fs.manifest import Manifest, ManifestError, MissingObject, TooManyEntries
from ...fs.store import Store
from ..wire.replies import CommitReply, PrepareReply, RemoveReply
from ..wire.requests import RequestError
from . import source_path
from .backing_upkeep import BackingUpkeep
from .collection import UNLOADABLE, Collection
from .events import EventLog
from .fetch import Fetcher
from .flusher import Flusher
from .incomplete import Incomplete
from .lost import Losses
from .manifest_cache import ManifestCache
from .refs import Refs
from .source_links import SourceLinks

log = logging.getLogger("monarch_fs.daemon")

KEEP_VERSIONS = 3


class Publisher:
    """Prepare, commit and remove workspaces, keep backing files and claims on the store, and
    collect what nothing uses.

    One object for all of it because it is one invariant: a chunk is deleted only when no
    retained version, no version being published, no file the kernel holds and no push that
    was told this node has it can still need it. `fs` is the view it publishes to: a mounted
    SnapshotFS in the daemon, an unmounted one in tests (then no kernel entry is dropped)."""

    def __init__(self, store: Store, refs: Refs, backing: BackingFiles, fs: SnapshotFS, *,
                 keep: int, max_entries: int, counters: dict[str, int],
                 mount: str | os.PathLike[str] | None = None,
                 fetcher: Fetcher | None = None, events: EventLog | None = None,
                 links: SourceLinks | None = None, flusher: Flusher | None = None) -> None:
        self.store = store
        self.events = events  # collects are recorded there
        self.fetcher = fetcher  # an early prepare waits on it for the first-read chunks
        # The versions published early (push --early) and not known complete, saved in refs.json;
        # a prepare and commit without `early` complete one.
        self.incomplete = Incomplete(refs)
        # Current versions a crash took chunks from, found at start (lost.py), until pushed.
        self.losses = Losses()
        self.flusher = flusher  # None: --durable sync, every prepare flushes (flusher.py)
        # Where the mount is: a workspace exposed at its source path links to MOUNT/NAME
        # (source_path.py). None: nothing is exposed there (a service built without a mount).
        self.mount = Path(mount) if mount is not None else None
        self.links = links or SourceLinks(refs.path.parent, identity=False)
        self.refs = refs
        self.fs = fs
        self.keep = keep
        self.counters = counters
        # What could not be loaded at start: logged, shown by `status`, and the rest served.
        # A workspace's own problems go once it is published again.
        self.problems: list[str] = [*store.problems, *refs.problems]
        self.workspace_problems: dict[str, list[str]] = {}
        self.manifests = ManifestCache(store, refs, max_entries)
        self.backing_upkeep = BackingUpkeep(backing, store, fs, self.manifests,
                                            versions=self._versions)
        self._prepared: set[tuple[str, bytes, bool]] = set()  # (name, version, early)
        # The version each workspace is being prepared for: its backing files are kept.
        self._pinned: dict[str, bytes] = {}
        self._removing: set[str] = set()  # no new process may pin these
        self._publish_lock = trio.Lock()
        self.collection = Collection(store, refs, fs, counters=counters, events=events,
                                     manifest=self.manifest, pinned=self._pinned.values)
        # The kernel let go of a file no served version has (after `rm`, or a dropped version
        # a reader held): its chunks may go now.
        fs.on_orphan_forgotten = self.collection.start

    @property
    def nursery(self) -> trio.Nursery | None:
        """Background work (backing files, collects); set while the service runs."""
        return self.collection.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self.collection.nursery = nursery

    def all_problems(self) -> list[str]:
        return [*self.problems, *self.losses.problems(),
                *(p for ps in self.workspace_problems.values() for p in ps)]

    # ---- manifests ------------------------------------------------------------------------

    async def manifest(self, version: bytes, root: bytes | memoryview | None = None
                       ) -> Manifest:
        """A version's manifest (ManifestCache.get)."""
        return await self.manifests.get(version, root)

    def _versions(self) -> set[bytes]:
        """Every retained or in-flight version."""
        return {*self._pinned.values(), *(v for vs in self.refs.workspaces.values() for v in vs)}

    def _drop_manifests(self) -> None:
        """Forget the decoded manifests no retained or in-flight version uses."""
        self.manifests.keep_only(self._versions())

    async def lacking(self, early: dict[str, list[bytes]]) -> dict[bytes, int]:
        """How many chunks each of the `early` versions (by workspace) lacks, for those whose
        manifest loads."""
        out = {}
        for v in {v for vs in early.values() for v in vs}:
            try:
                m = await self.manifest(v)
            except (*UNLOADABLE, OSError):
                continue
            out[v] = await trio.to_thread.run_sync(self.incomplete.lacking, self.store, m)
        return out

    # ---- the two-phase publish ------------------------------------------------------------

    async def missing(self, ids: list[bytes]) -> list[bytes]:
        """Which of `ids` the store lacks; not while a collect drops chunks."""
        async with self.collection.lock:
            return await trio.to_thread.run_sync(self.store.missing, ids)

    async def _check_complete(self, version: bytes) -> None:
        """Refuse unless the store has every chunk of `version`. A version loaded against one
        this node serves whole (an edit) is checked for what it adds: the chunks of the base
        are here, and stay (no collect runs meanwhile: the caller holds the collect lock)."""
        manifest = await self._checked_manifest(version)
        base = manifest.base() if manifest.base is not None else None
        ids = manifest.added_chunk_ids() if base is not None and self._whole(base) else None
        missing = await trio.to_thread.run_sync(
            self.store.missing, manifest.chunk_ids() if ids is None else ids)
        if missing:
            raise RequestError(f"version {version.hex()[:12]}: {len(missing)} chunks missing")

    def _whole(self, manifest: Manifest) -> bool:
        """Whether `manifest` is a version this node serves with every chunk (retained, and
        not published early)."""
        version = manifest.id
        return (any(version in vs for vs in self.refs.workspaces.values())
                and not self.incomplete.has(version)
                and self.manifests.decoded.get(version) is manifest)

    async def _checked_manifest(self, version: bytes) -> Manifest:
        """The manifest of a version being prepared; RequestError saying why it cannot be."""
        try:
            return await self.manifest(version)
        except KeyError as e:
            what = ("" if not isinstance(e, MissingObject) or e.oid == version
                    else f" whole ({e.args[0]})")
            raise RequestError(f"version {version.hex()[:12]}: manifest not received{what}"
                               ) from None
        except TooManyEntries as e:  # a ManifestError: first
            raise RequestError(
                f"version {version.hex()[:12]}: the manifest has at least {e.count:,} entries, "
                f"more than "
                f"this node accepts ({e.limit:,}: its --max-entries or MONARCH_FS_MAX_ENTRIES)"
            ) from None
        except (CorruptChunk, ManifestError) as e:
            raise RequestError(f"version {version.hex()[:12]}: {e}") from None

    async def _check_early(self, version: bytes, early: tuple[bytes, ...]) -> None:
        """An early publish's check: the manifest and the first-read chunks are here (the
        rest streams on, and a read of a missing chunk fetches it: fetch.py)."""
        await self._checked_manifest(version)
        missing = await trio.to_thread.run_sync(self.store.missing, early)
        if missing:
            raise RequestError(f"version {version.hex()[:12]}: {len(missing)} of the "
                               f"{len(early)} chunks the first reads need did not arrive")

    async def _will_need(self, read: Callable[[], int]) -> None:
        """Ask the kernel to read chunks of file objects into the page cache (O_DIRECT wrote
        them past it), in the background: only advice, so a failure is only logged."""
        try:
            await trio.to_thread.run_sync(read)
        except OSError as e:
            log.info("reading the first reads ahead: %s", e)

    async def _make_ready(self, name: str, version: bytes,
                          early: tuple[bytes, ...] | None = None, wait: float = 0.0) -> None:
        """Everything a publish of `version` needs: every chunk (with `early`: the manifest
        and those chunks, waited for up to `wait` seconds first, outside the lock, as they
        arrive on another session), durable in the store. The version is pinned (kept from
        collection) meanwhile, and stays pinned if it is ready. Checked and synced under the
        collect lock: a cut back in between could drop a chunk found present but not yet
        durable."""
        before = self._pinned.get(name)
        self._pinned[name] = version
        try:
            if early is not None and wait and self.fetcher is not None:
                await self._wait_early(version, early, wait)
            async with self.collection.lock:
                if early is None:
                    await self._check_complete(version)
                else:
                    await self._check_early(version, early)
                # Early: what arrived of the large files still arriving is not made durable
                # (copied to a pack): the version is recorded as early, so a crash that loses
                # it makes it lack more, never whole (incomplete.py). --durable background:
                # made durable after the publish (flusher.py). Others' chunks: not copied.
                needed = _needed_by(await self.manifest(version))
                if self.flusher is not None:
                    await trio.to_thread.run_sync(self.store.settle, needed)
                else:
                    await trio.to_thread.run_sync(self.store.sync, early is None, needed)
            if early is not None and self.nursery is not None:  # read right after publishing
                self.nursery.start_soon(self._will_need, partial(self.store.will_need, early))
        except BaseException:
            if before is None:
                self._pinned.pop(name, None)
            else:
                self._pinned[name] = before
            raise

    async def _wait_early(self, version: bytes, early: tuple[bytes, ...], wait: float) -> None:
        """Wait up to `wait` seconds for the manifest's objects and the `early` chunks, as
        they arrive on another session: the root is the last object sent, and an object still
        being stored when it came is waited for in turn."""
        assert self.fetcher is not None
        with trio.move_on_after(wait):
            await self.fetcher.wait([version, *early], wait)
            while True:
                try:
                    await self.manifest(version)
                    return
                except MissingObject as e:
                    await self.fetcher.wait([e.oid], wait)  # bounded by this scope
                except UNLOADABLE:
                    return  # prepare says why

    def _check_source(self, source: str | None) -> None:
        """Refuse a source path that overlaps this node's own folders, before anything
        changes (the wire already refused an unsafe one: requests.check_source_path)."""
        if source is not None and self.mount is not None:
            try:
                source_path.check_outside(source, self.mount, self.refs.path.parent)
            except ValueError as e:
                raise RequestError(str(e)) from None

    def _check_owner(self, name: str, owner: int | None, doing: str) -> None:
        try:
            self.refs.check_owner(name, owner, doing)
        except ValueError as e:
            raise RequestError(str(e)) from None

    async def prepare(self, name: str, version: bytes, source: str | None = None,
                      owner: int | None = None, early: tuple[bytes, ...] | None = None,
                      wait: float = 0.0) -> PrepareReply:
        """Phase one; `owner` is who asks (--identity munge), refused for another's workspace.
        With `early` (push --early), only the manifest and those chunks must be here."""
        self._check_owner(name, owner, "replace")
        self._check_source(source)
        await self._make_ready(name, version, early, wait)
        self._prepared.add((name, version, early is not None))
        return PrepareReply(version)

    def serving(self, name: str, owner: int | None) -> bytes | None:
        """The version `name` serves whole and without problems, if `owner` pushed it: every
        chunk of it is here, so a push of another version asks only about what that one adds
        (CurrentReply.serving)."""
        refs = self.refs
        if self.incomplete.current(name) or name in self.workspace_problems:
            return None
        if refs.owners.get(name) != owner:
            return None
        return refs.workspaces.get(name, [None])[0]

    def current(self, name: str, version: bytes, source: str | None,
                owner: int | None) -> bool:
        """Whether `name` serves `version` already, whole and without problems, exposed at
        `source`, pushed by `owner`: a commit of it would change nothing (requests.Current)."""
        return (self.serving(name, owner) == version
                and self.refs.sources.get(name) == source)

    async def commit(self, name: str, version: bytes, source: str | None = None,
                     source_id: str | None = None, owner: int | None = None,
                     early: tuple[bytes, ...] | None = None,
                     wait: float = 0.0, ahead: tuple[bytes, ...] = ()) -> CommitReply:
        """Publish `version` of `name`; with `source`, expose it at that path too (a warning
        in the reply, not a failure, when this node cannot). With `owner` (who asks, under
        --identity munge) it belongs to that user from then on; another's is refused. With
        `early`, the version is served incomplete (see prepare) and gets no backing files
        until a commit without it: passthrough must never bind a partial file. `ahead`: the
        chunks read first last time, read into the page cache from here on (readahead.py)."""
        self._check_owner(name, owner, "replace")
        self._check_source(source)
        if (name, version, early is not None) not in self._prepared:
            await self._make_ready(name, version, early, wait)
        async with self._publish_lock:
            self._check_owner(name, owner, "replace")  # again: another may have committed
            # Everything that can fail comes before the refs are saved, and nothing changes
            # before the save: a commit that fails leaves no trace in memory, on disk, or in
            # the mount (issue 16, finding 5). Backing files are only a cache of the store.
            versions = self.refs.next_versions(name, version, self.keep)
            staged = await self.fs.stage(name.encode(),
                                         [(v, await self.manifest(v)) for v in versions])
            if self.fs.passthrough and self.nursery is not None:
                # Backing files are a cache of the store (fs/backing.py), written in the
                # background from the commit on: not at prepare, where the copies slowed the
                # other nodes' prepares (4.5 s vs 4.2 s for 3 hosts on one 2-core machine) and
                # would compete with the store's fsync on a real disk. Queued before the switch,
                # so an open of a new file waits for its copy rather than missing passthrough.
                entries = await trio.to_thread.run_sync(self.manifests.backed,
                                                        await self.manifest(version), staged)
                if early is not None:  # only the files that are whole: never a partial one
                    entries = await trio.to_thread.run_sync(self.backing_upkeep.whole_files,
                                                            entries)
                await self.nursery.start(self.backing_upkeep.write, entries)
            previous = self.refs.workspaces.get(name, [None])[0]
            old_source = self.refs.sources.get(name)
            early_versions = self.incomplete.after_commit(name, version, versions,
                                                          early is not None)
            try:
                await self.refs.publish(name, versions, source, owner, early_versions)
            except OSError as e:
                raise RequestError(f"cannot save {self.refs.path}: {e.strerror or e}; "
                                   f"{name!r} stays at its last version") from None
            await self.fs.switch(staged)
            if self.flusher is not None:
                self.flusher.published()
            self.losses.published(name)
            self.workspace_problems.pop(name, None)
            self._prepared.discard((name, version, early is not None))
            if self._pinned.get(name) == version:
                del self._pinned[name]
            self._drop_manifests()
            await self.backing_upkeep.prune()
            warnings = await self._relink(name, old_source, source, source_id, owner)
            if ahead and early is None and self.nursery is not None:
                self.nursery.start_soon(self._will_need, partial(
                    readahead.chunks, staged.trees[0].manifest, self.backing_upkeep.backing, ahead))
        log.info("published %s = %s", name, version.hex())
        return CommitReply(version, previous, warnings, replaced=staged)

    async def _relink(self, name: str, old: str | None, new: str | None,
                      new_id: str | None, owner: int | None) -> list[str]:
        """Make `name`'s source path link to MOUNT/NAME, with the rights of its owner
        (source_links.py): withdraw its link at `old` if it moved (or is no longer asked
        for), then expose it at `new`. Warnings, never raises."""
        if self.mount is None:
            return []
        claimed = [n for n, s in self.refs.sources.items() if n != name and s == new]
        warnings = await self.links.relink(name, str(self.mount / name), old, new, new_id,
                                           owner, claimed)
        for w in warnings:
            log.warning("workspace %s: %s", name, w)
        return warnings

    def served_version(self, name: str, version: bytes | None) -> bytes:
        """The version of workspace `name` a process may run from: `version`, or the current
        one. Raises LookupError (message for the client) if this node does not serve it."""
        versions = self.refs.workspaces.get(name) if name not in self._removing else None
        if not versions:
            raise LookupError(f"no workspace {name!r} on this node; push it first")
        if version is None:
            return versions[0]
        if version not in versions:
            raise LookupError(f"workspace {name!r} has no version {version.hex()[:12]} here")
        return version

    async def remove(self, name: str, users: Callable[[str], list[int]],
                     owner: int | None = None) -> RemoveReply:
        """Delete a workspace (`monarch-fs rm`): the mount drops it at once, kernel entries
        included; its manifests leave memory, its backing files go, and a collect gives back
        its chunks (the open pack is sealed first, so that a collect may reach those in it).
        A file a reader holds open keeps reading until closed, as for dropped versions.

        Refused while a process this daemon started with `--workspace NAME` runs (`users`
        gives their pids): it runs from MOUNT/.versions/NAME/VERSION, which would vanish
        under it."""
        async with self._publish_lock:
            versions = self.refs.workspaces.get(name)
            if not versions:
                raise RequestError(f"no workspace {name!r} on this node")
            self._check_owner(name, owner, "remove")
            pids = users(name)
            if pids:
                shown = ", ".join(str(pid) for pid in pids[:5])
                raise RequestError(
                    f"workspace {name!r} is in use by {len(pids)} "
                    f"process{'es' if len(pids) > 1 else ''} started with --workspace (pid "
                    f"{shown}{', ...' if len(pids) > 5 else ''}); stop them, then remove it")
            self._removing.add(name)  # refs.json is saved on a thread: no new user meanwhile
            source, pusher = self.refs.sources.get(name), self.refs.owners.get(name)
            try:
                await self.refs.remove(name)
            finally:
                self._removing.discard(name)
            await self._relink(name, source, None, None, pusher)
            await self.fs.remove_workspace(name.encode())
            self._drop_manifests()
            await self.backing_upkeep.prune()
        try:
            await trio.to_thread.run_sync(self.store.seal)
        except OSError as e:  # a full disk: what the open pack holds waits for a later seal
            log.warning("sealing the open pack after removing %s: %s", name, e)
        self.collection.start()
        log.info("removed workspace %s (%d versions)", name, len(versions))
        return RemoveReply(versions)

    async def recover(self) -> None:
        """At start, once the mount decided on passthrough: write the backing files the
        current versions lack (files of older retained versions without one are read through
        the daemon), drop unused ones, and collect what a crash left behind. Of a version
        published early, only the files that are whole (the others once they are)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.collection.collect)
            if self.fs.passthrough:
                for versions in list(self.refs.workspaces.values()):
                    entries = (await self.manifest(versions[0])).entries
                    if self.incomplete.has(versions[0]):
                        wanted = [e for e in entries if backing_wanted(e)]
                        entries = await trio.to_thread.run_sync(self.backing_upkeep.whole_files,
                                                                wanted)
                    await self.backing_upkeep.write(entries)
                await self.backing_upkeep.prune()


def _needed_by(manifest: Manifest) -> Callable[[bytes], bool]:
    """Whether a chunk is `manifest`'s (its set made once, when first asked: rarely)."""
    ids = cache(lambda: frozenset(manifest.chunk_ids()))
    return lambda cid: cid in ids()
