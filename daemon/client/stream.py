"""Streaming a push's chunks to the roots of its broadcast plan: open a relay session on each
root, then read and compress each chunk once and send it to every root whose subtree lacks it,
then flush. What to send where was planned before (push.py: who lacks what, which topology);
this is only the moving of bytes, with its order (`interleave`) and its pipeline: encoder
threads feed a bounded queue per root, drained by one sender per root; helper processes take a
share of many small files on sessions of their own (send_helpers.py).

push --early (`head` given) streams on a data connection per root of its own, so the push's
control channels stay free to publish while the chunks flow. The manifest goes first, then the
chunks the first reads need (`head`), then the rest; and the roots may send `Want`s on it: a
reader of the early-published version needs a chunk that has not arrived. A wanted chunk is
read, encoded and sent at once on that connection, ahead of the queues (its relay tree forwards
wants up to the root: daemon/node/relay.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial

import trio

from ...fs import chunk
from ...fs.manifest import Manifest
from ...fs.snapshot import Source, SourceChanged
from ...fs.snapshot import ahead as files_ahead
from ..wire import bulk, topology
from ..wire import protocol as p
from ..wire.buffers import BufferPool
from ..wire.replies import FlushReply, RelayReply
from ..wire.transport import CONNECT_TIMEOUT, Channel, connect, describe_failure
from . import encoding, send_helpers
from .controller_store import ControllerStore
from .encoding import Later
from .keeper import Keeper
from .links import NODE_ERRORS, NodeLink, each
from .progress import Progress
from .send_order import LEAD, in_place, interleave, lead

_QUEUE = 4  # batches buffered per root
READ_BUFFERS = 24  # 4 MiB buffers kept for reads: the queues', the encoders' and the keeper's
_ENCODERS = 2  # (and a root's wants, read beside them: push --early)

Batch = list[tuple[bytes, bytes | memoryview]]


class Pacer:
    """push --bwlimit: keeps what the dev box streams under `rate` bytes a second, all roots
    together (on a shared cluster the dev box's link is shared too). Chunks a reader wants
    (push --early) are not paced: someone waits for them. A rate of 0 is no limit."""

    def __init__(self, rate: float = 0):
        self.rate = rate
        self.free_at = 0.0  # trio time when the next batch may go

    async def take(self, size: int) -> None:
        """Wait until `size` more bytes may go, and book them."""
        if self.rate <= 0:
            return
        start = max(self.free_at, trio.current_time())
        self.free_at = start + size / self.rate
        await trio.sleep_until(start)


class Sizes(Mapping[bytes, int]):
    """Each chunk's and folder object's size, looked up in the snapshot as asked: a dict of
    them all would cost a pass over every chunk of the tree for each push of an edit."""

    def __init__(self, sources: Mapping[bytes, Source], objects: Mapping[bytes, bytes]):
        self.sources = sources
        self.objects = objects
        # Each size once found: a push to a fresh node asks for every chunk's ~10 times (the
        # plan, the order, the batches, the progress), through two Mappings each time.
        self._found: dict[bytes, int] = {}

    def __getitem__(self, cid: bytes) -> int:
        size = self._found.get(cid)
        if size is None:
            blob = self.objects.get(cid)
            size = self._found[cid] = (len(blob) if blob is not None
                                       else self.sources[cid].length)
        return size

    def __contains__(self, cid: object) -> bool:
        return cid in self.objects or cid in self.sources

    def __iter__(self) -> Iterator[bytes]:
        yield from self.objects
        yield from (c for c in self.sources if c not in self.objects)

    def __len__(self) -> int:
        return len(self.objects) + sum(c not in self.objects for c in self.sources)


@dataclass
class Payload:
    """What a push sends: the snapshot's chunk ids in folder order, then its manifest (the
    folder objects, by id: the root's is `version`), their sizes, and how to obtain a chunk's
    blob: from the dev box's store when it
    holds it (no read, hash or compression), else read from the source (checked against its
    id) and compressed, and then kept in the store. Roots in `raw_roots` (links faster than
    the codec, link_codec.py) get every chunk raw; the nodes below a root receive
    what the root received, forwarded as it arrives."""

    ids: Collection[bytes]  # Manifest.chunk_ids()
    version: bytes
    objects: Mapping[bytes, bytes]  # Manifest.objects(): children before parents, the root last
    sources: Mapping[bytes, Source]  # Snapshot.sources
    read_into: Callable[..., bytearray | memoryview]  # Snapshot.read_into
    store: ControllerStore | None = None
    raw_roots: set[str] = field(default_factory=set)
    keeper: Keeper | None = None  # set while a Stream runs with a store
    # What chunks are read into: reused once sent (and kept), not a new 4 MiB each.
    buffers: BufferPool = field(default_factory=lambda: BufferPool(READ_BUFFERS))
    manifest: Manifest | None = None  # the snapshot's, for send_order.in_place
    open_ahead: Callable[..., dict[bytes, int]] | None = None  # Snapshot.open_ahead

    @cached_property
    def sizes(self) -> Sizes:
        return Sizes(self.sources, self.objects)

    def _fresh(self, cid: bytes) -> bool:
        """Whether a raw link had better read the chunk from its source than decompress the
        stored blob: its file is one the scan cache vouches for (unchanged, so probably in the
        page cache). Measured on the torch venv, loopback: 5.4 client CPU-s reading the
        source, 7.3 decompressing from the store. A read is checked against the id; a file
        that changed unseen falls back to the store."""
        if cid in self.objects:  # a folder object: the sources, asked about it, would look
            return False  # through every file of the manifest first (Sources)
        src = self.sources.get(cid)
        return src is not None and src.unread

    def read(self, cid: bytes, fd: int | None = None) -> bytearray | memoryview:
        """A chunk's bytes after one free byte (for its codec byte, when it goes raw); `fd`:
        its file, opened by `open_ahead`."""
        obj = self.objects.get(cid)
        if obj is not None:
            return bytearray(1) + obj
        return self.read_into(cid, 1, self._buffer, fd)

    def _buffer(self, size: int) -> bytearray | memoryview:
        """Where a chunk is read: a small one in plain memory (it is copied into its frame
        with its neighbours: frames.py), a large one on a page of a pooled buffer."""
        return bytearray(size) if size < BufferPool.SMALL else self.buffers.take(size)

    def encoded(self, cids: list[bytes], zstd: bool = True,
                raw: bool = False) -> tuple[Batch, Batch, Later]:
        """(wire form, raw form, what to keep in the store) of `cids`, each form only if asked
        (else empty), on a worker thread (encoding.py: read once, compressed only for a link
        that takes zstd)."""
        keeper = self.keeper
        return encoding.encoded(cids, zstd=zstd, raw=raw, store=self.store,
                                objects=self.objects, read=self.read, fresh=self._fresh,
                                kept=keeper.ids if keeper is not None else (),
                                ahead=self.open_ahead and partial(
                                    self.open_ahead, most=files_ahead(_ENCODERS + 1)))

    def keep(self, later: Later) -> None:
        """Hand what `encoded` did not keep to the keeper (trio thread; see keeper.py)."""
        if later and self.keeper is not None:
            self.keeper.offer(later)


class Stream:
    """Moves a payload to the roots of a plan (see the module docstring); counts what left."""

    def __init__(self, payload: Payload, nodes: Sequence[NodeLink], local: bulk.LocalTransport,
                 timeout: float, progress: Progress, head: list[bytes] | None = None,
                 token: bytes = b"", encrypt: str = "auto", pacer: Pacer | None = None,
                 helpers: int = 0):
        self.payload = payload
        self.helpers = helpers  # processes that may share the small files (send_helpers.py)
        self.warnings: list[str] = []
        self.helped = {"processes": 0, "chunks": 0, "bytes": 0}  # what helpers sent
        self.pacer = pacer or Pacer()
        self.head = head  # push --early: what goes right after the manifest (module docstring)
        self.token = token  # for the data connections of push --early
        self.encrypt = encrypt
        self.wanted = 0  # chunks sent ahead of the stream because a node's reader wanted them
        self.by_addr = {n.addr: n for n in nodes}
        self.local = local
        self.timeout = timeout
        self.progress = progress
        self.chunks_sent = 0  # chunk copies that left the dev box (relays forward the rest)
        self.bytes_sent = 0
        self.data: dict[str, Channel] = {}  # push --early: each root's data connection
        self.senders: dict[str, bulk.BulkSender] = {}  # each root's bulk sender

    def _blame(self, failed: dict[str, str]) -> None:
        for addr, cause in failed.items():
            if addr in self.by_addr:
                self.by_addr[addr].fail(cause)

    async def run(self, roots: list[tuple[NodeLink, list[dict]]], opened: bool = False
                  ) -> None:
        """Open a relay session on each root (unless `opened`: a push's control tree, whose
        relays negotiate asked), then read and compress each chunk once and stream it to every
        root whose subtree lacks it."""
        failed: BaseException | None = None
        pl = self.payload
        async with trio.open_nursery() as keeping:
            keeper = None
            if pl.store is not None and pl.keeper is None:  # keeps beside the send
                keeper = pl.keeper = Keeper(pl.store)
                keeping.start_soon(keeper.run)
            try:
                async with trio.open_nursery() as readers:  # push --early: the roots' wants
                    try:
                        await self._run(roots, readers, opened)
                    except BaseException as e:  # raised as itself below (SourceChanged, a
                        failed = e  # cancel), not wrapped in an ExceptionGroup by a nursery
                    finally:
                        readers.cancel_scope.cancel()
                        for addr, chan in self.data.items():
                            await bulk.close_peer(self.senders.get(addr), chan)
            finally:
                if keeper is not None:  # what it holds is kept before this nursery ends
                    keeper.close()
                    pl.keeper = None
                if failed is not None:
                    keeping.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _read_wants(self, root: NodeLink, chan: Channel, *,
                          task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """Send each chunk a root wants at once, ahead of the queues, until cancelled (before
        the flush, which reads this channel)."""
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                while True:
                    msg = await chan.next_message()
                    if not isinstance(msg, p.Want):
                        raise p.ProtocolError(f"{root.addr}: unexpected {type(msg).__name__} "
                                              "while streaming")
                    known = [c for c in msg.ids if c in self.payload.sizes]
                    if not known:
                        continue
                    # Shielded: a send cut off mid-frame by the flush's cancel would break the
                    # channel the flush goes on.
                    with trio.CancelScope(shield=True), trio.fail_after(self.timeout):
                        raw = root.addr in self.payload.raw_roots
                        blobs, raws, later = await trio.to_thread.run_sync(
                            self.payload.encoded, known, not raw, raw)
                        self.payload.keep(later)
                        batch = raws if raw else blobs
                        await chan.send_many(bulk.frames_for(batch))
                        self.wanted += len(batch)
                        self.bytes_sent += sum(len(blob) for _, blob in batch)
            except SourceChanged as e:  # the dev box cannot read it as scanned any more
                root.fail(f"cannot send a wanted chunk: {e}")
            except NODE_ERRORS as e:
                root.fail(e, self.timeout)

    async def _run(self, roots: list[tuple[NodeLink, list[dict]]],
                   readers: trio.Nursery, opened: bool) -> None:
        pl = self.payload
        wants: dict[str, set[bytes]] = {}
        early = self.head is not None
        reading: dict[str, trio.CancelScope] = {}

        async def open_session(root: NodeLink, children: list[dict]) -> None:
            if early:  # a connection of its own, so the control channel can publish meanwhile
                chan = self.data[root.addr] = await connect(
                    root.addr, self.token, encrypt=self.encrypt,
                    timeout=min(CONNECT_TIMEOUT, self.timeout))
                self.senders[root.addr] = await bulk.open_sender(chan, root.transport[0],
                                                                 self.local, chan.info)
            else:
                chan = root.channel
                if root.bulk is None:
                    root.bulk = await bulk.open_sender(chan, root.transport[0], self.local,
                                                       chan.info)
                self.senders[root.addr] = root.bulk
            below = topology.subtree({"addr": root.addr, "children": children})
            lacking = set().union(*(self.by_addr[a].missing for a in below))
            if opened:  # negotiate asked the root, which asked its subtree: it knows
                wants[root.addr] = set(lacking)
                return
            extra = {"wants": True} if early else {}
            reply = RelayReply.from_wire(await chan.request(
                "relay", children=children, timeout=self.timeout, version=pl.version.hex(),
                **extra))
            self._blame(reply.failed)
            # negotiate() learned what each node lacks: ask the subtree only about those ids
            # (an id no node below lacks cannot come back), so neither the root nor the nodes
            # below look up the rest again.
            if children or early:
                wants[root.addr] = set(await chan.query_missing(list(lacking)))
            else:  # what it told negotiate() on this session, which it still holds
                wants[root.addr] = set(lacking)
            if early:
                reading[root.addr] = await readers.start(self._read_wants, root, chan)

        children_of = {r.addr: c for r, c in roots}
        levels = {r.addr: topology.patience(c) for r, c in roots}
        await each([r for r, _ in roots], lambda r: open_session(r, children_of[r.addr]),
                   self.timeout, levels)
        live = [r for r, _ in roots if r.error is None and r.addr in wants]
        wanted = set().union(*(wants[r.addr] for r in live))
        # In folder order (what a reader opens together arrives together), unless few are
        # (an edit): then a pass over every id of the tree would cost more than it sends.
        needed = ([c for c in pl.ids if c in wanted] if 4 * len(wanted) > len(pl.ids) else
                  [c for c in wanted if c not in pl.objects])
        # The manifest goes first: it tells each node where every large file's chunks go, so
        # they are written once, in place (fs/file_objects.py). Nothing is published before
        # prepare checks that every chunk it names has arrived (push --early: the first
        # reads' chunks, next, and the rest on demand).
        manifest = [o for o in pl.objects if o in wanted]
        # Each size looked up once, into a plain dict: the order, the batches and the
        # progress below ask for each chunk's ~6 times, and Sizes looks in the snapshot.
        sizes = {c: pl.sizes[c] for c in (*manifest, *needed)}
        if self.head is None:
            # (Not for an edit, which sends little: the lead's pass over the manifest to
            # find the large files would cost it more than it saves.)
            big = manifest and sum(sizes[c] for c in needed) > LEAD
            order = manifest + (lead(needed, sizes, in_place(pl.manifest)) if big else
                                interleave(needed, sizes))
        else:  # the first reads' chunks next: the version is usable once they are there
            first, wanted = set(self.head), set(needed)
            head = [c for c in dict.fromkeys(self.head) if c in wanted]
            order = manifest + head + interleave([c for c in needed if c not in first],
                                                 sizes)
        self.progress.phase("sending", sum(sizes[c] for r in live for c in wants[r.addr]))
        sent = 0
        small: list[bytes] = []  # what helpers share with the encoders (send_helpers.py)
        if self.helpers and self.head is None and self.pacer.rate <= 0 and all(
                r.addr in pl.raw_roots and r.transport[0] == bulk.TCP and not children_of[r.addr]
                for r in live):
            order, small = send_helpers.small_files(order, pl.sources)
        pool = send_helpers.Pool(small, pl.sources, {r.addr: wants[r.addr] for r in live})
        unsent: list[bytes] = []  # what a helper did not send: the encoders send it last
        helpers_done = trio.Event()
        local_error: list[BaseException] = []
        queues = {r.addr: trio.open_memory_channel[Batch](_QUEUE) for r in live}
        todo: Iterator[bytes] = iter(order)

        def next_batch() -> list[bytes]:
            """Take chunks off the shared iterator (each is read and compressed once) until
            the batch is worth a thread hop and a write."""
            batch: list[bytes] = []
            size = 0
            for cid in todo:
                batch.append(cid)
                size += sizes[cid]
                if size >= bulk.BATCH_BYTES or len(batch) >= bulk.BATCH_CHUNKS:
                    break
            return batch

        async def encode(cids: list[bytes]) -> bool:
            """Read (and compress, for the roots that take zstd) `cids` and queue them for
            every root that wants them, each in its form; False on a local error (the push
            is cancelled)."""
            raw_needed = any(r.addr in pl.raw_roots for r in live)
            zstd_needed = any(r.addr not in pl.raw_roots for r in live)
            try:
                blobs, raws, later = await trio.to_thread.run_sync(pl.encoded, cids,
                                                                   zstd_needed, raw_needed)
                pl.keep(later)
            except (SourceChanged, OSError, chunk.CorruptChunk) as e:
                local_error.append(e)
                nursery.cancel_scope.cancel()
                return False
            for r in live:
                wanted = wants[r.addr]
                form = raws if r.addr in pl.raw_roots else blobs
                mine = [(cid, blob) for cid, blob in form if cid in wanted]
                if mine and r.error is None:
                    try:
                        await queues[r.addr][0].send(mine)
                    except trio.BrokenResourceError:
                        pass  # that root failed; its sender said why
            return True

        async def encoder() -> None:
            while (cids := next_batch()) and await encode(cids):
                pass

        async def encoders() -> None:
            nonlocal todo
            # The manifest's objects, queued in order before the parallel encoders start: they
            # finish their batches in any order, and a chunk sent ahead of the root would miss
            # its file object.
            if manifest and not await encode([next(todo) for _ in manifest]):
                return
            # Then the rest of the order; the small files the helpers share, once they have
            # started (so they take part, not the push alone); what a helper did not send.
            for wait, more in ((None, todo), (pool.started, pool.ids), (helpers_done, unsent)):
                if wait is not None:
                    await wait.wait()
                todo = iter(more)
                async with trio.open_nursery() as inner:
                    for _ in range(_ENCODERS):
                        inner.start_soon(encoder)
            for send, _ in queues.values():
                await send.aclose()

        def helper_sent(size: int, chunks: int) -> None:
            nonlocal sent
            sent += size
            self.helped["bytes"] += size  # (push.py counts them as sent too)
            self.helped["chunks"] += chunks
            self.progress.update(sent)

        async def helpers() -> None:
            self.helped["processes"] = self.helpers if small else 0
            self.warnings += await send_helpers.run_all(
                self.helped["processes"], pool, [r.addr for r in live], self.token,
                self.encrypt, self.timeout, pl.version, helper_sent, unsent)
            helpers_done.set()

        async def sender(root: NodeLink) -> None:
            nonlocal sent
            async with queues[root.addr][1] as receive:
                try:
                    out = self.senders[root.addr]
                    async for batch in receive:
                        size = sum(len(blob) for _, blob in batch)
                        await self.pacer.take(size)
                        with trio.fail_after(self.timeout * levels[root.addr]):
                            await out.send_chunks(batch)
                        self.bytes_sent += size
                        for cid, _ in batch:
                            self.chunks_sent += cid not in pl.objects
                            sent += sizes[cid]
                        self.progress.update(sent)
                except NODE_ERRORS as e:
                    root.fail(e, self.timeout)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(helpers)
            nursery.start_soon(encoders)
            for r in live:
                nursery.start_soon(sender, r)
        if local_error:
            e = local_error[0]
            if isinstance(e, SourceChanged):
                raise e
            raise SourceChanged(describe_failure(e, self.timeout))

        async def flush(root: NodeLink) -> None:
            if root.addr in reading:  # the flush's reply comes on the wants' channel
                reading[root.addr].cancel()
            chan = self.data.get(root.addr) or root.channel
            extra = await self.senders[root.addr].flush()  # RDMA: the node waits for them
            self._blame(FlushReply.from_wire(await chan.request("flush", **extra)).failed)

        await each(live, flush, self.timeout, levels)
