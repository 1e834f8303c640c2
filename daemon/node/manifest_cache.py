"""The manifests a node has decoded: each retained or in-flight version's, loaded once from
its folder objects in the store, and which of its files are served from backing files.

Apart from the publisher (publisher.py), which asks for them at every phase and says which
versions to keep.
"""

from __future__ import annotations

import logging
import weakref

import trio

from ...fs.backing import wanted as backing_wanted
from ...fs.chunk import CorruptChunk
from ...fs.chunk import decode as decode_chunk
from ...fs.manifest import Entry, Manifest
from ...fs.store import Store
from ...fs.version_switch import Staged
from .refs import Refs

log = logging.getLogger("monarch_fs.daemon")


class ManifestCache:
    """Decoded manifests by version (`decoded`), and each one's backed files."""

    def __init__(self, store: Store, refs: Refs, max_entries: int) -> None:
        self.store = store
        self.refs = refs
        self.max_entries = max_entries  # a larger manifest is refused at prepare
        self.decoded: dict[bytes, Manifest] = {}
        self._loading: dict[bytes, trio.Event] = {}  # versions being loaded: set once done
        # See backed: a version's list goes with its manifest.
        self._backed: weakref.WeakKeyDictionary[Manifest, list[Entry]] = (
            weakref.WeakKeyDictionary())

    async def get(self, version: bytes, root: bytes | memoryview | None = None
                       ) -> Manifest:
        """A version's manifest, loaded once (on a worker thread) from its folder objects in
        the store. One with more than max_entries entries is refused (TooManyEntries), unless
        it was published before the limit was lowered: a prepare that refused it, and every
        collect after, load nothing. Raises KeyError (MissingObject) if the store lacks an
        object. `root`: the root object's bytes as they arrive in a push, before they are
        stored (checked against `version`, CorruptChunk): the push's large files are placed
        from it, and prepare finds it loaded here."""
        m = self.decoded.get(version)
        if m is not None:
            return m
        # One load at a time: push --early's prepare comes on the control channel while the
        # data connection's session is loading the version to place its large files.
        while (loading := self._loading.get(version)) is not None:
            await loading.wait()
            m = self.decoded.get(version)
            if m is not None:
                return m
        published = any(version in vs for vs in self.refs.workspaces.values())
        last = next(reversed(self.decoded.values()), None)

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

        done = self._loading[version] = trio.Event()
        try:
            m = await trio.to_thread.run_sync(load)
            self.decoded[version] = m
        finally:
            del self._loading[version]
            done.set()
        return m

    def backed(self, manifest: Manifest, staged: Staged | None = None) -> list[Entry]:
        """The files of `manifest` served from backing files in passthrough (fs/backing.py),
        found once per version: every commit and prune asks, and most files are too small.
        With `staged` (a commit's switch to it), from the version it replaces and what changed,
        when the switch found that. Blocking: a worker thread."""
        backed = self._backed.get(manifest)
        if backed is not None:
            return backed
        before = self._backed.get(staged.old[0].manifest) if staged and staged.old else None
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
        self._backed[manifest] = backed
        return backed

    def keep_only(self, versions: set[bytes]) -> None:
        """Forget the decoded manifests of versions not in `versions`."""
        self.decoded = {v: m for v, m in self.decoded.items() if v in versions}
