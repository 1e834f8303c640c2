"""Issue 16, finding 8: connection floods against a real daemon, on loopback only, with bounded
loops. Connections beyond the limits (in all, per peer address) are refused at once and say
why; a peer that never authenticates is dropped; idle unauthenticated connections cost little
memory; running out of file descriptors costs one log line, and a client is served as soon as
descriptors free up.

Flood sockets are plain blocking sockets bound to 127.0.0.2 or 127.0.0.3 (all of 127/8 is
loopback), so the limits of one peer address can be watched while 127.0.0.1 stays a
different, legitimate peer."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import struct
import time
from contextlib import contextmanager

import pytest
import trio

from monarch_fs.daemon.client.push import push
from monarch_fs.daemon.client.push_options import PushOptions
from monarch_fs.daemon.wire import frames
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.limits import LogOnce
from monarch_fs.daemon.wire.transport import ConnectError, connect

_HEADER = struct.Struct("<IB")  # a frame's payload length and type (daemon/wire/frames.py)


@contextmanager
def flood(addr: str, n: int, source: str):
    """`n` connections from `source` that say nothing; all closed on the way out."""
    host, port = addr.rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((source, 0))
            s.settimeout(5)
            s.connect((host, int(port)))
        yield socks
    finally:
        for s in socks:
            s.close()


def first_frame(s: socket.socket) -> tuple[int | None, bytes]:
    """(frame type, payload) of the first frame the daemon sent, (None, b"") at EOF."""
    data = b""
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        got = s.recv(65536)
        if not got:
            return None, b""
        data += got
    size, ftype = _HEADER.unpack_from(data)
    return ftype, data[_HEADER.size:_HEADER.size + size]


def greeted(socks: list[socket.socket]) -> tuple[int, list[str]]:
    """How many were greeted with HELLO (accepted, waiting for the handshake), and the messages
    of the ERROR frames the others got (refused)."""
    hellos, errors = 0, []
    for s in socks:
        ftype, payload = first_frame(s)
        if ftype == frames.FrameType.HELLO:
            hellos += 1
        else:
            assert ftype == frames.FrameType.ERROR, ftype
            errors.append(json_message(payload))
            assert s.recv(1) == b""  # and closed at once
    return hellos, errors


def json_message(payload: bytes) -> str:
    return json.loads(payload)["message"]


def wait_for_log(d, text: str, timeout: float = 5) -> str:
    """The daemon's log once `text` is in it."""
    deadline = time.monotonic() + timeout
    while text not in (log := d.log()):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log}"
        time.sleep(0.05)
    return log


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def status_of(addr: str, token: bytes) -> float:
    """Seconds for a legitimate client to connect, authenticate and get the status."""
    t = time.monotonic()
    async with await connect(addr, token) as chan:
        assert (await chan.request("status"))["node"]
    return time.monotonic() - t


def test_log_once_says_a_condition_once_per_key_per_interval(caplog):
    now = [0.0]
    once = LogOnce(logging.getLogger("test.limits"), interval=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.limits"):
        for i in range(100):
            now[0] = i * 0.1
            once(("peer", "10.0.0.1"), logging.WARNING, "refusing %s", "10.0.0.1")
            once(("peer", "10.0.0.2"), logging.WARNING, "refusing %s", "10.0.0.2")
        now[0] = 61
        once(("peer", "10.0.0.1"), logging.WARNING, "refusing %s", "10.0.0.1")
    assert caplog.messages == ["refusing 10.0.0.1", "refusing 10.0.0.2",
                               "refusing 10.0.0.1 (99 more times in the last 61s)"]


@pytest.mark.mount
async def test_connections_beyond_the_limits_are_refused_at_once_saying_why(lone_daemon):
    d = lone_daemon("--max-connections", "120", "--max-connections-per-peer", "100",
                    "--handshake-timeout", "60")
    token = load_token(d.token_file)
    t = time.monotonic()
    with flood(d.addr, 130, "127.0.0.2") as peer2:
        hellos, errors = greeted(peer2)
        assert hellos == 100 and len(errors) == 30
        assert set(errors) == {"too many connections from 127.0.0.2 (100 open, the limit per "
                               "address)"}
        assert await status_of(d.addr, token) < 2  # another address is still served
        with flood(d.addr, 30, "127.0.0.3") as peer3:
            hellos, errors = greeted(peer3)
            assert hellos == 20 and set(errors) == {"too many connections (120 open, the limit)"}
            with pytest.raises(ConnectError, match=r"too many connections \(120 open, the limit\)"):
                await connect(d.addr, token)  # a client is told why, in one line
        # 127.0.0.3's connections closed: room again for a legitimate client, at once.
        deadline = time.monotonic() + 5
        while True:
            try:
                seconds = await status_of(d.addr, token)
                break
            except ConnectError:  # the daemon has not seen those closes yet
                assert time.monotonic() < deadline
                await trio.sleep(0.05)
        assert seconds < 1
    assert time.monotonic() - t < 30  # refusals never waited for a timeout
    log = d.log()
    assert log.count("refusing connections: too many connections from 127.0.0.2") == 1, log
    assert log.count("refusing connections: too many connections (120 open") == 1, log
    assert "Traceback" not in log


@pytest.mark.mount
async def test_a_peer_that_says_nothing_is_dropped_after_the_handshake_timeout(lone_daemon):
    d = lone_daemon("--handshake-timeout", "1")
    with flood(d.addr, 5, "127.0.0.2") as socks:
        t = time.monotonic()
        for s in socks:
            assert first_frame(s)[0] == frames.FrameType.HELLO
        for s in socks:
            assert s.recv(1) == b""  # dropped
        waited = time.monotonic() - t
    assert 0.8 < waited < 4, waited
    log = wait_for_log(d, "no handshake within 1s")  # written just after the stream is closed
    await trio.sleep(0.2)
    assert d.log().count("no handshake within 1s") == 1, log  # five drops, one line


@pytest.mark.mount
async def test_an_idle_unauthenticated_connection_costs_less_than_32_kib(lone_daemon):
    """262 KiB each before connection.py kept its receive buffer small until the peer has
    authenticated (1,000 idle connections took 262 MB)."""
    d = lone_daemon("--max-connections", "1000", "--max-connections-per-peer", "1000",
                    "--handshake-timeout", "60")
    for _ in range(3):  # warm up: the accept path, its tasks, the allocator's arenas
        with flood(d.addr, 50, "127.0.0.2") as socks:
            assert greeted(socks) == (50, [])
        await trio.sleep(0.2)
    before = rss_kib(d.pid)
    n = 300
    with flood(d.addr, n, "127.0.0.2") as socks:
        assert greeted(socks) == (n, [])
        await trio.sleep(0.3)
        after = rss_kib(d.pid)
    per = (after - before) / n
    print(f"RSS {before} KiB -> {after} KiB with {n} idle connections: {per:.1f} KiB each")
    assert per < 32, f"{per:.1f} KiB per idle unauthenticated connection"


@pytest.mark.mount
async def test_running_out_of_descriptors_costs_one_log_line_and_clients_are_served_once_they_free(
        lone_daemon, tmp_path):
    d = lone_daemon("--handshake-timeout", "60")
    token = load_token(d.token_file)
    src = tmp_path / "app"
    src.mkdir()
    (src / "a.py").write_text("print('a')\n")
    await push(src, [d.addr], token, PushOptions(transport="tcp"))  # the store and refs exist
    (src / "a.py").write_text("print('b')\n")

    # 16 descriptors to spare, fewer than the 64 connections a peer may open: a flood of 150
    # leaves most waiting in the listen backlog while accept() fails with EMFILE.
    in_use = len(os.listdir(f"/proc/{d.pid}/fd"))
    _, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (in_use + 16, hard))
    with flood(d.addr, 150, "127.0.0.2"):
        await trio.sleep(2)  # 40 retries of accept() at 50 ms
        log = d.log()
        assert log.count("EMFILE") == 1, log
    t = time.monotonic()
    # the flood closed: served now
    result = await push(src, [d.addr], token, PushOptions(transport="tcp"))
    seconds = time.monotonic() - t
    print(f"push after the flood: {seconds:.3f} s")
    assert result.nodes == 1 and (d.mnt / "app" / "a.py").read_text() == "print('b')\n"
    assert seconds < 2, seconds
    log = d.log()
    assert log.count("EMFILE") <= 2 and "Traceback" not in log, log
