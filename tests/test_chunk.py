"""fs/chunk.py: chunk ids, spans, and the stored form of a chunk (raw or zstd), verified on
decode. Real bytes; no mocks."""

from __future__ import annotations

import os
import struct
import tracemalloc

import pytest
import xxhash
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from helpers import FUZZ
from monarch_fs.fs import chunk
from monarch_fs.fs.chunk import (
    CHUNK_SIZE,
    ID_SIZE,
    MAX_CHUNK_SIZE,
    RAW,
    ZSTD,
    CorruptChunk,
    chunk_id,
    spans,
)


def test_chunk_id_is_xxh3_128_of_the_raw_bytes():
    assert chunk_id(b"hello") == xxhash.xxh3_128_digest(b"hello")
    assert len(chunk_id(b"")) == ID_SIZE == 16
    assert chunk_id(memoryview(b"hello")) == chunk_id(b"hello")
    assert chunk_id(b"hello") != chunk_id(b"hellp")


def test_spans_cover_the_file_exactly():
    assert spans(0) == []
    assert spans(1, 10) == [(0, 1)]
    assert spans(10, 10) == [(0, 10)]
    assert spans(25, 10) == [(0, 10), (10, 10), (20, 5)]
    assert len(spans(CHUNK_SIZE + 1)) == 2


@pytest.mark.parametrize("data", [
    b"",
    b"x",
    b"a" * 255,  # below the compression threshold
    b"a" * 100_000,  # compressible
    os.urandom(100_000),  # incompressible
], ids=["empty", "one", "short", "compressible", "random"])
def test_encode_decode_round_trip(data):
    blob = chunk.encode(data)
    assert chunk.decode(chunk_id(data), blob) == data
    assert chunk.decode(chunk_id(data), memoryview(blob)) == data


def test_encode_compresses_only_when_it_saves_space():
    text = b"hello world " * 10_000
    blob = chunk.encode(text)
    assert blob[0] == ZSTD and len(blob) < len(text) // 10
    noise = os.urandom(10_000)
    assert chunk.encode(noise) == bytes([RAW]) + noise
    assert chunk.encode(b"a" * 100) == bytes([RAW]) + b"a" * 100  # too small to bother


def test_a_large_chunk_that_does_not_compress_is_judged_by_a_sample():
    """A 4 MiB random chunk is stored raw after zstd saw 64 KiB of it, not 4 MiB; a library-
    like one (4 bits of entropy a byte) still compresses."""
    noise = os.urandom(CHUNK_SIZE)
    assert not chunk.compressible(noise)
    assert chunk.encode(noise) == bytes([RAW]) + noise
    half = noise.translate(bytes(i & 0x0F for i in range(256)))
    assert chunk.compressible(half)
    blob = chunk.encode(half)
    assert blob[0] == ZSTD and len(blob) < 0.7 * len(half)
    assert chunk.decode(chunk_id(half), blob) == half


def test_decode_refuses_bytes_that_do_not_match_the_id():
    data = b"hello world " * 1000
    for blob in (chunk.encode(data), bytes([RAW]) + data):
        with pytest.raises(CorruptChunk):
            chunk.decode(chunk_id(b"something else"), blob)


@pytest.mark.parametrize("blob", [
    b"",
    b"\x02payload",
    b"\xffpayload",
    b"\x01not a zstd frame at all",
    b"\x01",
])
def test_decode_refuses_malformed_blobs(blob):
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(b"payload"), blob)


def test_decode_enforces_max_size():
    data = b"a" * 10_000
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(data), bytes([RAW]) + data, max_size=1000)
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(data), chunk.encode(data), max_size=1000)
    # A decompression bomb whose frame does not declare its size is cut off too.
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (4 << 20))
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(b"\0" * (4 << 20)), bytes([ZSTD]) + bomb, max_size=1 << 20)


def _zstd_with_declared_size(data: bytes, declared: int) -> bytes:
    """A zstd blob for `data` whose frame header claims `declared` content bytes."""
    frame = zstandard.ZstdCompressor().compress(data)
    fhd = frame[4]
    assert fhd >> 6 == 1 and fhd & 0x20, "expected a single-segment frame with a 2-byte size"
    return bytes([ZSTD]) + frame[:4] + bytes([0xE0]) + struct.pack("<Q", declared) + frame[7:]


@pytest.mark.parametrize("declared", [2**31, 2**40], ids=["2GiB", "1TiB"])
def test_decode_of_a_frame_claiming_a_huge_size_fails_fast_as_corrupt(declared):
    data = b"a" * 1000
    blob = _zstd_with_declared_size(data, declared)
    assert len(blob) < 64
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunk):
            chunk.decode(chunk_id(data), blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * MAX_CHUNK_SIZE


@FUZZ
@given(st.binary(max_size=300), st.binary(min_size=16, max_size=16))
def test_decode_of_arbitrary_bytes_raises_only_corrupt_chunk(blob, some_id):
    try:
        data = chunk.decode(some_id, blob)
    except CorruptChunk:
        return
    assert chunk_id(data) == some_id  # only possible if the fuzzer found a real preimage
