"""A node's side of a broadcast: store what it lacks, and forward each chunk to the children
whose subtrees lack it while the next chunk arrives (a queue per child bounded in bytes, so a
slow child slows its parent instead of filling its memory). Small chunks go down in batches.

A relay session runs inside one connection: `relay` opens the children (recursively: each child
opens its own), `QueryMissing` learns what each subtree lacks, `PutChunk`s flow down, and `flush`
waits until every queue has drained and every descendant has flushed, returning the failures seen
anywhere below as {addr: cause}.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from ..wire import bulk
from ..wire.topology import patience
from ..wire.transport import CONNECT_TIMEOUT, Channel, connect, describe_failure

log = logging.getLogger("monarch_fs.relay")

QUEUE_BYTES = 16 << 20  # buffered per child, at most (plus the one chunk that crosses it)


class _Child:
    def __init__(self, spec: dict):
        self.addr: str = spec["addr"]
        self.children: list[dict] = spec.get("children", [])
        self.patience = patience(self.children)  # timeouts to wait on it (its subtree below)
        self.chan: Channel | None = None
        self.bulk: bulk.BulkSender | None = None
        self.need: set[bytes] = set()
        self.error: str | None = None
        self.send, self.receive = trio.open_memory_channel[tuple[bytes, bytes]](float("inf"))
        self.queued = 0  # bytes in the queue; forward() waits while it is over QUEUE_BYTES
        self.space = trio.Event()  # set (and replaced) whenever the sender takes bytes out
        self.done = trio.Event()

    def took(self, size: int) -> None:
        self.queued -= size
        self.space.set()
        self.space = trio.Event()


class Relay:
    """One node's hop of a broadcast, for one session (see the module docstring): its links to
    its children, what each child's subtree lacks, and a queue per child. A child that fails is
    recorded in `failures` and skipped from then on, never fatal to the hop: the push reports
    it by address and the rest of the tree carries on."""

    def __init__(self, token: bytes, children: Sequence[dict], timeout: float,
                 nursery: trio.Nursery, counters: dict[str, int],
                 local: bulk.LocalTransport | None = None, encrypt: str = "auto"):
        self.token = token
        self.encrypt = encrypt  # the node's policy, for its links to its children
        self.counters = counters
        # Chunks go to each child over the best bulk transport both ends have (RDMA or TCP),
        # as the dev box does to the roots; control stays on the TCP channel.
        self.local = local or bulk.LocalTransport()
        self.timeout = timeout
        self.nursery = nursery
        self.children = [_Child(spec) for spec in children]
        self.failures: dict[str, str] = {}

    def _fail(self, child: _Child, e: BaseException | str) -> None:
        if child.error is None:
            child.error = e if isinstance(e, str) else describe_failure(e, self.timeout)
            self.failures[child.addr] = child.error
            log.warning("relay to %s failed: %s", child.addr, child.error)
            child.receive.close()  # the forwarder stops queueing for it
            child.took(0)  # and stops waiting for room

    async def _each(self, fn) -> None:
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
        """Connect to every child and have it open its own subtree."""
        async def start(child: _Child) -> None:
            child.chan = await connect(child.addr, self.token, encrypt=self.encrypt,
                                       timeout=min(CONNECT_TIMEOUT, self.timeout))
            policy = "tcp" if self.local.kind == bulk.TCP else "auto"
            kind, _ = bulk.choose_for_peer(self.local, policy, child.chan.info)
            child.bulk = await bulk.open_sender(child.chan, kind, self.local, child.chan.info)
            reply = await child.chan.request("relay", children=child.children,
                                             timeout=self.timeout)
            self.failures.update(reply.get("failed", {}))
            self.nursery.start_soon(self._sender, child)

        await self._each(start)
        return dict(self.failures)

    async def query(self, ids: list[bytes]) -> set[bytes]:
        """What the subtrees below lack, remembered per child for forwarding."""
        async def ask(child: _Child) -> None:
            child.need = set(await child.chan.query_missing(ids))

        await self._each(ask)
        return set().union(*(c.need for c in self.children if c.error is None))

    async def forward(self, cid: bytes, blob: bytes) -> None:
        for child in self.children:
            if cid not in child.need:
                continue
            while child.queued >= QUEUE_BYTES and child.error is None:
                await child.space.wait()
            if child.error is not None:
                continue  # the child failed meanwhile; _fail recorded why
            try:
                child.send.send_nowait((cid, blob))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue  # failed, or the session is closing
            child.queued += len(blob)

    async def _sender(self, child: _Child) -> None:
        try:
            async for first in child.receive:
                batch, size = [first], len(first[1])
                while size < bulk.BATCH_BYTES and len(batch) < bulk.BATCH_CHUNKS:
                    try:
                        item = child.receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break  # nothing more queued yet, or nothing more at all
                    batch.append(item)
                    size += len(item[1])
                with trio.fail_after(self.timeout * child.patience):
                    await child.bulk.send_chunks(batch)
                child.took(size)
                self.counters["chunks_forwarded"] += len(batch)
        except Exception as e:
            self._fail(child, e)
        finally:
            child.done.set()

    async def flush(self) -> dict[str, str]:
        """Wait until everything queued went out and every subtree flushed; all failures below."""
        for child in self.children:
            await child.send.aclose()

        async def drain(child: _Child) -> None:
            await child.done.wait()
            if child.error is None:
                extra = await child.bulk.flush()  # RDMA: the child waits for that many chunks
                reply = await child.chan.request("flush", **extra)
                for addr, cause in reply.get("failed", {}).items():
                    self.failures[addr or child.addr] = cause  # "" is the child itself

        await self._each(drain)
        return dict(self.failures)

    async def aclose(self) -> None:
        for child in self.children:
            child.send.close()
            await bulk.close_peer(child.bulk, child.chan)
