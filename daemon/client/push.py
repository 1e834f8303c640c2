"""The push client: scan a folder, send every node only the chunks it lacks, publish everywhere.

Data flows along a broadcast plan (see topology.py): the dev box streams each missing chunk once
to each root (stream.py), and nodes relay it down the chain or tree. Control is direct to a few
nodes (`control` star: the dev box asks every node what it lacks), or goes down a tree for many
(tree: the dev box asks a few roots, and each node asks its children; its relay links are that
tree, and its chunks follow it). Either way it publishes in two phases. Every node first receives
its missing chunks and the manifest, then is asked to `prepare` (check it holds everything,
durably). Only when every node has prepared is any node asked to `commit`. A node that cannot
be reached, refuses, stalls or dies fails the push and no node switches, unless `allow_partial`
is set: then the push routes around it, publishes on the healthy nodes and reports the others.
What did arrive is kept either way, so the next push sends less.

push --early publishes sooner: while the chunks stream (the manifest first, then those the
first reads need), every node is asked to prepare and commit with `early`, which waits for the
manifest and those chunks only; the version is usable then, and a read of a chunk that has not
arrived fetches it ahead of the stream (daemon/node/fetch.py). Once the stream is flushed, a
prepare and commit without `early` check every chunk, durably: the version is complete.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import trio

from ...fs.manifest import Kind
from ...fs.scan import Snapshot, SourceChanged, collector_paused, scan
from ...fs.scan_cache import ScanCache
from ..wire import bulk, identity, topology
from ..wire.read_lists import Read
from ..wire.replies import (
    CommitReply,
    CurrentReply,
    FanReply,
    MalformedReply,
    PrepareReply,
    RelayReply,
)
from ..wire.requests import check_source_path, check_workspace_name
from ..wire.transport import CONNECT_TIMEOUT, RemoteError, connect
from . import bytecode, first_reads, link_codec
from .controller_store import SMALL_PUSH, ControllerStore
from .link_codec import LinkChoice
from .links import STALL_TIMEOUT, NodeLink, Sessions, each
from .progress import Progress
from .stream import LARGE_CHUNK, Pacer, Payload, Stream

Reply = TypeVar("Reply", PrepareReply, CommitReply)


class PushError(Exception):
    """Some nodes failed; nothing was published (unless `published` names nodes)."""

    def __init__(self, stage: str, failures: dict[str, str], nodes: int,
                 published: Sequence[str] = ()):
        self.stage = stage
        self.failures = failures
        self.published = list(published)
        if published and stage != "committing":  # push --early: after its early publish
            head = (f"push failed on {len(failures)} of {nodes} nodes while {stage}, after "
                    f"{len(published)} served the version published early: they lack what did "
                    "not arrive until a push of it completes it")
        elif published:
            head = (f"commit failed on {len(failures)} of {nodes} nodes "
                    f"({len(published)} switched to the new version)")
        else:
            head = (f"push failed on {len(failures)} of {nodes} nodes while {stage}; "
                    "nothing was published, every node keeps its last good version")
        lines = [head] + [f"  {host}: {cause}" for host, cause in sorted(failures.items())]
        super().__init__("\n".join(lines))


@dataclass
class PushResult:
    """What a push did, as `push` prints it (and `--json` gives it)."""

    version: str
    name: str
    files: int
    bytes: int
    chunks_total: int
    chunks_sent: int  # chunk copies that left the dev box (relays forward the rest)
    bytes_sent: int  # bytes that left the dev box
    nodes: int  # nodes now serving the version
    seconds: float
    topology: str = "star"
    transport: str = "tcp"  # how chunk payloads left the dev box: tcp, rdma-rc or rdma-srd
    failed: dict[str, str] = field(default_factory=dict)  # --allow-partial: nodes left behind
    links: list[dict] = field(default_factory=list)  # per root: link_codec.LinkChoice
    store: dict = field(default_factory=dict)  # the dev box store: used, sent_from, added
    warnings: list[str] = field(default_factory=list)
    # push --early: seconds from the start until every node served the version (usable) and
    # until every node held all of it (complete); None (and left out of --json) otherwise.
    usable_seconds: float | None = None
    complete_seconds: float | None = None
    first_reads: int | None = None  # push --early: files sent first (the nodes' first reads)
    first_read_bytes: int | None = None  # push --early: what of them went first, in bytes
    chunks_wanted: int | None = None  # push --early: sent ahead of the stream, for a reader
    # Seconds each step took, in order (scan, connect, current, negotiate, send, publish, keep):
    # where a slow push spent its time.
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if v is not None or k not in ("usable_seconds", "complete_seconds",
                                              "first_reads", "first_read_bytes",
                                              "chunks_wanted")}

    def left_behind(self) -> list[str]:
        """The warning lines for the nodes an --allow-partial push left behind."""
        return [f"warning: {host} left behind (--allow-partial): {cause}"
                for host, cause in sorted(self.failed.items())]


class _Clock:
    """The seconds each step of a push took (PushResult.phases)."""

    def __init__(self, t0: float) -> None:
        self.last = t0
        self.phases: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.phases[step] = round(self.phases.get(step, 0.0) + now - self.last, 3)
        self.last = now


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


class _Push:
    """The state of one push; the steps are methods so `push()` reads as the protocol does."""

    local = bulk.LocalTransport("tcp", "tcp", "--transport tcp")  # set by push()
    requested = "tcp"

    def __init__(self, snap: Snapshot, hosts: Sequence[str], token: bytes, progress: Progress,
                 timeout: float, allow_partial: bool, encrypt: str = "auto", compress: str = "auto",
                 bwlimit: float = 0, sessions: Sessions | None = None,
                 tree: list[dict] | None = None, links: list[NodeLink] | None = None):
        """`tree`: the control tree (topology.forest), None for star. `links`: one per host,
        those the dev box talks to connected already (while the folder was scanned)."""
        self.snap = snap
        self.pacer = Pacer(bwlimit)  # one for the whole push: every broadcast shares the limit
        self.token = token
        self.encrypt = encrypt
        self.progress = progress
        self.timeout = timeout
        self.allow_partial = allow_partial
        self.sessions = sessions  # push --watch: the links stay open after this push
        self.kept: set[str] = set()  # nodes whose session this push took from `sessions`
        self.serving: dict[str, bytes | None] = {}  # what each node serves whole (current)
        self.nodes = links if links is not None else [
            sessions.link(h) if sessions else NodeLink(h) for h in hosts]
        self.by_addr = {n.addr: n for n in self.nodes}
        # control tree: the roots the dev box talks to, each with the subtree below it
        self.tree = tree
        objects = snap.manifest.objects()
        self.version = snap.manifest.id
        self.ids = snap.manifest.chunk_ids()
        self.payload = Payload(self.ids, self.version, objects, snap.sources, snap.read_into)
        self.compress = compress
        # Per root, chosen when it first gets chunks (once per session, with `sessions`).
        self.links: dict[str, LinkChoice] = sessions.codecs if sessions else {}
        self.chunks_sent = 0  # chunk copies that left the dev box (relays forward the rest)
        self.bytes_sent = 0
        self.warnings: list[str] = []  # from the nodes' commits
        self.started = time.monotonic()
        self.chunks_wanted = 0  # push --early: sent ahead of the stream, for a node's reader
        self.first_reads = 0  # push --early: files whose chunks went first
        self.first_read_bytes = 0  # and those chunks' bytes
        self.usable_seconds: float | None = None  # push --early
        self.complete_seconds: float | None = None

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
        if failures and self.payload.store is not None:  # did its copy of a chunk fail them?
            failures = self.payload.store.heal(
                failures, lambda cid: memoryview(self.payload.read(cid))[1:])
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

    def check_limits(self) -> None:
        """Fail the nodes that would refuse this snapshot for its size (each tells its limit
        when it connects), before anything is sent to them."""
        entries = len(self.snap.manifest)
        for node in [n for n in self.healthy if n.chan is not None]:
            limit = node.channel.info.get("max_entries")
            if isinstance(limit, int) and entries > limit:
                node.fail(f"the snapshot has {entries:,} entries, more than this node accepts "
                          f"({limit:,}: its --max-entries or MONARCH_FS_MAX_ENTRIES)")

    async def open_tree(self) -> None:
        """Control tree: have each root open its subtree (its relay, kept across the pushes
        of push --watch, which only rearm it), for this push's version. A root whose session
        was kept from the last push and broke is connected again, once."""
        assert self.tree is not None
        children = {r["addr"]: r["children"] for r in self.tree}

        async def open_one(root: NodeLink) -> None:
            reply = RelayReply.from_wire(await root.channel.request(
                "relay", children=children[root.addr], timeout=self.timeout,
                version=self.version.hex()))
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

    async def reconnect(self, stale: list[NodeLink]) -> None:
        """Replace the links of `stale` nodes (kept in `sessions`) with new sessions."""
        assert self.sessions is not None
        for node in stale:
            await bulk.close_peer(node.bulk, node.chan)
        fresh = {n.addr: self.sessions.link(n.addr) for n in stale}
        self.nodes = [fresh.get(n.addr, n) for n in self.nodes]
        self.by_addr = {n.addr: n for n in self.nodes}
        await self.connect()

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

    async def broadcast(self, kind: str, fanout: int, head: list[bytes] | None = None) -> str:
        """Send every healthy node what it lacks along a `kind` plan; returns the kind used.
        With `head` (push --early), those chunks go first, and nodes may want chunks."""
        lacking = [n for n in self.healthy if n.missing]
        if not lacking:
            return "none"
        if self.tree is not None:  # along the control tree, whose relays are open
            roots = [r for r in self.tree if self.by_addr[r["addr"]] in lacking]
            kind = "control tree"
        else:
            kind = topology.choose(kind, len(lacking), self.lacking_bytes())
            roots = topology.plan([n.addr for n in lacking], kind, fanout)
        by_addr = self.by_addr
        await self.choose_compression([by_addr[r["addr"]] for r in roots])
        stream = Stream(self.payload, self.nodes, self.local, self.timeout, self.progress,
                        head, self.token, self.encrypt, self.pacer)
        try:
            await stream.run([(by_addr[r["addr"]], r["children"]) for r in roots],
                             opened=self.tree is not None)
        finally:
            self.chunks_sent += stream.chunks_sent
            self.bytes_sent += stream.bytes_sent
            self.chunks_wanted += stream.wanted
        return kind

    async def choose_compression(self, roots: list[NodeLink]) -> None:
        """zstd or raw for each root's link (link_codec.py); the nodes below a root get what
        it forwards, as it arrives."""
        async def one(root: NodeLink) -> None:
            self.links[root.addr] = await link_codec.choose(self.compress, root.addr,
                                                           root.channel)

        await each([r for r in roots if r.addr not in self.links], one, self.timeout)
        self.payload.raw_roots = {a for a, c in self.links.items() if c.compression == "none"}

    async def publish(self, name: str, source: dict[str, str],
                      early: list[bytes] | None = None) -> None:
        """Prepare on every node, then commit on every node; `source` (path, id) asks each to
        expose the workspace at that path too. What a node could not do but committed anyway
        comes back as warnings, "HOST: ..." (`self.warnings`). With `early` (push --early,
        while the chunks stream), each node waits for the manifest and those chunks only."""
        args: dict = {"name": name, "version": self.version.hex(), **source}
        if early is not None:  # the node waits for them, a little less long than we do
            args.update(early=[c.hex() for c in early], wait=self.timeout * 0.9)
        else:
            self.progress.phase("publishing", 2 * len(self.healthy), "steps")
        steps = 0

        def step() -> None:
            nonlocal steps
            steps += 1
            if early is None:  # while streaming, the bar shows the bytes sent
                self.progress.update(steps)

        if self.tree is not None:  # down the control tree: a request per root, not per node
            for addr, reply in (await self.fan("prepare", args)).items():
                self.decode(addr, PrepareReply, reply)
            self.progress.update(len(self.nodes))
            self.check("preparing")
            for addr, reply in (await self.fan("commit", args)).items():
                if (done := self.decode(addr, CommitReply, reply)) is not None:
                    self.warnings += [f"{addr}: {w}" for w in done.warnings]
            self.check("committing", [n.addr for n in self.healthy])
            return

        async def prepare(node: NodeLink) -> None:
            signed = await identity.sign(node.channel, "prepare", args)  # if the node asks
            PrepareReply.from_wire(await node.channel.request("prepare", **signed))
            step()

        async def commit(node: NodeLink) -> None:
            signed = await identity.sign(node.channel, "commit", args)
            reply = CommitReply.from_wire(await node.channel.request("commit", **signed))
            self.warnings += [f"{node.addr}: {w}" for w in reply.warnings]
            step()

        await each(self.nodes, prepare, self.timeout)
        self.check("preparing")
        await each(self.nodes, commit, self.timeout)
        self.check("committing", [n.addr for n in self.healthy])

    def decode(self, addr: str, kind: type[Reply], value: dict) -> Reply | None:
        """A reply that came down the control tree, decoded; None, and the node failed, if it
        is malformed."""
        try:
            return kind.from_wire(value)
        except MalformedReply as e:
            self.by_addr[addr].fail(str(e))
            return None

    def first_read_chunks(self, reads: Sequence[Read]) -> list[bytes]:
        """The chunks push --early sends first and waits for: those the nodes read first
        after earlier publishes (first_reads.py), in that order: each chunk read, and all of a
        file of which nothing but its opening is known. Without such a list, the small files
        (under stream.LARGE_CHUNK): cheap in bytes, while each would cost a round trip if
        fetched on demand; a large file's chunks are few and are worth fetching on demand,
        ahead of the stream."""
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
                head.append(e.chunks[k])
            chosen.add(path)
        if not chosen:  # no list, or none of its files is in this snapshot
            small = [e for e in files.values() if e.size < LARGE_CHUNK]
            chosen = {e.path for e in small}
            head = [c for e in small for c in e.chunks]
        self.first_reads = len(chosen)
        head = list(dict.fromkeys(head))
        self.first_read_bytes = sum(self.payload.sizes[c] for c in head)
        return head

    async def push_early(self, name: str, source: dict[str, str], kind: str, fanout: int,
                         head: list[bytes], usable: Callable[[float, int], None]) -> str:
        """Stream (manifest, `head`, the rest) and meanwhile publish early on every node; call
        `usable(seconds, nodes)` once every node serves the version; then, once the stream is
        flushed, publish again without `early`: every chunk is checked, durably. Returns the
        topology kind used."""
        used = "none"
        failed: list[Exception] = []  # raised here, not as a group out of the nursery
        published: list[str] = []  # the nodes that serve it early

        async def stream() -> None:
            nonlocal used
            try:
                used = await self.broadcast(kind, fanout, head)
            except SourceChanged as e:
                failed.append(e)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            try:
                await self.publish(name, source, early=head)
            except PushError as e:
                failed.append(e)
                nursery.cancel_scope.cancel()
            else:
                self.usable_seconds = round(time.monotonic() - self.started, 3)
                published = [n.addr for n in self.healthy]
                usable(self.usable_seconds, len(published))
        if failed:
            raise failed[0]
        self.check("sending chunks", published)
        if self.allow_partial:  # as in push(): what a failed relay parent left behind
            await self.negotiate()
            await self.broadcast("star", fanout)
            self.check("sending chunks", published)
        await self.publish(name, source)
        self.complete_seconds = round(time.monotonic() - self.started, 3)
        return used

    async def aclose(self) -> None:
        for node in self.nodes:
            if self.sessions is None or node.error is not None:
                await bulk.close_peer(node.bulk, node.chan)


def keep(store: ControllerStore, snap: Snapshot, job: _Push, name: str) -> list[str]:
    """After publishing: add to the dev box store the chunks it lacks (those no node needed),
    record the snapshot and apply the bound; the lines to report. Blocking."""
    lines: list[str] = []
    try:
        store.added = store.fill([*job.ids, *job.payload.objects],
                                 lambda cid: memoryview(job.payload.read(cid))[1:],
                                 job.payload.objects)
    except (SourceChanged, OSError) as e:  # published already: the next push reads it again
        lines.append(f"the dev box store misses some chunks of this push: {e}")
    return lines + store.finish(job.version, name, snap.manifest.total_bytes)


def workspace_name(src: str | os.PathLike[str], name: str | None) -> str:
    """The workspace `src` is pushed as: `name`, else the folder's own name. ValueError, naming
    the folder and pointing at --name, when that cannot be a workspace name (check_workspace_name
    says why; a folder named in Latin-1 once took down every node it reached)."""
    if name:
        check_workspace_name(name)
        return name
    folder = os.path.abspath(src)
    try:
        check_workspace_name(os.path.basename(folder))
    except ValueError as e:
        shown = os.fsencode(folder).decode("utf-8", "backslashreplace")
        raise ValueError(f"the folder {shown} cannot name a workspace ({e}); pass --name NAME "
                         "to push it under another name") from None
    return os.path.basename(folder)


def source_args(src: str | os.PathLike[str]) -> dict[str, str]:
    """What prepare and commit carry for push --at-source: the folder's absolute path (as
    typed, links in it kept: a venv's scripts name the path it was made at, which is the path
    its user types) and its "DEV:INO". ValueError saying why a node could not expose it."""
    path = os.path.abspath(src)
    try:
        check_source_path(path)
    except ValueError as e:
        raise ValueError(f"{e}; push with --no-at-source, or from another folder") from None
    st = os.stat(path)
    return {"source": path, "source_id": f"{st.st_dev}:{st.st_ino}"}


async def push(
    src: str | os.PathLike[str],
    hosts: Sequence[str],
    token: bytes,
    *,
    name: str | None = None,
    excludes: Sequence[str] = (),
    progress: Progress | None = None,
    topology_kind: str = "auto",
    fanout: int = 2,
    allow_partial: bool = False,
    timeout: float = STALL_TIMEOUT,
    cache_dir: str | os.PathLike[str] | None = None,
    transport: str | bulk.LocalTransport = "auto",
    encrypt: str = "auto",
    at_source: bool | None = None,
    store_dir: str | os.PathLike[str] | None = None,
    store_bound: int = 0,
    compress: str = "auto",
    early: bool = False,
    on_usable: Callable[[float, int], None] | None = None,
    first_reads_dir: str | os.PathLike[str] | None = None,
    bwlimit: float = 0,
    snapshot: Snapshot | None = None,
    held: Snapshot | None = None,
    sessions: Sessions | None = None,
    control: str = "auto",
    control_fanout: int = topology.CONTROL_FANOUT,
    freeze_scan: bool = False,
) -> PushResult:
    """Push `src` to every host as workspace `name` (default: the folder's name). With
    `cache_dir`, the scan keeps a cache of the folder there, so unchanged files are not read.
    `encrypt` is the policy for the sessions with the nodes (addresses.encrypts). With
    `at_source`, every node also exposes the workspace at `src`'s absolute path (a link to
    MOUNT/NAME), so a venv's scripts, which name that path, run there; None (the default)
    does so where the path allows it, and otherwise pushes without it and warns. With
    `store_dir`, chunks are sent from the dev box's store there and kept in it
    (controller_store.py; `store_bound` bytes; a push that sends nothing, or an edit, only
    marks what it holds as pushed: `_Push.small_update`). `compress` (auto, on, off) is the
    policy for each link (link_codec.py). With `early`, the version is published as soon as
    every node holds the manifest and the chunks the first reads need (see the module
    docstring); `on_usable(seconds, nodes)` is called then. The first reads are the nodes'
    (first_reads.py), merged with those kept in `first_reads_dir` on the dev box. `bwlimit`
    (bytes a second, 0 for none) bounds what the dev box streams (stream.Pacer). `snapshot`:
    `src` as the caller scanned it (push --watch: fs.scan.rescan), not scanned again here;
    `held`: the snapshot every node took last (push --watch), whose chunks the nodes are not
    asked about. `sessions`: the nodes' sessions, kept open after the push
    for the next (push --watch; the caller closes them). `control` (auto, star, tree) is how
    the requests reach the nodes (topology.control); a tree has `control_fanout` children a
    node. `freeze_scan`: the process ends with the push (the command line), and what its
    scan made is frozen out of the collector's passes (fs.scan.collector_paused)."""
    t0 = time.monotonic()
    clock = _Clock(t0)
    progress = progress or Progress()
    name = workspace_name(src, name)
    source: dict[str, str] = {}
    unexposed: list[str] = []
    if at_source is not False:
        try:
            source = source_args(src)
        except ValueError as e:
            if at_source:
                raise
            unexposed = [f"not exposed at its source path on the nodes: {e}"]
    if compress not in link_codec.POLICIES:
        raise ValueError(f"unknown compression {compress!r}: use one of {link_codec.POLICIES}")
    if topology_kind not in topology.KINDS:
        raise ValueError(f"unknown topology {topology_kind!r}: use one of {topology.KINDS}")
    control = topology.control(control, len(hosts), early)

    requested = transport if isinstance(transport, str) else transport.requested
    local = (transport if isinstance(transport, bulk.LocalTransport)
             else bulk.resolve_local(transport))
    tree = topology.forest(list(hosts), control_fanout) if control == "tree" else None
    links: list[NodeLink] | None = None
    store: ControllerStore | None = None
    try:
        if snapshot is None:
            progress.phase("scanning", 0, "entries")
            first: list[NodeLink] = []  # the nodes the dev box talks to, connected meanwhile
            if sessions is None:
                links = [NodeLink(h) for h in hosts]
                roots = {r["addr"] for r in tree} if tree is not None else set(hosts)
                first = [link for link in links if link.addr in roots]
            with collector_paused(freeze=freeze_scan):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(open_links, first, token, encrypt, timeout, local,
                                       requested)
                    snapshot = await scan(src, excludes, progress=lambda done, total: (
                        progress.phase("hashing", total) if done == 0 else
                        progress.update(done)),
                        cache=ScanCache.for_folder(cache_dir, src) if cache_dir else None)
    except BaseException:  # the push failed before it began: close what it connected
        with trio.CancelScope(shield=True):
            for link in links or ():
                await bulk.close_peer(link.bulk, link.chan)
        raise
    snap = snapshot
    clock.mark("scan")
    job = _Push(snap, hosts, token, progress, timeout, allow_partial, encrypt, compress,
                bwlimit, sessions, tree, links)
    job.started, job.requested, job.local = t0, requested, local
    usable = on_usable or (lambda seconds, nodes: None)
    store_root = Path(store_dir) if store_dir is not None else None
    store_opened = marked = False

    async def open_store() -> None:
        """The dev box store, for a push that sends (once; without it if it is busy)."""
        nonlocal store, store_opened
        if store_root is not None and not store_opened:
            store_opened = True
            store, busy = await ControllerStore.open(store_root, store_bound)
            unexposed.extend([busy] if busy else [])
            job.payload.store = store

    async def learn_reads() -> list[Read]:
        """push --early: what the nodes read first, with what the dev box kept."""
        lists = await first_reads.learn(job.healthy, name, timeout)
        return (first_reads.known(Path(first_reads_dir), name, lists) if first_reads_dir
                else first_reads.merge(lists))

    async def send_and_publish() -> str:
        """The push proper, once some node does not serve the version yet; the topology used."""
        await job.negotiate(held)
        job.check("negotiating")
        clock.mark("negotiate")
        if not job.small_update():
            await open_store()
        if early:
            used = await job.push_early(name, source, topology_kind, fanout,
                                        job.first_read_chunks(await learn_reads()), usable)
            clock.mark("send and publish")
            return used
        used = await job.broadcast(topology_kind, fanout)
        job.check("sending chunks")
        if allow_partial and job.tree is None:
            # Nodes whose relay parent failed are healthy but incomplete: send them the rest
            # directly, once. (Down a control tree they failed with it: the dev box holds no
            # session with them.)
            await job.negotiate()
            await job.broadcast("star", fanout)
            job.check("sending chunks")
        clock.mark("send")
        await job.publish(name, source)
        clock.mark("publish")
        return used

    try:
        await job.connect()
        job.check("connecting")
        job.check_limits()
        job.check("checking the snapshot's size")
        if job.tree is not None:
            await job.open_tree()
            job.check("opening the control tree")
        clock.mark("connect")
        settled = await job.current(name, source)
        job.check("asking what the nodes serve")
        clock.mark("current")
        if not settled:
            used = await send_and_publish()
        else:  # no change: every node serves this version already
            used = "none"
            if early:
                job.usable_seconds = job.complete_seconds = round(time.monotonic() - t0, 3)
                usable(job.usable_seconds, len(job.healthy))
                # What the nodes read since it was published, kept for the fresh nodes of
                # the next allocation.
                job.first_read_chunks(await learn_reads())
        if store_root is not None and not store_opened:
            marked = await trio.to_thread.run_sync(
                ControllerStore.mark_pushed, store_root, job.version, name)
        if not marked:
            await open_store()
        if store is not None:
            unexposed += await trio.to_thread.run_sync(keep, store, snap, job, name)
            clock.mark("keep")
    finally:
        await job.aclose()
        if store is not None:
            store.close()

    warnings = (unexposed + snap.warnings + job.warnings
                + (bytecode.warnings(snap.manifest, src, snap.cache) if held is None else []))
    if snap.cache is not None and held is None and not any(n.error for n in job.nodes):
        snap.cache.keep_pushed(job.version, snap.manifest.object_ids())
        snap.cache.save_facts()
    files, size = snap.manifest.file_totals()
    return PushResult(
        version=job.version.hex(),
        name=name,
        files=files,
        bytes=size,
        chunks_total=len(job.ids),
        chunks_sent=job.chunks_sent,
        bytes_sent=job.bytes_sent,
        nodes=len(job.healthy),
        seconds=round(time.monotonic() - t0, 3),
        topology=used,
        transport=",".join(sorted({n.bulk.kind for n in job.nodes if n.bulk}
                                  or {n.transport[0] for n in job.healthy})) or "tcp",
        failed={n.addr: n.error for n in job.nodes if n.error},
        links=[c.to_json() for c in job.links.values()],
        store=({"path": str(store.root), "sent_from_store": store.hits, "added": store.added}
               if store is not None else
               {"path": str(store_root), "sent_from_store": 0, "added": 0} if marked
               else {}),
        # (Not again for each push of push --watch: a pass over the whole tree.)
        warnings=warnings,
        usable_seconds=job.usable_seconds,
        complete_seconds=job.complete_seconds,
        first_reads=job.first_reads if early else None,
        first_read_bytes=job.first_read_bytes if early else None,
        chunks_wanted=job.chunks_wanted if early else None,
        phases=clock.phases,
    )
