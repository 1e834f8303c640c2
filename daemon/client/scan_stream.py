"""Streaming while scanning: a new file's chunks go to the nodes as the scan hashes them, so
the dev box reads each of its bytes once.

Without it a new file is read twice: by the scan (its chunk ids make the manifest) and again
when its chunks are sent (docs/design/store.md). Here the scan (fs/scan.py, its `tap`) reads
each chunk of a file of backing.MIN_SIZE (256 KiB) or more, which a node keeps in a file
object, into a buffer of this module's, hashes it, and
hands it over; a bounded window (WINDOW chunks, which also bounds the memory) asks each node,
with a `stream_file` request per run of up to RUN chunks (the next run's question on its way
while this run's chunks are), what it lacks of them, and sends those only
(a node is never sent what it has). The node writes them at their offsets into a provisional
file object (fs/provisional.py), which the manifest claims when it arrives; the manifest, the
rest of the chunks and the two-phase publish go as before, and the negotiation finds these
chunks on the node. The scan's hash is the check: the bytes sent are the bytes hashed, and a
file whose stat key moved while it was read fails the push (SourceChanged) before anything is
published.

Small files (which a node keeps in its packs) go the same way, in batches (`stream_chunks`: up
to SMALL_RUN of them, their bytes copied out of the scan's buffer): a first push of a venv read
and hashed its 43k small files in the scan, then read them all again to send them once the
scan was done.

Only where every node is a root of the plan (star, or one node), not with push --early,
--watch, --bwlimit or a control tree, and only to nodes whose link goes raw (link_codec.py:
loopback or a link faster than the codec); elsewhere the push keeps its order. A node that
refuses `stream_file` (an older one, or --store-compressed) gets the chunks later as before.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from ...fs import chunk
from ...fs.backing import MIN_SIZE
from ...fs.snapshot import SourceChanged
from ..wire import bulk
from ..wire.buffers import BufferPool
from ..wire.stream_file import StreamChunks, StreamFile, StreamFileReply
from ..wire.transport import RemoteError
from . import link_codec
from .controller_store import ControllerStore
from .link_codec import LinkChoice
from .links import NODE_ERRORS, NodeLink

# Chunks hashed ahead of the nodes' answers, and so buffers held. Each buffer is memory the
# push process touches for the first time, dearer than the copy into it (a VM backs it only
# then: 16 buffers cost 7-12% of the push's CPU for 1 GiB); 6 keep the link busy.
WINDOW = 6
RUN = 8  # chunks taken off the scan at once, at most
ASK = 64  # a file's chunks asked about in one request, at most (stream_file.MAX_IDS)
SMALL_RUN = (1 << 20, 256)  # a batch of small files' chunks: bytes, chunks (one request each)
SMALL_HELD = 16 << 20  # bytes of small files copied and not yet sent to every node, at most


@dataclass
class _Chunk:
    file: _File | None  # None: a small file's (a batch's, not a window's)
    index: int
    cid: bytes
    blob: memoryview  # the codec byte, then the chunk's bytes


@dataclass
class _Run:
    chunks: list[_Chunk]  # consecutive chunks of one file
    nodes: int  # how many nodes are still to send it (its buffers are held until then)


class _File:
    """One streamed file: a FileSink (fs/scan.py) on the hashing thread."""

    def __init__(self, owner: ScanStream, number: int, path: bytes, size: int) -> None:
        self.owner, self.number, self.path, self.size = owner, number, path, size
        self.index = 0
        self.held: memoryview | None = None  # the buffer being read into

    def buffer(self, size: int) -> memoryview:
        # The window, on this thread: a hop to trio's per chunk waited for the loop while it
        # sealed and sent (and the scan of one file is one thread).
        while not self.owner.slots.acquire(timeout=0.1):
            if self.owner.stopped:
                raise SourceChanged("the push stopped while the file was read")
        self.held = self.owner.pool.take(size + 1, 1)
        return self.held[1:]

    def chunk(self, cid: bytes, buf: memoryview, length: int) -> None:
        assert self.held is not None
        blob, self.held = self.held[:length + 1], None
        blob[0] = chunk.RAW
        if not chunk.compressible(blob[1:]):
            self.owner.sourced.append(cid)  # its file is its wire form (encoding.py)
        self.owner.token.run_sync_soon(self.owner.put, _Chunk(self, self.index, cid, blob))
        self.index += 1

    def done(self, unchanged: bool) -> None:
        if self.held is not None:  # read nothing into it (the file ended on a chunk)
            self.held = None
            self.owner.slots.release()
        if not unchanged:
            self.owner.changed.append(self.path)


class _Small:
    """One small file: a FileSink that copies its chunk out of the scan's buffer, for the
    stream's batch once the file is read whole and unchanged."""

    def __init__(self, owner: ScanStream) -> None:
        self.owner = owner
        self.taken: _Chunk | None = None

    def buffer(self, size: int) -> None:
        return None  # the scan's own: a small file is copied, not read into a window

    def chunk(self, cid: bytes, buf: memoryview, length: int) -> None:
        blob = bytearray(length + 1)
        blob[0] = chunk.RAW
        blob[1:] = buf[:length]
        self.taken = _Chunk(None, 0, cid, memoryview(blob))

    def done(self, unchanged: bool) -> None:
        if unchanged and self.taken is not None:  # else the push reads it again, as before
            self.owner.add_small(self.taken)


class ScanStream:
    """The tap of one push's scan (see the module docstring) and what it sent."""

    def __init__(self, links: Sequence[NodeLink], chunk_size: int, compress: str,
                 timeout: float) -> None:
        self.links, self.chunk_size = links, chunk_size
        self.compress, self.timeout = compress, timeout
        self.slots = threading.Semaphore(WINDOW)  # taken on the hashing threads
        self.stopped = False  # the push ended: a hashing thread waits no longer
        self.token = trio.lowlevel.current_trio_token()
        self.queue, self._receive = trio.open_memory_channel[_Chunk | list[_Chunk]](math.inf)
        self.pool = BufferPool(WINDOW + 2)  # taken before a slot is given back
        # small files' chunks: those taken (each once), the batch being filled, and the bytes
        # held (the batch's and those not yet sent to every node), under one lock
        self.small = threading.Condition()
        self._seen: set[bytes] = set()
        self._batch: list[_Chunk] = []
        self._batch_bytes = self._held = 0
        self.targets: list[NodeLink] = []  # the nodes streamed to
        self.chosen = False  # the links' codecs are known (and so whether any streams)
        self.choices: dict[str, LinkChoice] = {}  # each link's codec, for the push to reuse
        self.changed: list[bytes] = []  # files whose stat key moved while they were read
        self.sourced: list[bytes] = []  # ids of chunks that do not compress
        # each streamed file's number (stream_file): taken on both lanes' hashing threads at
        # once, so from a counter whose next() is one step, not a `+= 1` two threads can share
        self._numbers = itertools.count(1)
        self.chunks_sent = self.bytes_sent = 0

    def __call__(self, path: bytes, size: int) -> _File | _Small | None:
        """fs/scan.py's Tap: a sink for a large file or a small one (on a hashing thread)."""
        if size < MIN_SIZE:  # not copied once it is known no link takes it
            return None if size == 0 or (self.chosen and not self.targets) else _Small(self)
        return _File(self, next(self._numbers), path, size)

    def add_small(self, c: _Chunk) -> None:
        """A small file's chunk joins the batch (on a hashing thread, which waits while
        SMALL_HELD bytes are held); a full batch is handed over."""
        with self.small:
            if c.cid in self._seen:  # a file whose copy went already (a venv has many)
                return
            self._seen.add(c.cid)
            self._batch.append(c)
            self._batch_bytes += len(c.blob)
            self._held += len(c.blob)
            if self._batch_bytes >= SMALL_RUN[0] or len(self._batch) >= SMALL_RUN[1]:
                self.token.run_sync_soon(self.put, self._batch)
                self._batch, self._batch_bytes = [], 0
            while self._held > SMALL_HELD and not self.stopped:
                self.small.wait(0.1)

    def put(self, c: _Chunk | list[_Chunk]) -> None:
        """Queue a chunk (or a batch of small files' chunks) the tap hands over (on trio's
        thread, in the order handed over)."""
        try:
            self.queue.send_nowait(c)
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # the push stopped
            self._release([c] if isinstance(c, _Chunk) else c)

    def _release(self, chunks: list[_Chunk]) -> None:
        """Give back what `chunks` held: a window's slots, or a batch's bytes."""
        if chunks and chunks[0].file is None:
            with self.small:
                self._held -= sum(len(c.blob) for c in chunks)
                self.small.notify_all()
        else:
            for _ in chunks:
                self.slots.release()

    async def run(self) -> None:
        """Send what the tap hands over until `finish`; the links are open (push_nodes)."""
        for node in self.links:
            if node.error is None:
                choice = await link_codec.choose(self.compress, node.addr, node.channel)
                self.choices[node.addr] = choice
                if choice.compression == "none":
                    self.targets.append(node)
        self.chosen = True
        queues = [(node, *trio.open_memory_channel[_Run](math.inf)) for node in self.targets]
        async with trio.open_nursery() as nursery:
            for node, _, receive in queues:
                nursery.start_soon(self._node, node, receive)
            async with self._receive:
                while True:
                    try:
                        batch = [await self._receive.receive()]
                    except trio.EndOfChannel:
                        break
                    while len(batch) < RUN:
                        try:
                            batch.append(self._receive.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    for run in _runs(batch, len(queues)):
                        for _, send, _ in queues:
                            send.send_nowait(run)
                        if not queues:
                            self._sent(run)
                    del batch, run  # a buffer goes back to the pool once nothing holds it
            for _, send, _ in queues:
                send.close()

    async def _node(self, node: NodeLink, runs: trio.MemoryReceiveChannel[_Run]) -> None:
        """Ask `node` what it lacks of each run, and send that: the question about the next
        run goes while this one's chunks are on their way, so the link never waits for an
        answer with nothing in flight."""
        asked_tx, asked_rx = trio.open_memory_channel[tuple[list[_Run], set[bytes]]](1)
        ok = True

        async def ask() -> None:
            nonlocal ok
            held: _Run | None = None
            async with asked_tx, runs:
                while True:
                    if held is None:
                        try:
                            held = await runs.receive()
                        except trio.EndOfChannel:
                            return
                    group, held = _group(held, runs)  # the runs queued meanwhile: one question
                    if ok:
                        try:
                            with trio.fail_after(self.timeout):
                                lacking = await self._ask(node, group)
                        except RemoteError:  # refused (an older node, --store-compressed)
                            ok = False
                        except NODE_ERRORS as e:
                            ok = False
                            node.fail(e, self.timeout)
                    if ok:
                        await asked_tx.send((group, lacking))
                    else:
                        for run in group:
                            self._sent(run)

        async def send() -> None:
            nonlocal ok
            async with asked_rx:
                async for group, lacking in asked_rx:
                    try:
                        if ok:
                            with trio.fail_after(self.timeout):
                                await self._send_run(node, group, lacking)
                    except NODE_ERRORS as e:
                        ok = False
                        node.fail(e, self.timeout)
                    finally:
                        for run in group:
                            self._sent(run)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(send)

    def _sent(self, run: _Run) -> None:
        """One node is done with `run`: once all are, its buffers go back to the window."""
        run.nodes -= 1
        if run.nodes <= 0:
            self._release(run.chunks)
            run.chunks.clear()

    async def finish(self) -> None:
        """The scan is done: send what is left, then stop; SourceChanged if a file changed
        while it was read (nothing of this push is published then)."""
        with self.small:  # the scan is done: no hashing thread adds to it
            batch, self._batch = self._batch, []
        if batch:
            self.put(batch)
        await self.queue.aclose()
        if self.changed:
            raise SourceChanged(f"{os.fsdecode(self.changed[0])} changed while it was read "
                                "(its stat key moved): push again once it is written")

    def keep(self, store: ControllerStore) -> None:
        """What the dev box store records of the chunks hashed here: those that do not
        compress are sent from their files (encoding.py); the others are read again by the
        push's keep, compressed and kept."""
        for cid in self.sourced:
            if not store.store.has(cid):
                store.add_sourced(cid)

    async def _ask(self, node: NodeLink, group: list[_Run]) -> set[bytes]:
        first = group[0].chunks[0]
        ids = [c.cid for run in group for c in run.chunks]
        req: StreamFile | StreamChunks = StreamChunks(ids) if first.file is None else StreamFile(
            first.file.number, first.file.size, self.chunk_size, first.index, ids)
        reply = await node.channel.request(req.op, **req.to_wire())
        return set(StreamFileReply.from_wire(reply).missing)

    async def _send_run(self, node: NodeLink, group: list[_Run], lacking: set[bytes]) -> None:
        out: list[tuple[bytes, bytes | memoryview]] = []
        for c in (c for run in group for c in run.chunks):
            if c.cid in lacking:  # once, if the group holds it twice
                lacking.remove(c.cid)
                out.append((c.cid, c.blob))
        if out:
            await node.channel.send_many(bulk.frames_for(out))
            self.chunks_sent += len(out)
            self.bytes_sent += sum(len(blob) for _, blob in out)


def _group(run: _Run, runs: trio.MemoryReceiveChannel[_Run]) -> tuple[list[_Run], _Run | None]:
    """`run` and the runs already queued after it that continue its file, up to ASK chunks;
    and the first queued run that does not (asked about next)."""
    group, count = [run], len(run.chunks)
    while count < ASK:
        try:
            nxt = runs.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return group, None
        last, first = group[-1].chunks[-1], nxt.chunks[0]
        if last.file is None or first.file is not last.file or first.index != last.index + 1:
            return group, nxt
        group.append(nxt)
        count += len(nxt.chunks)
    return group, None


def _runs(batch: list[_Chunk | list[_Chunk]], nodes: int) -> list[_Run]:
    """`batch` cut into runs of consecutive chunks of one file, and small files' batches as
    they are (one request each)."""
    runs: list[_Run] = []
    for c in batch:
        if isinstance(c, list):
            runs.append(_Run(c, nodes))
            continue
        last = runs[-1].chunks[-1] if runs else None
        if last is not None and last.file is c.file and last.index + 1 == c.index:
            runs[-1].chunks.append(c)
        else:
            runs.append(_Run([c], nodes))
    return runs
