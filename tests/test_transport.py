"""The trio TCP transport over real loopback sockets, and the token files it is keyed with."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from monarch_fs.daemon.wire.auth import (
    NoToken,
    TokenError,
    default_token_file,
    load_token,
    resolve_token,
    write_new_token,
)
from monarch_fs.daemon.wire.connection import Connection, Role
from monarch_fs.daemon.wire.frames import FrameType
from monarch_fs.daemon.wire.protocol import (
    AuthError,
    Error,
    Event,
    Hello,
    PutChunk,
    Reply,
    Request,
)
from monarch_fs.daemon.wire.transport import (
    Channel,
    ConnectError,
    ConnectionLost,
    RemoteError,
    accept,
    connect,
    parse_addr,
    refuse,
)

TOKEN = b"test-token"


@asynccontextmanager
async def serving(handler: Callable[[trio.SocketStream], Awaitable[None]]) -> AsyncIterator[int]:
    """A loopback listener that runs `handler` for each connection; yields its port."""
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


class Server:
    """A loopback server answering a few ops; records what went wrong with which client."""

    def __init__(self, token: bytes = TOKEN) -> None:
        self.token = token
        self.failures: list[BaseException] = []
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            ch = await accept(stream, self.token, {"node": "test-node"}, timeout=5)
        except (AuthError, ConnectionLost) as e:
            self.failures.append(e)
            return
        async with ch:
            try:
                while True:
                    await self.serve_one(ch, await ch.receive())
            except ConnectionLost:
                pass

    async def serve_one(self, ch: Channel, msg) -> None:
        if isinstance(msg, PutChunk):  # echo it back
            await ch.send(PutChunk(msg.cid, msg.blob))
        elif isinstance(msg, Request) and msg.op == "echo":
            await ch.send(Event("note", {"before": msg.id}))
            await ch.send(Reply(msg.id, {"args": msg.args, "peer_ok": ch.peer.startswith("127.")}))
        elif isinstance(msg, Request) and msg.op == "digest":
            digest = hashlib.sha256(msg.args["text"].encode()).hexdigest()
            await ch.send(Reply(msg.id, {"sha": digest}))
        elif isinstance(msg, Request):
            await ch.send(Error(f"unknown op {msg.op!r}", code="bad-op", id=msg.id))

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self.handle, listeners)
        return f"127.0.0.1:{self.port}"


async def test_request_reply_and_events():
    async with trio.open_nursery() as nursery:
        addr = await Server().start(nursery)
        async with await connect(addr, TOKEN) as ch:
            assert ch.info == {"node": "test-node"}
            assert ch.peer == addr
            reply = await ch.request("echo", x=1, y=["a"])
            assert reply == {"args": {"x": 1, "y": ["a"]}, "peer_ok": True}
            assert [e.kind for e in ch.events] == ["note"]
            reply = await ch.request("digest", text="hi")
            assert reply["sha"] == hashlib.sha256(b"hi").hexdigest()
            with pytest.raises(RemoteError, match="unknown op 'nope'") as info:
                await ch.request("nope")
            assert info.value.code == "bad-op" and info.value.peer == addr
            assert (await ch.request("echo"))["args"] == {}  # the channel is still usable
        nursery.cancel_scope.cancel()


async def test_wrong_token_then_right_token():
    server = Server()
    async with trio.open_nursery() as nursery:
        addr = await server.start(nursery)
        with pytest.raises(ConnectError, match="wrong token") as info:
            await connect(addr, b"not-the-token")
        assert str(info.value).startswith(addr + ": ")
        async with await connect(addr, TOKEN) as ch:
            assert (await ch.request("echo", n=2))["args"] == {"n": 2}
        nursery.cancel_scope.cancel()
    assert len(server.failures) == 1 and isinstance(server.failures[0], AuthError)


async def test_no_token_no_connection():
    """There is no tokenless mode: a client without a token does not even connect."""
    server = Server()
    async with trio.open_nursery() as nursery:
        addr = await server.start(nursery)
        with pytest.raises(ConnectError, match=f"^{addr}: no token to authenticate with$"):
            await connect(addr, b"")
        async with await connect(addr, TOKEN) as ch:
            assert ch.info["node"] == "test-node"
        nursery.cancel_scope.cancel()
    assert server.failures == []  # the tokenless client never reached the server


async def test_refusal_before_the_handshake_reaches_the_client_as_its_reason():
    async def busy(stream: trio.SocketStream) -> None:
        await refuse(stream, "too many connections from 127.0.0.1 (64 open, the limit)")

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, busy, listeners)
        addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        with trio.fail_after(5):
            with pytest.raises(ConnectError) as info:
                await connect(addr, TOKEN)
        assert str(info.value) == (
            f"{addr}: too many connections from 127.0.0.1 (64 open, the limit)")
        nursery.cancel_scope.cancel()


async def test_impostor_server_is_rejected():
    """A server that accepts any Auth but cannot compute the Welcome MAC."""

    async def impostor(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(Connection(Role.SERVER, b"guess").send(Hello()))
            got = b""
            while len(got) < 5 + 69:  # the client's Auth frame
                got += await stream.receive_some(100)
            welcome = b"\0" * 33 + b"{}" + b"\0" * 16  # MAC, flags, info, the frame's tag
            await stream.send_all(struct.pack("<IB", len(welcome), FrameType.WELCOME) + welcome)
            await trio.sleep_forever()

    async with serving(impostor) as port:
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}: frame failed authentication"):
            await connect(f"127.0.0.1:{port}", TOKEN, timeout=5)


async def test_cancelled_send_poisons_the_channel():
    async def deaf(stream: trio.SocketStream) -> None:
        async with await accept(stream, TOKEN, {}):
            await trio.sleep_forever()  # never reads, so a big send blocks

    async with serving(deaf) as port:
        async with await connect(f"127.0.0.1:{port}", TOKEN) as ch:
            with trio.CancelScope() as scope:
                scope.cancel()  # cancelled before anything went out: no harm done
                await ch.send(Request("echo"))
            with trio.move_on_after(0.2) as scope:
                await ch.send(PutChunk(b"c" * 16, bytes(64 << 20)))
            assert scope.cancelled_caught
            with pytest.raises(ConnectionLost, match="interrupted"):
                await ch.send(Request("echo"))


async def test_closed_port_fails_fast():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    start = trio.current_time()
    with pytest.raises(ConnectError, match=f"^127.0.0.1:{port}: connection refused"):
        await connect(f"127.0.0.1:{port}", TOKEN, timeout=5)
    assert trio.current_time() - start < 2


async def test_silent_peer_times_out():
    async def silent(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    async with serving(silent) as port:
        start = trio.current_time()
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}: timed out after 0.3s"):
            await connect(f"127.0.0.1:{port}", TOKEN, timeout=0.3)
        assert 0.25 < trio.current_time() - start < 2


async def test_peer_that_hangs_up_during_handshake():
    async def rude(stream: trio.SocketStream) -> None:
        await stream.aclose()

    async with serving(rude) as port:
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}: connection closed"):
            await connect(f"127.0.0.1:{port}", TOKEN, timeout=5)


async def test_big_chunk_and_concurrent_senders():
    big = os.urandom(5 * 1024 * 1024)
    blobs = {bytes([i]) * 16: os.urandom(1 << 20) + bytes([i]) for i in range(6)}
    async with trio.open_nursery() as nursery:
        addr = await Server().start(nursery)
        async with await connect(addr, TOKEN) as ch:
            await ch.send(PutChunk(b"\xaa" * 16, memoryview(big)))
            got = await ch.receive()
            assert got.cid == b"\xaa" * 16 and got.blob == big
            # Frames from several tasks must not interleave on the wire. Read the echoes while
            # sending: the echo server stops reading once its replies fill the socket buffers.
            echoed = {}

            async def collect() -> None:
                for _ in blobs:
                    msg = await ch.receive()
                    echoed[msg.cid] = msg.blob

            async with trio.open_nursery() as senders:
                senders.start_soon(collect)
                for cid, blob in blobs.items():
                    senders.start_soon(ch.send, PutChunk(cid, blob))
            assert echoed == blobs
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def hanging_up_server():
    """The address of a server that authenticates each client, then closes at once."""
    async def once(stream: trio.SocketStream) -> None:
        ch = await accept(stream, TOKEN, {})
        await ch.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, once, listeners)
        yield f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def test_receive_after_server_closes():
    async with hanging_up_server() as addr:
        ch = await connect(addr, TOKEN)
        with pytest.raises(ConnectionLost, match=addr):
            await ch.receive()
        await ch.aclose()


async def test_send_after_the_peer_closed_is_connection_lost():
    """A writer racing a reader that saw the peer hang up gets the transport's ConnectionLost,
    which callers handle, not a ProtocolError (a peer breaking the protocol)."""
    async with hanging_up_server() as addr:
        ch = await connect(addr, TOKEN)
        with pytest.raises(ConnectionLost):
            await ch.receive()
        with pytest.raises(ConnectionLost, match="connection closed"):
            await ch.send(Event("after", {}))
        await ch.aclose()


@pytest.mark.parametrize(
    "addr,expected",
    [
        ("node1:7000", ("node1", 7000)),
        ("10.0.0.5:1", ("10.0.0.5", 1)),
        ("[::1]:65535", ("::1", 65535)),
    ],
)
def test_parse_addr(addr, expected):
    assert parse_addr(addr) == expected


@pytest.mark.parametrize(
    "addr", ["n1", "n1:", ":7000", "n1:x", "n1:0", "h:65536", "::1:7", "[::1]", "[::1]7", "[::1:7"]
)
def test_parse_addr_rejects(addr):
    with pytest.raises(ValueError, match="bad address"):
        parse_addr(addr)


async def test_connect_bad_address():
    with pytest.raises(ConnectError, match="bad address"):
        await connect("nohost", TOKEN)


# -- token files -----------------------------------------------------------------------------


def test_write_and_load_token(tmp_path):
    path = tmp_path / "cluster" / "token"
    token = write_new_token(path)
    assert len(token) == 64 and bytes.fromhex(token.decode())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_token(path) == token
    assert write_new_token(path) != token  # replaced
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temp files left
    kept = load_token(path)
    with pytest.raises(TokenError, match="already exists"):
        write_new_token(path, replace=False)
    assert load_token(path) == kept
    assert [p.name for p in path.parent.iterdir()] == ["token"]


def test_load_token_errors(tmp_path):
    with pytest.raises(TokenError, match=f"{tmp_path / 'missing'}.*does not exist"):
        load_token(tmp_path / "missing")
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(TokenError, match="empty"):
        load_token(tmp_path / "empty")
    with pytest.raises(TokenError, match="directory"):
        load_token(tmp_path)
    (tmp_path / "t").write_text("  abc \n")
    assert load_token(tmp_path / "t") == b"abc"


def test_resolve_token(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MONARCH_FS_TOKEN_FILE", raising=False)
    assert default_token_file() == tmp_path / "home" / "cluster" / "token"
    with pytest.raises(NoToken, match="^no token: pass --token-file F or set "
                                      "\\$MONARCH_FS_TOKEN_FILE; `monarch-fs token new F`"):
        resolve_token(None)
    default = write_new_token(default_token_file())
    assert resolve_token(None) == default
    (tmp_path / "env").write_text("from-env")
    monkeypatch.setenv("MONARCH_FS_TOKEN_FILE", str(tmp_path / "env"))
    assert resolve_token(None) == b"from-env"
    (tmp_path / "cli").write_text("from-cli\n")
    assert resolve_token(str(tmp_path / "cli")) == b"from-cli"
    with pytest.raises(TokenError, match="nope"):
        resolve_token(str(tmp_path / "nope"))


def _congestion(ch: Channel) -> bytes:
    return ch.stream.socket.getsockopt(  # type: ignore[attr-defined]
        socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="Linux only")
async def test_loopback_sessions_leave_bbr_whatever_the_host_default():
    """Under BBR (this machine's default) a loopback session's window stays at a few dozen
    segments: a 4 MiB chunk left in ~20 sendmsg calls and the sender spent twice the CPU per
    GiB (bench/wire_bench.py). Both ends of a loopback session pick cubic, else reno. (On a
    host whose default is cubic or reno already, the old code passed this too.)"""
    seen: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with await accept(stream, TOKEN, {}, timeout=5) as ch:
            seen.append(_congestion(ch))

    async with serving(handler) as port:
        async with await connect(f"127.0.0.1:{port}", TOKEN) as ch:
            assert _congestion(ch) in (b"cubic", b"reno")
        with trio.fail_after(5):
            while not seen:
                await trio.sleep(0.01)
    assert seen[0] in (b"cubic", b"reno")
