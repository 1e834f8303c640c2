"""Chunks sent from their file (sendfile, wire/file_range.py) over real loopback sessions: the
peer gets the same bytes as from a buffer, and a file that changed after it was read never
passes for the chunk that was sealed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from monarch_fs.daemon.wire.file_range import FileRange, FileShrank
from monarch_fs.daemon.wire.protocol import AuthError, PutChunk
from monarch_fs.daemon.wire.transport import ConnectionLost, accept, connect

TOKEN = b"test-token"
CID = b"\x5a" * 16


def wchar() -> int:
    """Bytes this process wrote through write-like calls: sendfile(2) counts, a socket's
    sendmsg does not."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


async def receive_one(received: list, failures: list, listeners) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        ch = await accept(stream, TOKEN, {}, timeout=5)
        async with ch:
            try:
                msg = await ch.receive()
                received.append((msg.cid, bytes(msg.blob)))
            except Exception as e:  # what the session refused, and why
                failures.append(e)
    await trio.serve_listeners(handle, listeners)


async def send_from_file(path: Path, blob: bytes) -> tuple[list, list, int]:
    """PutChunk(CID, RAW byte + `blob`) with its bytes taken from `path`; what the peer
    received, what it refused (or the send raised), and the bytes sendfile wrote."""
    received: list = []
    failures: list = []
    written = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(receive_one, received, failures, listeners)
            port = listeners[0].socket.getsockname()[1]
            async with await connect(f"127.0.0.1:{port}", TOKEN) as ch:
                before = wchar()
                try:
                    await ch.send(PutChunk(CID, b"\x00" + blob,
                                           source=FileRange(fd, 0, len(blob))))
                except FileShrank as e:
                    failures.append(e)
                written = wchar() - before
                with trio.fail_after(10):
                    while not received and not failures:
                        await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        os.close(fd)
    return received, failures, written


async def test_a_chunk_sent_from_its_file_arrives_as_from_its_buffer(tmp_path):
    data = os.urandom(4 << 20)
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    received, failures, written = await send_from_file(path, data)
    assert received == [(CID, b"\x00" + data)] and not failures
    assert written >= len(data), "the chunk's bytes did not go by sendfile"


async def test_a_file_changed_after_it_was_read_is_refused_not_received(tmp_path):
    """The seal covers what was read and hashed; the file now holds other bytes: the peer
    refuses the frame instead of taking them."""
    read = os.urandom(4 << 20)
    path = tmp_path / "lib.so"
    path.write_bytes(bytes(b ^ 1 for b in read[:4096]) + read[4096:])  # written meanwhile
    received, failures, _ = await send_from_file(path, read)
    assert not received
    assert failures and isinstance(failures[0], AuthError), failures
    assert CID.hex() in str(failures[0]) and "seal" in str(failures[0]), failures


async def test_a_file_cut_while_it_is_sent_fails_the_send_and_the_link(tmp_path):
    data = os.urandom(4 << 20)
    path = tmp_path / "lib.so"
    path.write_bytes(data[: 1 << 20])  # truncated after it was read
    received, failures, _ = await send_from_file(path, data)
    assert not received
    assert isinstance(failures[0], FileShrank), failures
    assert "changed while it was pushed" in str(failures[0])


async def test_after_a_cut_file_the_channel_refuses_to_send(tmp_path):
    data = os.urandom(1 << 20)
    path = tmp_path / "lib.so"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(receive_one, [], [], listeners)
            port = listeners[0].socket.getsockname()[1]
            async with await connect(f"127.0.0.1:{port}", TOKEN) as ch:
                with pytest.raises(FileShrank):
                    await ch.send(PutChunk(CID, b"\x00" + data,
                                           source=FileRange(fd, 0, len(data))))
                with pytest.raises(ConnectionLost, match="interrupted mid-frame"):
                    await ch.send(PutChunk(CID, b"\x00" + data))
            nursery.cancel_scope.cancel()
    finally:
        os.close(fd)
