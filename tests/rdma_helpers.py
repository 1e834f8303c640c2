"""What the RDMA tests share (test_rdma_logic's simulated fabric, test_bulk_transports over fake
verbs, test_rdma_hw on a real device, test_run's transport checks): test chunk ids, an
authenticated channel pair, the node side of a bulk transfer, a sender talking to it, and
whether this host has a usable RDMA device.

A helper, not a test file: `from rdma_helpers import ...` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from monarch_fs.daemon.wire import bulk, rdma_devices
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.connection import Connection, Role
from monarch_fs.daemon.wire.transport import Channel


def cid(i: int) -> bytes:
    """A chunk id for test chunk `i`."""
    return i.to_bytes(4, "little") * 4


def host_has_rdma() -> bool:
    devices, _ = rdma_devices.probe_devices()
    return any(bulk.device_mode(d)[0] for d in devices)


async def channel_pair(encrypt: bool = False) -> tuple[Channel, Channel]:
    """Two ends of a socket pair past the handshake: (client side, server side)."""
    s1, s2 = trio.socket.socketpair()
    a = Channel(trio.SocketStream(s1), Connection(Role.CLIENT, b"t", encrypt=encrypt), "node")
    b = Channel(trio.SocketStream(s2), Connection(Role.SERVER, b"t", encrypt=encrypt), "client")
    await b.send(p.Hello())
    await a.receive()
    await a.send(p.Auth())
    await b.receive()
    await b.send(p.Welcome())
    await a.receive()
    return a, b


async def serve_bulk(chan: Channel, local: bulk.LocalTransport, got: list, slow: float = 0.0,
                     *, stop_after_flush: bool = False) -> None:
    """What NodeDaemon._session does with "bulk" and "flush", and nothing else: every delivered
    chunk is appended to `got` as (cid, blob), after `slow` seconds (a slow store: the sender
    must wait for credits); a refused bulk request is answered with an error. Runs until
    cancelled, or, with stop_after_flush, returns once the first flush is answered (closing the
    receiver first)."""
    async def deliver(cid: bytes, blob: bytes) -> None:
        if slow:
            await trio.sleep(slow)
        got.append((cid, blob))

    rx = None
    async with trio.open_nursery() as nursery:
        try:
            while True:
                msg = await chan.receive()
                if msg.op == "bulk":
                    try:
                        rx, value = bulk.accept_receiver(local, msg.args, deliver, nursery,
                                                            chan.conn.bulk_key)
                    except Exception as e:
                        await chan.send(p.Error(f"bulk: {e}", code="refused", id=msg.id))
                    else:
                        await chan.send(p.Reply(msg.id, value))
                elif msg.op == "flush":
                    err = await rx.wait_delivered(msg.args["bulk_chunks"])
                    await chan.send(p.Reply(msg.id, {"error": err}))
                    if stop_after_flush:
                        return
        finally:
            if rx is not None:
                await rx.aclose()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def bulk_sending(mode: str, local: bulk.LocalTransport, slow: float = 0.0
                       ) -> AsyncIterator[tuple[bulk.BulkSender, Channel, list]]:
    """A bulk sender of `mode` over a fresh channel pair whose node end runs serve_bulk (with
    `slow`): (the sender, its channel, the chunks the node got); the node end stops with the
    block."""
    tx_chan, rx_chan = await channel_pair()
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_bulk, rx_chan, local, got, slow)
        yield await bulk.open_sender(tx_chan, mode, local, local.info()), tx_chan, got
        nursery.cancel_scope.cancel()
