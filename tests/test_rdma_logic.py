"""The RDMA path's transport-independent logic, without hardware: the ring, credits, reordering,
reassembly, the completion state machines of both modes driven over a simulated fabric that
delivers completions in adversarial orders, the pyverbs enum shim, the transport choice, and the
TCP bulk channel over real sockets."""

from __future__ import annotations

import json
import random
import types
from collections import deque
from enum import IntEnum

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_fs.daemon.wire import bulk, rdma_devices
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
from monarch_fs.daemon.wire.seal import ChunkSealer
from monarch_fs.daemon.wire.transport import RemoteError
from rdma_helpers import bulk_sending, channel_pair, host_has_rdma, serve_bulk

CID = bytes(range(16))


def cid(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


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


# ---- choosing a transport ------------------------------------------------------------------------


def dev(name, kind, active=True, **kw):
    return {"name": name, "kind": kind, "port": 1, "active": active, **kw}


def test_choose_transport_pairs_devices_on_a_common_fabric():
    ib, roce = dev("mlx5_0", "ib"), dev("mlx5_1", "roce")
    efa = dev("efa0", "efa", rdma_read=True)
    assert bulk.choose_transport("auto", [ib], [ib])[0] == RC
    assert bulk.choose_transport("rdma", [roce, ib], [ib]) == (
        RC, "ib mlx5_0 to the peer's mlx5_0")
    assert bulk.choose_transport("auto", [efa], [efa])[0] == SRD
    assert bulk.choose_transport("tcp", [ib], [ib]) == ("tcp", "--transport tcp")


@pytest.mark.parametrize("local, peer, why", [
    ([], [dev("mlx5_0", "ib")], "no RDMA device on this host (pyverbs not installed)"),
    ([dev("mlx5_0", "ib")], None, "the peer offers no RDMA (its reason)"),
    ([dev("mlx5_0", "ib")], [dev("efa0", "efa", rdma_read=True)], "no common RDMA fabric"),
    ([dev("efa0", "efa", rdma_read=False)], [dev("efa0", "efa", rdma_read=True)],
     "does not advertise RDMA read"),
    ([dev("siw0", "iwarp")], [dev("siw0", "iwarp")], "iWARP (siw)"),
    ([dev("mlx5_0", "ib", active=False, state="down")], [dev("mlx5_0", "ib")], "is down"),
])
def test_auto_falls_back_to_tcp_and_rdma_refuses(local, peer, why):
    kind, reason = bulk.choose_transport("auto", local, peer, local_why="pyverbs not installed",
                                         peer_why="its reason")
    assert kind == "tcp" and why in reason
    with pytest.raises(bulk.TransportUnavailable, match=r"^--transport rdma: ") as e:
        bulk.choose_transport("rdma", local, peer, local_why="pyverbs not installed",
                              peer_why="its reason")
    assert why in str(e.value)
    with pytest.raises(ValueError, match="unknown transport"):
        bulk.choose_transport("infiniband", local, peer)


def test_resolve_local_probes_only_when_rdma_may_be_used():
    calls = []

    def probe():
        calls.append(1)
        return [], "ibv_get_device_list is empty"

    assert bulk.resolve_local("tcp", probe=probe).kind == "tcp" and not calls
    t = bulk.resolve_local("auto", probe=probe)
    assert (t.kind, t.reason) == ("tcp", "auto: no RDMA device on this host "
                                         "(ibv_get_device_list is empty)")
    assert t.info() == {"transport": "tcp", "transport_reason": t.reason}
    with pytest.raises(bulk.TransportUnavailable) as e:
        bulk.resolve_local("rdma", probe=probe)
    assert str(e.value) == ("--transport rdma: no RDMA device on this host "
                            "(ibv_get_device_list is empty)")
    up = bulk.resolve_local("rdma", probe=lambda: ([dev("mlx5_0", "roce", lid=0)], ""))
    assert up.kind == "rdma" and up.info()["rdma"] == [
        {"name": "mlx5_0", "kind": "roce", "port": 1, "active": True}]


def test_fallback_is_logged_once_for_all_nodes(caplog):
    choices = {f"h{i}:1": ("tcp", "no RDMA device on this host (x)") for i in range(5)}
    with caplog.at_level("INFO", logger="monarch_fs.transport"):
        bulk.log_choices(choices, "auto")
    assert len(caplog.records) == 1 and "all 5 nodes" in caplog.text
    assert caplog.records[0].levelname == "INFO"
    caplog.clear()
    with caplog.at_level("INFO", logger="monarch_fs.transport"):
        bulk.log_choices({"a:1": ("tcp", "the peer offers no RDMA (y)"), "b:1": (RC, "ib")},
                         "auto")
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "WARNING"
    assert "a:1" in caplog.text and "b:1" not in caplog.text


# ---- the TCP bulk channel: PutChunk frames over a real socket pair -------------------------------


async def test_tcp_bulk_channel_delivers_in_order_and_flush_counts():
    tx_chan, rx_chan = await channel_pair()
    got = []

    async def deliver(c, blob):
        got.append((c, blob))

    rx = bulk.TcpBulkReceiver(rx_chan, deliver)
    tx = bulk.TcpBulkSender(tx_chan)
    blobs = [bytes([i]) * (i * 1000) for i in range(20)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.run)
        for i, b in enumerate(blobs):
            await tx.send_chunk(cid(i), b)
        assert await tx.flush() == {}
        reply = await tx_chan.request("flush")
        assert reply == {"delivered": 20}
        assert await rx.wait_delivered(20) is None
        nursery.cancel_scope.cancel()
    assert got == [(cid(i), b) for i, b in enumerate(blobs)]
    assert tx.describe()["chunks_sent"] == 20 and rx.describe()["bytes_delivered"] == sum(
        map(len, blobs))


# ---- selection end to end: real daemons, the real command line -----------------------------------


@pytest.mark.mount
def test_transport_selection_through_the_command_line(fresh_cluster, tmp_path):
    """On a host without RDMA: `auto` falls back to TCP and says why (daemon log, status, push
    JSON); `--transport rdma` is a one-line error with exit 1 on daemon and push."""
    from helpers import mfs

    if host_has_rdma():
        pytest.skip("this host has an RDMA device: the fallback cannot be observed here")
    c = fresh_cluster(2)
    src = tmp_path / "app"
    src.mkdir()
    (src / "a.py").write_text("print(1)\n" * 1000)
    out = c.push_json(src)
    assert out["transport"] == "tcp" and out["nodes"] == 2
    for node in c.status():
        assert node["transport"] == "tcp"
        assert node["transport_reason"].startswith("auto: no RDMA device on this host (")
    log = (c.dir / "node-0" / "log").read_text()
    assert log.count("transport: tcp (auto: no RDMA device on this host") == 1
    text = mfs("status", "--hosts", c.hostfile, "--token-file", c.token_file).stdout
    assert text.count("transport tcp") == 2
    # -v shows push's one fallback line
    verbose = mfs("-v", "push", str(src), "--hosts", c.hostfile, "--token-file", c.token_file,
                  "--json")
    assert verbose.stderr.count("RDMA not used") == 1 and "all 2 nodes" in verbose.stderr
    assert json.loads(verbose.stdout)["transport"] == "tcp"
    tcp = c.push_json(src, "--transport", "tcp")
    assert tcp["transport"] == "tcp"

    bad = c.push(src, "--transport", "rdma", check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("monarch-fs: error: --transport rdma: no RDMA device on this "
                                 "host (")
    d = mfs("daemon", "--listen", "127.0.0.1:0", "--mount", str(tmp_path / "m"), "--state",
            str(tmp_path / "s"), "--token-file", c.token_file, "--transport", "rdma",
            check=False, timeout=30)
    assert d.returncode == 1 and "Traceback" not in d.stderr
    assert d.stderr.strip().splitlines()[-1].startswith(
        "monarch-fs: error: --transport rdma: no RDMA device on this host (")
    assert not (tmp_path / "s").exists()  # refused before touching anything


# ---- rdma.py and its endpoint, over a fake verbs layer (tests/fake_pyverbs.py) ------------------


FAKE_DEVICES = {RC: [dict(name="rxe0", link="eth")],
                SRD: [dict(name="efa0", efa=True, rdma_read=True)]}


@pytest.mark.parametrize("layout", ["44", "59"])
@pytest.mark.parametrize("mode", [RC, SRD])
async def test_rdma_driver_over_fake_verbs(monkeypatch, mode, layout):
    """rdma_endpoint.RdmaEndpoint, RdmaSender and RdmaReceiver, through bulk.open_sender() and
    accept_receiver(), on either pyverbs enum layout: small rings so credits run out, blobs
    spanning several slots, a slow receiver; every chunk arrives intact and in order."""
    import fake_pyverbs

    fabric = fake_pyverbs.install(monkeypatch, FAKE_DEVICES[mode], layout=layout, seed=3)
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOTS", "3")
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOT_SIZE", "8192")
    devices, why = rdma_devices.probe_devices()
    assert why == "" and [d["kind"] for d in devices] == [{RC: "roce", SRD: "efa"}[mode]]
    local = bulk.resolve_local("rdma")
    assert bulk.choose_for_peer(local, "auto", local.info())[0] == mode
    rnd = random.Random(4)
    blobs = [rnd.randbytes(rnd.choice([0, 1, 8128, 8129, 30_000])) for _ in range(25)]
    async with bulk_sending(mode, local, 0.001) as (sender, tx_chan, got):
        with trio.fail_after(30):
            for i, b in enumerate(blobs):
                await sender.send_chunk(cid(i), b)
            extra = await sender.flush()
            assert extra == {"bulk_chunks": 25}
            assert await tx_chan.request("flush", **extra) == {"error": None}
        assert got == [(cid(i), b) for i, b in enumerate(blobs)]
        assert sender.describe()["chunks_sent"] == 25
        await sender.aclose()
        with pytest.raises(bulk.BulkError, match="closed"):
            await sender.send_chunk(cid(99), b"after close")
    assert fabric.ops > 25  # fragments and credits really went through the verbs calls


async def test_rdma_chunks_that_fail_their_seal_are_refused(monkeypatch):
    """RDMA bytes bypass the session's sealed frames, so each chunk carries a seal under the
    session's bulk key: a chunk sealed under any other key (a forger's) is not delivered, and
    the flush reports the failure."""
    import fake_pyverbs

    fake_pyverbs.install(monkeypatch, FAKE_DEVICES[RC], seed=5)
    local = bulk.resolve_local("rdma")
    async with bulk_sending(RC, local) as (sender, tx_chan, got):
        with trio.fail_after(30):
            await sender.send_chunk(cid(1), b"sealed with the session's key")
            sender._sealer = ChunkSealer(b"f" * 32)  # what a forger without the key can do
            await sender.send_chunk(cid(2), b"forged")
            reply = await tx_chan.request("flush", **await sender.flush())
        assert got == [(cid(1), b"sealed with the session's key")]
        assert "failed authentication" in reply["error"]
        await sender.aclose()


async def test_rdma_refusals_over_fake_verbs(monkeypatch):
    """A node without RDMA refuses the bulk request; bad geometry is refused before any
    registration; the sender turns the refusal into a node error, not a crash."""
    import fake_pyverbs

    fake_pyverbs.install(monkeypatch, FAKE_DEVICES[RC])
    local = bulk.resolve_local("rdma")
    tcp_node = bulk.LocalTransport("tcp", "tcp", "--transport tcp")
    with pytest.raises(bulk.BulkRefused, match="does not offer RDMA"):
        bulk.accept_receiver(tcp_node, {"kind": RC}, None, None, b"k" * 32)
    with pytest.raises(BulkProtocolError, match="slots"):
        bulk.accept_receiver(local, {"kind": RC, "qp": {}, "slots": 10**6,
                                     "slot_size": 4096}, None, None, b"k" * 32)
    tx_chan, rx_chan = await channel_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_bulk, rx_chan, tcp_node, [], 0)
        with pytest.raises(RemoteError, match="does not offer RDMA"):  # push: that node failed
            await bulk.open_sender(tx_chan, RC, local, local.info())
        nursery.cancel_scope.cancel()


def test_probe_over_fake_verbs(monkeypatch):
    import fake_pyverbs

    fake_pyverbs.install(monkeypatch, [])
    assert rdma_devices.probe_devices() == ([], "ibv_get_device_list is empty")
    fake_pyverbs.install(monkeypatch, [dict(name="siw0", link="eth", iwarp=True),
                                       dict(name="mlx5_0", active=False),
                                       dict(name="efa0", efa=True, rdma_read=False)])
    devices, _ = rdma_devices.probe_devices()
    assert [(d["name"], d["kind"], d["active"]) for d in devices] == [
        ("siw0", "iwarp", True), ("mlx5_0", "ib", False), ("efa0", "efa", True)]
    with pytest.raises(bulk.TransportUnavailable) as e:
        bulk.resolve_local("rdma")
    msg = str(e.value)
    assert "iWARP (siw)" in msg and "mlx5_0 port 1 is not active" in msg
    assert "does not advertise RDMA read" in msg
