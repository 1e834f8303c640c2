"""Chunk seals (daemon/wire/chunk_seals.py): a large chunk is sealed once by whoever first sends
it, a relay hop checks that seal and forwards it with the very bytes it received, and the
next node checks it again; each link's own tag still covers the rest of every frame. Driven
on the protocol state machines: the dev box's link to a hop, and the hop's link to a leaf."""

from __future__ import annotations

import json
import os
import re

import pytest
import trio
from test_protocol import drain, encrypted_pair, ready_pair, recv_into_all
from test_session_security import Proxy, run_cli

from monarch_fs.daemon.wire import chunk_seals
from monarch_fs.daemon.wire.connection import Connection, Role
from monarch_fs.daemon.wire.frames import HEADER, FrameType
from monarch_fs.daemon.wire.protocol import AuthError, ProtocolError, PutChunk, Request
from monarch_fs.fs.chunk import RAW, chunk_id

MiB = 1 << 20


def chunk(size: int = 4 * MiB) -> PutChunk:
    data = os.urandom(size)
    return PutChunk(chunk_id(data), bytes([RAW]) + data)


def through_a_hop(msg: PutChunk, step: int = 256 * 1024):
    """`msg` from the dev box to a hop, and forwarded by the hop as it arrived: the hop's
    message, the bytes the hop sends on, and the hop -> leaf link."""
    upstream, down = ready_pair(), ready_pair()
    got, _ = recv_into_all(upstream.server, upstream.client.send(msg), step)
    assert len(got) == 1
    return got[0], down.client.send(got[0]), down


def test_a_hop_forwards_a_chunk_with_its_seal_and_the_leaf_gets_the_same_bytes():
    msg = chunk()
    at_hop, sent, down = through_a_hop(msg)
    assert sent[HEADER.size - 1] == FrameType.SEALED_CHUNK
    assert at_hop.seal is not None and len(at_hop.seal) == chunk_seals.SEAL_SIZE
    assert at_hop.digest == msg.cid  # the hop hashed it as it arrived, for its own store
    got, _ = recv_into_all(down.server, sent, 300_000)
    assert got == [msg] and bytes(got[0].blob) == msg.blob and got[0].digest == msg.cid
    assert got[0].seal == at_hop.seal  # forwarded as the dev box sealed it, not sealed again


def test_a_hop_forwards_the_very_buffer_it_received_into():
    at_hop, _, down = through_a_hop(chunk())
    parts = down.client.send_parts(at_hop)
    assert any(isinstance(p, memoryview) and p.obj is at_hop.blob.obj for p in parts)
    assert sum(len(p) for p in parts) - len(at_hop.blob) < 128  # header, seal, link tag


@pytest.mark.parametrize("where", [0, 1, 2 * MiB, 4 * MiB])
def test_a_chunk_changed_at_a_hop_is_refused_by_the_next_node(where):
    """The hop (or a man in the middle after it) changes a byte of the blob it forwards: the
    leaf refuses the chunk, naming it, and delivers nothing."""
    msg = chunk()
    _, sent, down = through_a_hop(msg)
    tampered = bytearray(sent)
    tampered[HEADER.size + chunk_seals.SEAL_NONCE + where] ^= 1
    with pytest.raises(AuthError, match=f"chunk {msg.cid.hex()} failed its seal"):
        recv_into_all(down.server, bytes(tampered), 256 * 1024)


def test_a_blob_sealed_for_another_chunk_is_refused():
    """A hop that swaps in another chunk's bytes, with that chunk's seal, under this chunk's
    id and frame: the seal binds the id too."""
    a, b = chunk(MiB), chunk(MiB)
    sealed_b, _, _ = through_a_hop(b)
    down = ready_pair()
    forged = down.client.send(PutChunk(a.cid, sealed_b.blob, seal=sealed_b.seal))
    with pytest.raises(AuthError, match=f"chunk {a.cid.hex()} failed its seal"):
        recv_into_all(down.server, forged, MiB)


@pytest.mark.parametrize("where", ["header", "seal nonce", "chunk id", "seal tag", "link tag"])
def test_the_link_tag_covers_everything_but_the_blob(where):
    msg = chunk(MiB)
    _, sent, down = through_a_hop(msg)
    tail = len(sent) - chunk_seals.TAIL - 16
    at = {"header": 0, "seal nonce": HEADER.size + 3, "chunk id": tail + 1,
          "seal tag": tail + 20, "link tag": len(sent) - 1}[where]
    tampered = bytearray(sent)
    tampered[at] ^= 1
    with pytest.raises(AuthError, match="failed authentication"):  # the header's: size - 1
        recv_into_all(down.server, bytes(tampered), MiB)


@pytest.mark.parametrize("attack", ["replay", "reorder", "drop"])
def test_replayed_reordered_or_dropped_sealed_frames_are_refused(attack):
    """Each sealed frame is bound to its place in its link's sequence: a frame replayed (its
    chunk seal is still valid), reordered or dropped fails the link's tag."""
    w = ready_pair()
    a, b = (w.client.send(chunk(MiB)) for _ in range(2))
    stream = {"replay": a + a, "reorder": b + a, "drop": b}[attack]
    with pytest.raises(AuthError, match="failed authentication"):
        recv_into_all(w.server, stream, 512 * 1024)


def test_a_sealed_frame_from_another_link_is_refused():
    """Sealed for a link with other keys (another hop's, a recording of another session)."""
    theirs, ours = ready_pair(), ready_pair()
    with pytest.raises(AuthError, match="failed authentication"):
        recv_into_all(ours.server, theirs.client.send(chunk(MiB)), MiB)


def test_small_chunks_and_other_frames_are_sealed_per_link_as_before():
    w = ready_pair()
    small = PutChunk(chunk_id(b"x" * 1000), bytes([RAW]) + b"x" * 1000)
    for msg in (small, Request("status", {}, id=1)):
        data = w.client.send(msg)
        assert data[HEADER.size - 1] != FrameType.SEALED_CHUNK
        w.server.receive_data(data)
        assert drain(w.server)[0] == msg


def test_an_encrypted_link_encrypts_its_chunks_and_refuses_sealed_frames():
    """--encrypt on: a chunk's bytes never cross in clear, so it goes encrypted under the
    link's key as before; a SEALED_CHUNK frame on such a session is refused."""
    e = encrypted_pair(True, True)
    msg = chunk(MiB)
    data = e.client.send(msg)
    assert data[HEADER.size - 1] == FrameType.PUT_CHUNK and msg.blob[1:4097] not in data
    got, _ = recv_into_all(e.server, data, MiB)
    assert got == [msg]
    plain = ready_pair()
    sealed = plain.client.send(msg)
    e2 = encrypted_pair(False, True)
    e2.client.encrypted, e2.client.seal_chunks = False, True  # a client that would send it
    with pytest.raises(ProtocolError):
        recv_into_all(e2.server, sealed, MiB)


def test_a_server_that_does_not_offer_chunk_seals_gets_put_chunk_frames():
    """The server's Welcome says it takes SEALED_CHUNK frames (and the client keeps that word
    out of the info it hands on)."""
    w = ready_pair()
    assert w.client.seal_chunks
    old = Connection(Role.CLIENT, b"t")
    assert not old.seal_chunks
    w.client.seal_chunks = False
    msg = chunk(MiB)
    data = w.client.send(msg)
    assert data[HEADER.size - 1] == FrameType.PUT_CHUNK
    got, _ = recv_into_all(w.server, data, MiB)
    assert got == [msg] and got[0].seal is None


def test_a_chunk_seal_is_new_each_time_it_is_made():
    """Every seal has its own key (HMAC of the token and a random r), so no GCM nonce repeats
    under a key, whoever seals."""
    msg = chunk(MiB)
    seals = {chunk_seals.seal(b"token", msg.cid, msg.blob) for _ in range(50)}
    assert len(seals) == 50
    assert len({s[: chunk_seals.SEAL_NONCE] for s in seals}) == 50


def sealed_frames(streams: list[bytearray]) -> set[bytes]:
    """r, chunk id and seal tag of every SEALED_CHUNK frame in what clients sent a proxy."""
    out = set()
    for sent in streams:
        at = 0
        while at + HEADER.size <= len(sent):
            size, ftype = HEADER.unpack_from(sent, at)
            end = at + HEADER.size + size
            if end > len(sent):
                break
            if ftype == FrameType.SEALED_CHUNK:
                out.add(bytes(sent[at + HEADER.size : at + chunk_seals.HEAD])
                        + bytes(sent[end - 16 - chunk_seals.TAIL : end - 16]))
            at = end
    return out


@pytest.mark.mount
async def test_real_nodes_relay_the_seals_the_dev_box_made(fresh_cluster, tmp_path):
    """A chain of 2 daemons, each behind a recording proxy: node 0 forwards each large chunk
    to node 1 with the seal the dev box made for it (sealed once per push, not per link), and
    both serve the file."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    data = os.urandom(9 * MiB)  # chunks of 4, 4 and 1 MiB
    (src / "big.bin").write_bytes(data)
    first, second = Proxy(c.hosts[0]), Proxy(c.hosts[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(first.serve)
        await nursery.start(second.serve)
        out = await run_cli("push", str(src), "--hosts", f"{first.addr},{second.addr}",
                            "--token-file", c.token_file, "--topology", "chain", "--json")
        nursery.cancel_scope.cancel()
    assert out.returncode == 0, out.stderr
    from_dev_box = sealed_frames(first.from_clients)
    assert len(from_dev_box) == 3
    assert sealed_frames(second.from_clients) == from_dev_box
    for i in range(2):
        assert (c.mnt(i) / "ws" / "big.bin").read_bytes() == data


@pytest.mark.mount
async def test_a_chunk_changed_between_two_real_nodes_is_refused_and_never_served(
        fresh_cluster, tmp_path):
    """A chain of 2 daemons, a man in the middle of node 0's link to node 1 changing a byte of
    the first sealed chunk node 0 forwards: node 1 refuses it with a line naming the peer and
    the chunk, the push fails naming node 1 and why, and nothing is published; the next push
    (the link clean again) relays the same chunks and node 1 serves the right bytes."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    data = os.urandom(9 * MiB)
    (src / "big.bin").write_bytes(data)
    proxy = Proxy(c.hosts[1], corrupt=FrameType.SEALED_CHUNK)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        push = ("push", str(src), "--hosts", f"{c.hosts[0]},{proxy.addr}", "--token-file",
                c.token_file, "--topology", "chain", "--json")
        out = await run_cli(*push)
        assert proxy.corrupted, "node 0 sent node 1 no SEALED_CHUNK frame"
        log = (c.dir / "node-1" / "log").read_text()
        assert re.search(r"session with 127\.0\.0\.1:\d+ ended: chunk [0-9a-f]{32} failed "
                         r"its seal: its bytes were changed on the way", log), log[-2000:]
        assert out.returncode != 0
        assert re.search(rf"{re.escape(proxy.addr)}: chunk [0-9a-f]{{32}} failed its seal",
                         out.stderr), out.stderr
        assert not any((c.mnt(i) / "ws").exists() for i in range(2))
        again = await run_cli(*push)
        nursery.cancel_scope.cancel()
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["failed"] == {}
    for i in range(2):
        assert (c.mnt(i) / "ws" / "big.bin").read_bytes() == data


def test_small_sealed_chunks_read_whole_in_one_go_are_checked_as_any():
    """A read past one large frame can hold the next frames whole (a tree's 64-128 KiB chunks
    back to back): they are checked from the receive buffer as they stand, their seals and
    digests as if they had arrived piece by piece, and a changed one is refused all the same."""
    chunks = [chunk(4 * MiB)] + [chunk(70_000 + i) for i in range(3)]
    w = ready_pair()
    data = b"".join(w.client.send(m) for m in chunks)
    got, _ = recv_into_all(w.server, data, 8 * MiB)  # a read takes the rest whole
    assert [(m.cid, bytes(m.blob)) for m in got] == [(m.cid, m.blob) for m in chunks]
    assert all(m.seal is not None and m.digest == m.cid for m in got)
    w = ready_pair()
    sent = [w.client.send(m) for m in chunks]
    last = bytearray(sent[-1])
    last[HEADER.size + chunk_seals.SEAL_NONCE + 100] ^= 1
    with pytest.raises(AuthError, match=f"chunk {chunks[-1].cid.hex()} failed its seal"):
        recv_into_all(w.server, b"".join(sent[:-1]) + bytes(last), 8 * MiB)
