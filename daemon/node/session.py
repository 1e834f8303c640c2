"""One authenticated connection to a node: its receive loop, its chunk writes, the relay or
RDMA channel it set up, and the dispatch of its requests.

Every request goes through one table, ROUTES (op -> request class and handler); the request
classes (requests.py) say what each op carries, the reply classes (replies.py) what each
handler returns, which the session encodes. A refusal (RequestError, ValueError,
ManifestError, SpawnRefused) goes back as an Error frame with code "refused" and its message as
is; anything else is logged with its traceback and answered "internal". Either way the session
goes on: one bad request never ends a connection, and a broken connection never takes the
daemon down.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ...fs.manifest import ManifestError
from ..wire import bulk, identity
from ..wire import protocol as p
from ..wire.chunk_read import ChunksReply, ReadChunks
from ..wire.identity import Identity, IdentityError
from ..wire.logs import Logs, LogsReply
from ..wire.read_lists import encode_reads
from ..wire.replies import (
    BulkReply,
    CommitReply,
    CurrentReply,
    FanReply,
    FirstReadsReply,
    FlushReply,
    PrepareReply,
    RelayReply,
    RemoveReply,
    StatusReply,
)
from ..wire.requests import (
    Bulk,
    Commit,
    Current,
    Fan,
    FirstReads,
    Flush,
    OpenRelay,
    Prepare,
    Remove,
    RequestError,
    Status,
)
from ..wire.telemetry_calls import Query, QueryReply, Stats, StatsReply
from ..wire.transport import Channel, ConnectionLost
from . import chunk_read, manifest_first, provisional
from .fetch import Upstream
from .logs import read as read_logs
from .process_routes import ROUTES as PROCESS_ROUTES
from .procs import SpawnRefused
from .push_received import PushReceived, hex_or_none
from .relay import Relay
from .stacks import ROUTES as STACK_ROUTES
from .writes import ChunkWrites

if TYPE_CHECKING:
    from .service import NodeService

log = logging.getLogger("monarch_fs.daemon")

REFUSED = (RequestError, ValueError, ManifestError, SpawnRefused, IdentityError)


class Session:
    """The state one connection builds up, living exactly as long as it: the chunks it has in
    flight to the store, what this node lacks (once asked), its claim on the store (no
    collect between "what do you lack" and the commit), the relay to the children below it
    and the RDMA channel its client opened. Processes it started are stopped when it ends."""

    def __init__(self, service: NodeService, chan: Channel, nursery: trio.Nursery) -> None:
        if service.procs is None:  # set by NodeService.serve, which is what accepts sessions
            raise RuntimeError("a session needs a serving NodeService")
        self.service = service
        self.procs = service.procs
        self.publisher = service.publisher
        self.chan = chan
        self.nursery = nursery  # this connection's writes, relay senders and RDMA receiver
        self.counters = service.counters
        self.writes = ChunkWrites(service.store, raw=service.store_raw,
                                  counters=service.counters, limiter=service.write_limiter,
                                  on_stored=service.fetcher.stored)
        self.relay: Relay | None = None
        # The manifest's root object id, when the client said which it is (OpenRelay.version):
        # the manifest comes first, and says where each large file's chunks go
        # (fs/file_objects.py).
        self.version: bytes | None = None
        self.placing: trio.Event | None = None  # set once the manifest's large files are placed
        self.upstream: Upstream | None = None  # push --early: this peer streams to us
        self.early: bytes | None = None  # push --early: the version (readers.py)
        self.own_missing: set[bytes] | None = None  # what this node lacks, once asked
        self.claimed = False  # told what this node has: no collect until commit
        self.bulk_rx: bulk.BulkReceiver | None = None  # an RDMA channel the client opened
        # Who asks for the request being answered (--identity munge: its credential's user);
        # requests are answered one at a time, so it is that request's.
        self.asker: Identity | None = None
        self.events = service.events
        self.rx = PushReceived()  # what this session received since its last flush
        self.streamed: dict = {}  # provisional file objects it opened (provisional.py)

    @classmethod
    async def serve(cls, service: NodeService, chan: Channel) -> None:
        """Answer `chan` until the peer goes away or breaks the protocol."""
        async with trio.open_nursery() as nursery:
            session = cls(service, chan, nursery)
            try:
                await session._receive_loop()
            finally:
                await session._close()
                nursery.cancel_scope.cancel()

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = await self.chan.receive()
            except ConnectionLost:
                return  # the peer went away: the normal end of a session
            except Exception as e:  # a broken or forged frame ends this session only
                log.warning("session with %s ended: %s", self.chan.peer, e)
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    await self.chan.send(p.Error(str(e), code="protocol"))  # why, for a relay
                return
            if isinstance(msg, p.PutChunk):
                await self.on_chunk(msg.cid, msg.blob, msg.digest, msg.seal)
            elif isinstance(msg, p.PutChunks):
                await self.on_chunks(msg.chunks)
            elif isinstance(msg, p.QueryMissing):
                await self._query_missing(msg.ids)
            elif isinstance(msg, p.Request):
                await self._dispatch(msg)

    async def _close(self) -> None:
        if self.upstream is not None:
            self.service.fetcher.remove(self.upstream)  # its readers' wants fail now
        if self.claimed:
            self.publisher.collection.release_claim()
            self.events.record("push.aborted", version=hex_or_none(self.rx.version),
                               peer=self.chan.peer, text="the pusher went away before its "
                               "commit (it failed elsewhere, or was stopped)")
        if self.relay is not None:
            await self.relay.aclose()
        if self.bulk_rx is not None:
            await self.bulk_rx.aclose()
        await self.procs.kill_owned_by(self.chan)  # the controller went away
        await provisional.close(self)
        if self.writes.store_failed:  # and did not flush: its writes may still run
            await self.writes.idle(self.nursery)
            await self._cut_back_after_failure()

    # ---- chunks ---------------------------------------------------------------------------

    async def on_chunk(self, cid: bytes, blob: bytes | memoryview,
                       digest: bytes | None = None, seal: bytes | None = None) -> None:
        """A chunk arrived (a PutChunk frame or over RDMA): forward it to the children whose
        subtrees lack it, and store it if this node lacks it (`digest`, `seal`: p.PutChunk's)."""
        await self.on_chunks((p.PutChunk(cid, blob, digest, seal),))

    async def on_chunks(self, msgs: Sequence[p.PutChunk]) -> None:
        """on_chunk of each, in order (a PutChunks frame: a tree of small files sends
        thousands, and what is done once per frame here is not done per file)."""
        size = sum(len(msg.blob) for msg in msgs)
        self.counters["chunks_received"] += len(msgs)
        self.counters["bytes_received"] += size
        self.rx.arrived(len(msgs), size)
        for msg in msgs:
            await self._take(msg)
        if self.early is not None:  # push --early: its tail gives way to readers
            await self.service.tail.taken(self.early, size)

    async def _take(self, msg: p.PutChunk) -> None:
        cid, blob = msg.cid, msg.blob
        if self.relay is not None:
            await self.relay.forward(msg)
        if cid == self.version:
            self.version = None
            if self.service.store_raw:  # --store-compressed: every chunk to a pack
                self.placing = manifest_first.start(self.publisher, self.writes, self.nursery,
                                                    cid, blob)
        await manifest_first.wait(self.placing, blob)  # a large file's: written in place
        if self.own_missing is None or cid in self.own_missing:
            await self.writes.start(self.nursery, msg)
            if self.service.fetcher.wanted(cid):  # a reader waits: no waiting for a batch
                await self.writes.hurry(self.nursery)

    async def _query_missing(self, ids: list[bytes]) -> None:
        await self.writes.idle(self.nursery)  # those streamed before it are here (provisional)
        own = await self.publisher.missing(ids)
        self.rx.asked += len(ids)
        self.rx.lacking += len(own)
        if not self.claimed:
            self.claimed = True
            self.publisher.collection.claim()
        self.own_missing = set(own)
        below = await self.relay.query(ids) if self.relay is not None else set()
        await self.chan.send(p.MissingIds([i for i in ids if i in self.own_missing
                                           or i in below]))

    async def _cut_back_after_failure(self) -> None:
        """After this session failed to store a chunk, give back what it stored (see
        Publisher.cut_back); once per failure."""
        if self.writes.store_failed:
            self.writes.store_failed = False
            await self.publisher.collection.cut_back()

    # ---- requests -------------------------------------------------------------------------

    async def _dispatch(self, msg: p.Request) -> None:
        route = ROUTES.get(msg.op)
        try:
            if route is None or route[0].after_chunks:
                await manifest_first.wait(self.placing)  # the chunks before it: placed
                await self.writes.idle(self.nursery)  # a request sees every chunk before it
                self.writes.raise_first()
            if route is None:
                raise RequestError(f"unknown request {msg.op!r}")
            kind, handler = route
            self.asker = None  # not the last request's, if this one's credential is refused
            self.asker = await self._identify(msg.op, msg.args)
            value = await handler(self, kind.parse(msg.args))
        except REFUSED as e:
            self._refused(msg.op, msg.args, str(e))
            await self.chan.send(p.Error(str(e), code="refused", id=msg.id))
        except Exception as e:
            log.exception("request %s failed", msg.op)
            await self.chan.send(p.Error(f"internal error: {e!r}", code="internal", id=msg.id))
        else:
            await self.chan.send(p.Reply(msg.id, value.to_wire()))

    def _refused(self, op: str, args: object, why: str) -> None:
        """Record a refusal: a publish's as the push aborted on this node, with its cause."""
        args = args if isinstance(args, dict) else {}
        name, version = args.get("name"), args.get("version")
        fields = {"workspace": name if isinstance(name, str) else None,
                  "version": version if isinstance(version, str) else None,
                  "peer": self.chan.peer, "text": why, "uid": self._owner}
        if op in ("prepare", "commit"):
            self.events.record("push.aborted", detail={"phase": op}, **fields)
        else:
            self.events.record("request.refused", detail={"op": op}, **fields)

    async def _identify(self, op: str, args: dict, scope: str | None = None
                        ) -> Identity | None:
        """Who asks, for the requests that act for a user on a daemon with --identity munge
        (checked before anything else of the request); None otherwise. A request that came
        down a control tree (`fan`) is bound to its `scope`, not to this connection."""
        if self.service.identity != identity.MODE or op not in identity.OPS:
            return None
        if scope is None:
            return await identity.verify(args.get(identity.FIELD), op, args,
                                         identity.session_id(self.chan),
                                         self.service.munge_socket)
        return await identity.verify(args.get(identity.FIELD), op, args,
                                     identity.fan_scope(scope), self.service.munge_socket,
                                     self.service.fan_scopes)

    @property
    def _owner(self) -> int | None:
        return None if self.asker is None else self.asker.uid

    async def _status(self, req: Status) -> StatusReply:
        return await self.service.status()

    async def _prepare(self, req: Prepare) -> PrepareReply:
        start = time.monotonic()
        value = await self.publisher.prepare(req.name, req.version, req.source, self._owner,
                                             req.early, req.wait)
        self.events.record("push.prepared", workspace=req.name, version=req.version.hex(),
                           peer=self.chan.peer, seconds=round(time.monotonic() - start, 6),
                           detail={"early": True} if req.early is not None else None)
        return value

    async def _commit(self, req: Commit) -> CommitReply:
        start = time.monotonic()
        before = list(self.service.refs.workspaces.get(req.name, []))
        value = await self.publisher.commit(req.name, req.version, req.source, req.source_id,
                                            self._owner, req.early, req.wait, req.ahead)
        self._published(req, before, time.monotonic() - start)
        self.service.first_reads.published(req.name, req.version)
        if self.claimed:  # what it has is now retained
            self.claimed = False
            self.publisher.collection.release_claim(committed=True)
        else:
            self.publisher.collection.start(committed=True)
        return value

    def _published(self, req: Commit, before: list[bytes], seconds: float) -> None:
        """Record a commit: the push's last phase here, the version published, and the
        versions it pushed out of the retained ones (collected from then on)."""
        ev, name = self.events, req.name
        previous = before[0].hex() if before else None
        ev.record("push.committed", workspace=name, version=req.version.hex(),
                  peer=self.chan.peer, seconds=round(seconds, 6),
                  detail={"previous": previous, **({"early": True} if req.early else {})})
        if previous != req.version.hex():
            ev.record("version.published", workspace=name, version=req.version.hex(),
                      detail={"previous": previous})
        kept = set(self.service.refs.workspaces.get(name, []))
        for v in before:
            if v not in kept:
                ev.record("version.dropped", workspace=name, version=v.hex(),
                          text=f"more than {self.publisher.keep} versions of {name}")

    async def _current(self, req: Current) -> CurrentReply:
        return CurrentReply(self.publisher.current(req.name, req.version, req.source,
                                                   self._owner),
                            self.publisher.serving(req.name, self._owner))

    async def _remove(self, req: Remove) -> RemoveReply:
        value = await self.publisher.remove(req.name, self.procs.pinned_to, self._owner)
        for v in value.versions:
            self.events.record("version.dropped", workspace=req.name, version=v.hex(),
                               peer=self.chan.peer, text=f"workspace {req.name} removed")
        return value

    async def _relay(self, req: OpenRelay) -> RelayReply:
        s = self.service
        self.version = req.version
        self.rx.opened(req.version, req.children)
        relay = self.relay
        if relay is not None and not req.wants and relay.fetcher is None \
                and relay.plan == req.children:  # pushing again to the same subtree
            return RelayReply(await relay.rearm(req.version))
        if relay is not None:  # a session that pushes again elsewhere
            await relay.aclose()
            self.relay = None
        self.relay = Relay(s.token, req.children, req.timeout, self.nursery, self.counters,
                           s.transport, s.encrypt, version=req.version,
                           fetcher=s.fetcher if req.wants else None)
        self.early = req.version if req.wants else None
        if req.wants and self.upstream is None:  # reads here may ask this peer for chunks
            self.upstream = Upstream(self.chan.peer, self.chan.send, req.timeout)
            s.fetcher.add(self.upstream)
        return RelayReply(await self.relay.open())

    async def _fan(self, req: Fan) -> FanReply:
        """Answer `req.request` here while the relay has the subtree below answer it too."""
        replies: dict[str, dict] = {}
        failed: dict[str, str] = {}

        async def below(relay: Relay) -> None:
            got, lost = await relay.fan(req.request, req.args, req.scope)
            replies.update(got)
            failed.update(lost)

        async with trio.open_nursery() as nursery:
            if self.relay is not None:
                nursery.start_soon(below, self.relay)
            kind, handler = ROUTES[req.request]
            try:
                self.asker = await self._identify(req.request, req.args, req.scope)
                value = await handler(self, kind.parse(req.args))
            except REFUSED as e:
                self._refused(req.request, req.args, str(e))
                failed[""] = str(e)
            except Exception as e:
                log.exception("request %s (down the control tree) failed", req.request)
                failed[""] = f"internal error: {e!r}"
            else:
                replies[""] = value.to_wire()
        return FanReply(failed, replies)

    async def _flush(self, req: Flush) -> FlushReply:
        bulk_error = None  # RDMA chunks are not ordered with this request
        self.rx.version = self.rx.version or req.version  # a push's helper says whose
        if self.bulk_rx is not None:
            bulk_error = await self.bulk_rx.wait_delivered(req.bulk_chunks)
        await self.writes.idle(self.nursery)
        await self._cut_back_after_failure()
        failed = await self.relay.flush() if self.relay is not None else {}
        if self.writes.errors:
            failed[""] = self.writes.errors[0]  # "" is this node, as its parent names it
        if bulk_error:
            failed[""] = f"rdma: {bulk_error}"
        self.rx.flushed(self.events, self.chan.peer, failed,
                        self.bulk_rx.kind if self.bulk_rx is not None else "tcp")
        return FlushReply(failed)

    async def _bulk(self, req: Bulk) -> BulkReply:
        key = self.chan.conn.bulk_key
        if key is None:  # derived by the handshake, which every session has completed
            raise RequestError("bulk: this session has no bulk key")
        try:  # an RDMA channel for chunk payloads; control stays here
            self.bulk_rx, value = bulk.accept_receiver(self.service.transport, req.setup,
                                                       self.on_chunk, self.nursery, key)
        except Exception as e:
            raise RequestError(f"bulk: {e}") from None
        return BulkReply.from_wire(value)

    async def _first_reads(self, req: FirstReads) -> FirstReadsReply:
        return FirstReadsReply(**encode_reads(await self.service.first_reads.reads(req.name)))

    async def _query(self, req: Query) -> QueryReply:
        answer = await self.events.query(req.sql, req.params, timeout=req.timeout,
                                         asker=self.asker)
        return QueryReply(answer.columns, answer.rows)

    async def _stats(self, req: Stats) -> StatsReply:
        return self.service.stats(self.asker)

    async def _logs(self, req: Logs) -> LogsReply:
        if not self.events.enabled:
            raise RequestError("logs: this node records nothing (MONARCH_FS_EVENTS=0)")
        await self.events.flush()  # every line printed before the request was asked
        return await trio.to_thread.run_sync(read_logs, self.events.path, req, self.asker)

    async def _read_chunks(self, req: ReadChunks) -> ChunksReply:
        chunk_read.check(self.publisher, req, self.asker)
        return await trio.to_thread.run_sync(chunk_read.read, self.service.store, req.ids)


NodeRequest = (Status | Prepare | Commit | Current | Remove | OpenRelay | Fan | Flush | Bulk
               | FirstReads | Query | Stats | Logs | ReadChunks)
NodeReply = (StatusReply | PrepareReply | CommitReply | CurrentReply | RemoveReply | RelayReply
             | FanReply | FlushReply | BulkReply | FirstReadsReply | QueryReply | StatsReply
             | LogsReply | ChunksReply)
Handler = Callable[[Session, Any], Awaitable[NodeReply]]  # (typed loosely: each takes its own)
Routed = type[NodeRequest]

_HANDLERS: list[tuple[Routed, Handler]] = [
    (Status, Session._status),
    (Prepare, Session._prepare),
    (Commit, Session._commit),
    (Current, Session._current),
    (Remove, Session._remove),
    (OpenRelay, Session._relay),
    (Fan, Session._fan),
    (Flush, Session._flush),
    (Bulk, Session._bulk),
    *PROCESS_ROUTES,  # process_routes.py's ops
    (FirstReads, Session._first_reads),
    (Query, Session._query),
    (Stats, Session._stats),
    *STACK_ROUTES,  # stacks.py's ops
    (Logs, Session._logs),
    (ReadChunks, Session._read_chunks),
    *provisional.ROUTES,  # provisional.py: stream_file, stream_chunks
]
# The one dispatch table: every op a node answers, its request class and its handler.
ROUTES: dict[str, tuple[Routed, Handler]] = {
    kind.op: (kind, handler) for kind, handler in _HANDLERS}
