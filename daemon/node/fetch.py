"""Chunks fetched on demand, for a version published before all of it arrived (push --early).

A read of a chunk the store lacks does not fail at once: it registers a waiter and sends a
`Want` to every upstream of this node, the relay sessions that stream it chunks (from the dev
box, or from its relay parent). The sender puts the chunk ahead of its queue (a relay parent
that lacks it too asks its own upstream first); the waiter wakes when a write batch that holds
it is stored (`stored`, called by writes.py). It never trusts anything but the store: a woken
reader reads the verified chunk from there, so a want can only make a read faster, never
wrong.

With no upstream (the dev box was killed, the relay session was lost) or after the wait bound
(the push's stall timeout), the read fails with one log line naming this host and the chunk,
and the caller answers EIO.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from ...fs.store import Store
from ..wire import protocol as p

log = logging.getLogger("monarch_fs.daemon")

DEFAULT_WAIT = 60.0  # seconds a read waits for a wanted chunk; an upstream sets its own


class ChunkUnavailable(LookupError):
    """A chunk this node lacks could not be had from upstream (the message says why)."""


class Upstream:
    """A peer that streams chunks to this node and takes wants: how to ask it, and how long
    to wait for its answer."""

    def __init__(self, name: str, send: Callable[[p.Want], Awaitable[None]], timeout: float):
        self.name = name
        self.send = send
        self.timeout = timeout


class Fetcher:
    """The waiters for chunks a reader needs and this node lacks, and the upstreams to ask."""

    def __init__(self, store: Store, host: str) -> None:
        self.store = store
        self.host = host  # this node, as the log names it
        self.upstreams: list[Upstream] = []
        self._waiting: dict[bytes, trio.Event] = {}  # a reader waits: write it at once
        self._arriving: dict[bytes, trio.Event] = {}  # an early prepare waits: in due course
        self.fetched = 0  # chunks a reader waited for and got
        self.failed = 0

    def add(self, upstream: Upstream) -> None:
        self.upstreams.append(upstream)

    def remove(self, upstream: Upstream) -> None:
        """An upstream ended: with none left, every waiter fails now rather than at its
        timeout (nothing else would send it)."""
        if upstream in self.upstreams:
            self.upstreams.remove(upstream)
        if not self.upstreams:
            for event in self._waiting.values():
                event.set()

    def waiting(self) -> bool:
        """Whether any reader waits for a chunk (node/readers.py holds no tail back then)."""
        return bool(self._waiting)

    def wanted(self, cid: bytes) -> bool:
        """Whether a reader waits for `cid` (its write should not wait for a full batch)."""
        return cid in self._waiting

    def stored(self, cids: list[bytes]) -> None:
        """These chunks are in the store now: wake whoever waits for them."""
        for waiting in (self._waiting, self._arriving):
            if waiting:
                for cid in cids:
                    event = waiting.pop(cid, None)
                    if event is not None:
                        event.set()

    async def wait(self, cids: list[bytes], timeout: float) -> list[bytes]:
        """Wait (without asking anyone) until every one of `cids` is stored, or `timeout`
        passed; returns those still missing. For an early prepare: the chunks the first reads
        need come first in the stream."""
        with trio.move_on_after(timeout):
            for cid in self.store.missing(cids):
                if not self.store.has(cid):  # stored while this waited for the ones before
                    await self._arriving.setdefault(cid, trio.Event()).wait()
        return self.store.missing(cids)

    async def fetch(self, cid: bytes) -> None:
        """Return once `cid` is in the store, asking the upstreams for it; ChunkUnavailable
        (after one log line naming this host and the chunk) if it cannot be had."""
        if self.store.has(cid):
            return
        if not self.upstreams:
            self._give_up(cid, "no push is streaming to this node (the dev box or the relay "
                          "parent went away before it arrived)")
        event = self._waiting.get(cid)
        if event is None or event.is_set():  # set: by a remove(), for an earlier upstream
            event = self._waiting[cid] = trio.Event()
            for upstream in list(self.upstreams):
                try:
                    await upstream.send(p.Want([cid]))
                except Exception as e:  # that upstream is going away; remove() follows
                    log.debug("want %s from %s: %s", cid.hex(), upstream.name, e)
        timeout = max((u.timeout for u in self.upstreams), default=DEFAULT_WAIT)
        with trio.move_on_after(timeout) as scope:
            await event.wait()
        if self.store.has(cid):
            self.fetched += 1
            return
        self._waiting.pop(cid, None)
        self._give_up(cid, f"not received within {timeout:g}s" if scope.cancelled_caught
                      else "the push streaming it ended before it arrived")

    def _give_up(self, cid: bytes, why: str) -> None:
        self.failed += 1
        log.error("%s: chunk %s is not available: %s", self.host, cid.hex(), why)
        raise ChunkUnavailable(f"{self.host}: chunk {cid.hex()} is not available: {why}")
