"""The dev box's link to each node of a push: its control channel, its bulk sender, what it
lacks and why it failed; and `each`, which runs one step on every healthy link at once, so a
node that fails is marked and the others go on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from ..wire import bulk
from ..wire import protocol as p
from ..wire.transport import Channel, ConnectError, RemoteError, describe_failure

STALL_TIMEOUT = 60.0  # no progress on one node for this long fails that node

# What fails one node (and not the push): its link broke, it refused, it stalled.
NODE_ERRORS = (OSError, bulk.BulkError, trio.TooSlowError, trio.BrokenResourceError,
               trio.ClosedResourceError, RemoteError, ConnectError, p.ProtocolError, EOFError)


class NodeLink:
    """One node as a push sees it. `chan` is set by the connect step and `bulk` when the node
    first receives chunks; a node without them has failed (`error`) and is skipped."""

    def __init__(self, addr: str):
        self.addr = addr
        self.chan: Channel | None = None
        self.missing: set[bytes] = set()
        self.error: str | None = None
        self.transport: tuple[str, str] = ("tcp", "")  # (bulk kind, why), chosen on connect
        self.bulk: bulk.BulkSender | None = None  # opened when the node first receives chunks

    def fail(self, e: BaseException | str, timeout: float = STALL_TIMEOUT) -> None:
        if self.error is None:
            self.error = e if isinstance(e, str) else describe_failure(e, timeout)

    @property
    def channel(self) -> Channel:
        """The control channel of a connected node."""
        if self.chan is None:
            raise ConnectError(f"{self.addr}: not connected")
        return self.chan

    @property
    def sender(self) -> bulk.BulkSender:
        """The bulk sender of a node that was opened for chunks."""
        if self.bulk is None:
            raise ConnectError(f"{self.addr}: no bulk channel open")
        return self.bulk


class Sessions:
    """The nodes' sessions that `push --watch` keeps open from one push to the next, so an
    edit costs no connect, handshake or link probe. A node whose session failed during a push
    is connected again at the next (push.py closes it)."""

    def __init__(self) -> None:
        self.links: dict[str, NodeLink] = {}
        self.codecs: dict = {}  # host -> its link_codec.LinkChoice, chosen once

    def link(self, addr: str) -> NodeLink:
        """`addr`'s link for a new push: the open one, or a new (unconnected) one."""
        link = self.links.get(addr)
        if link is None or link.error is not None or link.chan is None:
            link = self.links[addr] = NodeLink(addr)
            self.codecs.pop(addr, None)
        link.missing = set()
        return link

    async def __aenter__(self) -> Sessions:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for link in self.links.values():
            await bulk.close_peer(link.bulk, link.chan)
        self.links.clear()


async def each(nodes: Sequence[NodeLink], fn: Callable[[NodeLink], Awaitable[object]],
               timeout: float | None = None, levels: dict[str, int] | None = None) -> None:
    """Run fn(node) on every healthy node at once; a failure marks that node, not the others.
    A root of a relay plan waits for its subtree, so its timeout is multiplied by `levels`."""

    async def one(node: NodeLink) -> None:
        try:
            scale = (levels or {}).get(node.addr, 1)
            with trio.fail_after(timeout * scale) if timeout else trio.CancelScope():
                await fn(node)
        except NODE_ERRORS as e:
            node.fail(e, timeout or STALL_TIMEOUT)

    async with trio.open_nursery() as nursery:
        for node in nodes:
            if node.error is None:
                nursery.start_soon(one, node)
