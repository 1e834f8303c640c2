"""Mesh messages on DATA frames: a JSON header anyone can read, then a pickled body with its
out-of-band buffers.

Why the split: the header (which call, which actor, which method) is decoded without
unpickling, so a body that cannot be unpickled (say, a class missing on this side) fails that one
call and not the connection. Only peers that passed the HMAC handshake get here at all.

Bodies are pickle protocol 5. CPU torch tensors (and anything else that hands pickle a
PickleBuffer) go out-of-band: their bytes are framed directly, without being copied into the
pickle, padded so each starts 64-byte aligned within the frame, and rebuilt on the receiving side
as views of the received frame, without another copy. A message over PIECE bytes goes as
pieces, each received straight into the buffer the message is rebuilt on (_gather), so the
bytes are copied only by the kernel's send and receive (plus an encrypted link's in-place
decryption).
"""

from __future__ import annotations

import ctypes
import io
import json
import pickle
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import trio

from ..daemon.wire.frames import HEADER
from ..daemon.wire.protocol import Data, ProtocolError
from ..daemon.wire.seal import TAG_SIZE
from ..daemon.wire.transport import Channel, ConnectionLost, RemoteError
from .message_buffers import RECEIVED

_ALIGN = 64
_PAD = bytes(_ALIGN)
# A message larger than this goes as pieces of this size (so it has no size cap), received into
# a reused buffer (message_buffers.py: no fresh memory is faulted in per message); the sender
# seals piece k+1 while the receiver opens piece k.
PIECE = 4 << 20
MAX_MESSAGE = 1 << 40  # what a peer may announce: it passed the handshake, so only sanity
_LEAD = HEADER.size + 4 + 8  # a one-part DATA frame's bytes before its part (count, length)
_HEAD = _ALIGN  # room for the first piece's lead before a received message's buffer


class WireError(ValueError):
    """A DATA frame that is not a mesh message."""


def _tensor_bytes(t: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory that keeps the tensor alive
    (torch has no buffer protocol and numpy may not be installed, so go through ctypes)."""
    nbytes = t.numel() * t.element_size()
    arr = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    arr._keep = t  # the view -> arr -> tensor: the memory outlives the frame that carries it
    return memoryview(arr).cast("B")


def _rebuild_tensor(buf: pickle.PickleBuffer | memoryview, dtype: Any, shape: tuple,
                    requires_grad: bool) -> Any:
    import torch

    view = memoryview(buf).cast("B")
    if view.nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        if view.readonly:  # in-band (pickled without a buffer_callback): copy once
            view = memoryview(bytearray(view))
        t = torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor:
            return NotImplemented
        plain = (obj.device.type == "cpu" and obj.layout == torch.strided
                 and not obj.is_quantized and not obj.is_conj() and not obj.is_neg())
        if not plain or obj.element_size() == 0:
            return NotImplemented
        t = obj.detach().contiguous()
        return _rebuild_tensor, (pickle.PickleBuffer(_tensor_bytes(t)), t.dtype,
                                 tuple(t.shape), obj.requires_grad)


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """The pickle and its out-of-band buffers."""
    buffers: list[memoryview] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    return f.getvalue(), buffers


def encode(header: dict, body: Any = None, *, has_body: bool = False,
           copy: bool = False) -> Data:
    """A mesh message. `copy` snapshots the buffers now, for a message that is queued while the
    caller may go on mutating its tensors (broadcast returns before the bytes are sent)."""
    parts: list[Any] = [compact_json(header).encode()]
    if not (has_body or body is not None):
        return Data(parts)
    pickled, buffers = dumps(body)
    parts.append(pickled)
    n = 2 + 2 * len(buffers)
    offset = 4 + 8 * n + len(parts[0]) + len(pickled)  # where the next part starts
    for b in buffers:
        pad = -offset % _ALIGN
        parts.append(_PAD[:pad])
        parts.append(bytes(b) if copy else b)
        offset += pad + b.nbytes
    return Data(parts)


def header(msg: Data) -> dict:
    try:
        obj = json.loads(bytes(msg.parts[0]))
    except (IndexError, ValueError, RecursionError):
        raise WireError("a DATA frame without a JSON header") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise WireError("a DATA frame whose header is not an object with an 'op'")
    return obj


def body(msg: Data) -> Any:
    """Unpickle the body (None if there is none). Raises what unpickling raises."""
    if len(msg.parts) < 2:
        return None
    return pickle.loads(msg.parts[1], buffers=msg.parts[3::2])


def _layout(lengths: list[int]) -> tuple[list[int], int]:
    """Where each part of a message in pieces starts in the receiver's buffer (64-byte
    aligned, so tensors are rebuilt on it without another copy), and the buffer's size."""
    starts, at = [], 0
    for n in lengths:
        at += -at % _ALIGN
        starts.append(at)
        at += n
    return starts, at


def _pieces(msg: Data) -> Iterator[Data]:
    """One frame that announces the parts' lengths, then the message's bytes as they will lie
    in the receiver's buffer (_layout: zeros between parts), as one-part DATA frames of at
    most PIECE bytes. A piece is a view of its part's memory, or, where it spans parts, their
    bytes joined (a copy of at most PIECE bytes per part boundary)."""
    views = [memoryview(part).cast("B") for part in msg.parts]
    yield Data([compact_json({"op": "_pieces", "lengths": [v.nbytes for v in views]}).encode()])
    segments, at = [], 0
    for view in views:
        if pad := -at % _ALIGN:
            segments.append(memoryview(_PAD[:pad]))
        segments.append(view)
        at += pad + view.nbytes
    chunk: list[memoryview] = []
    room = PIECE
    for view in segments:
        while view.nbytes:
            take = view[:room]
            chunk.append(take)
            view = view[take.nbytes:]
            room -= take.nbytes
            if not room:
                yield Data([chunk[0] if len(chunk) == 1 else b"".join(chunk)])
                chunk, room = [], PIECE
    if chunk:
        yield Data([chunk[0] if len(chunk) == 1 else b"".join(chunk)])


def one_frame(msg: Data) -> bool:
    """Whether send() sends `msg` as one frame."""
    return sum(len(memoryview(part).cast("B")) for part in msg.parts) <= PIECE


async def send(chan: Channel, msg: Data) -> None:
    """Send one mesh message; one larger than PIECE goes as pieces, so a message has no size
    cap (a frame's length field has 32 bits, and each frame is buffered whole on receipt)."""
    if one_frame(msg):
        await chan.send(msg)
        return
    for piece in _pieces(msg):
        await chan.send(piece)


def _address(view: memoryview) -> int:
    """Where a writable view's bytes are (-1 for a read-only one)."""
    if view.readonly or not view.nbytes:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


async def _gather(chan: Channel, lengths: list[int]) -> Data:
    """Receive the pieces of a message of parts of `lengths` into one buffer, laid out as
    _layout says, reused from an earlier message when one is free (message_buffers.py).

    Each piece's frame is received straight into the buffer, around where its bytes go
    (Connection.receive_into): its header and part table land on the 17 bytes before them,
    which are put back once it is opened, and its tag on the next piece's first 16. So no
    piece is copied out of a frame buffer: that copy was a pass over every byte received."""
    starts, size = _layout(lengths)
    if size > MAX_MESSAGE:
        raise ProtocolError(f"a mesh message of {size} bytes announced")
    raw = RECEIVED.take(_HEAD + size + TAG_SIZE)
    whole = raw[_HEAD:_HEAD + size]
    at = 0
    try:
        while at < size:
            n = min(PIECE, size - at)
            lead = raw[_HEAD + at - _LEAD:_HEAD + at]
            under = bytes(lead)
            chan.conn.receive_into(raw[_HEAD + at - _LEAD:_HEAD + at + n + TAG_SIZE])
            msg = await chan.receive()
            lead[:] = under
            if not isinstance(msg, Data) or len(msg.parts) != 1 or len(msg.parts[0]) != n:
                raise ProtocolError("a mesh message's pieces were interrupted")
            piece = memoryview(msg.parts[0]).cast("B")
            if _address(piece) != _address(whole[at:at + n]):  # not received in place
                whole[at:at + n] = piece
            at += n
    finally:
        chan.conn.receive_into(None)
    return Data([whole[s:s + n] for s, n in zip(starts, lengths)])


async def forward(chan: Channel, outgoing: trio.abc.ReceiveChannel[Data]) -> None:
    """Send every message `outgoing` yields, in order, until it closes or the link ends (a
    connection's writer task: the reader notices the end and says why)."""
    try:
        async for msg in outgoing:
            await send(chan, msg)
    except (ConnectionLost, trio.ClosedResourceError, trio.BrokenResourceError):
        pass


async def messages(chan: Channel) -> AsyncIterator[tuple[dict, Data]]:
    """(header, message) for each mesh message `chan` receives, until the connection ends;
    frames that are not mesh messages are skipped."""
    while True:
        try:
            msg = await chan.receive()
            if isinstance(msg, Data) and len(msg.parts) == 1 and msg.parts[0][:16] == (
                    b'{"op":"_pieces",'):
                msg = await _gather(chan, [int(n) for n in header(msg)["lengths"]])
        except (ConnectionLost, RemoteError, ProtocolError, trio.ClosedResourceError,
                trio.BrokenResourceError, WireError, KeyError, TypeError, ValueError):
            return
        if not isinstance(msg, Data):
            continue
        try:
            h = header(msg)
        except WireError:
            continue
        yield h, msg
