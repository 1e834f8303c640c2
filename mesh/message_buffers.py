"""Buffers for large mesh messages, kept once faulted in and taken again when nothing views
them any more.

Why: a 64 MiB tensor received into a fresh buffer paid a zero-fill and a page fault per 4 KiB
of it on each message, most of a tensor round trip's time (py-spy: BufferPool.take's
allocation, 2.8 of 8 busy seconds on the two sides of an echo loop). Weight sync sends
messages of the same size every step, so the buffer of the last-but-one is the natural home of
the next. A received tensor is a view of its buffer (wire.py), so a buffer is taken again only
once its reference count says no view is left, as in daemon/wire/buffers.py's pool.
"""

from __future__ import annotations

import sys
import threading

from ..daemon.wire.buffers import ALIGN, aligned

KEEP_BYTES = 1 << 30  # what a process keeps for later messages; a larger buffer is not kept
KEEP = 4  # buffers kept: a message held by the user while the next one arrives needs a second


class MessageBuffers:
    """Page-aligned buffers of at least the asked size, reused (see the module docstring).
    Thread-safe: a controller may run more than one trio loop."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, keep: int = KEEP) -> None:
        self.keep_bytes = keep_bytes
        self.keep = keep
        self._pool: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable buffer of `size` bytes starting on a page, already faulted in when one
        of the right size is free. A buffer is reused for a message of at least half its size,
        so a small message does not pin a big buffer."""
        need = size + ALIGN
        with self._lock:
            best: bytearray | None = None
            for raw in self._pool:
                # Three references when free: the pool's, `raw`'s and getrefcount's argument.
                if (need <= len(raw) <= 2 * need and sys.getrefcount(raw) == 3
                        and (best is None or len(raw) < len(best))):
                    best = raw
            if best is not None:
                return aligned(size, 0, best)
            raw = bytearray(need)
            if need <= self.keep_bytes:
                self._make_room(need)
                if len(self._pool) < self.keep and self.kept + need <= self.keep_bytes:
                    self._pool.append(raw)
            return aligned(size, 0, raw)

    def _make_room(self, need: int) -> None:
        """Drop free buffers, oldest first, until `need` more bytes fit under the limits."""
        i = 0
        while i < len(self._pool) and (
                len(self._pool) >= self.keep
                or self.kept + need > self.keep_bytes):
            if sys.getrefcount(self._pool[i]) == 2:  # the pool's and getrefcount's argument
                del self._pool[i]
            else:
                i += 1

    @property
    def kept(self) -> int:
        """Bytes kept in the pool (held or free)."""
        return sum(len(r) for r in self._pool)


RECEIVED = MessageBuffers()  # where this process receives large mesh messages
