"""Planning a push: what every node serves already (`current`: a push with no change ends
there), which chunks each lacks (`negotiate`, asking only about what can differ), whether it is
a small edit, and, for push --early, which chunks go first. Nothing is sent here: push.py
streams and publishes what this decides."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ...fs.manifest import Kind
from ...fs.snapshot import Snapshot
from ..wire import bulk, identity, topology
from ..wire.read_lists import Read
from ..wire.replies import CurrentReply
from ..wire.transport import RemoteError
from .controller_store import SMALL_PUSH
from .links import NodeLink, Sessions, each
from .push_nodes import PushNodes
from .send_order import LARGE_CHUNK
from .stream import Payload


class PushPlan(PushNodes):
    """The nodes of a push (PushNodes) and the snapshot it pushes to them."""

    def __init__(self, snap: Snapshot, hosts: Sequence[str], token: bytes, timeout: float,
                 allow_partial: bool, encrypt: str, local: bulk.LocalTransport, requested: str,
                 sessions: Sessions | None = None, tree: list[dict] | None = None,
                 links: list[NodeLink] | None = None):
        super().__init__(hosts, token, timeout, allow_partial, encrypt, local, requested,
                         sessions, tree, links)
        self.snap = snap
        self.version = snap.manifest.id
        self.ids = snap.manifest.chunk_ids()
        self.payload = Payload(self.ids, self.version, snap.manifest.objects(), snap.sources,
                               snap.read_into, manifest=snap.manifest,
                               open_ahead=snap.open_ahead)
        self.serving: dict[str, bytes | None] = {}  # what each node serves whole (current)
        self.first_reads = 0  # push --early: files whose chunks went first
        self.first_read_bytes = 0  # and those chunks' bytes

    def explain(self, failures: dict[str, str]) -> dict[str, str]:
        """A node that rejected a chunk the dev box store sent: the store's copy is checked,
        and a damaged one dropped and replaced from the source (ControllerStore.heal), so the
        error says so and the next push sends good bytes."""
        store = self.payload.store
        if store is None:
            return failures
        return store.heal(failures, lambda cid: memoryview(self.payload.read(cid))[1:])

    async def current(self, name: str, source: dict[str, str]) -> bool:
        """Whether every node serves this version as `name` already (a push with no change):
        then there is nothing to send or publish, and the push is settled in this one round
        trip per node. A node that refuses to say counts as not current (the full push that
        follows says why, if it is refused again); one that fails is failed as at any step."""
        args = {"name": name, "version": self.version.hex(), **source}
        current: list[bool] = []
        if self.tree is not None:  # a node that fails here is failed by the steps after
            replies = {a: CurrentReply.from_wire(r)
                       for a, r in (await self.fan("current", args, fail=False)).items()}
            self.serving = {a: r.serving for a, r in replies.items()}
            return (len(replies) == len(self.nodes)
                    and all(r.current for r in replies.values()))

        async def ask(node: NodeLink) -> None:
            signed = await identity.sign(node.channel, "current", args)
            try:
                reply = CurrentReply.from_wire(await node.channel.request("current", **signed))
            except RemoteError:
                current.append(False)
            else:
                current.append(reply.current)
                self.serving[node.addr] = reply.serving

        await each(self.nodes, ask, self.timeout)
        stale = [n for n in self.nodes if n.error is not None and n.addr in self.kept]
        if stale:  # a session kept from the last push broke (the node restarted, say)
            await self.reconnect(stale)  # once more, on a new one
            again = {n.addr for n in stale}
            await each([n for n in self.nodes if n.addr in again], ask, self.timeout)
        return len(current) == len(self.nodes) and all(current)

    async def negotiate(self, held: Snapshot | None = None) -> None:
        """Ask every node which chunks it lacks, of those not in `held`, the snapshot every node
        took last (push --watch; prepare still checks every chunk). This one rescanned from
        that one: only what the rescan found new is asked about; else what its folders that
        differ from `held`'s hold. Without `held`, when every
        node serves the version last pushed from this folder (known_objects), only what this
        one adds to it."""
        objects = self.payload.objects
        known = self.known_objects() if held is None else None
        if known is not None:
            ask_for = self.snap.manifest.ids_beyond(known)
        elif held is None:
            ask_for = [*self.ids, *objects]
        elif self.snap.since == held.manifest.id and self.snap.added is not None:
            ask_for = [c for c in self.snap.added if not held.holds(c)]
            ask_for += [self.version] if self.version not in ask_for else []
        else:  # scanned whole, or rescanned from a tree never pushed (--on-demand): what
            # differs from `held`, found down the folders that do
            ask_for = self.snap.manifest.ids_beyond(held.manifest.objects())
            ask_for += [self.version] if self.version not in ask_for else []

        async def ask(node: NodeLink) -> None:
            node.missing = set(await node.channel.query_missing(ask_for))

        await each(self.reached, ask, self.timeout, self.levels)
        for root in self.tree or ():  # a root answers for its subtree: what any node lacks
            for addr in topology.subtree(root)[1:]:
                self.by_addr[addr].missing = self.by_addr[root["addr"]].missing

    def lacking_bytes(self) -> int:
        """What the node that lacks most lacks, in bytes (after negotiate)."""
        sizes = self.payload.sizes
        return max((sum(sizes.get(c, 0) for c in n.missing) for n in self.healthy), default=0)

    def small_update(self) -> bool:
        """Whether every node this push sends to serves a version of the workspace already,
        and lacks less than SMALL_PUSH of this one (after negotiate): an edit, for which the
        dev box store, there for fresh nodes, is not opened (controller_store.py)."""
        return all(self.serving.get(n.addr) for n in self.healthy if n.missing) \
            and self.lacking_bytes() < SMALL_PUSH

    def known_objects(self) -> Collection[bytes] | None:
        """The folder objects of the version every node serves whole (`current` said which),
        when it is one version and the last pushed from this folder, whose objects its scan
        cache keeps: every chunk below them is on every node, so only what this version adds
        is asked about (a one-file edit: its few folders and chunks, not 15k ids a node)."""
        cache, served = self.snap.cache, set(self.serving.values())
        if (cache is None or len(self.serving) < len(self.nodes) or len(served) != 1
                or cache.pushed is None or served.pop() != cache.pushed):
            return None
        return cache.pushed_objects

    def first_read_chunks(self, reads: Sequence[Read], fallback: bool = True,
                          early: bool = True) -> list[bytes]:
        """The chunks push --early sends first and waits for: those the nodes read first
        after earlier publishes (first_reads.py), in that order: each chunk read, and all of a
        file of which nothing but its opening is known. Without such a list, the small files
        (under send_order.LARGE_CHUNK): cheap in bytes, while each would cost a round trip if
        fetched on demand; a large file's chunks are few and are worth fetching on demand,
        ahead of the stream (not without `fallback`: then none)."""
        files = {e.path: e for e in self.snap.manifest if e.kind == Kind.FILE}
        by_chunk = {p for p, k in reads if k is not None}
        head: list[bytes] = []
        chosen: set[bytes] = set()
        for path, k in reads:
            e = files.get(path)
            if e is None:  # not in this snapshot
                continue
            if k is None:
                if path not in by_chunk:
                    head += e.chunks
            elif k < len(e.chunks):
                # And the next chunk: a file read through the daemon before it is whole (push
                # --early) is read ahead past the pages its reader touches, across the end of
                # the chunk it reads (by passthrough, as recorded, it was not): of libtorch_
                # cpu.so's 55 recorded chunks, 11 were followed by a read of the next one,
                # each waited for as a want behind the stream.
                head += e.chunks[k:k + 2] if early else e.chunks[k:k + 1]
            chosen.add(path)
        if not chosen and fallback:  # no list, or none of its files is in this snapshot
            small = [e for e in files.values() if e.size < LARGE_CHUNK]
            chosen = {e.path for e in small}
            head = [c for e in small for c in e.chunks]
        self.first_reads = len(chosen)
        head = list(dict.fromkeys(head))
        self.first_read_bytes = sum(self.payload.sizes[c] for c in head)
        return head
