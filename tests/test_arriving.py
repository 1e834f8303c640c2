"""Large frames checked while they arrive (daemon/wire/arriving.py), the digest a raw chunk
brings to the store, and the huge pages its buffer lies in (daemon/wire/buffers.py)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import xxhash
from test_protocol import encrypted_pair, ready_pair, recv_into_all

from monarch_fs.daemon.wire.buffers import HUGE, BufferPool
from monarch_fs.daemon.wire.protocol import AuthError, PutChunk
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
