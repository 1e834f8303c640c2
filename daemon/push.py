"""The push client: scan a folder, send every node only the chunks it lacks, publish everywhere.

Publish is two-phase. Every node first receives its missing chunks and the manifest, then is asked
to `prepare` (check it holds everything, durably). Only when every node has prepared is any node
asked to `commit`. A node that cannot be reached, refuses, or fails mid-way fails the push, and no
node switches; what did arrive is kept, so the next push sends less.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import trio

from ..fs import chunk
from ..fs.manifest import Kind
from ..fs.scan import Snapshot, SourceChanged, scan
from . import protocol as p
from .refs import check_workspace_name
from .transport import Channel, ConnectError, ConnectionLost, RemoteError, connect

CONNECT_TIMEOUT = 10.0
STALL_TIMEOUT = 60.0  # no progress on one node for this long fails that node
_QUEUE = 4  # blobs buffered per node
_ENCODERS = 2


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


@dataclass
class PushResult:
    version: str
    name: str
    files: int
    bytes: int
    chunks_total: int
    chunks_sent: int
    bytes_sent: int
    nodes: int
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


class Progress:
    """What a push reports as it goes; the CLI draws it as a progress bar, the default is silent."""

    def phase(self, name: str, total: int, unit: str = "B") -> None: ...

    def update(self, done: int) -> None: ...


def describe(e: BaseException) -> str:
    """One line a person can act on, without internal frames."""
    if isinstance(e, trio.TooSlowError):
        return f"no progress for {STALL_TIMEOUT:.0f}s (node stalled or unreachable)"
    if isinstance(e, RemoteError):
        return e.message
    if isinstance(e, ConnectionLost):
        return str(e).removeprefix(f"{e.peer}: ")
    if isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, EOFError)):
        return "connection lost"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e) or type(e).__name__


class _Node:
    def __init__(self, addr: str):
        self.addr = addr
        self.chan: Channel | None = None
        self.missing: set[bytes] = set()
        self.error: str | None = None
        self.chunks_sent = 0
        self.bytes_sent = 0

    def fail(self, e: BaseException | str) -> None:
        if self.error is None:
            self.error = e if isinstance(e, str) else describe(e)


async def _each(nodes: list[_Node], fn: Callable) -> None:
    """Run fn(node) on every healthy node at once; a failure marks that node, not the others."""

    async def one(node: _Node) -> None:
        try:
            await fn(node)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                RemoteError, ConnectError, p.ProtocolError, EOFError) as e:
            node.fail(e)

    async with trio.open_nursery() as nursery:
        for node in nodes:
            if node.error is None:
                nursery.start_soon(one, node)


def _raise_failures(stage: str, nodes: list[_Node], published: Sequence[str] = ()) -> None:
    failures = {n.addr: n.error for n in nodes if n.error}
    if failures:
        raise PushError(stage, failures, len(nodes), published)


async def connect_all(hosts: Sequence[str], token: bytes) -> list[_Node]:
    nodes = [_Node(h) for h in hosts]

    async def open_one(node: _Node) -> None:
        try:
            node.chan = await connect(node.addr, token, timeout=CONNECT_TIMEOUT)
        except ConnectError as e:
            node.fail(str(e).removeprefix(f"{node.addr}: "))

    await _each(nodes, open_one)
    return nodes


async def close_all(nodes: list[_Node]) -> None:
    for node in nodes:
        if node.chan is not None:
            with trio.CancelScope(shield=True):
                await node.chan.aclose()


async def push(
    src: str | os.PathLike[str],
    hosts: Sequence[str],
    token: bytes,
    *,
    name: str | None = None,
    excludes: Sequence[str] = (),
    progress: Progress | None = None,
) -> PushResult:
    """Push `src` to every host as workspace `name` (default: the folder's name)."""
    t0 = time.monotonic()
    progress = progress or Progress()
    name = name or os.path.basename(os.path.abspath(src))
    check_workspace_name(name)

    progress.phase("scanning", 0, "entries")
    snap = await scan(src, excludes, progress=lambda done, total: (
        progress.phase("hashing", total) if done == 0 else progress.update(done)))
    manifest_bytes = snap.manifest.encode()
    version = chunk.chunk_id(manifest_bytes)
    ids = snap.manifest.chunk_ids()

    nodes = await connect_all(hosts, token)
    try:
        _raise_failures("connecting", nodes)

        async def negotiate(node: _Node) -> None:
            with trio.fail_after(STALL_TIMEOUT):
                await node.chan.send(p.QueryMissing(ids + [version]))
                reply = await node.chan.receive()
            if not isinstance(reply, p.MissingIds):
                raise p.ProtocolError(f"expected the missing chunk list, got {type(reply).__name__}")
            node.missing = set(reply.ids)

        await _each(nodes, negotiate)
        _raise_failures("negotiating", nodes)

        await _send(snap, version, manifest_bytes, ids, nodes, progress)
        _raise_failures("sending chunks", nodes)

        args = {"name": name, "version": version.hex()}
        progress.phase("publishing", 2 * len(nodes), "steps")
        steps = 0

        async def request(op: str, node: _Node) -> None:
            nonlocal steps
            with trio.fail_after(STALL_TIMEOUT):
                await node.chan.request(op, **args)
            steps += 1
            progress.update(steps)

        await _each(nodes, lambda n: request("prepare", n))
        _raise_failures("preparing", nodes)
        await _each(nodes, lambda n: request("commit", n))
        _raise_failures("committing", nodes, [n.addr for n in nodes if not n.error])
    finally:
        await close_all(nodes)

    files = [e for e in snap.manifest if e.kind == Kind.FILE]
    return PushResult(
        version=version.hex(),
        name=name,
        files=len(files),
        bytes=sum(e.size for e in files),
        chunks_total=len(ids),
        chunks_sent=sum(n.chunks_sent for n in nodes),
        bytes_sent=sum(n.bytes_sent for n in nodes),
        nodes=len(nodes),
        seconds=round(time.monotonic() - t0, 3),
        warnings=snap.warnings,
    )


async def _send(snap: Snapshot, version: bytes, manifest_bytes: bytes, ids: list[bytes],
                nodes: list[_Node], progress: Progress) -> None:
    """Read and compress each needed chunk once, and stream it to every node that lacks it."""
    order = [cid for cid in ids if any(cid in n.missing for n in nodes)]
    if any(version in n.missing for n in nodes):
        order.append(version)  # the manifest goes last: it names everything before it
    sizes = {cid: src.length for cid, src in snap.sources.items()}
    sizes[version] = len(manifest_bytes)
    progress.phase("sending", sum(sizes[c] for n in nodes for c in n.missing if c in sizes))
    sent = 0
    local_error: list[BaseException] = []

    def load(cid: bytes) -> bytes:
        return chunk.encode(manifest_bytes if cid == version else snap.read_chunk(cid))

    queues = {n.addr: trio.open_memory_channel[tuple[bytes, bytes]](_QUEUE) for n in nodes}
    todo = iter(order)

    async def encoder() -> None:
        for cid in todo:  # shared iterator: each chunk is read and compressed once
            try:
                blob = await trio.to_thread.run_sync(load, cid)
            except (SourceChanged, OSError) as e:
                local_error.append(e)
                nursery.cancel_scope.cancel()
                return
            for node in nodes:
                if cid in node.missing and node.error is None:
                    try:
                        await queues[node.addr][0].send((cid, blob))
                    except trio.BrokenResourceError:
                        pass  # that node failed; its sender said why

    async def encoders() -> None:
        async with trio.open_nursery() as inner:
            for _ in range(_ENCODERS):
                inner.start_soon(encoder)
        for send, _ in queues.values():
            await send.aclose()

    async def sender(node: _Node) -> None:
        nonlocal sent
        receive = queues[node.addr][1]
        async with receive:
            try:
                async for cid, blob in receive:
                    with trio.fail_after(STALL_TIMEOUT):
                        await node.chan.send(p.PutChunk(cid, blob))
                    node.chunks_sent += cid != version
                    node.bytes_sent += len(blob)
                    sent += sizes[cid]
                    progress.update(sent)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                    trio.ClosedResourceError, RemoteError) as e:
                node.fail(e)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(encoders)
        for node in nodes:
            nursery.start_soon(sender, node)
    if local_error:
        e = local_error[0]
        raise SourceChanged(describe(e)) if not isinstance(e, SourceChanged) else e
