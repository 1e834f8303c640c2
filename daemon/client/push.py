"""The push client: scan a folder, send every node only the chunks it lacks, publish everywhere.

Data flows along a broadcast plan (see topology.py): the dev box streams each missing chunk once
to each root, and nodes relay it down the chain or tree. Control stays direct: the dev box asks
every node what it lacks, and publishes in two phases. Every node first receives its missing
chunks and the manifest, then is asked to `prepare` (check it holds everything, durably). Only
when every node has prepared is any node asked to `commit`. A node that cannot be reached,
refuses, stalls or dies fails the push and no node switches, unless `allow_partial` is set: then
the push routes around it, publishes on the healthy nodes and reports the others. What did arrive
is kept either way, so the next push sends less.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import trio

from ...fs import chunk
from ...fs.manifest import Kind
from ...fs.scan import Snapshot, SourceChanged, scan
from ...fs.scan_cache import ScanCache
from ..wire import bulk, topology
from ..wire import protocol as p
from ..wire.requests import check_workspace_name
from ..wire.transport import (
    CONNECT_TIMEOUT,
    Channel,
    ConnectError,
    RemoteError,
    connect,
    describe_failure,
)

STALL_TIMEOUT = 60.0  # no progress on one node for this long fails that node
_QUEUE = 4  # batches buffered per root
_ENCODERS = 2
LARGE_CHUNK = 1 << 20  # interleave(): chunks this big cost link time more than CPU
SMALL_RUN = 4 << 20


def interleave(ids: list[bytes], sizes: dict[bytes, int]) -> list[bytes]:
    """The order to send `ids` in: runs of small chunks (whole small files) spread among the
    large chunks in proportion to their bytes, each kind still in folder order.

    Small files cost CPU per byte (a read, a compression, a frame and a store write each, on
    every node); large chunks cost link time. Sent in folder order, a push is bound first by
    one and then by the other; mixed, it keeps both busy. A run of small files is up to
    SMALL_RUN bytes long, so files of one folder still sit together in a node's pack."""
    small = [c for c in ids if sizes[c] < LARGE_CHUNK]
    large = [c for c in ids if sizes[c] >= LARGE_CHUNK]
    if not small or not large:
        return ids
    small_total = sum(sizes[c] for c in small)
    large_total = sum(sizes[c] for c in large)
    out: list[bytes] = []
    i = j = small_done = large_done = 0
    while i < len(small) or j < len(large):
        # Small files next while they are behind the large chunks, as fractions sent.
        if j == len(large) or (i < len(small)
                               and small_done * large_total <= large_done * small_total):
            run = 0
            while i < len(small) and run < SMALL_RUN:
                out.append(small[i])
                run += sizes[small[i]]
                i += 1
            small_done += run
        else:
            out.append(large[j])
            large_done += sizes[large[j]]
            j += 1
    return out


class PushError(Exception):
    """Some nodes failed; nothing was published (unless `published` names nodes)."""

    def __init__(self, stage: str, failures: dict[str, str], nodes: int,
                 published: Sequence[str] = ()):
        self.stage = stage
        self.failures = failures
        self.published = list(published)
        if published:
            head = (f"commit failed on {len(failures)} of {nodes} nodes "
                    f"({len(published)} switched to the new version)")
        else:
            head = (f"push failed on {len(failures)} of {nodes} nodes while {stage}; "
                    "nothing was published, every node keeps its last good version")
        lines = [head] + [f"  {host}: {cause}" for host, cause in sorted(failures.items())]
        super().__init__("\n".join(lines))


def fmt_bytes(n: float) -> str:
    """A byte count for people: "512 B", "1.5 MiB", up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def left_behind(self) -> list[str]:
        """The warning lines for the nodes an --allow-partial push left behind."""
        return [f"warning: {host} left behind (--allow-partial): {cause}"
                for host, cause in sorted(self.failed.items())]


class Progress:
    """What a push reports as it goes; the CLI draws it as a progress bar, the default is silent."""

    def phase(self, name: str, total: int, unit: str = "B") -> None: ...

    def update(self, done: int) -> None: ...


class _Node:
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


_NODE_ERRORS = (OSError, bulk.BulkError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError, RemoteError, ConnectError, p.ProtocolError, EOFError)


async def _each(nodes: Sequence[_Node], fn: Callable, timeout: float | None = None,
                levels: dict[str, int] | None = None) -> None:
    """Run fn(node) on every healthy node at once; a failure marks that node, not the others.
    A root of a relay plan waits for its subtree, so its timeout is multiplied by `levels`."""

    async def one(node: _Node) -> None:
        try:
            scale = (levels or {}).get(node.addr, 1)
            with trio.fail_after(timeout * scale) if timeout else trio.CancelScope():
                await fn(node)
        except _NODE_ERRORS as e:
            node.fail(e, timeout or STALL_TIMEOUT)

    async with trio.open_nursery() as nursery:
        for node in nodes:
            if node.error is None:
                nursery.start_soon(one, node)


class _Push:
    """The state of one push; the steps are methods so `push()` reads as the protocol does."""

    local = bulk.LocalTransport("tcp", "tcp", "--transport tcp")  # set by push()
    requested = "tcp"

    def __init__(self, snap: Snapshot, hosts: Sequence[str], token: bytes, progress: Progress,
                 timeout: float, allow_partial: bool, encrypt: str = "auto"):
        self.snap = snap
        self.token = token
        self.encrypt = encrypt
        self.progress = progress
        self.timeout = timeout
        self.allow_partial = allow_partial
        self.nodes = [_Node(h) for h in hosts]
        self.manifest_bytes = snap.manifest.encode()
        self.version = chunk.chunk_id(self.manifest_bytes)
        self.ids = snap.manifest.chunk_ids()
        self.sizes = {cid: src.length for cid, src in snap.sources.items()}
        self.sizes[self.version] = len(self.manifest_bytes)
        self.chunks_sent = 0
        self.bytes_sent = 0

    @property
    def healthy(self) -> list[_Node]:
        return [n for n in self.nodes if n.error is None]

    def check(self, stage: str, published: Sequence[str] = ()) -> None:
        """After a step: fail the push if a node failed, unless partial pushes are allowed."""
        failures = {n.addr: n.error for n in self.nodes if n.error}
        if failures and (not self.allow_partial or not self.healthy):
            raise PushError(stage, failures, len(self.nodes), published)

    async def connect(self) -> None:
        async def open_one(node: _Node) -> None:
            node.chan = await connect(node.addr, self.token, encrypt=self.encrypt,
                                      timeout=min(CONNECT_TIMEOUT, self.timeout))

        await _each(self.nodes, open_one)
        for node in self.nodes:  # which bulk transport each node gets (--transport)
            if node.error is None:
                try:
                    node.transport = bulk.choose_for_peer(self.local, self.requested,
                                                          node.chan.info)
                except bulk.TransportUnavailable as e:
                    node.fail(str(e))
        bulk.log_choices({n.addr: n.transport for n in self.healthy}, self.requested)

    def check_limits(self) -> None:
        """Fail the nodes that would refuse this snapshot for its size (each tells its limit
        when it connects), before anything is sent to them."""
        entries = len(self.snap.manifest)
        for node in self.healthy:
            limit = node.chan.info.get("max_entries")
            if isinstance(limit, int) and entries > limit:
                node.fail(f"the snapshot has {entries:,} entries, more than this node accepts "
                          f"({limit:,}: its --max-entries or MONARCH_FS_MAX_ENTRIES)")

    async def negotiate(self) -> None:
        async def ask(node: _Node) -> None:
            node.missing = set(await node.chan.query_missing(self.ids + [self.version]))

        await _each(self.nodes, ask, self.timeout)

    async def broadcast(self, kind: str, fanout: int) -> str:
        """Send every healthy node what it lacks along a `kind` plan; returns the kind used."""
        lacking = [n for n in self.healthy if n.missing]
        if not lacking:
            return "none"
        payload = max(sum(self.sizes.get(c, 0) for c in n.missing) for n in lacking)
        kind = topology.choose(kind, len(lacking), payload)
        roots = topology.plan([n.addr for n in lacking], kind, fanout)
        by_addr = {n.addr: n for n in self.nodes}
        await self._stream([(by_addr[r["addr"]], r["children"]) for r in roots])
        return kind

    async def _stream(self, roots: list[tuple[_Node, list[dict]]]) -> None:
        """Open a relay session on each root, then read and compress each chunk once and stream
        it to every root whose subtree lacks it."""
        by_addr = {n.addr: n for n in self.nodes}
        wants: dict[str, set[bytes]] = {}

        def blame(failed: dict[str, str]) -> None:
            for addr, cause in failed.items():
                if addr in by_addr:
                    by_addr[addr].fail(cause)

        async def open_session(root: _Node, children: list[dict]) -> None:
            if root.bulk is None:
                root.bulk = await bulk.open_sender(root.chan, root.transport[0], self.local,
                                                   root.chan.info)
            reply = await root.chan.request("relay", children=children, timeout=self.timeout)
            blame(reply.get("failed", {}))
            # negotiate() learned what each node lacks: ask the subtree only about those ids
            # (an id no node below lacks cannot come back), so neither the root nor the nodes
            # below look up the rest again.
            below = topology.subtree({"addr": root.addr, "children": children})
            lacking = set().union(*(by_addr[a].missing for a in below))
            ids = [c for c in self.ids + [self.version] if c in lacking]
            wants[root.addr] = set(await root.chan.query_missing(ids))

        children_of = {r.addr: c for r, c in roots}
        levels = {r.addr: topology.patience(c) for r, c in roots}
        await _each([r for r, _ in roots], lambda r: open_session(r, children_of[r.addr]),
                    self.timeout, levels)
        live = [r for r, _ in roots if r.error is None and r.addr in wants]
        order = interleave([c for c in self.ids if any(c in wants[r.addr] for r in live)],
                           self.sizes)
        if any(self.version in wants[r.addr] for r in live):
            order.append(self.version)  # the manifest goes last: it names everything before it
        self.progress.phase("sending", sum(self.sizes[c] for r in live for c in wants[r.addr]))
        sent = 0
        local_error: list[BaseException] = []
        Batch = list[tuple[bytes, bytes]]
        queues = {r.addr: trio.open_memory_channel[Batch](_QUEUE) for r in live}
        todo = iter(order)

        def next_batch() -> list[bytes]:
            """Take chunks off the shared iterator (each is read and compressed once) until
            the batch is worth a thread hop and a write."""
            batch, size = [], 0
            for cid in todo:
                batch.append(cid)
                size += self.sizes[cid]
                if size >= bulk.BATCH_BYTES or len(batch) >= bulk.BATCH_CHUNKS:
                    break
            return batch

        def load(cids: list[bytes]) -> Batch:
            return [(cid, chunk.encode(self.manifest_bytes if cid == self.version
                                       else self.snap.read_chunk(cid))) for cid in cids]

        async def encoder() -> None:
            while cids := next_batch():
                try:
                    blobs = await trio.to_thread.run_sync(load, cids)
                except (SourceChanged, OSError) as e:
                    local_error.append(e)
                    nursery.cancel_scope.cancel()
                    return
                for r in live:
                    wanted = wants[r.addr]
                    mine = [(cid, blob) for cid, blob in blobs if cid in wanted]
                    if mine and r.error is None:
                        try:
                            await queues[r.addr][0].send(mine)
                        except trio.BrokenResourceError:
                            pass  # that root failed; its sender said why

        async def encoders() -> None:
            async with trio.open_nursery() as inner:
                for _ in range(_ENCODERS):
                    inner.start_soon(encoder)
            for send, _ in queues.values():
                await send.aclose()

        async def sender(root: _Node) -> None:
            nonlocal sent
            async with queues[root.addr][1] as receive:
                try:
                    async for batch in receive:
                        with trio.fail_after(self.timeout * levels[root.addr]):
                            await root.bulk.send_chunks(batch)
                        for cid, blob in batch:
                            self.chunks_sent += cid != self.version
                            self.bytes_sent += len(blob)
                            sent += self.sizes[cid]
                        self.progress.update(sent)
                except _NODE_ERRORS as e:
                    root.fail(e, self.timeout)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(encoders)
            for r in live:
                nursery.start_soon(sender, r)
        if local_error:
            e = local_error[0]
            if isinstance(e, SourceChanged):
                raise e
            raise SourceChanged(describe_failure(e, self.timeout))

        async def flush(root: _Node) -> None:
            extra = await root.bulk.flush()  # RDMA: the node waits for that many chunks
            blame((await root.chan.request("flush", **extra)).get("failed", {}))

        await _each(live, flush, self.timeout, levels)

    async def publish(self, name: str) -> None:
        args = {"name": name, "version": self.version.hex()}
        self.progress.phase("publishing", 2 * len(self.healthy), "steps")
        steps = 0

        async def request(op: str, node: _Node) -> None:
            nonlocal steps
            await node.chan.request(op, **args)
            steps += 1
            self.progress.update(steps)

        await _each(self.nodes, lambda n: request("prepare", n), self.timeout)
        self.check("preparing")
        await _each(self.nodes, lambda n: request("commit", n), self.timeout)
        self.check("committing", [n.addr for n in self.healthy])

    async def aclose(self) -> None:
        for node in self.nodes:
            await bulk.close_peer(node.bulk, node.chan)


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
) -> PushResult:
    """Push `src` to every host as workspace `name` (default: the folder's name). With
    `cache_dir`, the scan keeps a cache of the folder there, so unchanged files are not read.
    `encrypt` is the policy for the sessions with the nodes (transport.encrypts)."""
    t0 = time.monotonic()
    progress = progress or Progress()
    name = workspace_name(src, name)
    if topology_kind not in topology.KINDS:
        raise ValueError(f"unknown topology {topology_kind!r}: use one of {topology.KINDS}")

    progress.phase("scanning", 0, "entries")
    snap = await scan(src, excludes, progress=lambda done, total: (
        progress.phase("hashing", total) if done == 0 else progress.update(done)),
        cache=ScanCache.for_folder(cache_dir, src) if cache_dir else None)

    job = _Push(snap, hosts, token, progress, timeout, allow_partial, encrypt)
    job.requested = transport if isinstance(transport, str) else transport.requested
    job.local = (transport if isinstance(transport, bulk.LocalTransport)
                 else bulk.resolve_local(transport))
    try:
        await job.connect()
        job.check("connecting")
        job.check_limits()
        job.check("checking the snapshot's size")
        await job.negotiate()
        job.check("negotiating")
        used = await job.broadcast(topology_kind, fanout)
        job.check("sending chunks")
        if allow_partial:
            # Nodes whose relay parent failed are healthy but incomplete: send them the rest
            # directly, once.
            await job.negotiate()
            await job.broadcast("star", fanout)
            job.check("sending chunks")
        await job.publish(name)
    finally:
        await job.aclose()

    files = [e for e in snap.manifest if e.kind == Kind.FILE]
    return PushResult(
        version=job.version.hex(),
        name=name,
        files=len(files),
        bytes=sum(e.size for e in files),
        chunks_total=len(job.ids),
        chunks_sent=job.chunks_sent,
        bytes_sent=job.bytes_sent,
        nodes=len(job.healthy),
        seconds=round(time.monotonic() - t0, 3),
        topology=used,
        transport=",".join(sorted({n.bulk.kind for n in job.nodes if n.bulk}
                                  or {n.transport[0] for n in job.healthy})) or "tcp",
        failed={n.addr: n.error for n in job.nodes if n.error},
        warnings=snap.warnings,
    )
