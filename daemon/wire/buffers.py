"""Pooled buffers for chunk payloads, placed on pages, taken again once nothing holds a view
of them.

A new buffer per 4 MiB chunk pays a zero-fill and a page fault per 4 KiB on its first touch:
1.6 of a node's 11 busy CPU-seconds receiving the torch venv, and as much again on the dev box,
whose encoders read every chunk into a buffer of its own. A payload travels on as views (relay
queues, store writes, a DATA part the mesh rebuilds a tensor on, a batch queued for a root), so
a buffer is taken again only when no view of it is left: every memoryview of a bytearray holds
a reference to it, so its reference count says so.

A pooled buffer is an anonymous mapping whose 4 MiB middle is asked for as transparent huge
pages (this machine's THP setting is madvise): receiving a chunk into it and writing it with
O_DIRECT (which pins each page of the buffer) then touch 2 pages instead of 1024. In plain
Python, 1 GiB over loopback into a 4 MiB buffer and out with O_DIRECT, 4 alternating pairs:
0.20-0.23 CPU-s with 4 KiB pages, 0.13-0.20 with huge pages.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

ALIGN = 4096
HUGE = 2 * 1024 * 1024  # a transparent huge page


def aligned(size: int, lead: int = 0, raw: bytearray | mmap.mmap | None = None,
            boundary: int = ALIGN) -> memoryview:
    """A writable buffer of `size` bytes whose byte `lead` starts on an ALIGN boundary: in
    `raw` (at least size + `boundary` bytes), else in a new zeroed one. With `boundary`
    (a multiple of ALIGN), byte `lead` goes on the first such boundary past raw's first page."""
    raw = bytearray(size + ALIGN) if raw is None else raw
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    if boundary == ALIGN:
        start = (-(address + lead)) % ALIGN
    elif 0 <= lead <= ALIGN:
        start = (-(address + ALIGN)) % boundary + ALIGN - lead
    else:
        raise ValueError(f"a lead of {lead} bytes does not fit before a {boundary} boundary")
    return memoryview(raw)[start : start + size]


def _huge(size: int) -> mmap.mmap:
    """An anonymous mapping of `size` + HUGE bytes whose HUGE-aligned middle (where aligned()
    with boundary=HUGE puts a buffer's byte `lead`) is asked for as huge pages."""
    # Private: an anonymous shared mapping is shmem, which this kernel gives no huge pages.
    raw = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    middle = (-(address + ALIGN)) % HUGE + ALIGN
    whole = (size - ALIGN) // HUGE * HUGE  # the huge pages inside the buffer, no more
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            raw.madvise(mmap.MADV_HUGEPAGE, middle, whole)
        except OSError:  # a kernel without THP: 4 KiB pages, as before
            pass
    return raw


class BufferPool:
    """Up to `keep` buffers of POOLED bytes, handed out as aligned views (see the module
    docstring). Thread-safe: the dev box's encoders take buffers from worker threads."""

    POOLED = 4 * 1024 * 1024 + 64 * 1024  # a 4 MiB chunk's frame fits; larger ones are not kept
    # A smaller buffer is made to measure, as is one asked for while every pooled one is held:
    # a small file's chunk took a whole new POOLED buffer then (a batch of small chunks holds
    # many), a 4 MiB zero-fill per 20 KB file, half of the dev box's CPU pushing small files.
    SMALL = 128 * 1024

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._pool: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def prepare(self, count: int) -> None:
        """Make `count` pooled buffers now and touch their pages, so that the first chunks
        received do not pay for fresh memory (see RECEIVING). Blocking: run it on a thread."""
        for _ in range(min(count, self.keep) - len(self._pool)):
            raw = _huge(self.POOLED)  # made and touched outside the lock: take() never waits
            for offset in range(0, len(raw), ALIGN):
                raw[offset] = 0
            with self._lock:
                if len(self._pool) >= self.keep:
                    return
                self._pool.append(raw)

    def take(self, size: int, lead: int = 0) -> memoryview:
        """A buffer of `size` bytes whose byte `lead` is on a page."""
        if size < self.SMALL or size + ALIGN > self.POOLED:
            return aligned(size, lead)
        with self._lock:
            for raw in self._pool:
                # Three references: the pool's, `raw`'s and getrefcount's own argument.
                if sys.getrefcount(raw) == 3:
                    return aligned(size, lead, raw, HUGE)
            if len(self._pool) >= self.keep:  # every pooled one is held: one to measure
                return aligned(size, lead)
            raw = _huge(self.POOLED)
            self._pool.append(raw)
        return aligned(size, lead, raw, HUGE)


# The large frames every connection of this process receives, in one pool: a buffer freed by
# one connection serves the next, so a daemon's receive buffers are made once, not per push.
# Fresh memory is dear here (the first touch of never-used pages ran at ~1 GB/s on this VM
# against ~8 GB/s for pages used before): per connection, a 1 GiB push paid 10-12% of the
# daemon's CPU zeroing the pages of the buffers it made. A daemon fills it when it starts
# (prepare); more are made as needed, up to `keep`.
RECEIVING = BufferPool(keep=16)
