"""A proc's listener for direct calls: actors elsewhere that hold a reference to an actor mesh
(mesh_ref.py) connect here, authenticate with the mesh's peer token, and send calls, which go
into the actors' mailboxes like the owner's; the answers go back on the same connection, written
at once by whoever has them (an actor's thread, too) when nothing is queued ahead
(link_writer.py)."""

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
from .link_writer import LinkWriter
from .owner import HELLO_TIMEOUT, MESH_MAX_FRAME
from .tensor_buffer import read_reply

log = logging.getLogger("monarch_fs.mesh")
Deliver = Callable[[dict, p.Data, Callable[[p.Data], Awaitable[None]]], Awaitable[None]]


class PeerReply:
    """Where an actor's answer to a direct caller goes: from the loop (`await reply(msg)`) or
    from the actor's thread (`send_now`, False if something is queued ahead of it)."""

    def __init__(self, link: LinkWriter) -> None:
        self.link = link

    async def __call__(self, msg: p.Data) -> None:
        try:
            self.link.post(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def send_now(self, msg: p.Data) -> bool:
        return self.link.send_now(msg, wait=True)


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
        out, out_receive = trio.open_memory_channel[p.Data | None](math.inf)
        link = LinkWriter(chan, out.send_nowait)
        reply = PeerReply(link)

        async def writer() -> None:
            async for msg in out_receive:
                await link.write(msg)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
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
