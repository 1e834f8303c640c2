"""The wire protocol's vocabulary: every message two peers exchange, and how it can fail.

A message is a small frozen dataclass; the frame it travels in is frames.py, the handshake's
proofs are handshake.py, and the rules for what may be sent or received when (with buffering
and sealing) are connection.py's `Connection`, a sans-I/O state machine in the h11 style:
bytes in, these messages out, no sockets.

A session, in order:

    server -> Hello             the server's nonce
    client -> Auth              the client's nonce and its proof that it knows the token
    server -> Welcome           the server's proof, and what the node offers   [sealed]
    then, both ways and sealed: Request / Reply / Error, QueryMissing / MissingIds,
    PutChunk, Data; Event from the server only; Want from a node to the peer that streams
    chunks to it (its relay parent or the dev box), in a push --early relay session only.

An Error may be sent at any time, also to explain why a connection is being dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PROTOCOL_VERSION = 2
ID_SIZE = 16  # chunk ids, as fs.chunk.ID_SIZE


class ProtocolError(Exception):
    """The peer (or the caller) broke the protocol; the connection cannot continue."""


class AuthError(ProtocolError):
    """The other side does not know the shared token."""


class TruncatedFrame(ProtocolError):
    """The peer closed the connection in the middle of a frame."""


@dataclass(frozen=True)
class Hello:
    """The server's first frame, sent as soon as a client connects.

    Fields:
      version: the protocol version the server speaks; a peer speaking another is refused.
      nonce: the server's fresh random nonce (32 bytes), which the client's proof must cover.
        Left empty by the sender: its Connection fills it in.
    """

    version: int = PROTOCOL_VERSION
    nonce: bytes = b""


@dataclass(frozen=True)
class Auth:
    """The client's answer to Hello: proof that it knows the token, without sending it.

    Whether the client asks for encrypted payloads is the client Connection's `encrypt`
    setting, carried in the frame and covered by the MAC, not a field here.

    Fields:
      version: the protocol version the client speaks.
      nonce: the client's fresh random nonce (32 bytes).
      mac: HMAC-SHA256 under the token over both nonces and the encryption flag.
        nonce and mac are left empty by the sender: its Connection computes them; a received
        Auth has already been verified.
    """

    version: int = PROTOCOL_VERSION
    nonce: bytes = b""
    mac: bytes = b""


@dataclass(frozen=True)
class Welcome:
    """The server's answer to a valid Auth, and the first sealed frame: the session is open.

    Fields:
      mac: the server's proof that it knows the token (HMAC over both nonces and whether the
        session is encrypted). Left empty by the sender; verified on receipt.
      info: what the node tells every client: its name and address, request limits
        ("max_entries"), the bulk transport it offers and its RDMA devices (a JSON object).
    """

    mac: bytes = b""
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    """A failure, sent by either side at any time, also before or instead of a handshake.

    Fields:
      message: what went wrong, for a person (cut to 500 characters while the peer is still
        in its handshake, so the frame fits the 4 KiB it accepts then).
      code: what kind of failure, for a program: "auth" and "protocol" (the handshake failed),
        "busy" (the server refused the connection), "refused" (a request was refused),
        "internal", or "error".
      id: the Request this answers, when it answers one; None for a session-wide error.
    """

    message: str
    code: str = "error"
    id: int | None = None


@dataclass(frozen=True)
class Request:
    """A call the client makes of the server (and a relay of its children).

    Fields:
      op: which operation (requests.py has one typed request per op).
      args: the operation's arguments, a JSON object.
      id: chosen by the caller, unique among its outstanding requests; the Reply or Error
        that answers carries it back.
    """

    op: str
    args: dict = field(default_factory=dict)
    id: int = 0


@dataclass(frozen=True)
class Reply:
    """The successful answer to one Request.

    Fields:
      id: the Request's id.
      value: the result, a JSON object (empty when there is nothing to say).
    """

    id: int
    value: dict = field(default_factory=dict)


@dataclass(frozen=True)
class QueryMissing:
    """A pusher asks which of these chunks the node lacks, before sending any bytes.

    Fields:
      ids: chunk ids, ID_SIZE bytes each.
    """

    ids: list[bytes]


@dataclass(frozen=True)
class MissingIds:
    """The node's answer to a QueryMissing: the subset of its ids it does not have.

    Fields:
      ids: chunk ids, ID_SIZE bytes each, in the order they were asked.
    """

    ids: list[bytes]


@dataclass(frozen=True)
class PutChunk:
    """One chunk's bytes, on the control connection (the "tcp" bulk transport).

    Fields:
      cid: the chunk's id (ID_SIZE bytes).
      blob: the chunk as stored (compressed, if it was). Sent without being copied; received
        as a view into the frame's own buffer.
      digest: on receipt only, never sent: the xxh3_128 of a raw blob's bytes, computed as they
        arrived (arriving.py), for the store to compare with cid instead of hashing them again.
      seal: the chunk's seal (chunk_seals.py) as it arrived, checked, for a relay hop to forward
        with the same bytes; None: a link that takes sealed chunks seals it when it sends it.
    """

    cid: bytes
    blob: bytes | memoryview
    digest: bytes | None = field(default=None, compare=False, repr=False)
    seal: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PutChunks:
    """Small chunks back to back in one frame: a Python tree is mostly files of a few KiB, and
    a frame each cost more than its bytes (a seal and a check, a header, an event, on every
    hop: 24k frames took about 1.2 CPU-seconds to seal on the dev box and 1.5 to check on a
    node for the torch venv). Large chunks still go one per PutChunk frame, received in place.

    Fields:
      chunks: the PutChunk messages, in the order they were sent (at most
        frames.MAX_BATCH_CHUNKS); received blobs are views into the frame's buffer.
    """

    chunks: tuple[PutChunk, ...]


@dataclass(frozen=True)
class Want:
    """A node asks the peer that streams it chunks (in a relay session opened with
    `wants`) to send these chunks now, ahead of the rest: a reader of a version published
    early (push --early) needs them. The answer is the chunks themselves, as PutChunk frames
    (or nothing, if the peer cannot have them: the node then gives up after its timeout).

    Fields:
      ids: chunk ids, ID_SIZE bytes each.
    """

    ids: list[bytes]


@dataclass(frozen=True)
class Event:
    """Something the server tells the client unasked (server to client only): a spawned
    process's output and exit.

    Fields:
      kind: what happened ("output", "exit").
      data: its details, a JSON object (for a process: "proc", its id, and the lines or the
        exit status).
    """

    kind: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Data:
    """Binary parts, opaque to this layer, sent by either side (the actor mesh sends a header,
    a pickle and the pickle's out-of-band buffers), framed without being joined first.

    Fields:
      parts: the buffers, in order. Received parts are memoryviews into one writable
        bytearray per frame, so e.g. tensors can be rebuilt on them without another copy.
    """

    parts: Sequence[bytes | bytearray | memoryview]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Data) and len(self.parts) == len(other.parts)
                and all(bytes(a) == bytes(b) for a, b in zip(self.parts, other.parts)))


Message = (
    Hello | Auth | Welcome | Error | Request | Reply | QueryMissing | MissingIds | PutChunk | Event
    | Data | Want | PutChunks
)
