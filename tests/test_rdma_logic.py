"""The RDMA path's transport-independent logic, without hardware: the ring, credits, reordering,
reassembly, the completion state machines of both modes driven over a simulated fabric that
delivers completions in adversarial orders, and the pyverbs enum shim. (The transport choice and
the drivers over a channel: test_bulk_transports.py.)"""

from __future__ import annotations

import random
import types
from collections import deque
from enum import IntEnum

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_fs.daemon.wire import rdma_devices
from monarch_fs.daemon.wire.rdma_engines import (
    READ_DONE,
    RECV,
    RECV_IMM,
    SEND_DONE,
    Backoff,
    Completion,
    PostRecv,
    ReadData,
    ReceiverEngine,
    SenderEngine,
)
from monarch_fs.daemon.wire.rdma_format import (
    HEADER_SIZE,
    MIN_SLOT_SIZE,
    RC,
    SRD,
    BulkProtocolError,
    Fragment,
    check_geometry,
    decode_credit,
    encode_credit,
    fragments,
    unwrap32,
)
from monarch_fs.daemon.wire.rdma_ring import CreditWindow, Reassembler, ReorderBuffer, Ring
from rdma_helpers import cid

CID = bytes(range(16))


# ---- ring, credits, reorder, reassembly ----------------------------------------------------------


def test_ring_releases_out_of_order_and_frees_slots_only_contiguously():
    ring = Ring(3)
    assert [ring.fill(f) for f in (0, 1, 2)] == [0, 1, 2]
    assert not ring.may_fill(3)  # slot 0 still holds fragment 0
    ring.release(1)
    assert ring.released == 0 and not ring.may_fill(3) and ring.is_free(1)
    ring.release(0)
    assert ring.released == 2 and ring.may_fill(3) and ring.may_fill(4) and not ring.may_fill(5)
    with pytest.raises(BulkProtocolError, match="outside the receive window"):
        ring.fill(1)  # already released: a replay
    with pytest.raises(ValueError):
        ring.release(7)


def test_credit_window_refuses_overrun_and_ignores_stale_counts():
    w = CreditWindow(2)
    assert (w.take(), w.take()) == (0, 1)
    assert w.available == 0
    with pytest.raises(RuntimeError, match="no credit"):
        w.take()
    assert w.grant(1) and w.available == 1
    assert not w.grant(1) and not w.grant(0)  # repeated, stale: ignored
    assert w.available == 1
    with pytest.raises(BulkProtocolError, match="only 2 were sent"):
        w.grant(3)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=80))
def test_credits_never_go_negative(slots, ops):
    """Any interleaving of takes and (possibly stale, repeated, reordered) grants keeps the
    credit count within [0, slots] and never lets fseq reach granted + slots."""
    w = CreditWindow(slots)
    for take, n in ops:
        if take:
            if w.available > 0:
                fseq = w.take()
                assert fseq < w.granted + slots
        else:
            try:
                w.grant(min(n, w.next))
            except BulkProtocolError:
                raise AssertionError("a count within what was sent is never refused") from None
        assert 0 <= w.available <= slots


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.randoms(use_true_random=False))
def test_reorder_buffer_delivers_any_arrival_order_in_order(n, rnd):
    order = list(range(n))
    rnd.shuffle(order)
    buf = ReorderBuffer(window=n)
    out = []
    for seq in order:
        out += [s for s, _ in buf.push(seq, f"item{seq}")]
    assert out == list(range(n)) and len(buf) == 0


def test_reorder_buffer_refuses_duplicates_and_out_of_window():
    buf = ReorderBuffer(window=2)
    assert buf.push(1, "b") == []
    with pytest.raises(BulkProtocolError, match="twice"):
        buf.push(1, "b")
    with pytest.raises(BulkProtocolError, match="outside"):
        buf.push(2, "c")  # 0 is still missing: the window is [0, 2)
    assert buf.push(0, "a") == [(0, "a"), (1, "b")]
    with pytest.raises(BulkProtocolError, match="outside"):
        buf.push(0, "a")  # already delivered


def test_fragment_header_round_trip_and_checks():
    f = Fragment(2**40 + 3, CID, 10_000, 4032, 4032)
    raw = f.encode()
    assert len(raw) == HEADER_SIZE and Fragment.decode(raw, 4032) == f
    with pytest.raises(BulkProtocolError, match="exceeds the slot"):
        Fragment.decode(raw, 1000)
    with pytest.raises(BulkProtocolError, match="magic"):
        Fragment.decode(b"XXXX" + raw[4:], 4032)
    with pytest.raises(BulkProtocolError, match="does not fit"):
        Fragment.decode(Fragment(0, CID, 100, 90, 20).encode(), 4032)
    with pytest.raises(BulkProtocolError, match="truncated"):
        Fragment.decode(raw[:10], 4032)
    assert decode_credit(encode_credit(2**33 + 1)) == 2**33 + 1
    with pytest.raises(BulkProtocolError):
        decode_credit(b"\0" * 64)


def test_fragments_cover_the_blob_exactly():
    assert fragments(CID, b"", 10) == [(0, 0)]
    assert fragments(CID, b"x" * 25, 10) == [(0, 10), (10, 10), (20, 5)]
    with pytest.raises(ValueError):
        fragments(b"short", b"x", 10)


def test_reassembler_refuses_fragments_that_do_not_continue():
    r = Reassembler()
    assert r.add(Fragment(0, CID, 6, 0, 3), b"abc") is None
    with pytest.raises(BulkProtocolError, match="does not continue"):
        r.add(Fragment(1, cid(9), 6, 3, 3), b"def")
    r2 = Reassembler()
    with pytest.raises(BulkProtocolError, match="starts mid-blob"):
        r2.add(Fragment(0, CID, 6, 3, 3), b"def")
    r3 = Reassembler()
    assert r3.add(Fragment(0, CID, 0, 0, 0), b"") == (CID, b"")


def test_unwrap32_recovers_counts_across_the_wrap():
    for ref in (0, 5, 2**32 - 3, 2**32 + 7, 3 * 2**32 + 2**31 - 1):
        for delta in (-1000, -1, 0, 1, 1000):
            value = ref + delta
            if value >= 0:
                assert unwrap32(value & 0xFFFFFFFF, ref) == value


def test_backoff_spins_then_doubles_to_a_cap_and_resets():
    b = Backoff(spins=2, low=1e-5, high=4e-5)
    assert [b.next_delay() for _ in range(6)] == [0.0, 0.0, 1e-5, 2e-5, 4e-5, 4e-5]
    b.reset()
    assert b.next_delay() == 0.0
    for _ in range(5000):  # a long idle wait stays at the cap (no float overflow)
        delay = b.next_delay()
    assert delay == 4e-5


def test_geometry_limits():
    check_geometry(16, 1 << 20)
    for slots, size in ((0, 4096), (2000, 4096), (4, 100), (4, 1 << 30), ("4", 4096),
                        (1024, 64 << 20)):
        with pytest.raises(BulkProtocolError):
            check_geometry(slots, size)


# ---- both modes over a simulated fabric ----------------------------------------------------------


class SimFabric:
    """Two rings of registered memory and the work in flight between a SenderEngine and a
    ReceiverEngine: two wires (one per direction) and two completion queues. Each step runs one
    pending event of a queue chosen by `rnd`; on RC each queue stays in order (RC delivers and
    completes in order) while queues interleave freely, on SRD any pending event of a queue may
    run next. Data lands in the receiver's ring when a wire event runs, but the receiver only
    learns of it when it polls that completion later, as on hardware.

    It counts overruns: a write landing in a receiver slot whose previous fragment has landed
    but was not released yet, or the sender reusing a local slot whose previous fragment has not
    left yet (RC: its write landed; SRD: the receiver's read of it was served)."""

    def __init__(self, mode: str, slots: int, slot_size: int, rnd: random.Random, start: int = 0):
        self.mode, self.slots, self.size, self.rnd = mode, slots, slot_size, rnd
        self.src = bytearray(slots * slot_size)
        self.dst = bytearray(slots * slot_size)
        self.sender = SenderEngine(mode, slots, slot_size, start=start)
        self.receiver = ReceiverEngine(mode, slots, slot_size, self._read_dst, start=start)
        self.wire_rx: deque = deque()  # sender -> receiver
        self.wire_tx: deque = deque()  # receiver -> sender
        self.cq_rx: deque = deque()  # completions the receiver has not polled yet
        self.cq_tx: deque = deque()
        self.delivered: list[tuple[bytes, bytes]] = []
        self.overruns = 0
        self.landed: dict[int, int] = {}  # receiver slot -> last fragment that landed in it
        self.src_slot: dict[int, int] = {}  # sender slot -> fragment copied into it
        self.gone: set[int] = set()  # fragments whose bytes left the sender's slot

    def _read_dst(self, slot: int, off: int, length: int) -> bytes:
        base = slot * self.size + off
        return bytes(self.dst[base : base + length])

    def _pick(self, q: deque):
        if self.mode == RC:
            return q.popleft()
        i = self.rnd.randrange(len(q))
        q.rotate(-i)
        ev = q.popleft()
        q.rotate(i)
        return ev

    def post(self) -> None:
        for w in self.sender.work():
            prev = self.src_slot.get(w.slot)
            if prev is not None and prev not in self.gone:
                self.overruns += 1  # overwrote bytes still waiting to be sent or read
            self.src_slot[w.slot] = w.fseq
            base = w.slot * self.size
            self.src[base : base + HEADER_SIZE] = w.header
            self.src[base + HEADER_SIZE : base + HEADER_SIZE + len(w.payload)] = w.payload
            if self.mode == RC:
                self.wire_rx.append(("write", w.slot, HEADER_SIZE + len(w.payload), w.fseq))
            else:
                self.wire_rx.append(("announce", bytes(w.header), w.fseq))
            assert self.sender.window.available >= 0

    def _land(self, slot: int, start: int, length: int, fseq: int) -> None:
        """Fragment `fseq` lands in receiver slot `slot` (RC: the write; SRD: the read)."""
        prev = self.landed.get(slot)
        if prev is not None and prev >= self.receiver.ring.released:
            self.overruns += 1  # its previous fragment was never released
        self.landed[slot] = fseq
        self.gone.add(fseq)
        base = slot * self.size
        self.dst[base + start : base + start + length] = self.src[base + start : base + start
                                                                   + length]

    def _rx(self, c: Completion, msg: bytes = b"") -> None:
        work, chunks = self.receiver.on_completion(c, msg)
        self.delivered += chunks
        for w in work:
            if isinstance(w, ReadData):
                self.wire_tx.append(("read", w.slot, w.length, w.fseq))
            else:
                assert isinstance(w, PostRecv)
        credit = self.receiver.credit()
        if credit is not None:
            self.wire_tx.append(("credit", credit.released))

    def step(self) -> bool:
        self.post()
        queues = [q for q in (self.wire_rx, self.wire_tx, self.cq_rx, self.cq_tx) if q]
        if not queues:
            return False
        q = self.rnd.choice(queues)
        ev = self._pick(q)
        kind = ev[0]
        if kind == "write":  # RC: the write lands; both sides get a completion
            _, slot, length, fseq = ev
            self._land(slot, 0, length, fseq)
            self.cq_rx.append(("rx", Completion(RECV_IMM, wr_id=slot, imm=slot), b""))
            self.cq_tx.append(("tx", Completion(SEND_DONE, wr_id=fseq)))
        elif kind == "announce":  # SRD: the header SEND arrives in a receive buffer
            _, header, fseq = ev
            self.cq_rx.append(("rx", Completion(RECV, wr_id=0), header))
            self.cq_tx.append(("tx", Completion(SEND_DONE, wr_id=fseq)))
        elif kind == "read":  # SRD: the sender's NIC serves the receiver's READ
            _, slot, length, fseq = ev
            self._land(slot, HEADER_SIZE, length, fseq)
            self.cq_rx.append(("rx", Completion(READ_DONE, wr_id=fseq), b""))
        elif kind == "credit":  # the credit SEND arrives; both sides get a completion
            self.cq_tx.append(("credit_recv", ev[1]))
            self.cq_rx.append(("rx", Completion(SEND_DONE), b""))
        elif kind == "rx":
            self._rx(ev[1], ev[2])
        elif kind == "tx":
            self.sender.on_completion(ev[1])
        elif kind == "credit_recv":
            self.sender.on_completion(Completion(RECV, wr_id=0))
            self.sender.on_credit(ev[1])
        assert self.sender.window.available >= 0
        return True

    def run(self, blobs: list[bytes], interleave: int) -> None:
        pending = list(enumerate(blobs))
        while pending or self.step():
            # submit a few chunks between steps, as concurrent send_chunk() calls would
            for _ in range(self.rnd.randint(0, interleave)):
                if pending:
                    i, blob = pending.pop(0)
                    self.sender.submit(cid(i), blob)
            if pending and not self.sender.queued:
                i, blob = pending.pop(0)
                self.sender.submit(cid(i), blob)


blob_lists = st.lists(st.binary(min_size=0, max_size=3 * MIN_SLOT_SIZE), min_size=1, max_size=12)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [RC, SRD])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 5), blobs=blob_lists, rnd=st.randoms(use_true_random=False),
       interleave=st.integers(0, 3))
def test_random_completion_orders_deliver_every_chunk_in_order(mode, slots, blobs, rnd,
                                                              interleave):
    sim = SimFabric(mode, slots, MIN_SLOT_SIZE, rnd)
    sim.run(blobs, interleave)
    assert sim.delivered == [(cid(i), b) for i, b in enumerate(blobs)]
    assert sim.overruns == 0, "the sender wrote a slot the receiver had not released"
    assert sim.sender.idle and sim.receiver.ring.occupied == 0
    assert sim.receiver.chunks_delivered == sim.sender.chunks_submitted == len(blobs)


@pytest.mark.parametrize("mode", [RC, SRD])
def test_simulation_detects_a_sender_that_ignores_credits(mode):
    """The overrun check is real: a sender whose window is forced open is caught."""
    sim = SimFabric(mode, 2, MIN_SLOT_SIZE, random.Random(1))
    sim.sender.window.granted = 10**6  # pretend the receiver released everything
    for i in range(6):
        sim.sender.submit(cid(i), b"y" * 100)
    sim.post()  # six fragments posted from a two-slot ring
    assert sim.overruns == 4
    with pytest.raises(BulkProtocolError, match="outside the receive window|written into slot"):
        while sim.step():  # and the receiver refuses what it cannot hold
            pass


def test_sequence_numbers_survive_the_32_bit_wrap():
    """Fragment numbers are 64-bit; start just below 2**32 to cross the wrap mid-transfer."""
    rnd = random.Random(7)
    sim = SimFabric(SRD, 3, MIN_SLOT_SIZE, rnd, start=2**32 - 5)
    blobs = [bytes([i]) * (i * 1500) for i in range(8)]
    sim.run(blobs, 2)
    assert sim.delivered == [(cid(i), b) for i, b in enumerate(blobs)]


def test_receiver_refuses_a_write_into_the_wrong_slot():
    mem = bytearray(2 * MIN_SLOT_SIZE)
    rx = ReceiverEngine(RC, 2, MIN_SLOT_SIZE, lambda s, o, n: bytes(
        mem[s * MIN_SLOT_SIZE + o : s * MIN_SLOT_SIZE + o + n]))
    mem[MIN_SLOT_SIZE : MIN_SLOT_SIZE + HEADER_SIZE] = Fragment(0, CID, 1, 0, 1).encode()
    with pytest.raises(BulkProtocolError, match="written into slot 1"):
        rx.on_completion(Completion(RECV_IMM, imm=1))
    with pytest.raises(BulkProtocolError, match="slot 5"):
        rx.on_completion(Completion(RECV_IMM, imm=5))


def test_completion_errors_stop_both_engines():
    tx = SenderEngine(RC, 2, MIN_SLOT_SIZE)
    tx.on_completion(Completion(SEND_DONE, ok=False, error="status 12 (vendor error 129)"))
    assert "status 12" in tx.error
    with pytest.raises(BulkProtocolError, match="status 12"):
        tx.submit(CID, b"x")
    rx = ReceiverEngine(SRD, 2, MIN_SLOT_SIZE, lambda *a: b"")
    rx.on_completion(Completion(READ_DONE, ok=False, error="remote access error"))
    assert rx.error == "completion error: remote access error"


# ---- the pyverbs enum shim -----------------------------------------------------------------------


def test_enum_shim_reads_the_rdma_core_44_layout():
    old = types.SimpleNamespace(IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WC_RECV=128)
    E = rdma_devices.Enums([old])
    assert E.IBV_WR_RDMA_WRITE_WITH_IMM == 1 and E.IBV_WC_RECV == 128
    with pytest.raises(AttributeError, match="IBV_NOPE"):
        E.IBV_NOPE  # noqa: B018 (the lookup is what raises)
    assert E.IBV_LINK_LAYER_ETHERNET == 2  # anonymous in 59's .pxd: the ABI value if unexported


def test_enum_shim_reads_the_pyverbs_59_layout():
    class ibv_wr_opcode(IntEnum):
        IBV_WR_RDMA_WRITE = 0
        IBV_WR_RDMA_WRITE_WITH_IMM = 1

    class ibv_access_flags(IntEnum):
        IBV_ACCESS_LOCAL_WRITE = 1
        IBV_ACCESS_REMOTE_WRITE = 2

    new = types.ModuleType("libibverbs_enums")
    new.ibv_wr_opcode, new.ibv_access_flags = ibv_wr_opcode, ibv_access_flags
    E = rdma_devices.Enums([new])
    assert E.IBV_WR_RDMA_WRITE_WITH_IMM == 1
    assert E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE == 3


def test_enum_shim_against_the_installed_pyverbs():
    ok, why = rdma_devices.pyverbs_available()
    if not ok:
        pytest.skip(why)
    E = rdma_devices.enums()
    assert E.IBV_WR_RDMA_WRITE_WITH_IMM == 1  # fixed by the verbs ABI
    assert E.IBV_WC_RECV_RDMA_WITH_IMM == 129 and E.IBV_QPT_RC == 2
    assert rdma_devices.efa_enums().EFADV_QP_DRIVER_TYPE_SRD == 0
