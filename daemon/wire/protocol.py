"""The wire protocol as a pure state machine (h11 style): bytes in, events out, no sockets.

Keeping I/O out makes the protocol fuzzable and shared by every transport. A frame is a header
(payload length u32, frame type u8) and a payload. Limits are checked from the header alone,
before any payload is buffered, so a peer cannot make us allocate by claiming a huge frame.

Chunk payloads are most of the bytes, so they are not copied on the way through: send_parts()
gives a frame as a list of buffers (a socket writes them with one sendmsg), and a large PUT_CHUNK
or DATA frame is received in place, into a buffer of its own that get_buffer() hands to
recv_into (the asyncio BufferedProtocol pattern); its payload arrives as a view of that buffer.

Handshake (mutual HMAC challenge-response; the token never crosses the wire):

    server -> Hello(version, server_nonce)
    client -> Auth(version, client_nonce, encrypt?,
                   HMAC(token, "monarch-fs client" + sn + cn + encrypt?))
    server -> Welcome(HMAC(token, "monarch-fs server" + cn + sn + encrypted), encrypted,
                      info)   [sealed]

From the Welcome on, every frame in either direction is sealed (seal.py): a GCM tag under a
key derived from the token and both nonces, one key per direction, the frame's sequence number
as nonce; a frame that fails its check ends the session (AuthError). The payloads are also
encrypted when the client asked for it or the server requires it; that choice is inside both
MACs, so a man in the middle cannot strip it.

Until a peer has authenticated, only handshake frames (and Error) of at most 4096 bytes are
accepted from it, into a 4 KiB receive buffer. Nothing here ever unpickles; JSON payloads are
shape-checked on receipt.

DATA frames carry opaque binary parts for the layer above (the actor mesh sends a header, a
pickle and the pickle's out-of-band buffers), so large buffers are framed without being copied
into one pickle first, and arrive as views into a single writable buffer.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .seal import TAG_SIZE, Opener, Sealer, SealError, derive_keys

PROTOCOL_VERSION = 2
MAX_FRAME = 80 * 1024 * 1024
MAX_HANDSHAKE_FRAME = 4096
NONCE_SIZE = 32
MAC_SIZE = 32
ID_SIZE = 16  # chunk ids, as fs.chunk.ID_SIZE
MAX_DATA_PARTS = 4096

_HEADER = struct.Struct("<IB")  # payload length, frame type
_VERSION = struct.Struct("<I")
_COUNT = struct.Struct("<I")  # DATA: number of parts, then one u64 length per part
_LENGTH = struct.Struct("<Q")
_CLIENT_LABEL = b"monarch-fs client"
_SERVER_LABEL = b"monarch-fs server"
_MAX_EARLY_ERROR = 500  # characters of an Error message sent during the handshake
IN_PLACE = 64 * 1024  # PUT_CHUNK and DATA frames this big are received into their own buffer
_SCRATCH = 256 * 1024  # what get_buffer() offers between large frames
_EARLY_SCRATCH = 4096  # ... and before the peer has authenticated
_FLAGS = struct.Struct("<B")  # AUTH: what the client asks for; WELCOME: what was agreed
_ENCRYPT = 1


class ProtocolError(Exception):
    """The peer (or the caller) broke the protocol; the connection cannot continue."""


class AuthError(ProtocolError):
    """The other side does not know the shared token."""


class TruncatedFrame(ProtocolError):
    """The peer closed the connection in the middle of a frame."""


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"  # the receive side is finished: EOF or a protocol error


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


@dataclass(frozen=True)
class Hello:
    version: int = PROTOCOL_VERSION
    nonce: bytes = b""  # filled by the server's Connection


@dataclass(frozen=True)
class Auth:
    version: int = PROTOCOL_VERSION
    nonce: bytes = b""  # filled by the client's Connection, as is the mac
    mac: bytes = b""


@dataclass(frozen=True)
class Welcome:
    mac: bytes = b""  # filled by the server's Connection
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    message: str
    code: str = "error"
    id: int | None = None  # the Request this answers, when it answers one


@dataclass(frozen=True)
class Request:
    op: str
    args: dict = field(default_factory=dict)
    id: int = 0


@dataclass(frozen=True)
class Reply:
    id: int
    value: dict = field(default_factory=dict)


@dataclass(frozen=True)
class QueryMissing:
    ids: list[bytes]


@dataclass(frozen=True)
class MissingIds:
    ids: list[bytes]


@dataclass(frozen=True)
class PutChunk:
    cid: bytes
    blob: bytes | memoryview


@dataclass(frozen=True)
class Event:
    kind: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Data:
    """Binary parts, opaque to this layer. Received parts are memoryviews into one writable
    bytearray per frame (so e.g. tensors can be rebuilt on them without another copy)."""

    parts: tuple[bytes | bytearray | memoryview, ...] | list

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Data) and len(self.parts) == len(other.parts)
                and all(bytes(a) == bytes(b) for a, b in zip(self.parts, other.parts)))


class NeedData:
    """Sentinel type: more bytes are needed before the next event."""


class Closed:
    """Sentinel type: the peer closed the connection cleanly, between frames."""


NEED_DATA = NeedData()
CLOSED = Closed()

Message = (
    Hello | Auth | Welcome | Error | Request | Reply | QueryMissing | MissingIds | PutChunk | Event
    | Data
)

_TYPES: dict[type, FrameType] = {
    Hello: FrameType.HELLO, Auth: FrameType.AUTH, Welcome: FrameType.WELCOME,
    Error: FrameType.ERROR, Request: FrameType.REQUEST, Reply: FrameType.REPLY,
    QueryMissing: FrameType.QUERY_MISSING, MissingIds: FrameType.MISSING_IDS,
    PutChunk: FrameType.PUT_CHUNK, Event: FrameType.EVENT, Data: FrameType.DATA,
}  # fmt: skip
# What may flow once both sides are authenticated; Event only goes server -> client.
_DATA = {FrameType.REQUEST, FrameType.REPLY, FrameType.QUERY_MISSING, FrameType.MISSING_IDS,
         FrameType.PUT_CHUNK, FrameType.DATA}  # fmt: skip
_READY_FROM = {Role.CLIENT: _DATA, Role.SERVER: _DATA | {FrameType.EVENT}}


def _mac(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


Buffer = bytes | bytearray | memoryview


def _frame(ftype: FrameType, *parts: Buffer) -> list[Buffer]:
    """A frame as the buffers to write, the payload parts not copied."""
    return [_HEADER.pack(sum(len(p) for p in parts), ftype), *parts]


def _json(obj: dict) -> bytes:
    # ASCII escapes keep any str encodable, even lone surrogates decoded from a peer's JSON.
    return json.dumps(obj, separators=(",", ":")).encode()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_json(ftype: FrameType, payload: bytes, shape: dict[str, Callable[[Any], bool]]) -> dict:
    """Decode a JSON object and check each required field, so no KeyError/TypeError escapes."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:  # includes UnicodeDecodeError, JSONDecodeError
        raise ProtocolError(f"{ftype.name} frame: malformed JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{ftype.name} frame: expected a JSON object")
    for key, ok in shape.items():
        if key not in obj or not ok(obj[key]):
            raise ProtocolError(f"{ftype.name} frame: missing or invalid field {key!r}")
    return obj


def _split_ids(ftype: FrameType, payload: bytes) -> list[bytes]:
    if len(payload) % ID_SIZE:
        raise ProtocolError(f"{ftype.name} frame: {len(payload)} bytes is not a list of ids")
    return [payload[i : i + ID_SIZE] for i in range(0, len(payload), ID_SIZE)]


def _split_data(payload: bytearray | memoryview) -> Data:
    if len(payload) < _COUNT.size:
        raise ProtocolError("DATA frame too short")
    (count,) = _COUNT.unpack_from(payload)
    if count > MAX_DATA_PARTS:
        raise ProtocolError(f"DATA frame: {count} parts exceed {MAX_DATA_PARTS}")
    offset = _COUNT.size + count * _LENGTH.size
    if offset > len(payload):
        raise ProtocolError("DATA frame: part table is truncated")
    lengths = [_LENGTH.unpack_from(payload, _COUNT.size + i * _LENGTH.size)[0]
               for i in range(count)]
    if offset + sum(lengths) != len(payload):
        raise ProtocolError("DATA frame: part lengths do not add up to the frame size")
    view = memoryview(payload)
    parts = []
    for n in lengths:
        parts.append(view[offset : offset + n])
        offset += n
    return Data(tuple(parts))


def _check_version(ftype: FrameType, payload: bytes) -> None:
    """Checked before the rest of the payload, whose layout may differ in other versions."""
    if len(payload) < _VERSION.size:
        raise ProtocolError(f"{ftype.name} frame too short")
    (version,) = _VERSION.unpack_from(payload)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks version {version}, we speak {PROTOCOL_VERSION}"
        )


class Connection:
    """One side of one connection. Feed received bytes with receive_data(), pull events with
    next_event(), and write out whatever send() returns."""

    def __init__(
        self,
        role: Role,
        token: bytes,
        *,
        encrypt: bool = False,
        max_frame: int = MAX_FRAME,
        nonce: Callable[[int], bytes] = os.urandom,
    ) -> None:
        """`encrypt`: a client asks for encrypted payloads, a server requires them."""
        self.role = role
        self.want_encrypt = encrypt
        self.encrypted = False  # what both sides agreed, known once the Welcome has passed
        self.bulk_key: bytes | None = None  # for chunks sent outside frames (seal.ChunkSealer)
        self._sealer: Sealer | None = None  # set once the session keys exist
        self._opener: Opener | None = None
        self.state = State.HANDSHAKE
        self.max_frame = max_frame
        self._token = bytes(token)
        self._nonce = nonce(NONCE_SIZE)
        self._peer_nonce: bytes | None = None
        self._sent: set[FrameType] = set()  # handshake frames we have sent
        self._buf = bytearray()
        self._frame: bytearray | None = None  # a large frame being received in place
        self._got = 0  # bytes of self._frame received so far
        self._scratch: memoryview | None = None  # get_buffer() between large frames
        self._eof = False
        self._error: ProtocolError | None = None

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: Message) -> bytes:
        """The bytes that carry `msg`. Raises ProtocolError if it may not be sent now."""
        return b"".join(self.send_parts(msg))

    def send_parts(self, msg: Message) -> list[Buffer]:
        """send(), as a list of buffers to write in order: a chunk's blob or a DATA part is one
        of them, not copied. Raises ProtocolError if `msg` may not be sent now."""
        ftype = _TYPES.get(type(msg))
        if ftype is None:
            raise TypeError(f"not a protocol message: {msg!r}")
        self._check_send(ftype)
        if isinstance(msg, Hello):
            data = _frame(ftype, _VERSION.pack(PROTOCOL_VERSION), self._nonce)
        elif isinstance(msg, Auth):
            flags = _FLAGS.pack(_ENCRYPT if self.want_encrypt else 0)
            mac = _mac(self._token, _CLIENT_LABEL, self._peer_nonce, self._nonce + flags)
            data = _frame(ftype, _VERSION.pack(PROTOCOL_VERSION), self._nonce, flags, mac)
        elif isinstance(msg, Welcome):
            flags = _FLAGS.pack(_ENCRYPT if self.encrypted else 0)
            mac = _mac(self._token, _SERVER_LABEL, self._peer_nonce, self._nonce + flags)
            data = _frame(ftype, mac, flags, _json(msg.info))
        elif isinstance(msg, Error):
            # Until the peer is past its handshake it takes 4096-byte frames at most.
            text = msg.message if self._peer_ready() else msg.message[:_MAX_EARLY_ERROR]
            obj: dict = {"message": text, "code": msg.code}
            if msg.id is not None:
                obj["id"] = msg.id
            data = _frame(ftype, _json(obj))
        elif isinstance(msg, Request):
            data = _frame(ftype, _json({"id": msg.id, "op": msg.op, "args": msg.args}))
        elif isinstance(msg, Reply):
            data = _frame(ftype, _json({"id": msg.id, "value": msg.value}))
        elif isinstance(msg, Event):
            data = _frame(ftype, _json({"kind": msg.kind, "data": msg.data}))
        elif isinstance(msg, (QueryMissing, MissingIds)):
            if any(len(i) != ID_SIZE for i in msg.ids):
                raise ProtocolError(f"{ftype.name}: ids must be {ID_SIZE} bytes")
            data = _frame(ftype, *msg.ids)
        elif isinstance(msg, Data):
            if len(msg.parts) > MAX_DATA_PARTS:
                raise ProtocolError(f"DATA: {len(msg.parts)} parts exceed {MAX_DATA_PARTS}")
            views = [memoryview(p).cast("B") for p in msg.parts]
            lengths = b"".join(_LENGTH.pack(v.nbytes) for v in views)
            data = _frame(ftype, _COUNT.pack(len(views)), lengths, *views)
        else:
            assert isinstance(msg, PutChunk)
            if len(msg.cid) != ID_SIZE:
                raise ProtocolError(f"PUT_CHUNK: chunk id must be {ID_SIZE} bytes")
            data = _frame(ftype, msg.cid, msg.blob)
        limit = self.max_frame if self._peer_ready() else MAX_HANDSHAKE_FRAME
        size = sum(len(part) for part in data) - _HEADER.size
        if self._sealer is not None:
            size += TAG_SIZE
        if size > limit:
            raise ProtocolError(f"{ftype.name} frame of {size} bytes exceeds the limit of {limit}")
        if ftype in (FrameType.HELLO, FrameType.AUTH, FrameType.WELCOME):
            self._sent.add(ftype)
        if self._sealer is not None:
            data = self._sealer.seal(_HEADER.pack(size, ftype), data[1:])
        if ftype is FrameType.AUTH:  # the client's keys: every later frame is sealed
            self._start_session(self._nonce, self._peer_nonce)
        elif ftype is FrameType.WELCOME:  # sealed as such; what follows in the agreed mode
            self._sealer.encrypt = self.encrypted
        return data

    def _start_session(self, client_nonce: bytes, server_nonce: bytes) -> None:
        c2s, s2c, self.bulk_key = derive_keys(self._token, client_nonce, server_nonce)
        mine, theirs = (c2s, s2c) if self.role is Role.CLIENT else (s2c, c2s)
        self._sealer, self._opener = Sealer(mine), Opener(theirs)

    def _peer_ready(self) -> bool:
        """Whether the peer has left (or, on reading what we send, will leave) its handshake."""
        return (FrameType.WELCOME if self.role is Role.SERVER else FrameType.AUTH) in self._sent

    def _check_send(self, ftype: FrameType) -> None:
        if ftype is FrameType.ERROR:
            return  # always allowed, also to explain why we are hanging up
        if self.state is State.CLOSED:
            raise ProtocolError(f"cannot send {ftype.name}: connection is closed")
        server = self.role is Role.SERVER
        if ftype in self._sent:
            ok = False
        elif ftype is FrameType.HELLO:
            ok = server and self.state is State.HANDSHAKE
        elif ftype is FrameType.AUTH:
            ok = not server and self._peer_nonce is not None
        elif ftype is FrameType.WELCOME:
            ok = server and self.state is State.READY
        else:
            welcomed = FrameType.WELCOME in self._sent if server else True
            ok = self.state is State.READY and welcomed and ftype in _READY_FROM[self.role]
        if not ok:
            who, now = self.role.value, self.state.value
            raise ProtocolError(f"{who} may not send {ftype.name} now ({now})")

    # -- receiving -------------------------------------------------------------------------

    def receive_data(self, data: Buffer) -> None:
        """Buffer bytes read from the peer; b"" means the peer closed its side."""
        if self._eof:
            if data:
                raise ProtocolError("data received after EOF")
            return
        if not data:
            self._eof = True
            return
        if self._frame is not None:  # the rest of a large frame first
            take = min(len(data), len(self._frame) - self._got)
            self._frame[self._got : self._got + take] = memoryview(data)[:take]
            self._got += take
            data = memoryview(data)[take:]
        if data:
            self._buf += data

    @property
    def in_frame(self) -> bool:
        """Whether a large frame is being received in place (get_buffer() is its rest)."""
        return self._frame is not None

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the peer may be written (by recv_into); then call
        buffer_updated(n). While a large frame arrives, this is the rest of its own buffer."""
        if self._frame is not None:
            return memoryview(self._frame)[self._got :]
        if self._scratch is None or (len(self._scratch) < _SCRATCH
                                     and self.state is State.READY):
            # Small until the peer has authenticated: an idle connection costs little.
            size = _SCRATCH if self.state is State.READY else _EARLY_SCRATCH
            self._scratch = memoryview(bytearray(size))
        return self._scratch

    def buffer_updated(self, n: int) -> None:
        """`n` bytes were written to the start of get_buffer()'s buffer; 0 means EOF."""
        if n and self._frame is not None and not self._eof:
            if n > len(self._frame) - self._got:
                raise ValueError("buffer_updated() past the end of get_buffer()")
            self._got += n
        else:
            self.receive_data(self._scratch[:n] if n else b"")

    def next_event(self) -> Message | NeedData | Closed:
        """The next complete message, NEED_DATA, or CLOSED. Raises ProtocolError (AuthError for
        a bad MAC); after that the connection is CLOSED and the error is raised again."""
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except ProtocolError as e:
            self.state = State.CLOSED
            self._error = e
            raise

    def _next_event(self) -> Message | NeedData | Closed:
        if self._frame is not None:
            if self._got < len(self._frame):
                if self._eof:
                    raise TruncatedFrame("connection closed mid-frame")
                return NEED_DATA
            frame, self._frame = self._frame, None
            _, raw_type = _HEADER.unpack_from(frame)
            ftype = FrameType(raw_type)
            return self._large(ftype, self._payload(ftype, memoryview(frame)))
        buf = self._buf
        if len(buf) < _HEADER.size:
            if not self._eof:
                return NEED_DATA
            if buf:
                raise TruncatedFrame("connection closed mid-frame")
            self.state = State.CLOSED
            return CLOSED
        size, raw_type = _HEADER.unpack_from(buf)
        try:
            ftype = FrameType(raw_type)
        except ValueError:
            raise ProtocolError(f"unknown frame type {raw_type}") from None
        limit = self.max_frame if self.state is State.READY else MAX_HANDSHAKE_FRAME
        if size > limit:
            raise ProtocolError(f"{ftype.name} frame of {size} bytes exceeds the limit of {limit}")
        self._check_receive(ftype)
        end = _HEADER.size + size
        if len(buf) < end:
            if self._eof:
                raise TruncatedFrame("connection closed mid-frame")
            if end >= IN_PLACE and ftype in (FrameType.PUT_CHUNK, FrameType.DATA):
                # Everything buffered is the start of this frame: move it to a buffer of the
                # frame's size and receive the rest straight into it.
                self._frame, self._got = bytearray(end), len(buf)
                self._frame[: len(buf)] = buf
                buf.clear()
            return NEED_DATA
        if ftype is FrameType.DATA:  # one copy out of the receive buffer, then views
            frame: memoryview = memoryview(buf[:end])
        else:  # one copy of the frame: a chunk's blob is a view of it
            with memoryview(buf) as view:  # bytes(buf[a:b]) would copy twice
                frame = memoryview(bytes(view[:end]))
        del buf[:end]
        payload = self._payload(ftype, frame)
        if ftype in (FrameType.PUT_CHUNK, FrameType.DATA):
            return self._large(ftype, payload)
        return self._parse(ftype, bytes(payload))

    def _payload(self, ftype: FrameType, frame: memoryview) -> memoryview:
        """A whole frame's payload, checked (and decrypted) when the session seals it."""
        if self._opener is None or (ftype is FrameType.ERROR and self.state is not State.READY
                                    and self.role is Role.CLIENT):
            # Unsealed: the handshake, and an Error that refuses it (a server that could not
            # authenticate us has no keys to seal it with).
            return frame[_HEADER.size :]
        if len(frame) < _HEADER.size + TAG_SIZE:
            raise ProtocolError(f"{ftype.name} frame too short to be sealed")
        try:
            return self._opener.open(frame, _HEADER.size)
        except SealError as e:
            raise AuthError(str(e)) from None

    def _large(self, ftype: FrameType, payload: memoryview) -> Message:
        """A PUT_CHUNK or DATA message on its payload, which it keeps as views."""
        if ftype is FrameType.DATA:
            # Parts must be writable (the mesh rebuilds tensors on them): a decrypted payload
            # is not.
            return _split_data(payload if not payload.readonly else bytearray(payload))
        if len(payload) < ID_SIZE:
            raise ProtocolError("PUT_CHUNK frame too short")
        return PutChunk(bytes(payload[:ID_SIZE]), payload[ID_SIZE:])

    def _check_receive(self, ftype: FrameType) -> None:
        if ftype is FrameType.ERROR:
            return
        server = self.role is Role.SERVER
        if self.state is State.READY:
            ok = ftype in _READY_FROM[Role.CLIENT if server else Role.SERVER]
        elif self.state is State.CLOSED:
            ok = False
        elif server:
            ok = ftype is FrameType.AUTH and FrameType.HELLO in self._sent
        elif ftype is FrameType.HELLO:
            ok = self._peer_nonce is None
        else:
            ok = ftype is FrameType.WELCOME and FrameType.AUTH in self._sent
        if not ok:
            raise ProtocolError(f"unexpected {ftype.name} frame from the peer ({self.state.value})")

    def _parse(self, ftype: FrameType, p: bytes) -> Message:
        if ftype is FrameType.HELLO:
            _check_version(ftype, p)
            if len(p) != _VERSION.size + NONCE_SIZE:
                raise ProtocolError("HELLO frame has the wrong size")
            self._peer_nonce = p[_VERSION.size :]
            return Hello(PROTOCOL_VERSION, self._peer_nonce)
        if ftype is FrameType.AUTH:
            _check_version(ftype, p)
            if len(p) != _VERSION.size + NONCE_SIZE + _FLAGS.size + MAC_SIZE:
                raise ProtocolError("AUTH frame has the wrong size")
            nonce = p[_VERSION.size : _VERSION.size + NONCE_SIZE]
            flags, mac = p[-MAC_SIZE - _FLAGS.size : -MAC_SIZE], p[-MAC_SIZE:]
            want = _mac(self._token, _CLIENT_LABEL, self._nonce, nonce + flags)
            if not hmac.compare_digest(mac, want):
                raise AuthError("authentication failed: wrong token")
            self._peer_nonce = nonce
            self.encrypted = self.want_encrypt or bool(flags[0] & _ENCRYPT)
            self._start_session(nonce, self._nonce)
            self._opener.encrypt = self.encrypted  # the client sends nothing before Welcome
            self.state = State.READY
            return Auth(PROTOCOL_VERSION, nonce, mac)
        if ftype is FrameType.WELCOME:
            if len(p) < MAC_SIZE + _FLAGS.size:
                raise ProtocolError("WELCOME frame too short")
            mac, flags = p[:MAC_SIZE], p[MAC_SIZE : MAC_SIZE + _FLAGS.size]
            want = _mac(self._token, _SERVER_LABEL, self._nonce, self._peer_nonce + flags)
            if not hmac.compare_digest(mac, want):
                raise AuthError("server failed to prove it knows the token")
            self.encrypted = bool(flags[0] & _ENCRYPT)
            if self.want_encrypt and not self.encrypted:
                raise AuthError("the server did not agree to encrypt the session")
            info = _parse_json(ftype, p[MAC_SIZE + _FLAGS.size :], {})
            self._sealer.encrypt = self._opener.encrypt = self.encrypted
            self.state = State.READY
            return Welcome(mac, info)
        if ftype is FrameType.ERROR:
            o = _parse_json(ftype, p, {"message": _str, "code": _str})
            if o.get("id") is not None and not _is_int(o["id"]):
                raise ProtocolError("ERROR frame: invalid field 'id'")
            return Error(o["message"], o["code"], o.get("id"))
        if ftype is FrameType.REQUEST:
            o = _parse_json(ftype, p, {"id": _is_int, "op": _str, "args": _dict})
            return Request(o["op"], o["args"], o["id"])
        if ftype is FrameType.REPLY:
            o = _parse_json(ftype, p, {"id": _is_int, "value": _dict})
            return Reply(o["id"], o["value"])
        if ftype is FrameType.EVENT:
            o = _parse_json(ftype, p, {"kind": _str, "data": _dict})
            return Event(o["kind"], o["data"])
        if ftype is FrameType.QUERY_MISSING:
            return QueryMissing(_split_ids(ftype, p))
        assert ftype is FrameType.MISSING_IDS
        return MissingIds(_split_ids(ftype, p))


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _dict(v: Any) -> bool:
    return isinstance(v, dict)
