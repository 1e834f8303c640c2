"""The nodes of one push and how its requests reach them: the sessions the dev box holds
(every node, or the roots of a control tree, through which `fan` asks the rest), which nodes
failed and why, and when a failure fails the push (`check`). push.py's steps ride on these."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from ..wire import bulk, identity, topology
from ..wire.replies import FanReply, RelayReply
from ..wire.transport import CONNECT_TIMEOUT, connect
from .links import NodeLink, Sessions, each
from .push_result import PushError


async def open_links(nodes: Sequence[NodeLink], token: bytes, encrypt: str, timeout: float,
                     local: bulk.LocalTransport, requested: str) -> None:
    """Connect each node and choose its bulk transport (--transport); a node that fails is
    marked, the others go on."""
    async def open_one(node: NodeLink) -> None:
        node.chan = await connect(node.addr, token, encrypt=encrypt,
                                  timeout=min(CONNECT_TIMEOUT, timeout))

    await each(nodes, open_one)
    for node in nodes:
        if node.error is None:
            try:
                node.transport = bulk.choose_for_peer(local, requested, node.channel.info)
            except bulk.TransportUnavailable as e:
                node.fail(str(e))


class PushNodes:
    """The nodes of one push, by address; a failed node carries its cause (NodeLink.fail)."""

    def __init__(self, hosts: Sequence[str], token: bytes, timeout: float, allow_partial: bool,
                 encrypt: str, local: bulk.LocalTransport, requested: str,
                 sessions: Sessions | None = None, tree: list[dict] | None = None,
                 links: list[NodeLink] | None = None):
        """`tree`: the control tree (topology.forest), None for star. `links`: one per host,
        those the dev box talks to connected already (while the folder was scanned).
        `sessions`: push --watch's, kept open after the push."""
        self.token = token
        self.timeout = timeout
        self.allow_partial = allow_partial
        self.encrypt = encrypt
        self.local, self.requested = local, requested
        self.sessions = sessions
        self.kept: set[str] = set()  # nodes whose session this push took from `sessions`
        self.nodes = links if links is not None else [
            sessions.link(h) if sessions else NodeLink(h) for h in hosts]
        self.by_addr = {n.addr: n for n in self.nodes}
        # control tree: the roots the dev box talks to, each with the subtree below it
        self.tree = tree

    @property
    def healthy(self) -> list[NodeLink]:
        return [n for n in self.nodes if n.error is None]

    def cut_off(self, spec: dict, parent: NodeLink | None) -> None:
        node = self.by_addr[spec["addr"]]
        if parent is not None and parent.error is not None:
            node.fail(f"not reached: its relay parent {parent.addr} failed ({parent.error})")
        for child in spec["children"]:
            self.cut_off(child, node)

    @property
    def reached(self) -> list[NodeLink]:
        """The nodes the dev box holds a session with: every node, or the control tree's
        roots."""
        if self.tree is None:
            return self.nodes
        return [self.by_addr[r["addr"]] for r in self.tree]

    @property
    def levels(self) -> dict[str, int]:
        """How many timeouts to wait on each reached node: a root waits for its subtree."""
        return {r["addr"]: topology.patience(r["children"]) for r in self.tree or ()}

    def blame(self, failed: dict[str, str]) -> None:
        """Fail the nodes a relay reported, by address ("" would be the node asked: the
        callers map it to its address first)."""
        for addr, cause in failed.items():
            node = self.by_addr.get(addr)
            if node is not None:
                node.fail(cause)

    def check(self, stage: str, published: Sequence[str] = ()) -> None:
        """After a step: fail the push if a node failed, unless partial pushes are allowed.
        Down a control tree, a failed node fails every node below it, which only it reaches."""
        for root in self.tree or ():
            self.cut_off(root, None)
        failures = {n.addr: n.error for n in self.nodes if n.error}
        if failures and (not self.allow_partial or not self.healthy):
            raise PushError(stage, failures, len(self.nodes), published)

    async def connect(self) -> None:
        """Connect the nodes the dev box talks to, but those whose session is open: kept from
        the last push (`sessions`) or opened while the folder was scanned."""
        fresh = [n for n in self.reached if n.chan is None]
        if self.sessions is not None:
            self.kept = {n.addr for n in self.reached if n.chan is not None}
        await open_links(fresh, self.token, self.encrypt, self.timeout, self.local,
                         self.requested)
        bulk.log_choices({n.addr: n.transport for n in self.reached if n.error is None},
                         self.requested)  # (down a control tree, the nodes below choose theirs)

    def check_limits(self, entries: int) -> None:
        """Fail the nodes that would refuse a snapshot of `entries` entries for its size (each
        tells its limit when it connects), before anything is sent to them."""
        for node in [n for n in self.healthy if n.chan is not None]:
            limit = node.channel.info.get("max_entries")
            if isinstance(limit, int) and entries > limit:
                node.fail(f"the snapshot has {entries:,} entries, more than this node accepts "
                          f"({limit:,}: its --max-entries or MONARCH_FS_MAX_ENTRIES)")

    async def open_tree(self, version: bytes) -> None:
        """Control tree: have each root open its subtree (its relay, kept across the pushes
        of push --watch, which only rearm it), for this push's version. A root whose session
        was kept from the last push and broke is connected again, once."""
        assert self.tree is not None
        children = {r["addr"]: r["children"] for r in self.tree}

        async def open_one(root: NodeLink) -> None:
            reply = RelayReply.from_wire(await root.channel.request(
                "relay", children=children[root.addr], timeout=self.timeout,
                version=version.hex()))
            self.blame(reply.failed)

        await each(self.reached, open_one, self.timeout, self.levels)
        stale = [n for n in self.reached if n.error is not None and n.addr in self.kept]
        if stale:
            await self.reconnect(stale)
            again = {n.addr for n in stale}
            await each([n for n in self.reached if n.addr in again], open_one, self.timeout,
                       self.levels)

    async def fan(self, request: str, args: dict, fail: bool = True) -> dict[str, dict]:
        """Control tree: send `request` to every node through the roots; each node's reply by
        address. A node that failed or was not reached is failed (unless not `fail`: then it
        is only missing from the replies)."""
        replies: dict[str, dict] = {}
        scope = secrets.token_hex(16)  # what a MUNGE credential is bound to (identity.py)

        async def ask(root: NodeLink) -> None:
            signed = await identity.sign(root.channel, request, args, scope=scope)
            reply = FanReply.from_wire(await root.channel.request(
                "fan", request=request, args=signed, scope=scope))
            replies.update((a or root.addr, v) for a, v in reply.replies.items())
            if fail:
                self.blame({a or root.addr: c for a, c in reply.failed.items()})

        await each(self.reached, ask, self.timeout, self.levels)
        if fail:
            for node in self.healthy:
                if node.addr not in replies:
                    node.fail(f"no reply to {request} came back through the control tree")
        return {a: v for a, v in replies.items() if a in self.by_addr}

    async def reconnect(self, stale: list[NodeLink]) -> None:
        """Replace the links of `stale` nodes (kept in `sessions`) with new sessions."""
        assert self.sessions is not None
        for node in stale:
            await bulk.close_peer(node.bulk, node.chan)
        fresh = {n.addr: self.sessions.link(n.addr) for n in stale}
        self.nodes = [fresh.get(n.addr, n) for n in self.nodes]
        self.by_addr = {n.addr: n for n in self.nodes}
        await self.connect()

    async def aclose(self) -> None:
        for node in self.nodes:
            if self.sessions is None or node.error is not None:
                await bulk.close_peer(node.bulk, node.chan)
