"""Choosing a bulk transport (the device pairing, the fallback to TCP and what is said about
it, through the command line too) and driving each over a real channel pair: the TCP bulk
channel, and rdma.py with its endpoint over a fake verbs layer (tests/fake_pyverbs.py), without
hardware. The RDMA logic beneath (ring, credits, completion state machines): test_rdma_logic.py."""

from __future__ import annotations

import json
import random

import pytest
import trio

from monarch_fs.daemon.wire import bulk, rdma_devices
from monarch_fs.daemon.wire.rdma_format import RC, SRD, BulkProtocolError
from monarch_fs.daemon.wire.seal import ChunkSealer
from monarch_fs.daemon.wire.transport import RemoteError
from rdma_helpers import bulk_sending, channel_pair, cid, host_has_rdma, serve_bulk

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
