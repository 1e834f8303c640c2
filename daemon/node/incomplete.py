"""Versions served before every chunk arrived (push --early): which ones, and what they lack.

Which versions are early is saved in refs.json ("early": daemon/node/refs.py), in the same
write as the publish that made one current, so a restart never takes an early version for a
whole one (issue 33, finding 2: it did, `current` then answered yes, every later push sent
nothing and its large files stayed EIO). While a workspace serves an early version, `current`
and `serving` answer no for it (publisher.py), so a push asks what it lacks, sends that, and
its commit (without `early`) completes it.

What a version lacks is not saved: the store is the truth, asked again where it matters (at
start, for `status`, at the prepare that completes it). Chunks keep arriving after the early
publish, and a crash or a cut back of the store loses the ones not yet durable; a list saved
at the publish would be wrong both ways.

A large file of an early version is read through the daemon until all of it is here (a
passthrough binding of a partial file would read holes), then bound by passthrough from its
next open on (fs/file_objects.py: FileObjects.path).
"""

from __future__ import annotations

import logging

from ...fs.manifest import Manifest
from ...fs.store import Store
from .refs import Refs

log = logging.getLogger("monarch_fs.daemon")


class Incomplete:
    """The early versions of every workspace, as refs.json keeps them (see the module
    docstring)."""

    def __init__(self, refs: Refs) -> None:
        self.refs = refs

    def has(self, version: bytes) -> bool:
        """Whether `version` is an early version of some workspace."""
        return any(version in vs for vs in self.refs.early.values())

    def current(self, name: str) -> bool:
        """Whether workspace `name` serves an early version."""
        versions = self.refs.workspaces.get(name)
        return versions is not None and versions[0] in self.refs.early.get(name, ())

    def names(self) -> list[str]:
        """The workspaces that serve an early version (`status` lists them)."""
        return sorted(n for n in self.refs.workspaces if self.current(n))

    def after_commit(self, name: str, version: bytes, versions: list[bytes],
                     early: bool) -> list[bytes]:
        """The early versions of `name` once `version` is committed (`early` or whole) and it
        retains `versions`: what the commit saves (Refs.publish)."""
        before = [v for v in self.refs.early.get(name, []) if v != version]
        return [v for v in ([version] if early else []) + before if v in versions]

    @staticmethod
    def lacking(store: Store, manifest: Manifest) -> int:
        """How many distinct chunks of `manifest` the store lacks. Blocking (a pass over its
        chunk ids): a worker thread."""
        return len(store.missing(manifest.chunk_ids()))

    def settle_loaded(self, lacking: dict[bytes, int]) -> None:
        """At start, each early version's count of missing chunks (`lacking`) is known: those
        that lack none are whole (their chunks arrived and were made durable before the stop)
        and served as such; the others are logged. Memory only: the next publish saves it."""
        for name, versions in list(self.refs.early.items()):
            left = [v for v in versions if lacking.get(v, 1)]
            for v in left:
                if v in lacking:
                    log.warning("workspace %s: version %s was published early (push --early) "
                                "and lacks %d chunks: reads of them fail with EIO until a push "
                                "of it completes it", name, v.hex()[:12], lacking[v])
            if left:
                self.refs.early[name] = left
            else:
                del self.refs.early[name]
