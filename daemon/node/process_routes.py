"""The ops that start and stop a node's processes (spawn, kill, free_port, probe), for the
session's dispatch table: what `monarch-fs run` and the actor mesh ask (procs.py runs them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..wire import protocol as p
from ..wire.identity import Identity
from ..wire.process_calls import (
    FreePort,
    FreePortReply,
    Kill,
    KillReply,
    Probe,
    ProbeReply,
    Spawn,
    SpawnReply,
)
from ..wire.transport import Channel
from .procs import ProcessTable, SpawnRefused, free_port
from .publisher import Publisher


class _Session(Protocol):
    """What the handlers read of daemon/node/session.py's Session (not imported: it imports
    this module)."""

    procs: ProcessTable
    publisher: Publisher
    chan: Channel
    asker: Identity | None
    service: Any


async def _spawn(session: _Session, req: Spawn) -> SpawnReply:
    pin = None
    if req.workspace:
        try:
            version = session.publisher.served_version(req.workspace, req.version)
        except LookupError as e:
            raise SpawnRefused(str(e)) from None
        pin = str(session.service.mount / ".versions" / req.workspace / version.hex())

    async def emit(kind: str, data: dict) -> None:
        await session.chan.send(p.Event(kind, data))

    source = session.service.refs.sources.get(req.workspace) if pin else None
    return await session.procs.spawn(session.chan, emit, req.spec, pin,
                                     workspace=req.workspace if pin else "", who=session.asker,
                                     source=source)


async def _kill(session: _Session, req: Kill) -> KillReply:
    session.procs.kill(session.chan, req.proc, req.signal)
    return KillReply()


async def _free_port(session: _Session, req: FreePort) -> FreePortReply:
    return FreePortReply(free_port())


async def _probe(session: _Session, req: Probe) -> ProbeReply:
    return ProbeReply(req.size)


# The ops of this module, for session.py's dispatch table: (request class, handler).
ROUTES: list[tuple[Any, Callable[..., Any]]] = [
    (Spawn, _spawn), (Kill, _kill), (FreePort, _free_port), (Probe, _probe)]
