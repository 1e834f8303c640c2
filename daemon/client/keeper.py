"""The keeper: what a push keeps in the dev box store, compressed and written there beside the
send, never in front of it.

A chunk that went to the nodes raw (a link faster than the codec: link_codec.py) but
compresses is kept in the store zstd-compressed, for later pushes over slower links; a chunk
that went zstd has its blob kept as it is. Either costs CPU the send does not need (zstd at
~250 MiB/s a core here, a write into the page cache), so the encoders hand those chunks over
(encoding.py) and go on reading. The keeper takes up to BUDGET bytes in hand; what finds no
room is left out of the store for this push (`ControllerStore.skipped`, not filled after it
either) and kept by a later one that reads it. A push waits for what the keeper has in hand
before it records its snapshot.
"""

from __future__ import annotations

import trio

from ...fs import chunk
from .controller_store import ControllerStore
from .encoding import Later

BUDGET = 64 << 20  # bytes in hand, at most
WORKERS = 1  # the encoders' threads and the send are busy too (2 cores here)


class Keeper:
    """Keeps chunks in the dev box store off the send path (see the module docstring)."""

    def __init__(self, store: ControllerStore, budget: int = BUDGET) -> None:
        self.store = store
        self.budget = budget
        self.in_hand = 0
        self.ids: set[bytes] = set()  # in hand, or kept by this push
        self.kept = 0
        self._send, self._receive = trio.open_memory_channel[Later](1 << 16)

    def offer(self, later: Later) -> None:
        """Take what fits in the budget; the rest is left for a later push. Never waits."""
        took: Later = []
        for item in later:
            cid, data, _ = item
            if cid in self.ids:
                continue
            if self.in_hand + len(data) > self.budget:
                self.store.skipped.add(cid)
                continue
            self.in_hand += len(data)
            self.ids.add(cid)
            took.append(item)
        if took:
            try:
                self._send.send_nowait(took)
            except (trio.WouldBlock, trio.ClosedResourceError):
                self.in_hand -= sum(len(d) for _, d, _ in took)
                self.store.skipped.update(cid for cid, _, _ in took)

    def _keep(self, items: Later) -> None:
        """Compress (where asked) and write `items` into the store. Blocking."""
        for cid, data, is_blob in items:
            if is_blob:
                self.store.add(cid, memoryview(data))
                continue
            blob = chunk.encode(memoryview(data)[1:])
            if blob[0] == chunk.RAW:
                self.store.add_sourced(cid)  # did not save enough, whole
            else:
                self.store.add(cid, blob)

    async def run(self) -> None:
        """Keep what is offered until `close`; then the rest in hand."""
        async with self._receive:
            async for items in self._receive:
                try:
                    await trio.to_thread.run_sync(self._keep, items)
                    self.kept += len(items)
                except OSError:  # a full disk on the dev box: the store misses them
                    self.store.skipped.update(cid for cid, _, _ in items)
                finally:
                    self.in_hand -= sum(len(d) for _, d, _ in items)

    def close(self) -> None:
        """No more offers: `run` returns once it has kept what it holds."""
        self._send.close()
