"""A proc's listener for direct calls: actors elsewhere that hold a reference to an actor mesh
(mesh_ref.py) connect here, authenticate with the mesh's peer token, and send calls, which go
into the actors' mailboxes like the owner's; the answers go back on the same connection."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.addresses import format_addr
from ..daemon.wire.limits import Limits, serve_listeners
from ..daemon.wire.transport import accept
from . import wire
from .owner import HELLO_TIMEOUT, MESH_MAX_FRAME
from .tensor_buffer import read_reply

log = logging.getLogger("monarch_fs.mesh")
Deliver = Callable[[dict, p.Data, Callable[[p.Data], Awaitable[None]]], Awaitable[None]]


async def serve_peers(token: bytes, host: str, info: dict, deliver: Deliver,
                      task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on `host` (a fresh port); started() with the address peers connect to."""
    listener = (await trio.open_tcp_listeners(0, host=host))[0]
    addr = format_addr(host, listener.socket.getsockname()[1])

    async def connection(stream: trio.SocketStream) -> None:
        try:
            chan = await accept(stream, token, info, timeout=HELLO_TIMEOUT)
        except Exception:
            return  # not a holder of the peer token, or broken
        chan.conn.max_frame = MESH_MAX_FRAME
        out, out_receive = trio.open_memory_channel[p.Data](math.inf)

        async def reply(msg: p.Data) -> None:
            try:
                out.send_nowait(msg)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wire.forward, chan, out_receive)
            async for h, msg in wire.messages(chan):
                if h["op"] == "call":  # direct callers call; spawning and stopping are the owner's
                    await deliver(h, msg, reply)
                elif h["op"] == "buffer_read":  # a TensorBuffer of this proc
                    await reply(read_reply(h))
            nursery.cancel_scope.cancel()
        out.close()
        await trio.aclose_forcefully(chan.stream)

    limits = Limits(max_connections=4096, max_per_peer=1024, handshake_timeout=HELLO_TIMEOUT)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, connection, [listener], limits, log)
        task_status.started(addr)
