"""The keeper: the blobs a push sent zstd-compressed, written into the dev box store beside the
send, never in front of it.

A chunk that went zstd to some link has its blob in hand; writing it (into the page cache) is
all the store needs, and the encoders hand it over (encoding.py) and go on reading. A chunk
that went raw everywhere and compresses is not compressed here: zstd beside the send took a
quarter of a venv push's CPU on the cores the send and the nodes need. It is kept after the
publish (ControllerStore.fill, with every chunk the store still lacks: by the filler the push
starts, store_keep.py), once, so the next push to fresh nodes finds the store whole. The
keeper takes up to BUDGET bytes in hand; what finds no room is left to that fill too. A
push's send ends once the keeper has written what it holds.
"""

from __future__ import annotations

import trio

from .controller_store import ControllerStore
from .encoding import Later

BUDGET = 64 << 20  # bytes in hand, at most


class Keeper:
    """Writes blobs into the dev box store off the send path (see the module docstring)."""

    def __init__(self, store: ControllerStore, budget: int = BUDGET) -> None:
        self.store = store
        self.budget = budget
        self.in_hand = 0
        self.ids: set[bytes] = set()  # in hand, or kept by this push
        self.kept = 0
        self._send, self._receive = trio.open_memory_channel[Later](1 << 16)

    def offer(self, later: Later) -> None:
        """Take what fits in the budget; the rest is left to the fill after the publish.
        Never waits."""
        took: Later = []
        for item in later:
            cid, blob = item
            if cid in self.ids or self.in_hand + len(blob) > self.budget:
                continue
            self.in_hand += len(blob)
            self.ids.add(cid)
            took.append(item)
        if took:
            try:
                self._send.send_nowait(took)
            except (trio.WouldBlock, trio.ClosedResourceError):
                self.in_hand -= sum(len(b) for _, b in took)
                self.ids.difference_update(cid for cid, _ in took)

    def _keep(self, items: Later) -> None:
        """Write `items` into the store. Blocking."""
        for cid, blob in items:
            self.store.add(cid, memoryview(blob))

    async def run(self) -> None:
        """Keep what is offered until `close`; then the rest in hand."""
        async with self._receive:
            async for items in self._receive:
                try:
                    await trio.to_thread.run_sync(self._keep, items)
                    self.kept += len(items)
                except OSError:  # a full disk on the dev box: the fill tries them again
                    self.ids.difference_update(cid for cid, _ in items)
                finally:
                    self.in_hand -= sum(len(b) for _, b in items)

    def close(self) -> None:
        """No more offers: `run` returns once it has kept what it holds."""
        self._send.close()
