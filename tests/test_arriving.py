"""Large frames checked while they arrive (daemon/wire/arriving.py), the digest a raw chunk
brings to the store, and the huge pages its buffer lies in (daemon/wire/buffers.py)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import xxhash
from test_protocol import drain, encrypted_pair, ready_pair, recv_into_all

from monarch_fs.daemon.wire.buffers import HUGE, BufferPool
from monarch_fs.daemon.wire.connection import NEED_DATA
from monarch_fs.daemon.wire.protocol import AuthError, Data, PutChunk, Request
from monarch_fs.fs import chunk
from monarch_fs.fs.chunk import RAW, CorruptChunk, chunk_id
from monarch_fs.fs.store import Store

MiB = 1 << 20


@pytest.mark.parametrize("step", [1000, 64 * 1024 + 7, 512 * 1024, 8 * MiB])
def test_a_raw_chunk_received_in_place_carries_the_digest_of_its_bytes(step):
    """The node hashes a chunk while it arrives, so the store need not read it again."""
    w = ready_pair()
    data = os.urandom(4 * MiB)
    cid = chunk_id(data)
    got, _ = recv_into_all(w.server, w.client.send(PutChunk(cid, bytes([RAW]) + data)), step)
    assert len(got) == 1 and got[0].cid == cid and bytes(got[0].blob[1:]) == data
    assert got[0].digest == cid


def test_a_digest_is_never_taken_from_the_peer():
    """The sender's message may carry any digest: the receiver hashes the bytes it got."""
    w = ready_pair()
    real, sent = os.urandom(MiB), os.urandom(MiB)
    msg = PutChunk(chunk_id(real), bytes([RAW]) + sent, digest=chunk_id(real))
    got, _ = recv_into_all(w.server, w.client.send(msg), 256 * 1024)
    assert got[0].digest == xxhash.xxh3_128_digest(sent) != chunk_id(real)


def test_compressed_or_small_chunks_carry_no_digest():
    """Only a raw blob's bytes are its content, and a small frame is not received in place:
    the store hashes those itself."""
    w = ready_pair()
    text = b"compressible " * 100_000
    for blob in (chunk.encode(text), chunk.encode(b"small")):
        got, _ = recv_into_all(w.server, w.client.send(PutChunk(chunk_id(text), blob)), MiB)
        assert got[0].digest is None


@pytest.mark.parametrize("step", [1000, 64 * 1024 + 7, 8 * MiB])
def test_an_encrypted_chunk_is_decrypted_in_place_as_it_arrives(step):
    """--encrypt on: decrypted piece by piece where it was received (on its page, for
    O_DIRECT), and hashed as its plaintext appears; a changed ciphertext byte fails it."""
    e = encrypted_pair(True, True)
    data = os.urandom(4 * MiB)
    sent = e.client.send(PutChunk(chunk_id(data), bytes([RAW]) + data))
    assert data[:4096] not in sent
    got, buffers = recv_into_all(e.server, sent, step)
    assert bytes(got[0].blob[1:]) == data and got[0].digest == chunk_id(data)
    assert any(got[0].blob.obj is b.obj for b in buffers)  # where it was received
    tampered = bytearray(e.client.send(PutChunk(chunk_id(data), bytes([RAW]) + data)))
    tampered[3 * MiB] ^= 1
    with pytest.raises(AuthError):
        recv_into_all(e.server, bytes(tampered), step)


def test_a_changed_byte_in_the_last_piece_still_fails_the_frame():
    """The tag is checked over pieces as they come; the last piece and the tag count too."""
    w = ready_pair()
    data = bytearray(w.client.send(PutChunk(b"c" * 16, bytes([RAW]) + bytes(2 * MiB))))
    data[-20] ^= 1
    with pytest.raises(AuthError):
        recv_into_all(w.server, bytes(data), 300_000)


def test_the_store_checks_a_chunk_by_its_digest_and_refuses_a_mismatch(tmp_path):
    s = Store(tmp_path / "store")
    data, other = os.urandom(MiB), os.urandom(MiB)
    blob = bytes([RAW]) + data
    done = s.put_blobs([(chunk_id(data), blob)], digests=[xxhash.xxh3_128_digest(other)])
    assert isinstance(done[0], CorruptChunk) and "does not match its id" in str(done[0])
    assert not s.has(chunk_id(data)) and s.usage() == (0, 0)
    # a digest of a compressed blob is refused, not trusted
    text = b"compressible " * 10_000
    done = s.put_blobs([(chunk_id(text), chunk.encode(text))], digests=[chunk_id(text)])
    assert isinstance(done[0], CorruptChunk)
    assert s.put_blobs([(chunk_id(data), blob)], digests=[chunk_id(data)]) == [True]
    assert s.get(chunk_id(data)) == data


def test_a_large_file_object_is_not_written_from_a_chunk_whose_digest_mismatches(tmp_path):
    s = Store(tmp_path / "store")
    data, other = os.urandom(4 * MiB), os.urandom(4 * MiB)
    cid = chunk_id(data)
    assert s.expect_file("k" * 32, len(data), [cid], 4 * MiB)
    done = s.put_blobs([(cid, bytes([RAW]) + other)], digests=[chunk_id(other)])
    assert isinstance(done[0], CorruptChunk) and not s.has(cid)
    assert s.put_blobs([(cid, bytes([RAW]) + data)], digests=[cid]) == [True]
    assert s.get(cid) == data


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif("[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled")
                    .read_text(), reason="transparent huge pages are off on this host")
@pytest.mark.parametrize("lead", [0, 22])
def test_a_chunk_is_received_into_huge_pages(lead):
    """A 4 MiB chunk's bytes lie in two huge pages (the recv copy and O_DIRECT's pinning walk
    2 pages, not 1024), starting on a page for O_DIRECT."""
    buf = BufferPool().take(4 * MiB + lead + 16, lead)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf)) + lead
    assert start % HUGE == 0
    for address in (start, start + 4 * MiB - 1):
        assert "hg" in _vm_flags(address)  # MADV_HUGEPAGE


def readv_all(conn, data: bytes, step: int) -> tuple[list, list]:
    """What the socket reader does (transport.Channel): recvmsg_into get_buffers() at most
    `step` bytes at a time, buffers_updated(), then take every event. Returns the events and
    the buffers past a large frame that a read wrote the start of (the next frame's)."""
    events, spares, pos = [], [], 0
    while pos < len(data):
        bufs, n = conn.get_buffers(), 0
        for i, buf in enumerate(bufs):
            take = min(len(buf), step - n, len(data) - pos - n)
            buf[:take] = data[pos + n : pos + n + take]
            n += take
            if i and take:
                spares.append(buf.obj)
        conn.buffers_updated(n)
        pos += n
        events += [ev for ev in drain(conn) if ev is not NEED_DATA]
    return events, spares


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("step", [1000, 64 * 1024 + 7, MiB, 16 * MiB])
def test_a_stream_of_chunks_is_received_where_it_lands(step, encrypt):
    """The read that ends one large frame starts the next one in a buffer of its own, where it
    stays: after the first, no chunk's bytes pass through the shared receive buffer."""
    w = encrypted_pair(True, True) if encrypt else ready_pair()
    datas = [os.urandom(4 * MiB) for _ in range(3)] + [os.urandom(MiB)]
    msgs = [PutChunk(chunk_id(d), bytes([RAW]) + d) for d in datas[:2]]
    msgs += [Request("a", {}, id=1), PutChunk(chunk_id(datas[2]), bytes([RAW]) + datas[2]),
             Data([b"head", datas[3]]), PutChunk(chunk_id(b"small"), chunk.encode(b"small"))]
    got, spares = readv_all(w.server, b"".join(w.client.send(m) for m in msgs), step)
    assert len(got) == len(msgs)
    for sent, received in zip(msgs, got):
        assert type(received) is type(sent)
        if isinstance(sent, PutChunk):
            assert received.cid == sent.cid and bytes(received.blob) == bytes(sent.blob)
            raw = len(sent.blob) > 64 * 1024
            assert received.digest == (sent.cid if raw else None)
    assert bytes(got[4].parts[1]) == datas[3]
    # the chunks that follow a chunk are where the read that ended it put them
    assert any(got[1].blob.obj is spare for spare in spares)
    assert any(got[4].parts[1].obj is spare for spare in spares)


def test_bytes_past_a_frame_that_are_not_a_large_frame_are_parsed_as_ever():
    """A read past a chunk that holds a request and half a header: parsed from the receive
    buffer, and a forged frame there is still refused."""
    w = ready_pair()
    data = os.urandom(MiB)
    stream = (w.client.send(PutChunk(chunk_id(data), bytes([RAW]) + data))
              + w.client.send(Request("b", {}, id=2)))
    forged = bytearray(w.client.send(PutChunk(chunk_id(data), bytes([RAW]) + data)))
    forged[100] ^= 1
    got, _ = readv_all(w.server, stream + bytes(forged[:3]), 8 * MiB)
    assert [type(m) for m in got] == [PutChunk, Request] and got[1].op == "b"
    with pytest.raises(AuthError):
        readv_all(w.server, bytes(forged[3:]), 8 * MiB)
