"""TCP transport on trio: a socket stream driving a connection.Connection.

connect() and accept() run the authenticated handshake and hand back a Channel; everything the
caller sees afterwards is protocol messages. Failures to reach or authenticate a peer surface as
one ConnectError whose message names the peer, because that is what an operator needs to read.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import trio

from .addresses import encrypts, format_addr, is_loopback, parse_addr
from .calls import Call, Calls
from .connection import CLOSED, NEED_DATA, Connection
from .frame_rules import Role, State
from .protocol import (
    Auth,
    AuthError,
    Error,
    Event,
    Hello,
    Message,
    MissingIds,
    ProtocolError,
    QueryMissing,
    Reply,
    Request,
    TruncatedFrame,
    Want,
    Welcome,
)

RECEIVE_SIZE = 1 << 20
CONNECT_TIMEOUT = 10.0  # seconds to reach and authenticate a peer (push and relays cap theirs here)
_CLOSE_GRACE = 1.0  # seconds to spend telling a rejected peer why
_REFUSE_GRACE = 0.05  # the same for a peer refused before its handshake (a fresh socket's
# send buffer takes the frame at once; a refusal must never wait on the peer)


class ConnectError(Exception):
    """Could not connect to or authenticate with a peer; the message starts with "host:port: "."""


class RemoteError(Exception):
    """The peer sent an Error frame."""

    def __init__(self, message: str, code: str = "error", peer: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.peer = peer

    def __str__(self) -> str:
        return f"{self.peer}: {self.message}" if self.peer else self.message


class ConnectionLost(trio.BrokenResourceError):
    """The peer closed the connection (or it broke) when we expected more. A subclass of
    trio.BrokenResourceError, so code written against plain trio streams catches it too."""

    def __init__(self, peer: str, reason: str = "connection closed by peer") -> None:
        super().__init__(f"{peer}: {reason}")
        self.peer = peer


def _describe(e: OSError) -> str:
    """'connection refused' rather than trio's 'all attempts to connect ... failed'."""
    leaves: list[BaseException] = [e]
    cause = e.__cause__
    if isinstance(cause, BaseExceptionGroup):
        leaves = [x for x in _flatten(cause) if isinstance(x, OSError)] or leaves
    reasons: list[str] = []
    for x in leaves:
        if isinstance(x, socket.gaierror):
            text = f"cannot resolve host ({x.strerror})"
        elif isinstance(x, OSError) and x.errno:
            text = os.strerror(x.errno).lower()
        else:
            text = str(x)
        if text not in reasons:
            reasons.append(text)
    return "; ".join(reasons)


def _flatten(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for x in group.exceptions:
        out.extend(_flatten(x) if isinstance(x, BaseExceptionGroup) else [x])
    return out


def _nodelay(stream: trio.SocketStream) -> None:
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP (tests may hand us a socketpair)


# Congestion control on loopback only. A host's default may be BBR (it is on the machine these
# figures come from), whose model of a path with a round trip of microseconds keeps the window
# at a few dozen segments: a 4 MiB frame then left in ~20 sendmsg calls of ~200 KiB, each a
# pass through trio and the TCP stack, and the sender spent 0.51-0.52 CPU-s per GiB (0.23-0.28
# with cubic or reno; bench/wire_bench.py). Reno is one any user may choose (the kernel's
# default tcp_allowed_congestion_control); links that leave the host keep the host's choice.
_LOOPBACK_CONGESTION = (b"cubic", b"reno")


def _loopback_congestion(stream: trio.SocketStream, host: str) -> None:
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None or not is_loopback(host):
        return
    for name in _LOOPBACK_CONGESTION:
        try:
            stream.setsockopt(socket.IPPROTO_TCP, option, name)
            return
        except OSError:  # not allowed to this user, or not built: the next, else the default
            continue


_IOV_MAX = 1024  # buffers one sendmsg takes (Linux's IOV_MAX)
_SMALL = 16 * 1024
_LOWAT = 512 * 1024
_FLUSH = 4 << 20  # send_many writes what it framed every so many bytes


def _coalesce(parts: list) -> list:
    """`parts` with each run of small buffers joined: fewer, larger buffers for sendmsg."""
    out: list = []
    run: list = []
    for part in parts:
        if len(part) < _SMALL:
            run.append(part)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(part)
    if run:
        out.append(b"".join(run))
    return out


class Channel:
    """An authenticated connection. One task may receive at a time (request() receives too);
    any number of tasks may send, whole frames never interleave."""

    def __init__(self, stream: trio.abc.Stream, conn: Connection, peer: str) -> None:
        self.stream = stream
        self.conn = conn
        self.peer = peer
        # A socket is written with sendmsg and read with recv_into: chunk payloads are not
        # copied in user space on their way through (see connection.py).
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._lowat = 1
        self.info: dict = {}  # Welcome.info from the server (client side)
        self.events: list[Event] = []  # Events that arrived while request() awaited a Reply
        self._send_lock = trio.Lock()
        self._calls: Calls[Call[dict]] = Calls()
        self._send_broken = False

    async def send(self, msg: Message) -> None:
        """Send one message. If a send is cancelled, part of a frame may have gone out, so the
        channel refuses further sends (receive() stays safe to cancel)."""
        await self.send_many([msg])

    async def send_many(self, msgs: list[Message]) -> None:
        """Send messages back to back in one write (many small chunks: one syscall)."""
        async with self._send_lock:
            if self._send_broken:
                raise ConnectionLost(self.peer, "an earlier send was interrupted mid-frame")
            parts: list = []
            size = 0
            for i, msg in enumerate(msgs):
                try:
                    framed = self.conn.send_parts(msg)
                except ProtocolError:
                    if self.conn.state is State.CLOSED:  # the peer hung up (receive() saw it)
                        raise ConnectionLost(self.peer, "connection closed") from None
                    raise
                parts += framed
                size += sum(len(part) for part in framed)
                # Written every _FLUSH bytes: an encrypted frame's ciphertext is in the
                # sealer's arena until then, and a batch of 4 MiB chunks sealed at once made a
                # new arena every two (a zero-fill and a page fault per 4 KiB of each).
                if size >= _FLUSH or i == len(msgs) - 1:
                    await self._write_sealed(parts)
                    parts, size = [], 0

    async def _write_sealed(self, parts: list) -> None:
        """Write frames send_parts() made, then let the sealer reuse their space."""
        try:
            await self._write(parts)
        except trio.BrokenResourceError as e:
            self._send_broken = True
            raise ConnectionLost(self.peer, "connection broken") from e
        except BaseException:
            self._send_broken = True
            raise
        finally:
            self.conn.sent()

    async def _write(self, parts: list) -> None:
        if self._sock is None:
            await self.stream.send_all(b"".join(parts))
            return
        bufs, first = _coalesce(parts), 0
        while first < len(bufs):
            try:
                sent = await self._sock.sendmsg(bufs[first : first + _IOV_MAX])
            except OSError as e:
                raise trio.BrokenResourceError(_describe(e)) from e
            while first < len(bufs) and sent >= len(bufs[first]):
                sent -= len(bufs[first])
                first += 1
            if sent:  # a partial write: the rest of this buffer goes next
                bufs[first] = memoryview(bufs[first])[sent:]

    async def _receive(self) -> None:
        """Feed the connection what the peer sent next (b"" at EOF)."""
        if self._sock is None:
            self.conn.receive_data(await self.stream.receive_some(RECEIVE_SIZE))
            return
        bufs = self.conn.get_buffers()
        # Inside a large frame, wake up only once a good part of the rest has arrived: fewer,
        # larger reads (never more than the frame needs, so a reply can never be held back;
        # what else has arrived is read too, into the second buffer).
        lowat = min(len(bufs[0]), _LOWAT) if self.conn.in_frame else 1
        try:
            if lowat != self._lowat:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                self._lowat = lowat
            if len(bufs) == 1:
                n = await self._sock.recv_into(bufs[0])
            else:
                n = (await self._sock.recvmsg_into(bufs))[0]
        except OSError as e:
            raise trio.BrokenResourceError(_describe(e)) from e
        self.conn.buffers_updated(n)

    async def _next(self) -> Message:
        """The next message of any kind, Error frames included."""
        while True:
            try:
                event = self.conn.next_event()
            except TruncatedFrame as e:
                raise ConnectionLost(self.peer, str(e)) from e
            if event is NEED_DATA:
                try:
                    await self._receive()
                except trio.BrokenResourceError as e:
                    raise ConnectionLost(self.peer, "connection broken") from e
            elif event is CLOSED:
                raise ConnectionLost(self.peer)
            else:
                return event  # type: ignore[return-value]

    @property
    def local_host(self) -> str:
        """The address of our end of the connection: the one the peer reached us from (so
        the one its side can connect back to). Loopback for a stream without a socket."""
        if self._sock is None:
            return "127.0.0.1"
        return str(self._sock.getsockname()[0])

    async def next_message(self) -> Message:
        """The next message of any kind, Error frames included, for a reader task that routes
        Replies and Errors to waiting requests by id. Raises ConnectionLost on EOF."""
        return await self._next()

    async def receive(self) -> Message:
        """The next message. Raises RemoteError for an Error frame, ConnectionLost on EOF and
        ProtocolError if the peer breaks the protocol."""
        msg = await self._next()
        if isinstance(msg, Error):
            raise RemoteError(msg.message, msg.code, self.peer)
        return msg

    async def request(self, op: str, **args: Any) -> dict:
        """Send a Request and return the value of its Reply. Events arriving meanwhile are
        appended to self.events; Replies and Errors for other (abandoned) requests are dropped.
        The caller is its own reader here (one receiving task at a time), so it routes what
        arrives through the same matcher a reader task would, until its own call is settled."""
        with self._calls.expecting(Call()) as call:
            await self.send(Request(op, args, call.id))
            while not call.settled:
                msg = await self._next()
                if isinstance(msg, Reply):
                    self._calls.settle(msg.id, msg.value)
                elif isinstance(msg, Error):
                    error = RemoteError(msg.message, msg.code, self.peer)
                    if msg.id is None:  # about the session, not one request: it is ours too
                        raise error
                    self._calls.fail(msg.id, error)
                elif isinstance(msg, Event):
                    self.events.append(msg)
                elif isinstance(msg, Want):
                    pass  # push --early: a want sent as the stream ended; it is all there now
                else:
                    raise ProtocolError(
                        f"{self.peer}: unexpected {type(msg).__name__} awaiting reply")
            return await call.result()

    async def query_missing(self, ids: list[bytes]) -> list[bytes]:
        """Ask the peer which of `ids` it (and, in a relay session, its subtree) lacks."""
        await self.send(QueryMissing(ids))
        reply = await self.receive()
        while isinstance(reply, Want):  # push --early: a want before the stream; it brings it
            reply = await self.receive()
        if not isinstance(reply, MissingIds):
            raise ProtocolError(f"expected missing chunk ids, got {type(reply).__name__}")
        return reply.ids

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def connect(addr: str, token: bytes, *, timeout: float = CONNECT_TIMEOUT,
                  encrypt: str = "auto") -> Channel:
    """Connect to a server at "host:port" and authenticate, all within `timeout` seconds;
    `encrypt` is the policy (see encrypts()). Every failure is a ConnectError naming the peer."""
    try:
        host, port = parse_addr(addr)
    except ValueError as e:
        raise ConnectError(str(e)) from None
    peer = format_addr(host, port)
    if not token:
        raise ConnectError(f"{peer}: no token to authenticate with")
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            try:
                _nodelay(stream)
                _loopback_congestion(stream, host)
                conn = Connection(Role.CLIENT, token, encrypt=encrypts(encrypt, host))
                channel = Channel(stream, conn, peer)
                await channel.receive()  # Hello: the protocol accepts nothing else first
                await channel.send(Auth())
                welcome = await channel.receive()  # likewise a Welcome, or an Error
                channel.info = welcome.info  # type: ignore[union-attr]
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError:
        raise ConnectError(f"{peer}: timed out after {timeout:g}s") from None
    except RemoteError as e:
        raise ConnectError(f"{peer}: {e.message}") from e
    except ConnectionLost as e:
        raise ConnectError(f"{peer}: connection closed during the handshake") from e
    except ProtocolError as e:
        raise ConnectError(f"{peer}: {e}") from e
    except OSError as e:
        raise ConnectError(f"{peer}: {_describe(e)}") from e
    return channel


async def accept(
    stream: trio.SocketStream, token: bytes, info: dict, *, timeout: float = 10.0,
    encrypt: str = "auto",
) -> Channel:
    """Run the server side of the handshake on a freshly accepted stream; `encrypt` is the
    policy under which this server requires encryption (see encrypts()).

    A peer with the wrong token (or protocol version) is told why in an Error frame, then the
    stream is closed and AuthError (ProtocolError) is raised. ConnectionLost and RemoteError
    propagate, as does trio.TooSlowError if the handshake takes longer than `timeout`; the
    stream is closed in every failure case.
    """
    try:
        name = stream.socket.getpeername()
        peer, host = format_addr(name[0], name[1]), name[0]
    except (OSError, AttributeError, IndexError, TypeError):
        peer, host = "?", "?"
    _nodelay(stream)
    _loopback_congestion(stream, host)
    conn = Connection(Role.SERVER, token, encrypt=encrypts(encrypt, host))
    channel = Channel(stream, conn, peer)
    try:
        with trio.fail_after(timeout):
            await channel.send(Hello())
            await channel.receive()  # the protocol only lets a valid Auth through
            await channel.send(Welcome(info=info))
    except ProtocolError as e:
        code = "auth" if isinstance(e, AuthError) else "protocol"
        with trio.move_on_after(_CLOSE_GRACE):
            try:
                await channel.send(Error(str(e), code=code))
            except (ConnectionLost, trio.ClosedResourceError, ProtocolError):
                pass
        await trio.aclose_forcefully(stream)
        raise
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return channel


async def refuse(stream: trio.SocketStream, message: str, code: str = "busy") -> None:
    """Tell a peer why it is not served, before any handshake (an Error frame may always be
    sent), and close the stream; connect() on the other side raises ConnectError with it."""
    data = Connection(Role.SERVER, b"-").send(Error(message, code=code))
    with trio.move_on_after(_REFUSE_GRACE):
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


def describe_failure(e: BaseException, timeout: float) -> str:
    """What went wrong with a peer, in one line a person can act on (no internal frames);
    `timeout` is the stall limit a TooSlowError stands for."""
    if isinstance(e, trio.TooSlowError):
        return f"no progress for {timeout:g}s (node stalled or unreachable)"
    if isinstance(e, RemoteError):
        return e.message
    if isinstance(e, ConnectionLost):
        return str(e).removeprefix(f"{e.peer}: ")
    if isinstance(e, ConnectError):
        return str(e).split(": ", 1)[-1]
    if isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, EOFError)):
        return "connection lost"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e) or type(e).__name__
