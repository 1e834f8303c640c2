"""Answering a node's connections: the handshake, then a Session for each, while the service's
background work (events, flusher, processes) runs beside them.

Apart from service.py so that the service (what a node knows) does not import the session
(what a connection asks of it), which reads the service.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial

import trio

from ..wire.limits import peer_host, serve_listeners
from ..wire.transport import accept
from .events import EventLogHandler
from .procs import ProcessTable
from .service import NodeService, dial_addr
from .session import Session

log = logging.getLogger("monarch_fs.daemon")


async def serve(service: NodeService, listeners: list[trio.SocketListener], *,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer connections on `listeners` until cancelled, then stop every process this
    node started. Started (with the bound address) once connections are accepted."""
    if not service.addr:
        service.addr = dial_addr(*listeners[0].socket.getsockname()[:2])
    logs = logging.getLogger("monarch_fs")
    handler = EventLogHandler(service.events)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.events.run)
            if service.flusher is not None:
                await nursery.start(service.flusher.run)
            if service.events.enabled:
                logs.addHandler(handler)
            service.procs = ProcessTable(service.mount, nursery, events=service.events,
                                         allow_root=service.allow_root_procs)
            service.publisher.nursery = service.first_reads.nursery = nursery
            await nursery.start(serve_listeners, partial(_handle, service), listeners,
                                service.limits, log)
            log.info("%s", service.describe_procs())
            service.events.record("daemon.started", pid=os.getpid(), peer=service.addr,
                                  transport=service.transport.kind, text=str(service.mount),
                                  detail={"workspaces": {n: vs[0].hex() for n, vs in
                                                         service.refs.workspaces.items()}})
            task_status.started(service.addr)
    finally:
        if service.procs is not None:
            await service.procs.stop_all()  # no process outlives its daemon
        service.publisher.nursery = service.first_reads.nursery = None
        logs.removeHandler(handler)
        service.events.record("daemon.stopped", pid=os.getpid(),
                              seconds=round(time.time() - service.started, 3))
        await service.events.close()


async def _handle(service: NodeService, stream: trio.SocketStream) -> None:
    """One connection: the handshake (with the connection limits' timeout), then a
    Session. A broken client must never take the daemon down."""
    try:
        peer = "%s:%d" % stream.socket.getpeername()[:2]
    except OSError:
        peer = "?"
    try:
        info = {"node": service.node_name, "addr": service.addr,
                "max_entries": service.max_entries, "identity": service.identity,
                **service.transport.info()}
        chan = await accept(stream, service.token, info,
                            timeout=service.limits.handshake_timeout, encrypt=service.encrypt)
    except Exception as e:  # a line per peer address per minute, however many attempts
        if isinstance(e, trio.TooSlowError):
            why = f"no handshake within {service.limits.handshake_timeout:g}s"
        else:
            why = str(e) or type(e).__name__
        service.log_once(("handshake", peer_host(stream)), logging.WARNING,
                         "refused connection from %s: %s", peer, why)
        await trio.aclose_forcefully(stream)
        return
    try:
        await Session.serve(service, chan)
    except Exception as e:
        log.warning("connection from %s ended: %s", peer, e)
    finally:
        await chan.aclose()
