"""The transport-independent half of the RDMA path: pure state machines, no pyverbs, no I/O.

Everything here is exercised by tests/test_rdma_logic.py on a machine with no RDMA device; the
pyverbs half (rdma.py) only moves bytes and completions between these classes and the verbs.

How chunks move (both modes):

* Each side registers a ring of `slots` buffers of `slot_size` bytes. A chunk blob is cut into
  fragments of at most `slot_size - HEADER_SIZE` bytes; fragment number `fseq` (0, 1, 2, ... over
  the whole connection) always lives in slot `fseq % slots`, behind a 64-byte header that names
  it (fseq, chunk id, blob length, offset, length).
* **Credits.** The receiver counts the fragments it has delivered *in order* and copied out of
  its ring (`Ring.released`) and sends that cumulative count back in a small SEND. The sender may
  use fragment `fseq` only while `fseq < granted + slots` (`CreditWindow`), so slot `fseq % slots`
  was released by the receiver before the sender touches it again: a sender never overruns a
  receiver. Counts are cumulative, so credit messages may arrive late, twice or out of order
  (SRD) and the largest simply wins; a count beyond what was sent is a protocol error.
* **RC (InfiniBand, RoCE): push.** The sender copies header + payload into its local slot and
  posts one RDMA WRITE WITH IMMEDIATE into the same slot of the receiver's ring, the slot index in
  the immediate. The receiver's completion names the slot; it reads the header there.
* **SRD (EFA): pull.** The sender copies header + payload into its local slot and SENDs the
  64-byte header alone; the receiver posts an RDMA READ of the payload from the sender's slot
  into its own. SRD delivers and completes out of order, so `ReorderBuffer` puts fragments back
  in fseq order before they are reassembled.
* `SenderEngine` / `ReceiverEngine` are the completion-handling state machines for both modes:
  events in (chunks submitted, completions, credit messages), work requests out.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .frames import MAX_FRAME  # a chunk blob never exceeds one frame
from .protocol import ID_SIZE

HEADER_SIZE = 64
MSG_SIZE = 64  # small SEND/RECV buffers: credit messages, SRD fragment announcements
_MAGIC = b"MFSB"
_HEADER = struct.Struct("<4sQ16sQQI")  # magic, fseq, chunk id, blob length, offset, length
_CREDIT = struct.Struct("<4sQ")  # magic, cumulative fragments released
_CREDIT_MAGIC = b"MFSC"

DEFAULT_SLOTS = 16
DEFAULT_SLOT_SIZE = 1 << 20
MAX_SLOTS = 1024
MIN_SLOT_SIZE = 4096
MAX_SLOT_SIZE = 64 << 20
MAX_RING = 1 << 30  # registered bytes per ring (pyverbs MR offsets are C ints)

RC = "rdma-rc"
SRD = "rdma-srd"
TCP = "tcp"


class BulkProtocolError(Exception):
    """The peer broke the bulk protocol (bad slot, sequence, header or credit count)."""


# ---- headers and small messages ---------------------------------------------------------------


@dataclass(frozen=True)
class Fragment:
    fseq: int
    cid: bytes
    total: int  # length of the whole blob
    offset: int  # where this fragment starts in the blob
    length: int

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.fseq, self.cid, self.total, self.offset,
                            self.length).ljust(HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes | memoryview, payload_limit: int) -> Fragment:
        if len(data) < _HEADER.size:
            raise BulkProtocolError(f"fragment header of {len(data)} bytes is truncated")
        magic, fseq, cid, total, offset, length = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise BulkProtocolError("fragment header has a bad magic number")
        if length > payload_limit:
            raise BulkProtocolError(
                f"fragment of {length} bytes exceeds the slot ({payload_limit})")
        if total > MAX_FRAME or offset + length > total or (length == 0 and total != 0):
            raise BulkProtocolError(
                f"fragment {fseq}: offset {offset} + length {length} does not fit a blob of "
                f"{total} bytes")
        return cls(fseq, cid, total, offset, length)


def encode_credit(released: int) -> bytes:
    return _CREDIT.pack(_CREDIT_MAGIC, released).ljust(MSG_SIZE, b"\0")


def decode_credit(data: bytes | memoryview) -> int:
    if len(data) < _CREDIT.size:
        raise BulkProtocolError("credit message is truncated")
    magic, released = _CREDIT.unpack_from(data)
    if magic != _CREDIT_MAGIC:
        raise BulkProtocolError("credit message has a bad magic number")
    return released


def fragments(cid: bytes, blob: bytes | memoryview, payload: int) -> list[tuple[int, int]]:
    """(offset, length) of each fragment of `blob`; an empty blob is one empty fragment."""
    if len(cid) != ID_SIZE:
        raise ValueError(f"chunk id must be {ID_SIZE} bytes")
    if len(blob) > MAX_FRAME:
        raise ValueError(f"blob of {len(blob)} bytes exceeds {MAX_FRAME}")
    if payload <= 0:
        raise ValueError("slot payload must be positive")
    if not len(blob):
        return [(0, 0)]
    return [(off, min(payload, len(blob) - off)) for off in range(0, len(blob), payload)]


def check_geometry(slots: int, slot_size: int) -> None:
    """Ring geometry a peer proposes, checked before anything is registered."""
    if not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise BulkProtocolError(f"ring of {slots!r} slots: must be 1..{MAX_SLOTS}")
    if not isinstance(slot_size, int) or not MIN_SLOT_SIZE <= slot_size <= MAX_SLOT_SIZE:
        raise BulkProtocolError(
            f"slot size {slot_size!r}: must be {MIN_SLOT_SIZE}..{MAX_SLOT_SIZE} bytes")
    if slots * slot_size > MAX_RING:
        raise BulkProtocolError(f"ring of {slots} x {slot_size} bytes exceeds {MAX_RING}")


# ---- the ring, credits, reordering -----------------------------------------------------------


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


class ReorderBuffer:
    """Puts items back in sequence order. At most `window` items ahead of the next expected one
    are held (the ring bounds it); anything else is a protocol error, never silent loss."""

    def __init__(self, window: int, start: int = 0):
        self.window = window
        self.next = start
        self._held: dict[int, object] = {}

    def push(self, seq: int, item: object) -> list[tuple[int, object]]:
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


def unwrap32(value: int, reference: int) -> int:
    """The 64-bit count nearest `reference` whose low 32 bits are `value` (for immediates)."""
    base = reference - (1 << 31)
    return base + ((value - base) & 0xFFFFFFFF)


class Backoff:
    """How long to sleep after a poll that found nothing: `spins` immediate retries (yielding to
    the event loop), then doubling from `low` to `high` seconds; any completion resets it."""

    def __init__(self, spins: int = 16, low: float = 20e-6, high: float = 2e-3):
        self.spins, self.low, self.high = spins, low, high
        self._idle = 0

    def reset(self) -> None:
        self._idle = 0

    def next_delay(self) -> float:
        self._idle += 1
        if self._idle <= self.spins:
            return 0.0
        return min(self.high, self.low * 2.0 ** min(self._idle - self.spins - 1, 60))


# ---- completions and work requests -----------------------------------------------------------

# Completion kinds, as the pyverbs driver classifies ibv_wc opcodes.
SEND_DONE = "send_done"  # our SEND (credit or SRD announcement) or RDMA WRITE completed
READ_DONE = "read_done"  # our RDMA READ completed (SRD receiver)
RECV = "recv"  # a SEND arrived in receive buffer `wr_id`
RECV_IMM = "recv_imm"  # an RDMA WRITE WITH IMMEDIATE landed (RC receiver); imm = slot


@dataclass(frozen=True)
class Completion:
    kind: str
    wr_id: int = 0
    ok: bool = True
    imm: int = 0
    byte_len: int = 0
    error: str = ""


@dataclass(frozen=True)
class WriteData:
    """Copy header + payload into local slot `slot`, then (RC) RDMA WRITE WITH IMM them into
    the receiver's slot `slot`, or (SRD) SEND the header from it."""

    fseq: int
    slot: int
    header: bytes
    payload: memoryview


@dataclass(frozen=True)
class ReadData:
    """SRD receiver: RDMA READ `length` payload bytes of the sender's slot `slot` into ours."""

    fseq: int
    slot: int
    length: int


@dataclass(frozen=True)
class SendCredit:
    released: int


@dataclass(frozen=True)
class PostRecv:
    buf: int  # index of the small receive buffer to post again


@dataclass
class _Pending:
    cid: bytes
    blob: memoryview
    pieces: deque = field(default_factory=deque)


class SenderEngine:
    """The sending side of one bulk connection, RC or SRD (sans I/O).

    `submit()` queues a blob; `work()` hands out the work requests the credits allow now; the
    driver posts them and feeds completions to `on_completion()`."""

    def __init__(self, mode: str, slots: int, slot_size: int, *, start: int = 0):
        if mode not in (RC, SRD):
            raise ValueError(f"unknown RDMA mode {mode!r}")
        check_geometry(slots, slot_size)
        self.mode = mode
        self.slots = slots
        self.slot_size = slot_size
        self.payload = slot_size - HEADER_SIZE
        self.window = CreditWindow(slots, start)
        self._queue: deque[_Pending] = deque()
        self.in_flight = 0  # posted data work requests not yet completed
        self.chunks_submitted = 0
        self.error: str | None = None

    def submit(self, cid: bytes, blob: bytes | memoryview) -> None:
        if self.error:
            raise BulkProtocolError(self.error)
        view = memoryview(blob).cast("B")
        item = _Pending(cid, view, deque(fragments(cid, view, self.payload)))
        self._queue.append(item)
        self.chunks_submitted += 1

    @property
    def queued(self) -> int:
        return sum(len(p.pieces) for p in self._queue)

    @property
    def idle(self) -> bool:
        """Everything submitted was posted and its data work requests completed."""
        return not self._queue and self.in_flight == 0

    def work(self) -> list[WriteData]:
        out = []
        while self._queue and self.window.available > 0 and self.error is None:
            item = self._queue[0]
            offset, length = item.pieces.popleft()
            fseq = self.window.take()
            frag = Fragment(fseq, item.cid, len(item.blob), offset, length)
            out.append(WriteData(fseq, fseq % self.slots, frag.encode(),
                                 item.blob[offset : offset + length]))
            self.in_flight += 1
            if not item.pieces:
                self._queue.popleft()
        return out

    def on_completion(self, c: Completion) -> list[PostRecv]:
        """SEND_DONE for our data work requests (wr_id = fseq); RECV for credit messages, whose
        payload the driver passes to on_credit() first. Returns receive buffers to repost."""
        if not c.ok:
            self.error = self.error or f"completion error: {c.error or 'failed'}"
            return []
        if c.kind == SEND_DONE:
            self.in_flight -= 1
            return []
        if c.kind == RECV:
            return [PostRecv(c.wr_id)]
        raise BulkProtocolError(f"unexpected {c.kind} completion on the sending side")

    def on_credit(self, released: int) -> bool:
        return self.window.grant(released)


class ReceiverEngine:
    """The receiving side of one bulk connection, RC or SRD (sans I/O).

    The driver feeds completions; `read_slot(slot, offset, length)` reads our registered ring.
    Delivered chunks come out of `on_completion()` in the order they were sent; the slots they
    occupied are released at once (their bytes were copied out), and `credit()` says when the
    sender should be told."""

    def __init__(self, mode: str, slots: int, slot_size: int,
                 read_slot: Callable[[int, int, int], bytes], *, start: int = 0):
        if mode not in (RC, SRD):
            raise ValueError(f"unknown RDMA mode {mode!r}")
        check_geometry(slots, slot_size)
        self.mode = mode
        self.slots = slots
        self.payload = slot_size - HEADER_SIZE
        self.read_slot = read_slot
        self.ring = Ring(slots, start)
        self.reorder = ReorderBuffer(slots, start)
        self.assembler = Reassembler()
        self._frags: dict[int, Fragment] = {}  # SRD: announced fragments by fseq
        self.credit_sent = start
        self.credit_sends = 0  # credit SENDs not yet completed
        self.max_credit_sends = slots
        self.chunks_delivered = 0
        self.error: str | None = None

    def on_completion(self, c: Completion, msg: bytes = b"") -> tuple[list, list]:
        """Returns (work requests to post, chunks delivered in order as (cid, blob)).
        `msg` is the content of receive buffer c.wr_id for a RECV (SRD announcement)."""
        if not c.ok:
            self.error = self.error or f"completion error: {c.error or 'failed'}"
            return [], []
        if c.kind == SEND_DONE:  # one of our credit messages went out
            self.credit_sends -= 1
            return [], []
        if c.kind == RECV_IMM:
            if self.mode != RC:
                raise BulkProtocolError("RDMA WRITE WITH IMM on an SRD connection")
            slot = c.imm
            if not 0 <= slot < self.slots:
                raise BulkProtocolError(f"write into slot {slot} of a {self.slots}-slot ring")
            frag = Fragment.decode(self.read_slot(slot, 0, HEADER_SIZE), self.payload)
            if frag.fseq % self.slots != slot:
                raise BulkProtocolError(f"fragment {frag.fseq} written into slot {slot}")
            self.ring.fill(frag.fseq)
            return [PostRecv(c.wr_id)], self._arrived(frag)
        if c.kind == RECV:
            if self.mode != SRD:
                raise BulkProtocolError("unexpected SEND on an RC bulk connection")
            frag = Fragment.decode(msg, self.payload)
            slot = self.ring.fill(frag.fseq)
            self._frags[frag.fseq] = frag
            return [PostRecv(c.wr_id), ReadData(frag.fseq, slot, frag.length)], []
        if c.kind == READ_DONE:
            frag = self._frags.pop(c.wr_id, None)
            if frag is None:
                raise BulkProtocolError(f"read completion for unknown fragment {c.wr_id}")
            return [], self._arrived(frag)
        raise BulkProtocolError(f"unexpected {c.kind} completion on the receiving side")

    def _arrived(self, frag: Fragment) -> list[tuple[bytes, bytes]]:
        out = []
        for fseq, f in self.reorder.push(frag.fseq, frag):
            payload = self.read_slot(self.ring.slot(fseq), HEADER_SIZE, f.length)
            self.ring.release(fseq)  # copied out: the sender may reuse the slot
            done = self.assembler.add(f, payload)
            if done is not None:
                self.chunks_delivered += 1
                out.append(done)
        return out

    def credit(self) -> SendCredit | None:
        """A credit message to send now, if slots were released since the last one and the
        send queue has room (a later call sends the newer count otherwise)."""
        if self.ring.released > self.credit_sent and self.credit_sends < self.max_credit_sends:
            self.credit_sent = self.ring.released
            self.credit_sends += 1
            return SendCredit(self.credit_sent)
        return None

