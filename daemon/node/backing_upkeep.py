"""A node's backing files (fs/backing.py) kept in step with its versions: written in the
background from a commit on, and pruned once no retained or in-flight version uses them.

Apart from the publisher's phases (publisher.py), which say when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ...fs.backing import BackingFiles
from ...fs.backing import key as backing_key
from ...fs.fuse_ops import SnapshotFS
from ...fs.manifest import Entry
from ...fs.store import Store
from .collection import UNLOADABLE
from .manifest_cache import ManifestCache

log = logging.getLogger("monarch_fs.daemon")


class BackingUpkeep:
    """Writes and prunes the backing files; `error`: why a file of the latest version has none
    (shown by `status`)."""

    def __init__(self, backing: BackingFiles, store: Store, fs: SnapshotFS,
                 manifests: ManifestCache, *, versions: Callable[[], set[bytes]]) -> None:
        self.backing = backing
        self.store = store
        self.fs = fs
        self.manifests = manifests
        self.versions = versions  # every retained or in-flight version
        self.error: str | None = None

    def whole_files(self, entries: list[Entry]) -> list[Entry]:
        """The backed files of an early version (push --early) whose chunks have all arrived
        (their opens are passthrough at once). A file still arriving into its file object is
        bound from the first open after it is complete (FileObjects.path); the others get
        their backing copies at the commit that completes the version. Blocking: a worker
        thread."""
        return [e for e in entries if not self.store.missing(e.chunks)]

    async def write(self, entries: list[Entry], *,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                             ) -> None:
        """Write the backing files `entries` lack; a file that cannot be written is served
        from the chunk store, and `status` says why. Started once the copies are queued."""
        try:
            failed = await self.backing.write_missing(entries, self.store,
                                                      task_status=task_status)
        except OSError as e:  # the folder itself (this runs in the background: never fatal)
            failed = [f"backing files in {self.backing.root}: {e.strerror or e}"]
        self.error = None  # about the latest version's files only
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            self.error = failed[0] + more
            log.warning("backing files: %s; those files are read through the daemon",
                        self.error)

    async def prune(self) -> None:
        """Delete the backing files that no retained or in-flight version uses (all of them
        when the mount is not in passthrough mode)."""
        if not self.fs.passthrough:
            await trio.to_thread.run_sync(self.backing.prune, set())
            return
        manifests = []
        for v in self.versions():
            try:
                manifests.append(await self.manifests.get(v))
            except UNLOADABLE:
                continue  # a pinned version whose manifest never arrived

        def keep() -> set[str]:
            return {backing_key(e) for m in manifests for e in self.manifests.backed(m)}

        try:
            await trio.to_thread.run_sync(lambda: self.backing.prune(keep()))
        except OSError as e:
            log.warning("pruning backing files: %s", e)
