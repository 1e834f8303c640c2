"""Versions served before every chunk arrived (push --early): which ones, what they lack, and
their large files that became whole since.

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
passthrough binding of a partial file would read holes): `watch` follows the chunks each one
still lacks, and `stored` says which became whole, which the publisher then records (its file
object) and binds by passthrough from the next open on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...fs.manifest import Entry, Manifest
from ...fs.store import Store
from .refs import Refs

log = logging.getLogger("monarch_fs.daemon")


@dataclass(eq=False)
class _Partial:
    """A large file of an early version, and the chunks of it not stored yet."""

    version: bytes
    entry: Entry
    lacks: set[bytes] = field(default_factory=set)


class Incomplete:
    """The early versions of every workspace (as refs.json keeps them) and the partial files
    of those being completed (see the module docstring)."""

    def __init__(self, refs: Refs, store: Store) -> None:
        self.refs = refs
        self.store = store
        self._waiting: dict[bytes, list[_Partial]] = {}  # chunk id -> the files that lack it

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

    # ---- large files becoming whole -------------------------------------------------------

    def watch(self, version: bytes, entries: Iterable[Entry]) -> list[Entry]:
        """Follow the files `entries` of early version `version` until they are whole; returns
        those whole already. Blocking (store lookups): a worker thread."""
        self.drop([version])  # followed already (an early push of it again)
        whole = []
        for e in entries:
            lacks = set(self.store.missing(e.chunks))
            if not lacks:
                whole.append(e)
                continue
            partial = _Partial(version, e, lacks)
            for cid in lacks:
                self._waiting.setdefault(cid, []).append(partial)
        return whole

    def stored(self, cids: Iterable[bytes]) -> list[Entry]:
        """These chunks were written (or their write failed: the store says which): the
        followed files that are whole now."""
        whole: list[Entry] = []
        waiting, has = self._waiting, self.store.has
        if not waiting:
            return whole
        for cid in cids:
            partials = waiting.get(cid)
            if partials is None or not has(cid):
                continue
            del waiting[cid]
            for p in partials:
                p.lacks.discard(cid)
                if not p.lacks:
                    whole.append(p.entry)
        return whole

    def drop(self, versions: Iterable[bytes]) -> None:
        """Stop following the files of `versions` (completed, or no longer served)."""
        gone = set(versions)
        if not gone or not self._waiting:
            return
        for cid, partials in list(self._waiting.items()):
            kept = [p for p in partials if p.version not in gone]
            if kept:
                self._waiting[cid] = kept
            else:
                del self._waiting[cid]
