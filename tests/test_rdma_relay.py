"""A relay hop over RDMA, through the fake verbs (tests/fake_pyverbs.py): a push along a chain
dev box -> A -> B -> C where every hop's bulk channel is rdma.py's RdmaSender/RdmaReceiver.

Why not real daemon processes: the fake fabric is in-process memory (its memory regions are
bytearrays, its queue pairs live in a dict), so every end of every queue pair must live in this
one process; and one process can serve only one FUSE mount (pyfuse3's state is global), so three
`NodeDaemon.run()`s cannot share it. The highest level that is possible is what runs here: three
real `NodeService`s (the whole node but its mount: sessions, store, refs, publisher, process
table, relay.py and bulk.py), each served by `serve` (daemon/node/serve.py) on its own loopback TCP
listener, driven by the real push client (`push()`), with pyverbs replaced by the fake. Only
`NodeDaemon` is left out (the FUSE mount, signal handling, the ready file). Control messages go
over real TCP; chunk payloads go through the fake fabric on every hop, which the test checks
rather than assumes.
"""
from __future__ import annotations

import random
import re
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from monarch_fs.daemon.client.push import push
from monarch_fs.daemon.client.push_options import PushOptions
from monarch_fs.daemon.client.push_result import PushError
from monarch_fs.daemon.node.serve import serve
from monarch_fs.daemon.node.service import NodeService, open_listeners
from monarch_fs.daemon.wire import bulk, rdma
from monarch_fs.daemon.wire.rdma_engines import SenderEngine
from monarch_fs.daemon.wire.rdma_format import HEADER_SIZE, RC, SRD
from monarch_fs.daemon.wire.rdma_ring import Ring
from monarch_fs.fs import chunk
from monarch_fs.mesh.loop import service_nursery

TOKEN = b"relay-test-token-0123456789abcdef"
SLOTS = 2
SLOT_SIZE = 8192
FAKE_DEVICES = {RC: [dict(name="rxe0", link="eth")],
                SRD: [dict(name="efa0", efa=True, rdma_read=True)]}


@asynccontextmanager
async def serving(tmp_path: Path, n: int, local: bulk.LocalTransport):
    """n NodeServices in this process, each answering on 127.0.0.1:<a free port>; all stopped
    (every session closed, every RDMA channel released) when the block ends."""
    async with service_nursery() as nursery:  # the servers end with the block
        nodes = []
        for i in range(n):
            d = NodeService(state=tmp_path / f"node-{i}" / "state",
                            mount=tmp_path / f"node-{i}" / "mnt", token=TOKEN,
                            node_name=f"node-{i}", transport=local)
            listeners, _ = await open_listeners("127.0.0.1:0")
            await nursery.start(serve, d, listeners)
            nodes.append(d)
        yield nodes


def _source(tmp_path: Path) -> dict[str, bytes]:
    """Incompressible files (so blobs are as large as the data): empty, one byte, exactly one
    slot's payload, just over it, and several spanning many slots."""
    rnd = random.Random(7)
    payload = SLOT_SIZE - HEADER_SIZE
    sizes = [0, 1, payload, payload + 1, 30_000, 100_000, 250_000] + [rnd.randrange(1, 50_000)
                                                                      for _ in range(12)]
    files = {f"f{i:02d}.bin": rnd.randbytes(size) for i, size in enumerate(sizes)}
    src = tmp_path / "app"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    return files


@pytest.fixture
def instrumented(monkeypatch):
    """Which bulk channels were opened to whom, and evidence about credits: how often a sender
    found its credit window empty with fragments still queued (it had to wait for the
    receiver), and how far ahead of the receiver's released count any fragment landed (a write
    beyond the ring would raise in Ring.fill and fail the push)."""
    seen = {"channels": [], "stalls": 0, "ahead": 0, "fills": 0}
    connect = rdma.RdmaSender.connect.__func__

    async def recording_connect(cls, chan, mode, dev):
        sender = await connect(cls, chan, mode, dev)
        seen["channels"].append((chan.peer, mode, sender))
        return sender

    work = SenderEngine.work

    def counting_work(self):
        out = work(self)
        if self._queue and self.window.available == 0:
            seen["stalls"] += 1
        return out

    fill = Ring.fill

    def checking_fill(self, fseq):
        seen["ahead"] = max(seen["ahead"], fseq - self.released + 1)
        seen["fills"] += 1
        return fill(self, fseq)

    monkeypatch.setattr(rdma.RdmaSender, "connect", classmethod(recording_connect))
    monkeypatch.setattr(SenderEngine, "work", counting_work)
    monkeypatch.setattr(Ring, "fill", checking_fill)
    return seen


def _fake_rdma(monkeypatch, mode: str):
    import fake_pyverbs

    fabric = fake_pyverbs.install(monkeypatch, FAKE_DEVICES[mode], seed=5)
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOTS", str(SLOTS))
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOT_SIZE", str(SLOT_SIZE))
    local = bulk.resolve_local("rdma")
    assert local.kind == "rdma"
    return fabric, local


@pytest.mark.parametrize("mode", [RC, SRD])
async def test_chain_relays_over_rdma_hops(monkeypatch, tmp_path, instrumented, mode):
    """dev box -> A -> B -> C, every hop RDMA (tiny rings, so credits run out all the time):
    every node ends with every chunk, verified against its id, and the version published;
    A and B forwarded everything; the senders waited for credit and no fragment ever landed
    outside the receiver's window."""
    fabric, local = _fake_rdma(monkeypatch, mode)
    files = _source(tmp_path)
    async with serving(tmp_path, 3, local) as nodes:
        a, b, c = nodes
        with trio.fail_after(60):
            result = await push(tmp_path / "app", [d.addr for d in nodes], TOKEN,
                                PushOptions(topology="chain", transport=local, timeout=20))
        assert result.topology == "chain" and result.nodes == 3
        assert result.transport == mode
        # The dev box sent to A only; A relayed to B and B to C, each over an RDMA channel.
        assert [(peer, m) for peer, m, _ in instrumented["channels"]] == [
            (a.addr, mode), (b.addr, mode), (c.addr, mode)]
        n = result.chunks_total + 1  # and the manifest
        for peer, _, sender in instrumented["channels"]:
            assert sender.describe()["chunks_sent"] == n, peer
        assert (a.counters["chunks_forwarded"], b.counters["chunks_forwarded"],
                c.counters["chunks_forwarded"]) == (n, n, 0)
        for d in nodes:
            assert d.counters["chunks_received"] == n
            assert d.refs.workspaces["app"][0].hex() == result.version
            for name, data in files.items():
                if data:  # an empty file has no chunk
                    assert d.store.get(chunk.chunk_id(data)) == data, (d.node_name, name)
    assert instrumented["stalls"] > 0  # the credit window really was the limit
    assert 0 < instrumented["ahead"] <= SLOTS
    assert instrumented["fills"] >= 3 * n
    assert fabric.ops > 3 * n  # fragments and credits went through the verbs calls


@pytest.mark.parametrize("mode", [RC, SRD])
async def test_a_broken_rdma_hop_is_reported_naming_the_host(monkeypatch, tmp_path,
                                                              instrumented, mode):
    """The B -> C queue pair breaks (the fake completes its sends with retry-exceeded): the
    push fails naming C (not A or B, whose hops work), and no node publishes."""
    fabric, local = _fake_rdma(monkeypatch, mode)
    _source(tmp_path)
    async with serving(tmp_path, 3, local) as nodes:
        a, b, c = nodes
        connect = rdma.RdmaSender.connect.__func__

        async def breaking_connect(cls, chan, mode, dev):
            sender = await connect(cls, chan, mode, dev)
            if chan.peer == c.addr:
                fabric.broken.add(sender.ep.qp.qp_num)
            return sender

        monkeypatch.setattr(rdma.RdmaSender, "connect", classmethod(breaking_connect))
        with trio.fail_after(60):
            with pytest.raises(PushError) as e:
                await push(tmp_path / "app", [d.addr for d in nodes], TOKEN,
                           PushOptions(topology="chain", transport=local, timeout=20))
        assert fabric.broken, "the B -> C channel was never opened"
        assert e.value.stage == "sending chunks"
        assert list(e.value.failures) == [c.addr]
        cause = e.value.failures[c.addr]
        # retry exceeded (12); on SRD, whose CQ reorders, possibly a later send's flush (5)
        status = "12" if mode == RC else "(12|5)"
        assert re.fullmatch(rf"rdma: completion error: status {status} \(vendor error 0\)",
                            cause), cause
        assert f"  {c.addr}: rdma: completion error" in str(e.value)
        assert "nothing was published" in str(e.value)
        for d in nodes:
            assert "app" not in d.refs.workspaces
        # B received everything over its own (working) RDMA hop and kept it for the next push.
        assert b.counters["chunks_received"] == a.counters["chunks_received"] > 0
