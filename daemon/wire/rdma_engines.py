"""The RDMA bulk path's completion-handling state machines: pure, no pyverbs, no I/O.

Everything here is exercised by tests/test_rdma_logic.py on a machine with no RDMA device; the
pyverbs half (rdma_endpoint.py, rdma.py) only moves bytes and completions between these
classes and the verbs.

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
* `SenderEngine` / `ReceiverEngine` (here) are the completion-handling state machines for both
  modes: events in (chunks submitted, completions, credit messages), work requests out. The
  headers and credit messages they exchange are rdma_format.py's; the ring, credit window,
  reorder buffer and reassembler they keep are rdma_ring.py's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .rdma_format import (
    HEADER_SIZE,
    RC,
    SRD,
    BulkProtocolError,
    Fragment,
    check_geometry,
    fragments,
)
from .rdma_ring import CreditWindow, Reassembler, ReorderBuffer, Ring


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
    """One work completion, as the driver reads it off the completion queue: `kind` (one of the
    above, or "error" with `ok` False and `error` saying why), the work request's `wr_id`, and
    for RECV_IMM the immediate `imm`; `byte_len` bytes arrived for a receive."""

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
    """Receiver: SEND a credit message, `released` fragments in all."""

    released: int


@dataclass(frozen=True)
class PostRecv:
    """Post receive buffer `buf` again (its message was read)."""

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
        self.reorder: ReorderBuffer[Fragment] = ReorderBuffer(slots, start)
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
            announced = self._frags.pop(c.wr_id, None)
            if announced is None:
                raise BulkProtocolError(f"read completion for unknown fragment {c.wr_id}")
            return [], self._arrived(announced)
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

