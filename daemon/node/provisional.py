"""The streaming ops of a push that sends new chunks while it scans (daemon/client/
scan_stream.py): `stream_file`, a session's provisional file objects (fs/provisional.py),
opened and declared window by window as a push streams a new large file, and dropped with the
session unless the push's manifest claimed them; and `stream_chunks`, a batch of small files'
chunks, for the packs. Both answer which chunks the node lacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

from ...fs.file_objects import FileObject
from ...fs.provisional import ProvisionalError, declare, drop, open_object
from ..wire.requests import RequestError
from ..wire.stream_file import StreamChunks, StreamFile, StreamFileReply
from .publisher import Publisher
from .writes import ChunkWrites


class _Session(Protocol):
    """What the handler reads of daemon/node/session.py's Session (not imported: it imports
    this module)."""

    service: Any
    publisher: Publisher
    writes: ChunkWrites
    nursery: trio.Nursery
    relay: Any
    claimed: bool
    own_missing: set[bytes] | None
    streamed: dict[int, FileObject]


async def _stream_file(session: _Session, req: StreamFile) -> StreamFileReply:
    service = session.service
    if not service.store_raw:
        raise RequestError("stream_file: this node stores chunks compressed "
                           "(--store-compressed), not in file objects")
    if session.relay is not None:
        raise RequestError("stream_file: this session relays to other nodes")
    objects = service.store.objects
    obj = session.streamed.get(req.file)
    try:
        if obj is None:
            if req.first != 0:
                raise ProvisionalError(f"file {req.file} was never opened")
            obj = session.streamed[req.file] = open_object(objects, req.size)
        elif obj.size != req.size:
            raise ProvisionalError(f"file {req.file} is {obj.size} bytes, not {req.size}")
        declare(objects, obj, req.first, req.ids, req.chunk_size)
    except ProvisionalError as e:
        raise RequestError(f"stream_file: {e}") from None
    return await _lacking(session, req.ids)


async def _stream_chunks(session: _Session, req: StreamChunks) -> StreamFileReply:
    if session.relay is not None:  # its children were not asked
        raise RequestError("stream_chunks: this session relays to other nodes")
    return await _lacking(session, req.ids)


async def _lacking(session: _Session, ids: list[bytes]) -> StreamFileReply:
    """Which of `ids` the node lacks; the session now stores them when they come, and holds
    off a collection until its commit."""
    async with session.publisher.collection.lock:  # (publisher.missing, without its thread
        own = session.service.store.missing(ids)    # hop: one question per run of chunks)
    if not session.claimed:  # no collect between "what do you lack" and the commit
        session.claimed = True
        session.publisher.collection.claim()
    if session.own_missing is not None:
        session.own_missing.update(own)
    return StreamFileReply(own)


async def close(session: _Session) -> None:
    """The session ended: its provisional objects no manifest claimed go, once no write of
    its chunks is still running (a write would index a chunk of a dropped object)."""
    if session.streamed:
        await session.writes.idle(session.nursery)
        await trio.to_thread.run_sync(drop, session.service.store.objects,
                                      list(session.streamed.values()))
        session.streamed.clear()


ROUTES: list[tuple[Any, Callable[..., Any]]] = [(StreamFile, _stream_file),
                                                (StreamChunks, _stream_chunks)]
