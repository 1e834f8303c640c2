"""Answer `read_chunks` (wire/chunk_read.py): the stored form of chunks of a version this node
serves, for `monarch-fs repro` on the dev box. Only of a version the node retains, and under
--identity munge only for the user who pushed the workspace (or root). The ids asked are not
checked against the version's: any chunk is readable by whoever may read some version's, as
any user on the node who may read the mount can read its files."""

from __future__ import annotations

from ...fs.chunk import CorruptChunk
from ...fs.store import Store
from ..wire.chunk_read import MAX_REPLY_BYTES, ChunksReply, ReadChunks
from ..wire.identity import Identity
from ..wire.requests import RequestError
from .publisher import Publisher


def check(publisher: Publisher, req: ReadChunks, asker: Identity | None) -> None:
    """RequestError unless `asker` may read chunks of `req.version` of `req.workspace`."""
    try:
        publisher.served_version(req.workspace, req.version)
    except LookupError as e:
        raise RequestError(f"read_chunks: {e}") from None
    owner = publisher.refs.owners.get(req.workspace)
    if asker is not None and asker.uid != 0 and owner != asker.uid:
        raise RequestError(f"read_chunks: workspace {req.workspace} was pushed by uid {owner}, "
                           f"not by you (uid {asker.uid})")


def read(store: Store, ids: list[bytes]) -> ChunksReply:
    """The blobs of `ids` this store holds, up to MAX_REPLY_BYTES (blocking)."""
    blobs: list[bytes | None] = []
    size = 0
    for cid in ids:
        blob = None
        if size < MAX_REPLY_BYTES and store.has(cid):
            try:
                blob = store.get_blob(cid)
            except (KeyError, CorruptChunk):  # collected meanwhile, or damaged: not here
                blob = None
        size += len(blob) if blob is not None else 0
        blobs.append(blob)
    return ChunksReply(blobs)
