"""A node's side of a broadcast: store what it lacks, and forward each chunk to the children
whose subtrees lack it while the next chunk arrives. Chunks go down in batches (up to
bulk.BATCH_BYTES or BATCH_CHUNKS) through a bounded channel per child, so a slow child slows its
parent instead of filling its memory. A large chunk goes down with the seal it arrived with
(wire/chunk_seals.py): this hop checked it on arrival and each child checks it again, so the
hop does not seal the chunk's bytes again for each child's link.

A relay session runs inside one connection: `relay` opens the children (recursively: each child
opens its own), `QueryMissing` learns what each subtree lacks, `PutChunk`s flow down, and `flush`
waits until every queue has drained and every descendant has flushed, returning the failures seen
anywhere below as {addr: cause}.

A push to many nodes keeps its relays as its control tree (push.py, `control`): `fan` sends a
request (current, prepare, commit) to every child, which answers it and has its own subtree
answer; and a session that pushes again with the same children (push --watch) rearms its relay
over the links it has (`rearm`) instead of connecting again.

In a push --early session (`fetcher` given) a child may send a `Want` for chunks a reader of it
needs: they go to it at once on its control channel, ahead of its queue, from this node's store
(fetched from upstream first if this node lacks them too). Its wants are read from when the
subtree was queried until the flush, which reads its reply on the same channel.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from ..wire import bulk
from ..wire import protocol as p
from ..wire.replies import FanReply, FlushReply, RelayReply
from ..wire.topology import patience, subtree
from ..wire.transport import CONNECT_TIMEOUT, Channel, ConnectError, connect, describe_failure
from .fetch import ChunkUnavailable, Fetcher

log = logging.getLogger("monarch_fs.relay")

# Batches queued per child, at most, besides the one being filled and the one being sent. A
# batch ends once it holds BATCH_BYTES, so with 4 MiB chunks (one per batch) that is 16 MiB.
QUEUE_BATCHES = 4

Batch = list[p.PutChunk]  # as received: a large chunk's seal goes on with it (chunk_seals.py)


class _Child:
    """One child of this hop: its link, what its subtree lacks, and the queue to it."""

    def __init__(self, spec: dict):
        self.addr: str = spec["addr"]
        self.children: list[dict] = spec.get("children", [])
        self.patience = patience(self.children)  # timeouts to wait on it (its subtree below)
        self.chan: Channel | None = None
        self.bulk: bulk.BulkSender | None = None
        self.need: set[bytes] = set()
        self.error: str | None = None
        self.reset()

    def reset(self) -> None:
        """A push's state: the queue to the child, what it lacks, its wants' reader."""
        self.need = set()
        self.send, self.receive = trio.open_memory_channel[Batch](QUEUE_BATCHES)
        # Not queued yet: goes once it is a full batch, or at once while the queue is empty
        # (the sender is idle, or about to be), or at flush.
        self.filling: Batch = []
        self.filling_bytes = 0
        self.done = trio.Event()
        self.reading = trio.CancelScope()  # its wants, until the flush (push --early)
        self.read_done = trio.Event()
        self.read_done.set()

    @property
    def spec(self) -> dict:
        return {"addr": self.addr, "children": self.children}

    def link(self) -> tuple[Channel, bulk.BulkSender]:
        """The child's control channel and bulk sender. `open` sets both before anything else
        runs on a child, and a child whose open failed has an error and is skipped."""
        if self.chan is None or self.bulk is None:
            raise ConnectError(f"{self.addr}: not connected")
        return self.chan, self.bulk

    def add(self, msg: p.PutChunk) -> Batch | None:
        """Add a chunk to the batch being filled; returns the batch once it should be queued."""
        self.filling.append(msg)
        self.filling_bytes += len(msg.blob)
        full = (self.filling_bytes >= bulk.BATCH_BYTES
                or len(self.filling) >= bulk.BATCH_CHUNKS)
        if full or self.send.statistics().current_buffer_used == 0:
            return self.take()
        return None

    def take(self) -> Batch:
        batch, self.filling, self.filling_bytes = self.filling, [], 0
        return batch


class Relay:
    """One node's hop of a broadcast, for one session (see the module docstring): its links to
    its children, what each child's subtree lacks, and a queue per child. A child that fails is
    recorded in `failures` and skipped from then on, never fatal to the hop: the push reports
    it by address and the rest of the tree carries on."""

    def __init__(self, token: bytes, children: Sequence[dict], timeout: float,
                 nursery: trio.Nursery, counters: dict[str, int],
                 local: bulk.LocalTransport | None = None, encrypt: str = "auto",
                 version: bytes | None = None, fetcher: Fetcher | None = None):
        self.token = token
        self.version = version  # the manifest's id, which comes first: told to each child
        self.fetcher = fetcher  # push --early: children may want chunks ahead of the stream
        self.encrypt = encrypt  # the node's policy, for its links to its children
        self.counters = counters
        # Chunks go to each child over the best bulk transport both ends have (RDMA or TCP),
        # as the dev box does to the roots; control stays on the TCP channel.
        self.local = local or bulk.LocalTransport()
        self.timeout = timeout
        self.nursery = nursery
        self.plan = list(children)  # as the parent sent it: a push with the same rearms
        self.children = [_Child(spec) for spec in children]
        self.failures: dict[str, str] = {}

    def _fail(self, child: _Child, e: BaseException | str) -> None:
        if child.error is None:
            child.error = e if isinstance(e, str) else describe_failure(e, self.timeout)
            self.failures[child.addr] = child.error
            log.warning("relay to %s failed: %s", child.addr, child.error)
            child.receive.close()  # a forward waiting for room in its queue gives up
            child.take()  # and what was being filled is dropped

    @staticmethod
    def _lost(child: _Child) -> dict[str, str]:
        """What a failed child costs a request down the control tree: itself, and every
        node below it, which it no longer reaches. (The dev box may still reach those
        directly with chunks: a broadcast reports only the child.)"""
        lost = {child.addr: child.error or "failed"}
        for addr in subtree(child.spec)[1:]:
            lost[addr] = f"not reached: its relay parent {child.addr} failed ({child.error})"
        return lost

    async def _each(self, fn: Callable[[_Child], Awaitable[None]]) -> None:
        async def one(child: _Child) -> None:
            # A child waits for its own subtree, which times out first and is blamed instead.
            try:
                with trio.fail_after(self.timeout * child.patience):
                    await fn(child)
            except Exception as e:  # a child's failure is reported, never fatal to the relay
                self._fail(child, e)

        async with trio.open_nursery() as nursery:
            for child in self.children:
                if child.error is None:
                    nursery.start_soon(one, child)

    async def open(self) -> dict[str, str]:
        """Connect to every child (unless linked already: `rearm`) and have it open its own
        subtree."""
        extra: dict[str, str | bool] = ({} if self.version is None
                                         else {"version": self.version.hex()})
        if self.fetcher is not None:
            extra["wants"] = True

        async def start(child: _Child) -> None:
            if child.chan is not None and child.bulk is not None:  # rearmed: the last push's
                try:
                    reply = await child.chan.request("relay", children=child.children,
                                                     timeout=self.timeout, **extra)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    # the child restarted since: connect again, once
                    await bulk.close_peer(child.bulk, child.chan)
                    child.chan, child.bulk = None, None
            if child.chan is None or child.bulk is None:
                child.chan = await connect(child.addr, self.token, encrypt=self.encrypt,
                                           timeout=min(CONNECT_TIMEOUT, self.timeout))
                policy = "tcp" if self.local.kind == bulk.TCP else "auto"
                kind, _ = bulk.choose_for_peer(self.local, policy, child.chan.info)
                child.bulk = await bulk.open_sender(child.chan, kind, self.local,
                                                    child.chan.info)
                reply = await child.chan.request("relay", children=child.children,
                                                 timeout=self.timeout, **extra)
            self.failures.update(RelayReply.from_wire(reply).failed)
            self.nursery.start_soon(self._sender, child, child.bulk, child.receive, child.done)

        await self._each(start)
        return dict(self.failures)

    async def rearm(self, version: bytes | None) -> dict[str, str]:
        """Open this relay again for the session's next push, over the links it has: a child
        that failed is connected again, every child's queue starts afresh (a sender still
        draining an abandoned push's queue finishes first), and each child rearms its own."""
        self.version = version
        self.failures = {}
        for child in self.children:
            child.send.close()
            if child.error is None:
                with trio.move_on_after(self.timeout * child.patience):
                    await child.done.wait()
                if not child.done.is_set():
                    self._fail(child, "its queue did not drain before the next push")
            if child.error is not None:
                await bulk.close_peer(child.bulk, child.chan)
                child.chan, child.bulk, child.error = None, None, None
            child.reset()
        return await self.open()

    async def fan(self, request: str, args: dict, scope: str
                  ) -> tuple[dict[str, dict], dict[str, str]]:
        """Send request `request` down to every child's subtree (requests.Fan): every reply
        and every failure below, by address. A child that failed, now or earlier in this
        push, fails its whole subtree, which it no longer reaches."""
        replies: dict[str, dict] = {}
        failed: dict[str, str] = {}

        async def ask(child: _Child) -> None:
            chan, _ = child.link()
            reply = FanReply.from_wire(await chan.request("fan", request=request, args=args,
                                                          scope=scope))
            for addr, value in reply.replies.items():
                replies[addr or child.addr] = value  # "" is the child itself
            for addr, cause in reply.failed.items():
                failed[addr or child.addr] = cause

        await self._each(ask)
        for child in self.children:
            if child.error is not None:
                lost = self._lost(child)
                failed.update(lost)
                for addr in lost:
                    replies.pop(addr, None)
        return replies, failed

    async def query(self, ids: list[bytes]) -> set[bytes]:
        """What the subtrees below lack, remembered per child for forwarding."""
        async def ask(child: _Child) -> None:
            chan, _ = child.link()
            child.need = set(await chan.query_missing(ids))

        await self._each(ask)
        if self.fetcher is not None:
            for child in self.children:
                if child.error is None:
                    child.read_done = trio.Event()
                    self.nursery.start_soon(self._read_wants, child)
        return set().union(*(c.need for c in self.children if c.error is None))

    async def forward(self, msg: p.PutChunk) -> None:
        """Queue a chunk for the children whose subtrees lack it (with its seal, if it came
        with one: each child checks the seal the chunk left the dev box with); waits while a
        child's queue is full (until its sender makes room, or the child fails)."""
        for child in self.children:
            if msg.cid not in child.need or child.error is not None:
                continue  # not wanted there, or the child failed; _fail recorded why
            batch = child.add(msg)
            if batch is not None:
                await self._queue(child, batch)

    async def _queue(self, child: _Child, batch: Batch) -> None:
        try:
            try:  # room in the queue: no pass through the scheduler for each chunk
                child.send.send_nowait(batch)
            except trio.WouldBlock:
                await child.send.send(batch)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the child failed meanwhile, or the session is closing

    async def _sender(self, child: _Child, sender: bulk.BulkSender,
                      receive: trio.MemoryReceiveChannel[Batch], done: trio.Event) -> None:
        try:
            async for batch in receive:
                for _ in range(QUEUE_BATCHES):  # what else is queued goes in the same write
                    try:
                        batch = batch + receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                with trio.fail_after(self.timeout * child.patience):
                    await sender.send_puts(batch)
                self.counters["chunks_forwarded"] += len(batch)
        except Exception as e:
            self._fail(child, await self._why(child, e))
        finally:
            done.set()

    async def _why(self, child: _Child, e: Exception) -> Exception | str:
        """A child that hung up on its stream says why first (session.py sends an Error: a
        chunk that failed its seal, a frame that failed its link's tag): its words, else `e`.
        Read here unless its wants' reader reads the channel (push --early)."""
        if self.fetcher is not None or child.chan is None \
                or not isinstance(e, trio.BrokenResourceError):
            return e
        with trio.move_on_after(1):
            try:
                while not isinstance(msg := await child.chan.next_message(), p.Error):
                    pass
                return msg.message
            except Exception:
                pass
        return e

    async def _read_wants(self, child: _Child) -> None:
        """Answer the child's wants until the flush (push --early); see the module docstring."""
        try:
            with child.reading:
                chan, _ = child.link()
                while True:
                    msg = await chan.next_message()
                    if isinstance(msg, p.Want):
                        for cid in msg.ids:
                            self.nursery.start_soon(self._send_wanted, child, cid)
                    else:
                        raise p.ProtocolError(f"unexpected {type(msg).__name__} while streaming")
        except Exception as e:
            self._fail(child, e)
        finally:
            child.read_done.set()

    async def _send_wanted(self, child: _Child, cid: bytes) -> None:
        fetcher = self.fetcher
        if fetcher is None or child.error is not None:
            return
        try:
            await fetcher.fetch(cid)  # from upstream, if this node lacks it too
            blob = await trio.to_thread.run_sync(fetcher.store.get_blob, cid)
            chan, _ = child.link()
            await chan.send(p.PutChunk(cid, blob))
            self.counters["chunks_forwarded"] += 1
        except ChunkUnavailable:
            pass  # logged; the child gives up when its own upstream (this session) ends
        except Exception as e:
            self._fail(child, e)

    async def flush(self) -> dict[str, str]:
        """Wait until everything queued went out and every subtree flushed; all failures below."""
        for child in self.children:
            child.reading.cancel()  # the flush reads the child's channel now
            await child.read_done.wait()
        for child in self.children:
            if child.filling and child.error is None:
                await self._queue(child, child.take())
            await child.send.aclose()

        async def drain(child: _Child) -> None:
            await child.done.wait()
            if child.error is None:
                chan, sender = child.link()
                extra = await sender.flush()  # RDMA: the child waits for that many chunks
                reply = FlushReply.from_wire(await chan.request("flush", **extra))
                for addr, cause in reply.failed.items():
                    self.failures[addr or child.addr] = cause  # "" is the child itself

        await self._each(drain)
        return dict(self.failures)

    async def aclose(self) -> None:
        for child in self.children:
            child.reading.cancel()
            child.send.close()
            await bulk.close_peer(child.bulk, child.chan)
