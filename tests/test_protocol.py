"""The sans-I/O protocol state machine: handshake, messages, limits, and hostile input."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_fs.daemon.wire.buffers import RECEIVING, BufferPool
from monarch_fs.daemon.wire.bulk import SMALL_CHUNK, frames_for
from monarch_fs.daemon.wire.connection import (
    CLOSED,
    IN_PLACE,
    NEED_DATA,
    Connection,
    Role,
    State,
)
from monarch_fs.daemon.wire.frames import MAX_FRAME, FrameType
from monarch_fs.daemon.wire.protocol import (
    PROTOCOL_VERSION,
    Auth,
    AuthError,
    Data,
    Error,
    Event,
    Hello,
    MissingIds,
    ProtocolError,
    PutChunk,
    PutChunks,
    QueryMissing,
    Reply,
    Request,
    TruncatedFrame,
    Welcome,
)
from monarch_fs.daemon.wire.seal import TAG_SIZE, ChunkSealer, SealError

TOKEN = b"TOKEN-0123456789abcdef-very-secret"
HEADER = struct.Struct("<IB")


def frame(ftype: int, payload: bytes, size: int | None = None) -> bytes:
    return HEADER.pack(len(payload) if size is None else size, ftype) + payload


def drain(conn: Connection) -> list:
    """Every event `conn` can produce from what it has buffered (ends with NEED_DATA/CLOSED)."""
    out = []
    while True:
        ev = conn.next_event()
        out.append(ev)
        if ev is NEED_DATA or ev is CLOSED:
            return out


class Wire:
    """Two Connections wired together in memory, recording every byte sent."""

    def __init__(self, client_token: bytes = TOKEN, server_token: bytes = TOKEN) -> None:
        self.client = Connection(Role.CLIENT, client_token)
        self.server = Connection(Role.SERVER, server_token)
        self.sent: list[bytes] = []

    def deliver(self, sender: Connection, msg) -> object:
        data = sender.send(msg)
        self.sent.append(data)
        receiver = self.server if sender is self.client else self.client
        receiver.receive_data(data)
        events = drain(receiver)
        assert len(events) == 2 and events[1] is NEED_DATA
        return events[0]

    def handshake(self, info: dict | None = None) -> Welcome:
        hello = self.deliver(self.server, Hello())
        assert isinstance(hello, Hello) and len(hello.nonce) == 32
        auth = self.deliver(self.client, Auth())
        assert isinstance(auth, Auth)
        assert self.server.state is State.READY and self.client.state is State.HANDSHAKE
        welcome = self.deliver(self.server, Welcome(info=info or {"node": "n1"}))
        assert isinstance(welcome, Welcome)
        assert self.client.state is State.READY
        return welcome


def ready_pair() -> Wire:
    w = Wire()
    w.handshake()
    return w


def test_handshake_round_trip():
    w = Wire()
    assert w.client.state is w.server.state is State.HANDSHAKE
    welcome = w.handshake({"node": "gpu-7", "pid": 12})
    assert welcome.info == {"node": "gpu-7", "pid": 12}
    assert len(welcome.mac) == 32


def test_nonces_come_from_the_nonce_function():
    c = Connection(Role.CLIENT, TOKEN, nonce=lambda n: b"c" * n)
    s = Connection(Role.SERVER, TOKEN, nonce=lambda n: b"s" * n)
    c.receive_data(s.send(Hello()))
    assert c.next_event() == Hello(PROTOCOL_VERSION, b"s" * 32)
    s.receive_data(c.send(Auth()))
    auth = s.next_event()
    assert auth.nonce == b"c" * 32


def test_empty_token_is_an_ordinary_key():
    w = Wire(b"", b"")
    w.handshake()
    with pytest.raises(AuthError):
        Wire(b"", TOKEN).handshake()


MESSAGES = [
    Request("push", {"path": "/x", "n": [1, 2.5, None, True], "ü": "ñ"}, id=7),
    Request("ping"),
    Reply(7, {"ok": True, "nested": {"a": []}}),
    QueryMissing([bytes([i]) * 16 for i in range(5)]),
    QueryMissing([]),
    MissingIds([b"\xff" * 16]),
    PutChunk(b"\x01" * 16, b"\x00blob bytes"),
    PutChunk(b"\x02" * 16, b""),
    Error("boom", code="io", id=3),
    Error("lone surrogate \ud800 and ü"),
    Error("plain"),
    Data((b'{"op":"call"}', b"\x80\x05pickle", b"", b"\x00" * 1000)),
    Data(()),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("direction", ["c2s", "s2c"])
def test_messages_round_trip(msg, direction):
    w = ready_pair()
    sender = w.client if direction == "c2s" else w.server
    assert w.deliver(sender, msg) == msg


def test_event_goes_server_to_client_only():
    w = ready_pair()
    ev = Event("output", {"stream": "stdout", "text": "hi\n"})
    assert w.deliver(w.server, ev) == ev
    with pytest.raises(ProtocolError):
        w.client.send(ev)
    w.client.receive_data(frame(FrameType.EVENT, b'{"kind":"x","data":{}}'))
    w.server.receive_data(frame(FrameType.EVENT, b'{"kind":"x","data":{}}'))
    with pytest.raises(ProtocolError, match="unexpected EVENT"):
        w.server.next_event()


def test_put_chunk_accepts_memoryview_and_big_blobs():
    w = ready_pair()
    blob = bytes(range(256)) * 40_000  # ~10 MB
    got = w.deliver(w.client, PutChunk(b"\x09" * 16, memoryview(blob)))
    assert got.cid == b"\x09" * 16 and got.blob == blob


def test_data_parts_arrive_as_writable_views_of_one_buffer():
    import array

    w = ready_pair()
    floats = array.array("d", [1.5, -2.0, 3.25])  # a buffer with 8-byte items goes out as bytes
    big = bytearray(range(256)) * 40_000  # ~10 MB
    got = w.deliver(w.server, Data([b"head", memoryview(floats), big]))
    assert [bytes(p) for p in got.parts] == [b"head", floats.tobytes(), bytes(big)]
    assert all(isinstance(p, memoryview) and not p.readonly for p in got.parts)
    assert got.parts[1].obj is got.parts[2].obj  # views into the same frame buffer
    got.parts[1][0] = 0  # writable: a receiver may rebuild mutable objects on them in place


def recv_into_all(conn: Connection, data: bytes, step: int) -> tuple[list, list]:
    """What a socket reader does: recv_into get_buffer() at most `step` bytes at a time,
    buffer_updated(), then take every event. Returns the events and the buffers handed out."""
    events, buffers, pos = [], [], 0
    while pos < len(data):
        buf = conn.get_buffer()
        n = min(step, len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        buffers.append(buf)
        conn.buffer_updated(n)
        pos += n
        events += [ev for ev in drain(conn) if ev is not NEED_DATA]
    return events, buffers


def test_large_frames_are_received_in_place():
    w = ready_pair()
    blob = bytes(range(256)) * 40_000  # ~10 MB
    msgs = [Request("a", {}, id=1), PutChunk(b"\x09" * 16, blob), Request("b", {}, id=2),
            Data([b"head", bytes(3 * IN_PLACE)]), PutChunk(b"\x01" * 16, b"\x00small")]
    data = b"".join(w.client.send(m) for m in msgs)
    got, buffers = recv_into_all(w.server, data, 100_000)
    assert got == msgs
    # The big blob is a view of the buffer its bytes were received into: no copy was made.
    assert isinstance(got[1].blob, memoryview)
    assert any(b.obj is got[1].blob.obj for b in buffers)
    assert any(b.obj is got[3].parts[1].obj for b in buffers)
    # A small frame is copied out of the shared receive buffer (which is reused).
    assert not any(b.obj is getattr(got[4].blob, "obj", None) for b in buffers)


def test_frame_buffers_are_reused_only_once_no_view_is_left():
    """Large frames are received into pooled buffers: a payload still held (queued for a
    child, being written) is never overwritten by a later frame, and a buffer whose views are
    all gone is taken again instead of a new one."""
    w = ready_pair()
    w.server._buffers = BufferPool()  # this test's own: the process's is shared (below)
    blobs = [b"\x00" + bytes([i]) * (4 * IN_PLACE) for i in range(6)]
    data = [w.client.send(PutChunk(bytes([i]) * 16, blob)) for i, blob in enumerate(blobs)]
    held = recv_into_all(w.server, data[0] + data[1], IN_PLACE)[0]
    assert [bytes(m.blob) for m in held] == blobs[:2]
    for chunk in data[2:]:
        (msg,) = recv_into_all(w.server, chunk, IN_PLACE)[0]
        del msg  # dropped at once, as a stored chunk is
    assert [bytes(m.blob) for m in held] == blobs[:2]  # untouched by the four frames after
    assert len(w.server._buffers._pool) == 3  # the two held, and one taken again and again


def test_connections_share_their_frame_buffers_and_a_daemon_makes_them_once():
    """A buffer one connection is done with serves the next connection's frames: per
    connection, every push paid again for fresh memory (10-12% of a node's CPU for 1 GiB
    here). A daemon makes its first ones when it starts (prepare)."""
    pool = BufferPool()
    pool.prepare(2)
    made = [id(raw) for raw in pool._pool]  # ids: a reference would mark a buffer as held
    assert len(made) == 2 and id(pool.take(4 * IN_PLACE).obj) in made
    for i in range(4):  # one push after another, each on a connection of its own
        w = ready_pair()
        w.server._buffers = pool  # as RECEIVING is for every connection of a process
        blob = b"\x00" + bytes([i]) * (4 * IN_PLACE)
        (msg,) = recv_into_all(w.server, w.client.send(PutChunk(bytes([i]) * 16, blob)),
                               IN_PLACE)[0]
        assert bytes(msg.blob) == blob
        del msg, w
        gc.collect()
        if i == 0:
            made = [id(raw) for raw in pool._pool]  # a frame, and the spare its reads run into
    assert [id(raw) for raw in pool._pool] == made and len(made) <= 3  # none made since
    assert ready_pair().server._buffers is RECEIVING


def test_a_large_frame_passes_at_most_its_first_in_place_bytes_through_the_shared_buffer():
    """Between large frames a read goes into the shared receive buffer, and what it takes of
    the next frame is copied out again into that frame's own buffer. Offered 256 KiB there,
    a read took 256 KiB of every 4 MiB chunk: two copies, and the shared buffer grown past
    malloc's mmap threshold and freed once per chunk (64 page faults each, 17,000 per GiB)."""
    w = ready_pair()
    blobs = [b"\x00" + bytes([i]) * (4 << 20) for i in range(3)]
    data = b"".join(w.client.send(PutChunk(bytes([i]) * 16, b)) for i, b in enumerate(blobs))
    got, buffers = recv_into_all(w.server, data, 8 << 20)  # a socket holding all of it
    assert [bytes(m.blob) for m in got] == blobs
    shared = [b for b in buffers if not any(b.obj is m.blob.obj for m in got)]
    assert shared and all(len(b) <= IN_PLACE for b in shared)


def test_a_small_buffer_or_one_past_the_pool_is_made_to_measure():
    """A small file's chunk read while every pooled buffer is held got a whole new 4 MiB
    one (a zero-fill per 20 KB file: half of a push's CPU for a tree of small files)."""
    pool = BufferPool(keep=2)
    held = [pool.take(4 << 20) for _ in range(2)]
    small, large = pool.take(20_000), pool.take(4 << 20)
    assert len(small) == 20_000 and len(small.obj) < 64 << 10
    assert len(large.obj) < BufferPool.POOLED + 4096 and len(pool._pool) == 2
    del held
    assert pool.take(1 << 20).obj is pool._pool[0]  # free again: taken from the pool


def test_send_parts_leave_the_payload_uncopied():
    w = ready_pair()
    blob = memoryview(bytes(IN_PLACE))
    parts = w.client.send_parts(PutChunk(b"\x09" * 16, blob))
    assert any(part is blob for part in parts)
    w.server.receive_data(b"".join(parts))
    assert drain(w.server)[0] == PutChunk(b"\x09" * 16, bytes(blob))


@pytest.mark.parametrize("api", ["buffer", "bytes"])
def test_connection_closed_inside_a_large_frame(api):
    w = ready_pair()
    data = w.client.send(PutChunk(b"\x09" * 16, bytes(4 * IN_PLACE)))[: 2 * IN_PLACE]
    if api == "buffer":
        assert recv_into_all(w.server, data, 10_000)[0] == []
        w.server.buffer_updated(0)
    else:
        w.server.receive_data(data)
        assert w.server.next_event() is NEED_DATA
        w.server.receive_data(b"")
    with pytest.raises(TruncatedFrame):
        w.server.next_event()


def test_buffer_updated_past_the_buffer_is_refused():
    w = ready_pair()
    w.server.receive_data(w.client.send(PutChunk(b"\x09" * 16, bytes(2 * IN_PLACE)))[:100])
    assert w.server.next_event() is NEED_DATA
    rest = len(w.server.get_buffer())
    with pytest.raises(ValueError):
        w.server.buffer_updated(rest + 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3 * IN_PLACE), min_size=1, max_size=4),
       st.integers(1, 2 * IN_PLACE), st.booleans())
def test_fuzz_chunks_of_any_size_in_any_pieces(sizes, step, buffered):
    w = ready_pair()
    msgs = [PutChunk(bytes([i]) * 16, bytes([i]) * n) for i, n in enumerate(sizes)]
    data = b"".join(w.client.send(m) for m in msgs)
    if buffered:
        assert recv_into_all(w.server, data, step)[0] == msgs
    else:
        for i in range(0, len(data), step):
            w.server.receive_data(data[i : i + step])
        assert drain(w.server) == [*msgs, NEED_DATA]


@pytest.mark.parametrize("payload", [
    b"",                                                   # no part count
    struct.pack("<I", 5000),                               # more parts than allowed
    struct.pack("<I", 2) + struct.pack("<Q", 1),           # part table cut short
    struct.pack("<IQ", 1, 4) + b"abc",                     # part longer than the frame
    struct.pack("<IQ", 1, 2) + b"abc",                     # trailing bytes
    struct.pack("<IQ", 1, 2**64 - 1) + b"abc",             # absurd length
])
def test_malformed_data_frames(payload):
    w = ready_pair()
    w.client.receive_data(frame(FrameType.DATA, payload))
    with pytest.raises(ProtocolError, match="DATA"):
        w.client.next_event()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2 * SMALL_CHUNK), min_size=1, max_size=40),
       st.integers(1, 2 * IN_PLACE))
def test_fuzz_small_chunks_travel_grouped_in_order(sizes, step):
    """Runs of small chunks share a PutChunks frame, large ones keep their own; the node sees
    every chunk, byte-exact, in the order sent."""
    w = ready_pair()
    batch = [(bytes([i]) * 16, bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    msgs = frames_for(batch)
    assert len(msgs) <= len(batch)
    data = b"".join(w.client.send(m) for m in msgs)
    got = []
    for msg in recv_into_all(w.server, data, step)[0]:
        got += msg.chunks if isinstance(msg, PutChunks) else [msg]
    assert [(c.cid, bytes(c.blob)) for c in got] == batch


@pytest.mark.parametrize("payload", [
    b"",                                                   # no chunk count
    struct.pack("<I", 5000),                               # more chunks than allowed
    struct.pack("<I", 2) + struct.pack("<16sI", b"i" * 16, 1),  # chunk table cut short
    struct.pack("<I16sI", 1, b"i" * 16, 4) + b"abc",       # blob longer than the frame
    struct.pack("<I16sI", 1, b"i" * 16, 2) + b"abc",       # trailing bytes
])
def test_malformed_put_chunks_frames(payload):
    """Sealed by the peer's own keys (an authenticated peer that sends nonsense): refused by
    the frame's checks, not by the seal."""
    w = ready_pair()
    sealer, _ = w.server._keys()
    header = HEADER.pack(len(payload) + TAG_SIZE, FrameType.PUT_CHUNKS)
    w.client.receive_data(b"".join(sealer.seal(header, [payload])))
    with pytest.raises(ProtocolError, match="PUT_CHUNKS"):
        w.client.next_event()


def test_data_is_refused_before_authentication_and_limited_in_parts():
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    s.receive_data(frame(FrameType.DATA, struct.pack("<I", 0)))
    with pytest.raises(ProtocolError, match="unexpected DATA"):
        s.next_event()
    w = ready_pair()
    with pytest.raises(ProtocolError, match="parts"):
        w.client.send(Data([b""] * 5000))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=8), st.integers(1, 64))
def test_fuzz_data_round_trip_in_any_pieces(parts, step):
    w = ready_pair()
    data = w.client.send(Data(parts))
    for i in range(0, len(data), step):
        w.server.receive_data(data[i : i + step])
    assert drain(w.server) == [Data(parts), NEED_DATA]


def test_many_frames_in_one_read_and_byte_by_byte():
    w = ready_pair()
    msgs = [Request("a", {"i": i}, id=i) for i in range(50)] + [PutChunk(b"c" * 16, b"x" * 100)]
    data = b"".join(w.client.send(m) for m in msgs)
    w.server.receive_data(data)
    assert drain(w.server) == [*msgs, NEED_DATA]
    data = b"".join(w.client.send(m) for m in msgs)  # sealed anew: a replay would not pass
    for byte in data:
        w.server.receive_data(bytes([byte]))
        ev = w.server.next_event()
        if ev is not NEED_DATA:
            assert ev == msgs.pop(0)
    assert not msgs


def test_wrong_token_at_server():
    w = Wire(client_token=b"wrong", server_token=TOKEN)
    w.deliver(w.server, Hello())
    w.server.receive_data(w.client.send(Auth()))
    with pytest.raises(AuthError, match="authentication failed: wrong token"):
        w.server.next_event()
    assert w.server.state is State.CLOSED
    with pytest.raises(AuthError):  # stays failed
        w.server.next_event()
    with pytest.raises(ProtocolError):
        w.server.send(Welcome())
    # ...but the server may still say why before hanging up.
    err = Error("authentication failed: wrong token", code="auth")
    w.client.receive_data(w.server.send(err))
    assert w.client.next_event() == err


def test_client_rejects_server_that_does_not_know_the_token():
    c = Connection(Role.CLIENT, TOKEN)
    impostor = Connection(Role.SERVER, b"other")
    c.receive_data(impostor.send(Hello()))
    c.next_event()
    c.send(Auth())
    c.receive_data(frame(FrameType.WELCOME, b"\x00" * 33 + b'{"node":"evil"}' + b"\x00" * 16))
    # Without the token it can neither seal the frame nor compute the MAC inside it.
    with pytest.raises(AuthError, match="failed authentication"):
        c.next_event()
    assert c.state is State.CLOSED


def test_welcome_mac_is_bound_to_this_session():
    """A Welcome recorded from another session (other nonces) does not authenticate."""
    w1 = Wire()
    w1.handshake()
    old_welcome = w1.sent[-1]
    c = Connection(Role.CLIENT, TOKEN)
    c.receive_data(Connection(Role.SERVER, TOKEN).send(Hello()))
    c.next_event()
    c.send(Auth())
    c.receive_data(old_welcome)
    with pytest.raises(AuthError):
        c.next_event()


def test_token_never_on_the_wire():
    w = Wire()
    w.handshake()
    for msg in MESSAGES:
        w.deliver(w.client, msg)
        w.deliver(w.server, msg)
    bad = Wire(client_token=TOKEN, server_token=b"x" + TOKEN)
    bad.deliver(bad.server, Hello())
    bad.sent.append(bad.client.send(Auth()))
    wire = b"".join(w.sent + bad.sent)
    for secret in (TOKEN, TOKEN.hex().encode(), TOKEN[:8]):
        assert secret not in wire


@pytest.mark.parametrize("ready", [False, True])
def test_oversize_frame_rejected_from_the_header_alone(ready):
    if ready:
        conn = ready_pair().server
        ftype = FrameType.PUT_CHUNK
    else:
        conn = Connection(Role.SERVER, TOKEN)
        conn.send(Hello())
        ftype = FrameType.AUTH
    conn.receive_data(HEADER.pack(1 << 30, ftype))  # 1 GiB claimed; no payload follows
    with pytest.raises(ProtocolError, match="exceeds"):
        conn.next_event()
    assert len(conn._buf) == HEADER.size  # nothing was allocated for the payload


def test_limits_at_the_boundary():
    w = Wire()
    w.client = Connection(Role.CLIENT, TOKEN, max_frame=100)
    w.handshake()
    w.client.receive_data(w.server.send(PutChunk(b"i" * 16, b"i" * (100 - 16 - TAG_SIZE))))
    assert isinstance(w.client.next_event(), PutChunk)  # 100 bytes with its tag
    w.client.receive_data(frame(FrameType.PUT_CHUNK, b"i" * 101))
    with pytest.raises(ProtocolError, match="exceeds"):
        w.client.next_event()
    assert MAX_FRAME == 80 * 1024 * 1024


def test_handshake_frames_are_small():
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    s.receive_data(HEADER.pack(4097, FrameType.ERROR))
    with pytest.raises(ProtocolError, match="exceeds"):
        s.next_event()
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    big_error = json.dumps({"message": "m" * 4000, "code": "x"}).encode()
    s.receive_data(frame(FrameType.ERROR, big_error))
    assert s.next_event().code == "x"
    w = Wire()
    w.deliver(w.server, Hello())
    w.deliver(w.client, Auth())
    with pytest.raises(ProtocolError):  # the client could not read it
        w.server.send(Welcome(info={"big": "x" * 5000}))
    # An over-long error message during the handshake is cut rather than refused.
    assert len(Connection(Role.SERVER, TOKEN).send(Error("e" * 10_000))) < 4096


def test_pre_auth_messages_rejected():
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    request = frame(FrameType.REQUEST, b'{"id":1,"op":"x","args":{}}')
    s.receive_data(Wire().client.send(Error("x")) + request)
    assert isinstance(s.next_event(), Error)  # Error is fine in any state
    with pytest.raises(ProtocolError, match="unexpected REQUEST"):
        s.next_event()
    c = Connection(Role.CLIENT, TOKEN)
    with pytest.raises(ProtocolError):
        c.send(Request("x"))
    c.receive_data(frame(FrameType.PUT_CHUNK, b"c" * 16))
    with pytest.raises(ProtocolError, match="unexpected PUT_CHUNK"):
        c.next_event()


def test_messages_in_the_wrong_direction_or_order():
    s = Connection(Role.SERVER, TOKEN)
    with pytest.raises(ProtocolError):
        s.send(Auth())  # servers never send Auth
    with pytest.raises(ProtocolError):
        s.send(Welcome())  # not before an accepted Auth
    s.receive_data(frame(FrameType.AUTH, b"\0" * 68))  # Auth before our Hello
    with pytest.raises(ProtocolError, match="unexpected AUTH"):
        s.next_event()
    c = Connection(Role.CLIENT, TOKEN)
    with pytest.raises(ProtocolError):
        c.send(Hello())
    with pytest.raises(ProtocolError):
        c.send(Auth())  # not before the server's Hello
    w = Wire()
    w.deliver(w.server, Hello())
    with pytest.raises(ProtocolError):
        w.server.send(Hello())  # only once
    w.client.receive_data(frame(FrameType.HELLO, struct.pack("<I", 1) + b"n" * 32))
    with pytest.raises(ProtocolError, match="unexpected HELLO"):
        w.client.next_event()
    w = Wire()
    w.deliver(w.server, Hello())
    w.deliver(w.client, Auth())
    with pytest.raises(ProtocolError):
        w.server.send(Reply(1, {}))  # Welcome comes first


@pytest.mark.parametrize("ftype", [FrameType.HELLO, FrameType.AUTH])
def test_version_mismatch(ftype):
    payload = struct.pack("<I", PROTOCOL_VERSION + 1) + b"\0" * 64
    conn = Connection(Role.CLIENT if ftype is FrameType.HELLO else Role.SERVER, TOKEN)
    if ftype is FrameType.AUTH:
        conn.send(Hello())
    conn.receive_data(frame(ftype, payload))
    with pytest.raises(ProtocolError,
                       match=f"version {PROTOCOL_VERSION + 1}, we speak {PROTOCOL_VERSION}"):
        conn.next_event()


def test_truncated_frame_at_eof():
    w = ready_pair()
    data = w.client.send(Request("x"))
    w.server.receive_data(data[:-1])
    assert w.server.next_event() is NEED_DATA
    w.server.receive_data(b"")
    with pytest.raises(ProtocolError, match="connection closed mid-frame"):
        w.server.next_event()
    w = ready_pair()
    w.server.receive_data(data[:3])  # a partial header
    w.server.receive_data(b"")
    with pytest.raises(ProtocolError, match="mid-frame"):
        w.server.next_event()


def test_clean_eof():
    w = ready_pair()
    w.server.receive_data(w.client.send(Request("x")))
    w.server.receive_data(b"")
    assert w.server.next_event() == Request("x")
    assert w.server.next_event() is CLOSED
    assert w.server.state is State.CLOSED
    assert w.server.next_event() is CLOSED
    with pytest.raises(ProtocolError):
        w.server.receive_data(b"more")
    with pytest.raises(ProtocolError):
        w.server.send(Reply(0, {}))
    w.server.send(Error("bye"))


def test_unknown_frame_type():
    w = ready_pair()
    w.server.receive_data(HEADER.pack(0, 200))
    with pytest.raises(ProtocolError, match="unknown frame type 200"):
        w.server.next_event()


@pytest.mark.parametrize(
    "ftype,payload",
    [
        (FrameType.REQUEST, b"not json"),
        (FrameType.REQUEST, b"\xff\xfe"),
        (FrameType.REQUEST, b"[1, 2]"),
        (FrameType.REQUEST, b'{"id": "1", "op": "x", "args": {}}'),
        (FrameType.REQUEST, b'{"id": true, "op": "x", "args": {}}'),
        (FrameType.REQUEST, b'{"id": 1, "op": 5, "args": {}}'),
        (FrameType.REQUEST, b'{"id": 1, "op": "x", "args": []}'),
        (FrameType.REQUEST, b'{"id": 1, "op": "x"}'),
        (FrameType.REQUEST, b"[" * 100_000),
        (FrameType.REQUEST, b'{"id": 1' + b"0" * 5000 + b', "op": "x", "args": {}}'),
        (FrameType.REPLY, b'{"id": 1, "value": 3}'),
        (FrameType.ERROR, b'{"message": null, "code": "x"}'),
        (FrameType.ERROR, b'{"message": "m", "code": "x", "id": "7"}'),
        (FrameType.QUERY_MISSING, b"x" * 17),
        (FrameType.MISSING_IDS, b"x" * 15),
        (FrameType.PUT_CHUNK, b"x" * 15),
        (FrameType.WELCOME, b""),
    ],
)
def test_malformed_payloads(ftype, payload):
    w = ready_pair()
    w.server.receive_data(frame(ftype, payload))
    with pytest.raises(ProtocolError):
        w.server.next_event()


def test_send_validates_ids():
    w = ready_pair()
    with pytest.raises(ProtocolError):
        w.client.send(PutChunk(b"short", b""))
    with pytest.raises(ProtocolError):
        w.client.send(QueryMissing([b"a" * 16, b"b" * 15]))


# -- fuzzing -------------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_json_objects = st.fixed_dictionaries(
    {},
    optional={
        k: _json_values for k in ("id", "op", "args", "value", "kind", "data", "message", "code")
    },
)
_right_type = {
    "id": st.integers(-(2**70), 2**70), "op": st.text(max_size=5), "kind": st.text(max_size=5),
    "message": st.text(max_size=5), "code": st.text(max_size=5),
    "args": st.dictionaries(st.text(max_size=3), _json_values, max_size=2),
}  # fmt: skip
_right_type["value"] = _right_type["data"] = _right_type["args"]
_SHAPES = {
    FrameType.REQUEST: ("id", "op", "args"), FrameType.REPLY: ("id", "value"),
    FrameType.EVENT: ("kind", "data"), FrameType.ERROR: ("message", "code"),
}  # fmt: skip


def _shaped(ftype: FrameType) -> st.SearchStrategy[dict]:
    """Objects with the fields `ftype` needs, each usually of the right type."""
    return st.fixed_dictionaries({k: _right_type[k] | _json_values for k in _SHAPES[ftype]})


_shaped_objects = st.sampled_from(list(_SHAPES)).flatmap(_shaped)
_shaped_frames = st.sampled_from(list(_SHAPES)).flatmap(
    lambda t: _shaped(t).map(lambda o: frame(t, json.dumps(o).encode()))
)
_payloads = (
    st.binary(max_size=64)
    | _shaped_objects.map(lambda o: json.dumps(o).encode())
    | _json_objects.map(lambda o: json.dumps(o).encode())
    | _json_values.map(lambda o: json.dumps(o).encode())
    | st.binary(max_size=4).map(lambda b: b"\0" * 32 + b)
)
_frames = st.one_of(
    st.binary(max_size=40),  # raw garbage
    st.tuples(st.integers(0, 12), _payloads).map(lambda t: frame(t[0], t[1])),
    _shaped_frames,
    st.tuples(st.integers(0, 12), _payloads, st.integers(0, 2**32 - 1)).map(
        lambda t: frame(t[0], t[1], t[2])  # a lying length
    ),
)
_streams = st.tuples(st.lists(_frames, max_size=6), st.booleans(), st.integers(1, 50))

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def feed(conn: Connection, frames: list[bytes], eof: bool, step: int) -> None:
    """Feed the stream in `step`-byte pieces; only ProtocolError may come out."""
    data = b"".join(frames)
    try:
        for i in range(0, len(data), step):
            conn.receive_data(data[i : i + step])
            drain(conn)
        if eof:
            conn.receive_data(b"")
            drain(conn)
    except ProtocolError:
        assert conn.state is State.CLOSED


@pytest.mark.slow
@FUZZ
@given(_streams)
def test_fuzz_server_in_handshake(stream):
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    feed(s, *stream)
    assert s.state is not State.READY  # nobody guesses the MAC


@pytest.mark.slow
@FUZZ
@given(_streams)
def test_fuzz_client_in_handshake(stream):
    c = Connection(Role.CLIENT, TOKEN)
    feed(c, *stream)
    assert c.state is not State.READY


@pytest.mark.slow
@FUZZ
@given(_streams, st.sampled_from(["client", "server"]))
def test_fuzz_ready_connection(stream, side):
    w = ready_pair()
    feed(w.client if side == "client" else w.server, *stream)


# ---- sealed sessions: every frame after the handshake is authenticated -----------------------


def test_a_proxy_that_relayed_the_handshake_cannot_inject_a_request():
    """The session hijack: a man in the middle passes the handshake through untouched, then
    writes a request of its own. It has no session key, so the daemon refuses the frame."""
    w = ready_pair()
    w.server.receive_data(frame(FrameType.REQUEST, b'{"id":1,"op":"spawn","args":{}}'
                                + b"\x00" * TAG_SIZE))
    with pytest.raises(AuthError, match="failed authentication"):
        w.server.next_event()
    assert w.server.state is State.CLOSED


@pytest.mark.parametrize("where", ["header", "payload", "tag"])
def test_a_changed_byte_anywhere_in_a_frame_is_refused(where):
    w = ready_pair()
    data = bytearray(w.client.send(PutChunk(b"c" * 16, b"chunk bytes" * 10)))
    at = {"header": 4, "payload": 30, "tag": len(data) - 1}[where]
    data[at] ^= 1
    w.server.receive_data(bytes(data))
    with pytest.raises(ProtocolError):  # AuthError, or the changed type is not allowed
        w.server.next_event()


@pytest.mark.parametrize("attack", ["replay", "reorder", "drop"])
def test_replayed_reordered_or_dropped_frames_are_refused(attack):
    w = ready_pair()
    a, b = (w.client.send(Request(op, {}, id=i)) for i, op in enumerate(("a", "b"), 1))
    stream = {"replay": a + a, "reorder": b + a, "drop": b}[attack]
    w.server.receive_data(stream)
    with pytest.raises(AuthError):
        drain(w.server)


def test_large_frames_are_checked_in_place_too():
    w = ready_pair()
    data = bytearray(w.client.send(PutChunk(b"c" * 16, bytes(4 * IN_PLACE))))
    data[3 * IN_PLACE] ^= 0xFF
    events, _ = recv_into_all(w.server, bytes(data[:IN_PLACE]), IN_PLACE)
    with pytest.raises(AuthError):
        recv_into_all(w.server, bytes(data[IN_PLACE:]), IN_PLACE)


def encrypted_pair(client: bool, server: bool) -> Wire:
    w = Wire()
    w.client = Connection(Role.CLIENT, TOKEN, encrypt=client)
    w.server = Connection(Role.SERVER, TOKEN, encrypt=server)
    w.handshake()
    return w


@pytest.mark.parametrize("client,server", [(True, False), (False, True), (True, True)])
def test_either_side_can_ask_for_encryption(client, server):
    w = encrypted_pair(client, server)
    assert w.client.encrypted and w.server.encrypted
    secret = b"MONARCH_MESH_TOKEN=" + b"s3cr3t" * 20
    for msg in (Request("spawn", {"secrets": {"T": secret.decode()}}, id=1),
                PutChunk(b"c" * 16, secret), PutChunk(b"c" * 16, secret * 1000),
                Data([b"head", secret * 1000])):
        data = w.client.send(msg)
        assert b"s3cr3t" not in data
        w.server.receive_data(data)
        got = drain(w.server)[0]
        assert got == msg
    reply = w.server.send(Reply(1, {"echo": secret.decode()}))
    assert b"s3cr3t" not in reply
    w.client.receive_data(reply)
    assert drain(w.client)[0] == Reply(1, {"echo": secret.decode()})


def test_decrypted_data_parts_are_writable():
    w = encrypted_pair(True, False)
    w.server.receive_data(w.client.send(Data([b"x" * 10, bytes(2 * IN_PLACE)])))
    got = drain(w.server)[0]
    assert all(not part.readonly for part in got.parts)


def test_encrypted_chunks_sealed_together_arrive_whole_and_in_place():
    """Several large encrypted frames sealed before any is written (one send_many) each get
    their own space for their ciphertext; received in place, a chunk's plaintext stays in the
    frame's own buffer, writable and with its raw bytes on a page (an O_DIRECT write's)."""
    import ctypes

    w = encrypted_pair(True, True)
    blobs = [b"\0" + os.urandom(4 * IN_PLACE) for _ in range(3)]  # raw blobs
    parts = [part for b in blobs for part in w.client.send_parts(PutChunk(b"c" * 16, b))]
    data = b"".join(parts)
    w.client.sent()
    assert blobs[0][1:64] not in data
    events, _ = recv_into_all(w.server, data, IN_PLACE)
    assert [bytes(m.blob) for m in events] == blobs
    for m in events:
        assert not m.blob.readonly
        raw = m.blob[1:]
        assert ctypes.addressof(ctypes.c_char.from_buffer(raw)) % 4096 == 0
    again = w.client.send(PutChunk(b"d" * 16, blobs[0]))  # the arena's space, used again
    w.server.receive_data(again)
    assert drain(w.server)[0] == PutChunk(b"d" * 16, blobs[0])


def test_without_encryption_payloads_are_authenticated_but_readable():
    w = encrypted_pair(False, False)
    assert not w.client.encrypted and not w.server.encrypted
    assert b"plain words" in w.client.send(Request("x", {"w": "plain words"}, id=1))


def test_a_proxy_cannot_strip_the_request_for_encryption():
    """The client's 'encrypt' flag is inside its MAC: clearing it breaks authentication."""
    w = Wire()
    w.client = Connection(Role.CLIENT, TOKEN, encrypt=True)
    w.deliver(w.server, Hello())
    auth = bytearray(w.client.send(Auth()))
    flag_at = HEADER.size + 4 + 32
    assert auth[flag_at] == 1
    auth[flag_at] = 0
    w.server.receive_data(bytes(auth))
    with pytest.raises(AuthError, match="wrong token"):
        w.server.next_event()


def test_an_unauthenticated_peer_gets_a_small_receive_buffer():
    s = Connection(Role.SERVER, TOKEN)
    s.send(Hello())
    assert len(s.get_buffer()) <= 4096
    w = ready_pair()
    assert len(w.server.get_buffer()) >= 64 * 1024  # bulk data once authenticated


def test_chunks_sent_outside_frames_are_sealed_one_by_one():
    w = ready_pair()
    assert w.client.bulk_key == w.server.bulk_key and len(w.client.bulk_key) == 32
    assert Wire().client.bulk_key is None
    tx, rx = ChunkSealer(w.client.bulk_key), ChunkSealer(w.server.bulk_key)
    blob = bytes(range(256)) * 100
    sealed = blob + tx.seal(b"i" * 16, blob)
    assert bytes(rx.open(b"i" * 16, sealed)) == blob
    with pytest.raises(SealError):
        rx.open(b"j" * 16, sealed)  # the id is covered
    bad = bytearray(sealed)
    bad[7] ^= 1
    with pytest.raises(SealError):
        rx.open(b"i" * 16, bad)
    other = ready_pair()  # another session's key
    with pytest.raises(SealError):
        ChunkSealer(other.server.bulk_key).open(b"i" * 16, sealed)
