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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from ... import collector
from ...fs.chunk import CHUNK_SIZE
from ...fs.scan import scan
from ...fs.scan_cache import ScanCache
from ...fs.snapshot import Snapshot, SourceChanged
from ...settings import settings
from ..wire import bulk, identity, topology
from ..wire.read_lists import Read
from ..wire.replies import (
    CommitReply,
    MalformedReply,
    PrepareReply,
)
from . import bytecode, link_codec, send_helpers, store_keep
from .controller_store import ControllerStore
from .link_codec import LinkChoice
from .links import NodeLink, Sessions, each
from .plan import PushPlan
from .progress import Progress
from .push_nodes import open_links
from .push_options import PushOptions, source_args, workspace_name
from .push_result import Clock, PushError, PushResult
from .scan_stream import ScanStream
from .stream import Pacer, Stream

Reply = TypeVar("Reply", PrepareReply, CommitReply)


class _Push(PushPlan):
    """The state of one push; the steps are methods so `push()` reads as the protocol does."""

    def __init__(self, snap: Snapshot, hosts: Sequence[str], token: bytes, progress: Progress,
                 opts: PushOptions, local: bulk.LocalTransport, requested: str,
                 sessions: Sessions | None = None, tree: list[dict] | None = None,
                 links: list[NodeLink] | None = None):
        super().__init__(snap, hosts, token, opts.timeout, opts.allow_partial, opts.encrypt,
                         local, requested, sessions, tree, links)
        self.pacer = Pacer(opts.bwlimit)  # one for the whole push: every broadcast shares it
        self.helpers = send_helpers.how_many(opts.helpers)
        self.helped: dict[str, int] = {}  # what send helpers did, over its broadcasts
        self.progress = progress
        self.compress = opts.compress
        # Per root, chosen when it first gets chunks (once per session, with `sessions`).
        self.links: dict[str, LinkChoice] = sessions.codecs if sessions else {}
        self.chunks_sent = 0  # chunk copies that left the dev box (relays forward the rest)
        self.bytes_sent = 0
        self.warnings: list[str] = []  # from the nodes' commits
        self.started = time.monotonic()
        self.chunks_wanted = 0  # push --early: sent ahead of the stream, for a node's reader
        self.usable_seconds: float | None = None  # push --early
        self.complete_seconds: float | None = None

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
                        head, self.token, self.encrypt, self.pacer, self.helpers)
        try:
            await stream.run([(by_addr[r["addr"]], r["children"]) for r in roots],
                             opened=self.tree is not None)
        finally:
            self.chunks_sent += stream.chunks_sent + stream.helped["chunks"]
            self.bytes_sent += stream.bytes_sent + stream.helped["bytes"]
            self.warnings += stream.warnings
            for k, v in stream.helped.items():
                self.helped[k] = self.helped.get(k, 0) + v
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
                      early: list[bytes] | None = None, ahead: Sequence[bytes] = ()) -> None:
        """Prepare on every node, then commit on every node; `source` (path, id) asks each to
        expose the workspace at that path too. What a node could not do but committed anyway
        comes back as warnings, "HOST: ..." (`self.warnings`). With `early` (push --early,
        while the chunks stream), each node waits for the manifest and those chunks only.
        `ahead`: the first reads' chunks, which each node reads into memory at its commit."""
        args: dict = {"name": name, "version": self.version.hex(), **source}
        if ahead:
            args["ahead"] = [c.hex() for c in ahead]
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

async def push(
    src: str | os.PathLike[str],
    hosts: Sequence[str],
    token: bytes,
    options: PushOptions | None = None,
    *,
    progress: Progress | None = None,
    on_usable: Callable[[float, int], None] | None = None,
    snapshot: Snapshot | None = None,
    held: Snapshot | None = None,
    sessions: Sessions | None = None,
) -> PushResult:
    """Push `src` to every host as `options` say (default: PushOptions()); PushError names
    the nodes that failed it and at which step. `on_usable(seconds, nodes)`: push --early,
    called once every node serves the version. `snapshot`: `src` as the caller scanned it
    (push --watch: fs.rescan), not scanned again here; `held`: the snapshot every node took
    last (push --watch), whose chunks the nodes are not asked about. `sessions`: the nodes'
    sessions, kept open after the push for the next (push --watch; the caller closes them)."""
    opts = options or PushOptions()
    opts.check()
    fill = settings.store_fill if opts.store_dir is not None else "off"  # a bad value: now
    t0 = time.monotonic()
    clock = Clock(t0)
    progress = progress or Progress()
    name = workspace_name(src, opts.name)
    early = opts.early
    source: dict[str, str] = {}
    unexposed: list[str] = []
    if opts.at_source is not False:
        try:
            source = source_args(src)
        except ValueError as e:
            if opts.at_source:
                raise
            unexposed = [f"not exposed at its source path on the nodes: {e}"]
    control = topology.control(opts.control, len(hosts), early)

    transport = opts.transport
    requested = transport if isinstance(transport, str) else transport.requested
    local = (transport if isinstance(transport, bulk.LocalTransport)
             else bulk.resolve_local(transport))
    tree = topology.forest(list(hosts), opts.control_fanout) if control == "tree" else None
    links: list[NodeLink] | None = None
    store: ControllerStore | None = None
    streaming: ScanStream | None = None  # a new large file's chunks sent as it is hashed
    try:
        if snapshot is None:
            progress.phase("scanning", 0, "entries")
            first: list[NodeLink] = []  # the nodes the dev box talks to, connected meanwhile
            if sessions is None:
                links = [NodeLink(h) for h in hosts]
                roots = {r["addr"] for r in tree} if tree is not None else set(hosts)
                first = [link for link in links if link.addr in roots]
            if sessions is None and tree is None and not early and not opts.bwlimit and (
                    opts.topology == "star" or len(hosts) == 1):  # every node is a root
                streaming = ScanStream(first, CHUNK_SIZE, opts.compress, opts.timeout)

            async def connect_and_stream() -> None:
                try:
                    await open_links(first, token, opts.encrypt, opts.timeout, local, requested)
                    if streaming is not None:
                        await streaming.run()
                finally:
                    if streaming is not None:
                        streaming.stopped = True  # no hashing thread waits for it any more

            with collector.paused(freeze=opts.freeze_scan):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(connect_and_stream)
                    snapshot = await scan(src, opts.excludes, progress=lambda done, total: (
                        progress.phase("hashing", total) if done == 0 else
                        progress.update(done)),
                        cache=ScanCache.for_folder(opts.cache_dir, src) if opts.cache_dir else None,
                        tap=streaming)
                    if streaming is not None:
                        await streaming.finish()
    except BaseException:  # the push failed before it began: close what it connected
        with trio.CancelScope(shield=True):
            for link in links or ():
                await bulk.close_peer(link.bulk, link.chan)
        raise
    snap = snapshot
    clock.mark("scan")
    job = _Push(snap, hosts, token, progress, opts, local, requested, sessions, tree, links)
    job.started = t0
    if streaming is not None:
        job.links.update(streaming.choices)
        job.chunks_sent, job.bytes_sent = streaming.chunks_sent, streaming.bytes_sent
    usable = on_usable or (lambda seconds, nodes: None)
    store_root = Path(opts.store_dir) if opts.store_dir is not None else None
    store_opened = marked = False
    kept = store_keep.Kept()

    async def open_store() -> None:
        """The dev box store, for a push that sends (once; without it if it is busy)."""
        nonlocal store, store_opened
        if store_root is not None and not store_opened:
            store_opened = True
            store, busy = await ControllerStore.open(store_root, opts.store_bound)
            unexposed.extend([busy] if busy else [])
            job.payload.store = store

    async def learn_reads() -> list[Read]:
        """What the nodes the dev box talks to read first, with what the dev box kept."""
        from . import first_reads

        lists = await first_reads.learn(job.reached, name, opts.timeout)
        return (first_reads.known(Path(opts.first_reads_dir), name, lists) if opts.first_reads_dir
                else first_reads.merge(lists))

    async def send_and_publish() -> str:
        """The push proper, once some node does not serve the version yet; the topology used."""
        await job.negotiate(held)
        job.check("negotiating")
        clock.mark("negotiate")
        small = job.small_update()  # an edit: no dev box store, no first reads read ahead
        if not small:
            await open_store()
        if early:
            used = await job.push_early(name, source, opts.topology, opts.fanout,
                                        job.first_read_chunks(await learn_reads()), usable)
            clock.mark("send and publish")
            return used
        # What the nodes read first, for their commits to read ahead (one request each,
        # before the stream: a node's channel carries one request at a time).
        reads = [] if small else await learn_reads()
        used = await job.broadcast(opts.topology, opts.fanout)
        job.check("sending chunks")
        if opts.allow_partial and job.tree is None:
            # Nodes whose relay parent failed are healthy but incomplete: send them the rest
            # directly, once. (Down a control tree they failed with it: the dev box holds no
            # session with them.)
            await job.negotiate()
            await job.broadcast("star", opts.fanout)
            job.check("sending chunks")
        clock.mark("send")
        await job.publish(name, source, ahead=job.first_read_chunks(reads, fallback=False,
                                                                      early=False))
        clock.mark("publish")
        return used

    try:
        await job.connect()
        job.check("connecting")
        job.check_limits(len(snap.manifest))
        job.check("checking the snapshot's size")
        if job.tree is not None:
            await job.open_tree(job.version)
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
            if streaming is not None:
                streaming.keep(store)
            kept = await store_keep.keep(
                store, fill, job.ids, job.payload.objects,
                lambda cid: memoryview(job.payload.read(cid))[1:], job.started, job.version,
                name, snap.manifest.total_bytes)
            unexposed += kept.lines
            clock.mark("keep")
    finally:
        await job.aclose()
        if store is not None:
            store.close()
    if store is not None and store_root is not None:  # the store closed: the filler takes it
        unexposed += await store_keep.start_filler(kept, store_keep.filler_spec(
            settings.home, store_root, opts.store_bound, src, opts.excludes, opts.cache_dir,
            job.version, name))

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
        helpers=job.helped if job.helped.get("processes") else {},
        store=({"path": str(store.root), "sent_from_store": store.hits, "added": store.added,
                "background_fill": kept.filler is not None, "lacking": kept.lacking}
               if store is not None else
               {"path": str(store_root), "sent_from_store": 0, "added": 0,
                "background_fill": False, "lacking": 0} if marked
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
