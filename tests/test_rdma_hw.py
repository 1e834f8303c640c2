"""RDMA on real hardware: RC over InfiniBand/RoCE (Soft-RoCE rxe counts), SRD over EFA.

Skipped, with the reason, where pyverbs is missing or ibv_get_device_list is empty (machines
without RDMA, like the development VMs). On an RDMA host: `pytest -m rdma tests/test_rdma_hw.py`.
"""

from __future__ import annotations

import json
import os
import random
from functools import partial

import pytest
import trio

from monarch_fs.daemon.wire import bulk, rdma_devices
from rdma_helpers import channel_pair, serve_bulk


def _skip_reason() -> str | None:
    ok, why = rdma_devices.pyverbs_available()
    if not ok:
        return why  # "pyverbs not installed"
    devices, why = rdma_devices.probe_devices()
    if not devices:
        return f"no RDMA device ({why})"  # "no RDMA device (ibv_get_device_list is empty)"
    if not any(bulk.device_mode(d)[0] for d in devices):
        return "no usable RDMA device (" + "; ".join(bulk.device_mode(d)[1] for d in devices) + ")"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _modes() -> list[str]:
    local = bulk.resolve_local("rdma") if _REASON is None else None
    if local is None:
        return [bulk.RC]
    return sorted({bulk.device_mode(d)[0] for d in local.devices})


def test_probe_describes_the_devices():
    devices, why = rdma_devices.probe_devices()
    assert devices and why == ""
    for d in devices:
        assert d["kind"] in ("ib", "roce", "efa", "iwarp") and d["port"] >= 1
    local = bulk.resolve_local("rdma")
    assert local.kind == "rdma" and local.info()["rdma"]


@pytest.mark.parametrize("slots, slow", [(16, 0.0), (2, 0.002)])
async def test_loopback_channel_moves_chunks_intact_and_in_order(slots, slow, monkeypatch):
    """One process, both ends on this host's device: fragments across slots, credits when the
    receiver is slow, flush semantics. Every mode the device supports."""
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOTS", str(slots))
    monkeypatch.setenv("MONARCH_FS_RDMA_SLOT_SIZE", str(256 * 1024))
    local = bulk.resolve_local("rdma")
    rnd = random.Random(5)
    blobs = [rnd.randbytes(rnd.choice([0, 1, 1000, 256 * 1024 - 64, 700_000, 3 << 20]))
             for _ in range(40)]
    for mode in _modes():
        tx_chan, rx_chan = await channel_pair()
        got: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(serve_bulk, rx_chan, local, got, slow,
                                       stop_after_flush=True))
            sender = await bulk.open_sender(tx_chan, mode, local, local.info())
            assert sender.kind == mode
            with trio.fail_after(60):
                for i, b in enumerate(blobs):
                    await sender.send_chunk(i.to_bytes(16, "little"), b)
                extra = await sender.flush()
                assert extra == {"bulk_chunks": len(blobs)}
                assert (await tx_chan.request("flush", **extra)) == {"error": None}
            await sender.aclose()
        assert got == [(i.to_bytes(16, "little"), b) for i, b in enumerate(blobs)]


@pytest.mark.mount
def test_push_to_daemons_over_rdma(fresh_cluster, tmp_path):
    """Real daemons (default --transport auto, so they offer RDMA here) and a real push with
    --transport rdma: the payload goes over the fabric, the mount serves it."""
    from helpers import mfs

    c = fresh_cluster(2)
    src = tmp_path / "app"
    src.mkdir()
    data = os.urandom(9 << 20)  # three 4 MiB chunks
    (src / "big.bin").write_bytes(data)
    (src / "a.py").write_text("print(1)\n")
    out = c.push_json(src, "--transport", "rdma", "--topology", "star")
    assert out["transport"] in ("rdma-rc", "rdma-srd")
    for i in range(2):
        assert (c.mnt(i) / "app" / "big.bin").read_bytes() == data
    for node in c.status():
        assert node["transport"] == "rdma"
    text = mfs("status", "--hosts", c.hostfile, "--token-file", c.token_file).stdout
    assert text.count("transport rdma") == 2
    again = json.loads(c.push(src, "--transport", "rdma").stdout)
    assert again["chunks_sent"] == 0
