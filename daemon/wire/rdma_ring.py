"""The flow-control bookkeeping of an RDMA bulk connection: which ring slots are in use, how far
the sender may go, and putting fragments back in order and back together.

Pure: the engines (rdma_engines.py) drive these; tests drive them directly.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from .frames import MAX_FRAME
from .rdma_format import BulkProtocolError, Fragment

T = TypeVar("T")


class Ring:
    """The receiver's ring of `slots` buffers. Fragment `fseq` occupies slot `fseq % slots`
    from `fill(fseq)` until `release(fseq)`. Releases may come in any order; `released` is the
    number of fragments released contiguously from the start, and slot `s` is free for fragment
    `fseq` exactly when `fseq < released + slots`."""

    def __init__(self, slots: int, start: int = 0):
        if slots < 1:
            raise ValueError("a ring needs at least one slot")
        self.slots = slots
        self.released = start
        self._filled: set[int] = set()  # fseqs in the ring, not yet released
        self._done: set[int] = set()  # released out of order, above `released`

    def slot(self, fseq: int) -> int:
        return fseq % self.slots

    def may_fill(self, fseq: int) -> bool:
        return (self.released <= fseq < self.released + self.slots
                and fseq not in self._filled and fseq not in self._done)

    def fill(self, fseq: int) -> int:
        if not self.may_fill(fseq):
            raise BulkProtocolError(
                f"fragment {fseq} is outside the receive window "
                f"[{self.released}, {self.released + self.slots}) or already seen")
        self._filled.add(fseq)
        return self.slot(fseq)

    def is_free(self, slot: int) -> bool:
        """No fragment occupies `slot` (it was never filled, or its fragment was released)."""
        return not any(f % self.slots == slot for f in self._filled)

    def release(self, fseq: int) -> None:
        if fseq not in self._filled:
            raise ValueError(f"fragment {fseq} is not in the ring")
        self._filled.discard(fseq)
        self._done.add(fseq)
        while self.released in self._done:
            self._done.discard(self.released)
            self.released += 1

    @property
    def occupied(self) -> int:
        return len(self._filled)


class CreditWindow:
    """The sender's view of the receiver's ring. Fragment `fseq` may be written only when
    `fseq < granted + slots`, where `granted` is the largest cumulative release count received.
    Credits (`available`) are never negative: a stale count is ignored, and a count beyond what
    was sent is refused."""

    def __init__(self, slots: int, start: int = 0):
        if slots < 1:
            raise ValueError("a window needs at least one slot")
        self.slots = slots
        self.granted = start  # cumulative fragments the receiver released
        self.next = start  # the next fragment number

    @property
    def available(self) -> int:
        return self.granted + self.slots - self.next

    def take(self) -> int:
        if self.available <= 0:
            raise RuntimeError("no credit: the receiver has not released a slot")
        fseq = self.next
        self.next += 1
        return fseq

    def grant(self, released: int) -> bool:
        """A cumulative release count from the receiver; True if it opened the window."""
        if released > self.next:
            raise BulkProtocolError(
                f"receiver claims {released} fragments released, only {self.next} were sent")
        if released <= self.granted:
            return False  # stale or repeated: counts only grow
        self.granted = released
        return True


class ReorderBuffer(Generic[T]):
    """Puts items back in sequence order. At most `window` items ahead of the next expected one
    are held (the ring bounds it); anything else is a protocol error, never silent loss."""

    def __init__(self, window: int, start: int = 0):
        self.window = window
        self.next = start
        self._held: dict[int, T] = {}

    def push(self, seq: int, item: T) -> list[tuple[int, T]]:
        if not self.next <= seq < self.next + self.window:
            raise BulkProtocolError(
                f"sequence {seq} outside the reorder window [{self.next}, "
                f"{self.next + self.window})")
        if seq in self._held:
            raise BulkProtocolError(f"sequence {seq} arrived twice")
        self._held[seq] = item
        out = []
        while self.next in self._held:
            out.append((self.next, self._held.pop(self.next)))
            self.next += 1
        return out

    def __len__(self) -> int:
        return len(self._held)


class Reassembler:
    """Joins in-order fragments back into (chunk id, blob)."""

    def __init__(self, max_blob: int = MAX_FRAME):
        self.max_blob = max_blob
        self._cid: bytes | None = None
        self._total = 0
        self._parts: list[bytes] = []
        self._have = 0

    @property
    def idle(self) -> bool:
        return self._cid is None

    def add(self, frag: Fragment, payload: bytes) -> tuple[bytes, bytes] | None:
        if len(payload) != frag.length:
            raise BulkProtocolError(f"fragment {frag.fseq}: {len(payload)} bytes, header says "
                                    f"{frag.length}")
        if frag.total > self.max_blob:
            raise BulkProtocolError(f"blob of {frag.total} bytes exceeds {self.max_blob}")
        if self._cid is None:
            if frag.offset != 0:
                raise BulkProtocolError(f"fragment {frag.fseq} starts mid-blob at {frag.offset}")
            self._cid, self._total, self._parts, self._have = frag.cid, frag.total, [], 0
        elif frag.cid != self._cid or frag.total != self._total or frag.offset != self._have:
            raise BulkProtocolError(f"fragment {frag.fseq} does not continue the blob in flight")
        self._parts.append(payload)
        self._have += frag.length
        if self._have < self._total:
            return None
        cid, blob = self._cid, b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._cid, self._parts = None, []
        return cid, blob

