"""Everything that changes what a node serves: the two-phase publish, removal, the backing
files and the store's garbage collection.

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
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import trio

from ...fs.backing import BackingFiles
from ...fs.backing import key as backing_key
from ...fs.backing import wanted as backing_wanted
from ...fs.chunk import CorruptChunk
from ...fs.chunk import decode as decode_chunk
from ...fs.fuse_ops import SnapshotFS
from ...fs.manifest import Entry, Manifest, ManifestError, MissingObject, TooManyEntries
from ...fs.store import Store
from ...fs.version_switch import Staged
from ..wire.replies import CommitReply, PrepareReply, RemoveReply
from ..wire.requests import RequestError
from . import source_path
from .events import EventLog
from .fetch import Fetcher
from .flusher import Flusher
from .incomplete import Incomplete
from .lost import Losses
from .refs import Refs
from .source_links import SourceLinks

log = logging.getLogger("monarch_fs.daemon")

KEEP_VERSIONS = 3
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
_UNLOADABLE = (KeyError, CorruptChunk, ManifestError)  # a manifest missing, damaged or refused


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
        self.backing = backing
        self.fs = fs
        self.keep = keep
        self.max_entries = max_entries  # a larger manifest is refused at prepare
        self.counters = counters
        # What could not be loaded at start: logged, shown by `status`, and the rest served.
        # A workspace's own problems go once it is published again.
        self.problems: list[str] = [*store.problems, *refs.problems]
        self.workspace_problems: dict[str, list[str]] = {}
        self.backing_error: str | None = None  # why a file of the latest version has none
        # Background work (backing files, collects); set while the service runs.
        self.nursery: trio.Nursery | None = None
        self._manifests: dict[bytes, Manifest] = {}
        # See _backed: a version's list goes with its manifest.
        self._backed_files: weakref.WeakKeyDictionary[Manifest, list[Entry]] = (
            weakref.WeakKeyDictionary())
        self._prepared: set[tuple[str, bytes, bool]] = set()  # (name, version, early)
        # The version each workspace is being prepared for: its backing files are kept.
        self._pinned: dict[str, bytes] = {}
        self._removing: set[str] = set()  # no new process may pin these
        self._publish_lock = trio.Lock()
        # A collect, the answers to "which chunks do you lack", a prepare's check that it has
        # every chunk, durably, and a cut back of the open pack (which only drops what is not
        # durable): none of them runs during another.
        self._gc_lock = trio.Lock()
        self._collect_due: float | None = None  # when the next collect starts (trio time)
        self._deferred_since: float | None = None  # commits put the next collect off since
        self._received_at_collect = 0  # counters["bytes_received"] at the last collect
        self._negotiating = 0  # sessions told what this node has, and not committed since
        # The kernel let go of a file no served version has (after `rm`, or a dropped version
        # a reader held): its chunks may go now.
        fs.on_orphan_forgotten = self.start_collect

    def all_problems(self) -> list[str]:
        return [*self.problems, *self.losses.problems(),
                *(p for ps in self.workspace_problems.values() for p in ps)]

    # ---- manifests ------------------------------------------------------------------------

    async def manifest(self, version: bytes, root: bytes | memoryview | None = None
                       ) -> Manifest:
        """A version's manifest, loaded once (on a worker thread) from its folder objects in
        the store. One with more than max_entries entries is refused (TooManyEntries), unless
        it was published before the limit was lowered: a prepare that refused it, and every
        collect after, load nothing. Raises KeyError (MissingObject) if the store lacks an
        object. `root`: the root object's bytes as they arrive in a push, before they are
        stored (checked against `version`, CorruptChunk): the push's large files are placed
        from it, and prepare finds it loaded here."""
        m = self._manifests.get(version)
        if m is not None:
            return m
        published = any(version in vs for vs in self.refs.workspaces.values())
        last = next(reversed(self._manifests.values()), None)

        def get(oid: bytes) -> bytes | memoryview:
            if oid == version and root is not None:
                return decode_chunk(version, root)
            try:
                return self.store.get(oid)
            except CorruptChunk:  # damaged on disk: the next push is told it lacks it
                log.warning("folder object %s is damaged in the store: dropped",
                            oid.hex()[:12])
                self.store.forget(oid)
                raise

        def load() -> Manifest:
            # The folders it shares with the version loaded last are taken from that one:
            # loaded once, and held once in memory.
            return Manifest.load(version, get, None if published else self.max_entries,
                                 known=last)

        m = await trio.to_thread.run_sync(load)
        self._manifests[version] = m
        return m

    def _backed(self, manifest: Manifest, staged: Staged | None = None) -> list[Entry]:
        """The files of `manifest` served from backing files in passthrough (fs/backing.py),
        found once per version: every commit and prune asks, and most files are too small.
        With `staged` (a commit's switch to it), from the version it replaces and what changed,
        when the switch found that. Blocking: a worker thread."""
        backed = self._backed_files.get(manifest)
        if backed is not None:
            return backed
        before = self._backed_files.get(staged.old[0].manifest) if staged and staged.old else None
        if staged is not None and before is not None:  # changed: what differs from it, exactly
            by_path = {e.path: e for e in before}
            for old, new in staged.changed:
                if old is not None:
                    by_path.pop(old.path, None)
                if new is not None and backing_wanted(new):
                    by_path[new.path] = new
            backed = list(by_path.values())
        else:
            backed = [e for e in manifest if backing_wanted(e)]
        self._backed_files[manifest] = backed
        return backed

    def _drop_manifests(self) -> None:
        """Forget the decoded manifests no retained or in-flight version uses."""
        self._manifests = {v: m for v, m in self._manifests.items()
                           if v in self._pinned.values()
                           or any(v in vs for vs in self.refs.workspaces.values())}

    async def lacking(self, early: dict[str, list[bytes]]) -> dict[bytes, int]:
        """How many chunks each of the `early` versions (by workspace) lacks, for those whose
        manifest loads."""
        out = {}
        for v in {v for vs in early.values() for v in vs}:
            try:
                m = await self.manifest(v)
            except (*_UNLOADABLE, OSError):
                continue
            out[v] = await trio.to_thread.run_sync(self.incomplete.lacking, self.store, m)
        return out

    # ---- the two-phase publish ------------------------------------------------------------

    async def missing(self, ids: list[bytes]) -> list[bytes]:
        """Which of `ids` the store lacks; not while a collect drops chunks."""
        async with self._gc_lock:
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
                and self._manifests.get(version) is manifest)

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

    async def _will_need(self, ids: tuple[bytes, ...]) -> None:
        """Ask the kernel to read the first reads' chunks into the page cache (O_DIRECT wrote
        them past it), in the background: only advice, so a failure is only logged."""
        try:
            await trio.to_thread.run_sync(self.store.will_need, ids)
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
            async with self._gc_lock:
                if early is None:
                    await self._check_complete(version)
                else:
                    await self._check_early(version, early)
                # Early: what arrived of the large files still arriving is not made durable
                # (copied to a pack): the version is recorded as early, so a crash that
                # loses it makes it lack more, never makes it whole (incomplete.py).
                # --durable background: made durable after the publish (flusher.py).
                if self.flusher is not None:
                    await trio.to_thread.run_sync(self.store.settle)
                else:
                    await trio.to_thread.run_sync(self.store.sync, early is None)
            if early is not None and self.nursery is not None:  # read right after publishing
                self.nursery.start_soon(self._will_need, early)
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
                except _UNLOADABLE:
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
                     wait: float = 0.0) -> CommitReply:
        """Publish `version` of `name`; with `source`, expose it at that path too (a warning
        in the reply, not a failure, when this node cannot). With `owner` (who asks, under
        --identity munge) it belongs to that user from then on; another's is refused. With
        `early`, the version is served incomplete (see prepare) and gets no backing files
        until a commit without it: passthrough must never bind a partial file."""
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
                entries = await trio.to_thread.run_sync(self._backed,
                                                        await self.manifest(version), staged)
                if early is not None:  # only the files that are whole: never a partial one
                    entries = await trio.to_thread.run_sync(self._whole_files, entries)
                await self.nursery.start(self._write_backing, entries)
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
            await self._prune_backing()
            warnings = await self._relink(name, old_source, source, source_id, owner)
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
            await self._prune_backing()
        try:
            await trio.to_thread.run_sync(self.store.seal)
        except OSError as e:  # a full disk: what the open pack holds waits for a later seal
            log.warning("sealing the open pack after removing %s: %s", name, e)
        self.start_collect()
        log.info("removed workspace %s (%d versions)", name, len(versions))
        return RemoveReply(versions)

    # ---- backing files --------------------------------------------------------------------

    def _whole_files(self, entries: list[Entry]) -> list[Entry]:
        """The backed files of an early version (push --early) whose chunks have all arrived
        (their opens are passthrough at once). A file still arriving into its file object is
        bound from the first open after it is complete (FileObjects.path); the others get
        their backing copies at the commit that completes the version. Blocking: a worker
        thread."""
        return [e for e in entries if not self.store.missing(e.chunks)]

    async def _write_backing(self, entries: list[Entry], *,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                             ) -> None:
        """Write the backing files `entries` lack; a file that cannot be written is served
        from the chunk store, and `status` says why. Started once the copies are queued."""
        try:
            failed = await self.backing.write_missing(entries, self.store,
                                                      task_status=task_status)
        except OSError as e:  # the folder itself (this runs in the background: never fatal)
            failed = [f"backing files in {self.backing.root}: {e.strerror or e}"]
        self.backing_error = None  # about the latest version's files only
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            self.backing_error = failed[0] + more
            log.warning("backing files: %s; those files are read through the daemon",
                        self.backing_error)

    async def recover(self) -> None:
        """At start, once the mount decided on passthrough: write the backing files the
        current versions lack (files of older retained versions without one are read through
        the daemon), drop unused ones, and collect what a crash left behind. Of a version
        published early, only the files that are whole (the others once they are)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._collect)
            if self.fs.passthrough:
                for versions in list(self.refs.workspaces.values()):
                    entries = (await self.manifest(versions[0])).entries
                    if self.incomplete.has(versions[0]):
                        entries = await trio.to_thread.run_sync(
                            self._whole_files, [e for e in entries if backing_wanted(e)])
                    await self._write_backing(entries)
                await self._prune_backing()

    async def _prune_backing(self) -> None:
        """Delete the backing files that no retained or in-flight version uses (all of them
        when the mount is not in passthrough mode)."""
        if not self.fs.passthrough:
            await trio.to_thread.run_sync(self.backing.prune, set())
            return
        manifests = []
        for v in {v for vs in self.refs.workspaces.values() for v in vs} | {*self._pinned.values()}:
            try:
                manifests.append(await self.manifest(v))
            except _UNLOADABLE:
                continue  # a pinned version whose manifest never arrived

        def keep() -> set[str]:
            return {backing_key(e) for m in manifests for e in self._backed(m)}

        try:
            await trio.to_thread.run_sync(lambda: self.backing.prune(keep()))
        except OSError as e:
            log.warning("pruning backing files: %s", e)

    # ---- claims and collection ------------------------------------------------------------

    def claim(self) -> None:
        """A session was told what this node has: nothing is collected until it commits."""
        self._negotiating += 1

    def release_claim(self, committed: bool = False) -> None:
        """A session told what this node has committed (its collect waits for commits to
        pause: COLLECT_DELAY) or went away (it collects at once)."""
        self._negotiating -= 1
        self.start_collect(committed)

    def start_collect(self, committed: bool = False) -> None:
        """After a commit, a released claim, a removal or a forgotten file: once no push is in
        flight, the chunks the last ones left unused can go: at once, or after a commit once
        commits pause (see COLLECT_DELAY). One collect waiting does for every request made
        meanwhile that can wait as long (the kernel forgets files in many batches); one that
        cannot starts a collect of its own."""
        if self._negotiating or self.nursery is None:
            return
        now = trio.current_time()
        brought = self.counters["bytes_received"] - self._received_at_collect
        due = now
        if committed:
            due += COLLECT_DELAY if brought >= COLLECT_SMALL else COLLECT_MAX_WAIT
            if self._deferred_since is not None:
                due = min(due, self._deferred_since + COLLECT_MAX_WAIT)
        if committed and self._deferred_since is not None and self._collect_due is not None:
            if now - self._deferred_since < COLLECT_MAX_WAIT and brought < COLLECT_BYTES:
                self._collect_due = due  # put off again: the waiting task sees it and leaves
                self.nursery.start_soon(self._collect_at, due)
                return
        if committed and self._collect_due is None:
            self._deferred_since = now
        if self._collect_due is None or due < self._collect_due:
            if not committed:
                self._deferred_since = None  # due now: a commit may not put it off
            self._collect_due = due
            self.nursery.start_soon(self._collect_at, due)

    async def _collect_at(self, due: float) -> None:
        await trio.sleep_until(due)
        if self._collect_due is not None and self._collect_due <= due:
            await self._collect()

    async def _collect(self) -> None:
        """Delete the store's packs that hold only chunks nothing uses (no retained version, no
        version being published, no file the kernel still holds), and compact those that hold
        mostly such chunks (Store.collect). Skipped while another push has been told what this
        node has (those chunks must stay): its commit collects."""
        async with self._gc_lock:
            self._collect_due = self._deferred_since = None
            self._received_at_collect = self.counters["bytes_received"]
            if self._negotiating:
                return
            if self.refs.held:  # what their versions use is unknown (`status` says why)
                log.warning("not collecting: workspaces not loaded at start: %s",
                            ", ".join(map(repr, self.refs.held)))
                return
            retained = {v for vs in self.refs.workspaces.values() for v in vs}
            versions = retained | set(self._pinned.values())
            manifests = []
            for v in versions:
                try:
                    manifests.append(await self.manifest(v))
                except _UNLOADABLE as e:
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
        async with self._gc_lock:
            try:
                freed = await trio.to_thread.run_sync(self.store.cut_back)
            except OSError as e:
                log.warning("cutting back the open pack after a failed write: %s", e)
                return
        if freed:
            log.info("a write failed: gave back the %d bytes the push had stored since the "
                     "last durable record", freed)

