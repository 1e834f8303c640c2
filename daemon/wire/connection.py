"""One side of one connection as a pure state machine (h11 style): bytes in, messages out.

Keeping I/O out makes the protocol fuzzable and shared by every transport. This module holds
the rules (which side may send or receive which frame in which state, the size limits) and the
buffering; the messages are protocol.py's, their bytes frames.py's and handshake.py's.

Limits are checked from a frame's header alone, before any payload is buffered, so a peer
cannot make us allocate by claiming a huge frame. Until a peer has authenticated, only
handshake frames (and Error) of at most 4096 bytes are accepted from it, into a 4 KiB receive
buffer. From the Welcome on, every frame is sealed (seal.py; see handshake.py).

Chunk payloads are most of the bytes, so they are not copied on the way through: send_parts()
gives a frame as a list of buffers (a socket writes them with one sendmsg), and a large PUT_CHUNK
or DATA frame is received in place, into a buffer of its own that get_buffer() hands to
recv_into (the asyncio BufferedProtocol pattern); its payload arrives as a view of that buffer.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from . import chunk_seals, frames, handshake
from .arriving import CHUNK_DATA, CHUNKS, Arriving
from .buffers import ALIGN, RECEIVING, BufferPool
from .frame_rules import Role, State, may_receive, may_send
from .frames import HEADER, MAX_FRAME, MAX_HANDSHAKE_FRAME, Buffer, FrameType
from .handshake import NONCE_SIZE
from .protocol import (
    PROTOCOL_VERSION,
    Auth,
    AuthError,
    Hello,
    Message,
    ProtocolError,
    TruncatedFrame,
    Welcome,
)
from .seal import TAG_SIZE, FrameCheck, Opener, Sealer, SealError, derive_keys

IN_PLACE = 64 * 1024  # PUT_CHUNK and DATA frames this big are received into their own buffer
# What get_buffer() offers between large frames. A read into it past a large frame's header
# is that frame's first bytes, copied through the shared buffer into the frame's own: at most
# IN_PLACE of them. 256 KiB here grew the shared buffer past malloc's mmap threshold and freed
# it again once per frame, 64 page faults and two 256 KiB copies per 4 MiB chunk received
# (17,000 faults per GiB; 2,100 with 64 KiB).
_SCRATCH = IN_PLACE
_EARLY_SCRATCH = 4096  # ... and before the peer has authenticated
# A chunk's raw bytes in a PUT_CHUNK frame received in place (arriving.CHUNK_DATA into it) start
# on a page, which lets the store write a large file's chunk with O_DIRECT, straight from this
# buffer (see fs/file_objects.py: a buffered write's copy into the page cache was most of a
# node's CPU per ingested byte).
_LARGE_TYPES = {ftype.value for ftype in frames.LARGE}

class NeedData:
    """Sentinel type: more bytes are needed before the next event."""


class Closed:
    """Sentinel type: the peer closed the connection cleanly, between frames."""


NEED_DATA = NeedData()
CLOSED = Closed()


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
        self.seal_chunks = False  # the server takes SEALED_CHUNK frames (chunk_seals.py)
        self._sealer: Sealer | None = None  # set once the session keys exist
        self._opener: Opener | None = None
        self.state = State.HANDSHAKE
        self.max_frame = max_frame
        self._token = bytes(token)
        self._nonce = nonce(NONCE_SIZE)
        self._peer_nonce: bytes | None = None
        self._sent: set[FrameType] = set()  # handshake frames we have sent
        self._buf = bytearray()
        self._frame: Arriving | None = None  # a large frame being received in place
        self._buffers = RECEIVING  # large frames' buffers, reused by every connection
        self._spare: memoryview | None = None  # get_buffers() past a large frame: the next one
        self._spare_got = 0  # bytes read into it
        self._scratch: memoryview | None = None  # get_buffer() between large frames
        self._into: memoryview | None = None  # where the next large frame goes (receive_into)
        self._eof = False
        self._error: ProtocolError | None = None

    # -- sending ---------------------------------------------------------------------------

    def send(self, msg: Message) -> bytes:
        """The bytes that carry `msg`. Raises ProtocolError if it may not be sent now."""
        data = b"".join(self.send_parts(msg))
        self.sent()
        return data

    def send_parts(self, msg: Message) -> list[Buffer]:
        """send(), as a list of buffers to write in order: a chunk's blob or a DATA part is one
        of them, not copied. They stay valid until `sent()` (an encrypted frame's ciphertext
        is in space the sealer reuses). Raises ProtocolError if `msg` may not be sent now."""
        ftype = frames.FRAME_TYPES.get(type(msg))
        if ftype is None:
            raise TypeError(f"not a protocol message: {msg!r}")
        self._check_send(ftype)
        if self.seal_chunks and chunk_seals.applies(msg, self.encrypted):
            return chunk_seals.sealed_frame(self._keys()[0], self._token, msg, self.max_frame)
        if isinstance(msg, Hello):
            data = handshake.hello_frame(self._nonce)
        elif isinstance(msg, Auth):
            data = handshake.auth_frame(self._token, self._their_nonce(), self._nonce,
                                        self.want_encrypt)
        elif isinstance(msg, Welcome):
            data = handshake.welcome_frame(self._token, self._their_nonce(), self._nonce,
                                           self.encrypted, {**msg.info,
                                                            chunk_seals.CAPABILITY: True})
        else:
            data = frames.encode(msg, early=not self._peer_ready())
        limit = self.max_frame if self._peer_ready() else MAX_HANDSHAKE_FRAME
        size = sum(len(part) for part in data) - HEADER.size
        if self._sealer is not None:
            size += TAG_SIZE
        if size > limit:
            raise ProtocolError(f"{ftype.name} frame of {size} bytes exceeds the limit of {limit}")
        if ftype in frames.HANDSHAKE:
            self._sent.add(ftype)
        if self._sealer is not None:
            data = self._sealer.seal(HEADER.pack(size, ftype), data[1:])
        if ftype is FrameType.AUTH:  # the client's keys: every later frame is sealed
            self._start_session(self._nonce, self._their_nonce())
        elif ftype is FrameType.WELCOME:  # sealed as such; what follows in the agreed mode
            self._keys()[0].encrypt = self.encrypted
        return data

    def sent(self) -> None:
        """The buffers send_parts() returned so far are written: their space may be reused."""
        if self._sealer is not None:
            self._sealer.sent()

    def _start_session(self, client_nonce: bytes, server_nonce: bytes) -> tuple[Sealer, Opener]:
        c2s, s2c, self.bulk_key = derive_keys(self._token, client_nonce, server_nonce)
        mine, theirs = (c2s, s2c) if self.role is Role.CLIENT else (s2c, c2s)
        self._sealer, self._opener = Sealer(mine), Opener(theirs)
        return self._sealer, self._opener

    def _keys(self) -> tuple[Sealer, Opener]:
        """The session's sealer and opener; only asked for once the handshake made them."""
        if self._sealer is None or self._opener is None:
            raise ProtocolError("no session keys before the handshake")
        return self._sealer, self._opener

    def _their_nonce(self) -> bytes:
        """The peer's nonce; only asked for once its Hello or Auth has arrived."""
        if self._peer_nonce is None:
            raise ProtocolError("the peer has not sent its nonce")
        return self._peer_nonce

    def _peer_ready(self) -> bool:
        """Whether the peer has left (or, on reading what we send, will leave) its handshake."""
        return (FrameType.WELCOME if self.role is Role.SERVER else FrameType.AUTH) in self._sent

    def _check_send(self, ftype: FrameType) -> None:
        if ftype is FrameType.ERROR:
            return  # always allowed, also to explain why we are hanging up
        if self.state is State.CLOSED:
            raise ProtocolError(f"cannot send {ftype.name}: connection is closed")
        if not may_send(ftype, self.role, self.state, self._sent, self._peer_nonce is not None):
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
            data = self._frame.add(data)
        if data:
            self._buf += data

    def receive_into(self, buffer: memoryview | None) -> None:
        """Receive the next frame, header to tag, into `buffer` if it is a large DATA frame of
        exactly that size (else as usual): a caller that knows where a frame's
        payload belongs (a piece of a larger message, mesh/wire.py) saves copying it there.
        The frame is opened in place; the bytes under its header and tag are the caller's
        to put back."""
        self._into = buffer

    @property
    def in_frame(self) -> bool:
        """Whether a large frame is being received in place (get_buffer() is its rest)."""
        return self._frame is not None

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the peer may be written (by recv_into); then call
        buffer_updated(n). While a large frame arrives, this is the rest of its own buffer."""
        if self._frame is not None:
            return self._frame.rest()
        if self._scratch is None or (len(self._scratch) < _SCRATCH
                                     and self.state is State.READY):
            # Small until the peer has authenticated: an idle connection costs little.
            size = _SCRATCH if self.state is State.READY else _EARLY_SCRATCH
            self._scratch = memoryview(bytearray(size))
        return self._scratch

    def get_buffers(self) -> list[memoryview]:
        """get_buffer(), and while a large frame arrives, a buffer for what follows it: a
        socket reads into both at once (recvmsg_into; then buffers_updated). In a stream of
        chunks the read that ends one frame starts the next, which stays where it landed, on
        its page (_adopt), instead of passing through the shared buffer. Not after a DATA
        frame: the next piece of a mesh message goes where its caller says (receive_into)."""
        if self._frame is None:
            return [self.get_buffer()]
        if self._frame.ftype is FrameType.DATA:
            return [self._frame.rest()]
        if self._spare is None:
            self._spare = self._buffers.take(BufferPool.POOLED - ALIGN, CHUNK_DATA)
        return [self._frame.rest(), self._spare]

    def buffers_updated(self, n: int) -> None:
        """`n` bytes were written across get_buffers()' buffers, in order; 0 means EOF."""
        if self._frame is None or not n or self._eof:
            self.buffer_updated(n)
            return
        rest = len(self._frame.frame) - self._frame.got
        if n > rest and (self._spare is None or n - rest > len(self._spare)):
            raise ValueError("buffers_updated() past the end of get_buffers()")
        self._frame.received(min(n, rest))
        self._spare_got = max(n - rest, 0)

    def buffer_updated(self, n: int) -> None:
        """`n` bytes were written to the start of get_buffer()'s buffer; 0 means EOF."""
        if n and self._frame is not None and not self._eof:
            self._frame.received(n)
        elif not n:
            self.receive_data(b"")
        elif self._scratch is None:
            raise ValueError("buffer_updated() before get_buffer()")
        else:
            self.receive_data(self._scratch[:n])

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
            if not self._frame.whole:
                if self._eof:
                    raise TruncatedFrame("connection closed mid-frame")
                return NEED_DATA
            whole, self._frame = self._frame, None
            if not whole.checked:
                return frames.decode_large(whole.ftype, self._payload(whole.ftype, whole.frame))
            try:
                payload, digest = whole.finish()
            except SealError as e:
                raise AuthError(str(e)) from None
            return frames.decode_large(whole.ftype, payload, digest)
        if self._spare_got:
            return self._adopt()
        buf = self._buf
        if len(buf) < HEADER.size:
            if not self._eof:
                return NEED_DATA
            if buf:
                raise TruncatedFrame("connection closed mid-frame")
            self.state = State.CLOSED
            return CLOSED
        size, raw_type = HEADER.unpack_from(buf)
        try:
            ftype = FrameType(raw_type)
        except ValueError:
            raise ProtocolError(f"unknown frame type {raw_type}") from None
        limit = self.max_frame if self.state is State.READY else MAX_HANDSHAKE_FRAME
        if size > limit:
            raise ProtocolError(f"{ftype.name} frame of {size} bytes exceeds the limit of {limit}")
        self._check_receive(ftype)
        end = HEADER.size + size
        if len(buf) < end:
            if self._eof:
                raise TruncatedFrame("connection closed mid-frame")
            if end >= IN_PLACE and ftype in frames.LARGE:
                self._receive_in_place(ftype, end)
            return NEED_DATA
        self._into = None  # it was for this frame, which is not received in place
        if ftype is FrameType.DATA:  # one copy out of the receive buffer, then views
            frame: memoryview = memoryview(buf[:end])
        else:  # one copy of the frame: a chunk's blob is a view of it
            with memoryview(buf) as view:  # bytes(buf[a:b]) would copy twice
                frame = memoryview(bytes(view[:end]))
        del buf[:end]
        if ftype is FrameType.SEALED_CHUNK:  # whole already (read past a large one): its
            # checks are fed at once, as they would be as it arrived (a zeroed buffer of its
            # own per frame cost a small file's chunk a memset and its page faults)
            self._frame = Arriving(ftype, frame, end, self._check(frame))
            return self._next_event()
        payload = self._payload(ftype, frame)
        if ftype in frames.LARGE:
            return frames.decode_large(ftype, payload)
        return self._parse(ftype, bytes(payload))

    def _adopt(self) -> Message | NeedData | Closed:
        """What was read past a large frame into the spare buffer: the next large frame stays
        there; anything else goes to the receive buffer, and is parsed (or refused) there."""
        spare, got, self._spare_got = self._spare, self._spare_got, 0
        assert spare is not None
        size, raw_type = HEADER.unpack_from(spare) if got >= HEADER.size else (0, 0)
        end = HEADER.size + size
        if (raw_type in _LARGE_TYPES and IN_PLACE <= end <= len(spare) and not self._buf
                and size <= self.max_frame and self.state is State.READY):
            ftype = FrameType(raw_type)
            self._check_receive(ftype)
            self._spare = None
            self._into = None  # this frame stays where it landed (a caller copies it)
            self._frame = Arriving(ftype, spare[:end], min(got, end), self._check(spare[:end]))
            self._buf += spare[end:got]  # a read can end inside the frame after
        else:
            self._buf += spare[:got]
        return self._next_event()

    def _check(self, frame: memoryview) -> FrameCheck | chunk_seals.SealedCheck | None:
        """The check of a large frame received in place, fed as it arrives (arriving.py)."""
        opener = self._opener
        if opener is None or self.state is not State.READY:
            return None
        check = opener.check_as_received(frame[: HEADER.size])
        if frame[HEADER.size - 1] != FrameType.SEALED_CHUNK:
            return check
        return chunk_seals.SealedCheck(check, self._token, len(frame) - TAG_SIZE, opener.encrypt)

    def _receive_in_place(self, ftype: FrameType, size: int) -> None:
        """Everything buffered is the start of a large frame of `size` bytes: move it to a
        buffer of the frame's own and receive the rest straight into it, checked (and
        decrypted) as it arrives (arriving.py)."""
        lead = CHUNK_DATA if ftype in CHUNKS else 0
        frame, self._into = self._into, None  # a caller's buffer for it (receive_into)
        if frame is None or len(frame) != size or ftype is not FrameType.DATA:
            frame = self._buffers.take(size, lead)
        frame[: len(self._buf)] = self._buf  # less than the frame: it is not whole yet
        self._frame = Arriving(ftype, frame, len(self._buf), self._check(frame))
        self._buf.clear()

    def _payload(self, ftype: FrameType, frame: memoryview) -> memoryview:
        """A whole frame's payload, checked (and decrypted) when the session seals it."""
        if self._opener is None or (ftype is FrameType.ERROR and self.state is not State.READY
                                    and self.role is Role.CLIENT):
            # Unsealed: the handshake, and an Error that refuses it (a server that could not
            # authenticate us has no keys to seal it with).
            return frame[HEADER.size :]
        if len(frame) < HEADER.size + TAG_SIZE:
            raise ProtocolError(f"{ftype.name} frame too short to be sealed")
        try:
            return self._opener.open(frame, HEADER.size)
        except SealError as e:
            raise AuthError(str(e)) from None

    def _check_receive(self, ftype: FrameType) -> None:
        if ftype is FrameType.ERROR:
            return
        if not may_receive(ftype, self.role, self.state, self._sent,
                           self._peer_nonce is not None):
            raise ProtocolError(f"unexpected {ftype.name} frame from the peer ({self.state.value})")

    def _parse(self, ftype: FrameType, p: bytes) -> Message:
        if ftype is FrameType.HELLO:
            self._peer_nonce = handshake.parse_hello(p)
            return Hello(PROTOCOL_VERSION, self._peer_nonce)
        if ftype is FrameType.AUTH:
            nonce, mac, asks = handshake.parse_auth(self._token, self._nonce, p)
            self._peer_nonce = nonce
            self.encrypted = self.want_encrypt or asks
            _, opener = self._start_session(nonce, self._nonce)
            opener.encrypt = self.encrypted  # the client sends nothing before Welcome
            self.state = State.READY
            return Auth(PROTOCOL_VERSION, nonce, mac)
        if ftype is FrameType.WELCOME:
            mac, self.encrypted, info = handshake.parse_welcome(
                self._token, self._nonce, self._their_nonce(), p, self.want_encrypt)
            self.seal_chunks = info.pop(chunk_seals.CAPABILITY, None) is True
            sealer, opener = self._keys()
            sealer.encrypt = opener.encrypt = self.encrypted
            self.state = State.READY
            return Welcome(mac, info)
        return frames.decode(ftype, p)
