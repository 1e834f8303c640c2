"""Streaming while scanning: a new large file's chunks go to the nodes as the scan hashes them,
so the dev box reads each of its bytes once.

Without it a new file is read twice: by the scan (its chunk ids make the manifest) and again
when its chunks are sent (docs/design/store.md). Here the scan (fs/scan.py, its `tap`) reads
each chunk of a file of MIN_FILE bytes or more into a buffer of this module's, hashes it, and
hands it over; a bounded window (WINDOW chunks, which also bounds the memory) asks each node,
with a `stream_file` request per run of chunks, what it lacks of them, and sends those only
(a node is never sent what it has). The node writes them at their offsets into a provisional
file object (fs/provisional.py), which the manifest claims when it arrives; the manifest, the
rest of the chunks and the two-phase publish go as before, and the negotiation finds these
chunks on the node. The scan's hash is the check: the bytes sent are the bytes hashed, and a
file whose stat key moved while it was read fails the push (SourceChanged) before anything is
published.

Only where every node is a root of the plan (star, or one node), not with push --early,
--watch, --bwlimit or a control tree, and only to nodes whose link goes raw (link_codec.py:
loopback or a link faster than the codec); elsewhere the push keeps its order. A node that
refuses `stream_file` (an older one, or --store-compressed) gets the chunks later as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from ...fs import chunk
from ...fs.snapshot import SourceChanged
from ..wire import bulk
from ..wire.buffers import BufferPool
from ..wire.stream_file import StreamFile, StreamFileReply
from ..wire.transport import RemoteError
from . import link_codec
from .controller_store import ControllerStore
from .link_codec import LinkChoice
from .links import NODE_ERRORS, NodeLink

WINDOW = 8  # chunks hashed ahead of the nodes' answers (and buffers held)
MIN_FILE = 8 << 20  # files streamed while scanning: at least two chunks


@dataclass
class _Chunk:
    file: _File
    index: int
    cid: bytes
    blob: memoryview  # the codec byte, then the chunk's bytes


class _File:
    """One streamed file: a FileSink (fs/scan.py) on the hashing thread."""

    def __init__(self, owner: ScanStream, number: int, path: bytes, size: int) -> None:
        self.owner, self.number, self.path, self.size = owner, number, path, size
        self.index = 0
        self.held: memoryview | None = None  # the buffer being read into

    def buffer(self, size: int) -> memoryview:
        trio.from_thread.run(self.owner.slots.acquire)  # the window: blocks the scan
        self.held = self.owner.pool.take(size + 1, 1)
        return self.held[1:]

    def chunk(self, cid: bytes, buf: memoryview, length: int) -> None:
        assert self.held is not None
        blob, self.held = self.held[:length + 1], None
        blob[0] = chunk.RAW
        if not chunk.compressible(blob[1:]):
            self.owner.sourced.append(cid)  # its file is its wire form (encoding.py)
        trio.from_thread.run_sync(self.owner.queue.send_nowait,
                                  _Chunk(self, self.index, cid, blob))
        self.index += 1

    def done(self, unchanged: bool) -> None:
        if self.held is not None:  # read nothing into it (the file ended on a chunk)
            self.held = None
            trio.from_thread.run_sync(self.owner.slots.release)
        if not unchanged:
            self.owner.changed.append(self.path)


class ScanStream:
    """The tap of one push's scan (see the module docstring) and what it sent."""

    def __init__(self, links: Sequence[NodeLink], chunk_size: int, compress: str,
                 timeout: float) -> None:
        self.links, self.chunk_size = links, chunk_size
        self.compress, self.timeout = compress, timeout
        self.slots = trio.Semaphore(WINDOW)
        self.queue, self._receive = trio.open_memory_channel[_Chunk](math.inf)
        self.pool = BufferPool(WINDOW + 2)
        self.targets: list[NodeLink] = []  # the nodes streamed to
        self.choices: dict[str, LinkChoice] = {}  # each link's codec, for the push to reuse
        self.changed: list[bytes] = []  # files whose stat key moved while they were read
        self.sourced: list[bytes] = []  # ids of chunks that do not compress
        self.files = self.chunks_sent = self.bytes_sent = 0

    def __call__(self, path: bytes, size: int) -> _File | None:
        """fs/scan.py's Tap: a sink for a large file (on a hashing thread)."""
        if size < MIN_FILE or size < 2 * self.chunk_size:
            return None
        self.files += 1
        return _File(self, self.files, path, size)

    async def run(self) -> None:
        """Send what the tap hands over until `finish`; the links are open (push_nodes)."""
        for node in self.links:
            if node.error is None:
                choice = await link_codec.choose(self.compress, node.addr, node.channel)
                self.choices[node.addr] = choice
                if choice.compression == "none":
                    self.targets.append(node)
        async with self._receive:
            while True:
                try:
                    batch = [await self._receive.receive()]
                except trio.EndOfChannel:
                    return
                while len(batch) < WINDOW:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await self._send(batch)
                finally:
                    for _ in batch:
                        self.slots.release()
                    batch.clear()

    async def finish(self) -> None:
        """The scan is done: send what is left, then stop; SourceChanged if a file changed
        while it was read (nothing of this push is published then)."""
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

    async def _send(self, batch: list[_Chunk]) -> None:
        runs: list[list[_Chunk]] = []  # consecutive chunks of one file
        for c in batch:
            if runs and runs[-1][-1].file is c.file and runs[-1][-1].index + 1 == c.index:
                runs[-1].append(c)
            else:
                runs.append([c])

        async def one(node: NodeLink) -> None:
            try:
                with trio.fail_after(self.timeout):
                    for run in runs:
                        await self._send_run(node, run)
            except RemoteError:  # refused (an older node, --store-compressed): as before
                self.targets.remove(node)
            except NODE_ERRORS as e:
                self.targets.remove(node)
                node.fail(e, self.timeout)

        async with trio.open_nursery() as nursery:
            for node in list(self.targets):
                nursery.start_soon(one, node)

    async def _send_run(self, node: NodeLink, run: list[_Chunk]) -> None:
        f = run[0].file
        req = StreamFile(f.number, f.size, self.chunk_size, run[0].index, [c.cid for c in run])
        reply = StreamFileReply.from_wire(await node.channel.request(req.op, **req.to_wire()))
        lacking = set(reply.missing)
        out: list[tuple[bytes, bytes | memoryview]] = []
        for c in run:
            if c.cid in lacking:  # once, if the run holds it twice
                lacking.remove(c.cid)
                out.append((c.cid, c.blob))
        if out:
            await node.channel.send_many(bulk.frames_for(out))
            self.chunks_sent += len(out)
            self.bytes_sent += sum(len(blob) for _, blob in out)
