"""Frames: how each message is laid out in bytes, and checked when it is read back.

A frame is a header (payload length u32, frame type u8) and a payload, so limits can be checked
from the header alone, before any payload is buffered (connection.py does). Payloads:

* Request, Reply, Error, Event (and Welcome's info): a JSON object, shape-checked on receipt so
  no KeyError or TypeError escapes to the layer above;
* QueryMissing, MissingIds, Want: chunk ids back to back;
* PutChunk: the chunk id, then the blob;
* PutChunks: a count (u32), (chunk id, blob length u32) per chunk, then the blobs;
* SealedChunk (a PutChunk that brings its own seal): the seal's nonce, the blob, the chunk id,
  the seal's tag (chunk_seals.py);
* Data: a part count (u32), one length (u64) per part, then the parts;
* Hello, Auth, Welcome: handshake.py.

Payload buffers are not copied on the way out: a frame is a list of buffers to write in order
(a socket writes them with one sendmsg). Nothing here ever unpickles.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable

from . import protocol as p

MAX_FRAME = 80 * 1024 * 1024
MAX_HANDSHAKE_FRAME = 4096  # what a peer may send before it has authenticated
MAX_DATA_PARTS = 4096
MAX_BATCH_CHUNKS = 4096  # chunks in one PUT_CHUNKS frame
MAX_EARLY_ERROR = 500  # characters of an Error message sent during the handshake

HEADER = struct.Struct("<IB")  # payload length, frame type
VERSION = struct.Struct("<I")
_COUNT = struct.Struct("<I")  # DATA: number of parts, then one u64 length per part
_LENGTH = struct.Struct("<Q")
_BATCH_ENTRY = struct.Struct("<16sI")  # PUT_CHUNKS: chunk id, blob length

Buffer = bytes | bytearray | memoryview


class FrameType(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    REQUEST = 5
    REPLY = 6
    QUERY_MISSING = 7
    MISSING_IDS = 8
    PUT_CHUNK = 9
    EVENT = 10
    DATA = 11
    WANT = 12
    PUT_CHUNKS = 13
    SEALED_CHUNK = 14


FRAME_TYPES: dict[type, FrameType] = {
    p.Hello: FrameType.HELLO, p.Auth: FrameType.AUTH, p.Welcome: FrameType.WELCOME,
    p.Error: FrameType.ERROR, p.Request: FrameType.REQUEST, p.Reply: FrameType.REPLY,
    p.QueryMissing: FrameType.QUERY_MISSING, p.MissingIds: FrameType.MISSING_IDS,
    p.PutChunk: FrameType.PUT_CHUNK, p.Event: FrameType.EVENT, p.Data: FrameType.DATA,
    p.Want: FrameType.WANT, p.PutChunks: FrameType.PUT_CHUNKS,
}  # fmt: skip
HANDSHAKE = (FrameType.HELLO, FrameType.AUTH, FrameType.WELCOME)
# payloads kept as views, maybe received in place
LARGE = (FrameType.PUT_CHUNK, FrameType.DATA, FrameType.PUT_CHUNKS, FrameType.SEALED_CHUNK)
_SEAL_NONCE, _SEAL_TAG = 16, 16  # a SEALED_CHUNK's (chunk_seals.py)

JsonShape = dict[str, Callable[[object], bool]]


def frame(ftype: FrameType, *parts: Buffer) -> list[Buffer]:
    """A frame as the buffers to write, the payload parts not copied."""
    return [HEADER.pack(sum(len(part) for part in parts), ftype), *parts]


def json_payload(obj: dict) -> bytes:
    # ASCII escapes keep any str encodable, even lone surrogates decoded from a peer's JSON.
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json(ftype: FrameType, payload: bytes, shape: JsonShape) -> dict:
    """Decode a JSON object and check each required field, so no KeyError/TypeError escapes."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:  # includes UnicodeDecodeError, JSONDecodeError
        raise p.ProtocolError(f"{ftype.name} frame: malformed JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise p.ProtocolError(f"{ftype.name} frame: expected a JSON object")
    for key, ok in shape.items():
        if key not in obj or not ok(obj[key]):
            raise p.ProtocolError(f"{ftype.name} frame: missing or invalid field {key!r}")
    return obj


def check_version(ftype: FrameType, payload: bytes) -> None:
    """Checked before the rest of the payload, whose layout may differ in other versions."""
    if len(payload) < VERSION.size:
        raise p.ProtocolError(f"{ftype.name} frame too short")
    (version,) = VERSION.unpack_from(payload)
    if version != p.PROTOCOL_VERSION:
        raise p.ProtocolError(
            f"protocol version mismatch: peer speaks version {version}, "
            f"we speak {p.PROTOCOL_VERSION}"
        )


# ---- the session's messages ------------------------------------------------------------------


def encode(msg: p.Message, *, early: bool) -> list[Buffer]:
    """The frame for any message but the handshake's. `early`: the peer is still in its
    handshake, so an Error must fit the 4096 bytes it accepts then."""
    if isinstance(msg, p.Error):
        text = msg.message[:MAX_EARLY_ERROR] if early else msg.message
        obj: dict = {"message": text, "code": msg.code}
        if msg.id is not None:
            obj["id"] = msg.id
        return frame(FrameType.ERROR, json_payload(obj))
    if isinstance(msg, p.Request):
        return frame(FrameType.REQUEST, json_payload({"id": msg.id, "op": msg.op,
                                                      "args": msg.args}))
    if isinstance(msg, p.Reply):
        return frame(FrameType.REPLY, json_payload({"id": msg.id, "value": msg.value}))
    if isinstance(msg, p.Event):
        return frame(FrameType.EVENT, json_payload({"kind": msg.kind, "data": msg.data}))
    if isinstance(msg, (p.QueryMissing, p.MissingIds, p.Want)):
        ftype = FRAME_TYPES[type(msg)]
        if any(len(i) != p.ID_SIZE for i in msg.ids):
            raise p.ProtocolError(f"{ftype.name}: ids must be {p.ID_SIZE} bytes")
        # One part, not one per id: each part is a step of the seal and of the write, and a
        # fresh node's answer of 43k missing ids took 0.1 s of its loop that way.
        return frame(ftype, b"".join(msg.ids))
    if isinstance(msg, p.Data):
        if len(msg.parts) > MAX_DATA_PARTS:
            raise p.ProtocolError(f"DATA: {len(msg.parts)} parts exceed {MAX_DATA_PARTS}")
        views = [memoryview(part).cast("B") for part in msg.parts]
        lengths = b"".join(_LENGTH.pack(v.nbytes) for v in views)
        return frame(FrameType.DATA, _COUNT.pack(len(views)), lengths, *views)
    if isinstance(msg, p.PutChunks):
        if len(msg.chunks) > MAX_BATCH_CHUNKS:
            raise p.ProtocolError(f"PUT_CHUNKS: {len(msg.chunks)} chunks exceed "
                                  f"{MAX_BATCH_CHUNKS}")
        if any(len(c.cid) != p.ID_SIZE for c in msg.chunks):
            raise p.ProtocolError(f"PUT_CHUNKS: chunk ids must be {p.ID_SIZE} bytes")
        table = b"".join(_BATCH_ENTRY.pack(c.cid, len(c.blob)) for c in msg.chunks)
        # The small blobs joined with the table: one part to seal and write, not one per chunk
        # (the copy, of under a MiB in the cache, costs less than the steps it saves).
        return frame(FrameType.PUT_CHUNKS, b"".join([_COUNT.pack(len(msg.chunks)), table,
                                                     *(c.blob for c in msg.chunks)]))
    if isinstance(msg, p.PutChunk):
        if len(msg.cid) != p.ID_SIZE:
            raise p.ProtocolError(f"PUT_CHUNK: chunk id must be {p.ID_SIZE} bytes")
        return frame(FrameType.PUT_CHUNK, msg.cid, msg.blob)
    raise TypeError(f"{type(msg).__name__} is a handshake message (see handshake.py)")


def decode(ftype: FrameType, payload: bytes) -> p.Message:
    """The message in a whole Error, Request, Reply, Event, QueryMissing, MissingIds or Want
    payload."""
    if ftype is FrameType.ERROR:
        o = parse_json(ftype, payload, {"message": _str, "code": _str})
        if o.get("id") is not None and not _is_int(o["id"]):
            raise p.ProtocolError("ERROR frame: invalid field 'id'")
        return p.Error(o["message"], o["code"], o.get("id"))
    if ftype is FrameType.REQUEST:
        o = parse_json(ftype, payload, {"id": _is_int, "op": _str, "args": _dict})
        return p.Request(o["op"], o["args"], o["id"])
    if ftype is FrameType.REPLY:
        o = parse_json(ftype, payload, {"id": _is_int, "value": _dict})
        return p.Reply(o["id"], o["value"])
    if ftype is FrameType.EVENT:
        o = parse_json(ftype, payload, {"kind": _str, "data": _dict})
        return p.Event(o["kind"], o["data"])
    if ftype is FrameType.QUERY_MISSING:
        return p.QueryMissing(_split_ids(ftype, payload))
    if ftype is FrameType.MISSING_IDS:
        return p.MissingIds(_split_ids(ftype, payload))
    if ftype is FrameType.WANT:
        return p.Want(_split_ids(ftype, payload))
    raise ValueError(f"{ftype.name} is not decoded here")


def decode_large(ftype: FrameType, payload: memoryview, digest: bytes | None = None
                 ) -> p.PutChunk | p.Data | p.PutChunks:
    """A PUT_CHUNK (or SEALED_CHUNK), PUT_CHUNKS or DATA message on its payload, which it keeps
    as views; `digest`: a PUT_CHUNK's, as it arrived (p.PutChunk.digest)."""
    if ftype is FrameType.PUT_CHUNKS:
        return _split_batch(payload)
    if ftype is FrameType.DATA:
        # Parts must be writable (the mesh rebuilds tensors on them): a decrypted payload
        # is not.
        return _split_data(payload if not payload.readonly else bytearray(payload))
    if ftype is FrameType.SEALED_CHUNK:  # its seals were checked as it arrived
        if len(payload) < _SEAL_NONCE + p.ID_SIZE + _SEAL_TAG:
            raise p.ProtocolError("SEALED_CHUNK frame too short")
        tail = len(payload) - p.ID_SIZE - _SEAL_TAG
        return p.PutChunk(bytes(payload[tail : tail + p.ID_SIZE]), payload[_SEAL_NONCE:tail],
                          digest, bytes(payload[:_SEAL_NONCE]) + bytes(payload[-_SEAL_TAG:]))
    if len(payload) < p.ID_SIZE:
        raise p.ProtocolError("PUT_CHUNK frame too short")
    return p.PutChunk(bytes(payload[:p.ID_SIZE]), payload[p.ID_SIZE:], digest)


def _split_ids(ftype: FrameType, payload: bytes) -> list[bytes]:
    if len(payload) % p.ID_SIZE:
        raise p.ProtocolError(f"{ftype.name} frame: {len(payload)} bytes is not a list of ids")
    return [payload[i : i + p.ID_SIZE] for i in range(0, len(payload), p.ID_SIZE)]


def _split_table(name: str, payload: memoryview, entry: struct.Struct, limit: int, item: str,
                 length: str) -> list[tuple[tuple, memoryview]]:
    """A PUT_CHUNKS or DATA payload: a count, a table of that many `entry` (each ending with a
    blob's length), then the blobs back to back. Each entry with a view of its blob, once the
    count is within `limit` and the lengths add up to the payload."""
    if len(payload) < _COUNT.size:
        raise p.ProtocolError(f"{name} frame too short")
    (count,) = _COUNT.unpack_from(payload)
    if count > limit:
        raise p.ProtocolError(f"{name} frame: {count} {item}s exceed {limit}")
    offset = _COUNT.size + count * entry.size
    if offset > len(payload):
        raise p.ProtocolError(f"{name} frame: {item} table is truncated")
    entries = [entry.unpack_from(payload, _COUNT.size + i * entry.size) for i in range(count)]
    if offset + sum(e[-1] for e in entries) != len(payload):
        raise p.ProtocolError(f"{name} frame: {length} lengths do not add up to the frame size")
    out = []
    for e in entries:
        out.append((e, payload[offset : offset + e[-1]]))
        offset += e[-1]
    return out


def _split_batch(payload: memoryview) -> p.PutChunks:
    table = _split_table("PUT_CHUNKS", payload, _BATCH_ENTRY, MAX_BATCH_CHUNKS, "chunk", "blob")
    return p.PutChunks(tuple(p.PutChunk(cid, blob) for (cid, _), blob in table))


def _split_data(payload: bytearray | memoryview) -> p.Data:
    table = _split_table("DATA", memoryview(payload), _LENGTH, MAX_DATA_PARTS, "part", "part")
    return p.Data(tuple(part for _, part in table))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(v: object) -> bool:
    return isinstance(v, str)


def _dict(v: object) -> bool:
    return isinstance(v, dict)
