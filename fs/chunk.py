"""Chunks: the unit of content. An id is the xxh3_128 of the raw bytes; a blob is how a chunk is
stored and sent (one codec byte, then the payload), compressed with zstd only when that saves space.

Compression and hashing release the GIL, so callers run these in worker threads and parallelise
across chunks.
"""

from __future__ import annotations

import threading

import xxhash
import zstandard

CHUNK_SIZE = 4 * 1024 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
ID_SIZE = 16
ZSTD_LEVEL = 1

RAW = 0
ZSTD = 1

# Below this, zstd frames cost more than they save; above it, keep compression only if it
# saves at least 1/16 of the bytes (decompression is not free on the read path).
_MIN_COMPRESS = 256
# A chunk this big is first judged by a sample: SAMPLES slices of SAMPLE bytes, spread over it,
# compressed alone. An incompressible 4 MiB chunk (a wheel's archive, model weights, random
# bytes) then costs 64 KiB of zstd, not 4 MiB and a copy: 18% of a push process's CPU was that
# attempt on 1 GiB of such data. On the torch venv's 366 chunks of 256 KiB or more, the sample
# and the whole chunk agree on every one (slices alone compress a little worse, so the sample
# only ever says "raw" for data that saves less than 1/16 whole).
SAMPLE_FROM = 256 * 1024
SAMPLES = 4
SAMPLE = 16 * 1024

_local = threading.local()


class CorruptChunk(Exception):
    """A blob does not decode to bytes whose hash is its id."""


def chunk_id(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def spans(size: int, chunk_size: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a file of `size` bytes; an empty file has none."""
    if size <= chunk_size:  # most files (a scan asks for every one): without the loop
        return [(0, size)] if size else []
    return [(off, min(chunk_size, size - off)) for off in range(0, size, chunk_size)]


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def compressible(data: bytes | bytearray | memoryview) -> bool:
    """Whether zstd is worth trying on `data`: for a large chunk, whether a sample of it
    saves 1/16 (see SAMPLE_FROM); a small one is always tried."""
    if len(data) < _MIN_COMPRESS:
        return False
    if len(data) < SAMPLE_FROM:
        return True
    view = memoryview(data)
    step = (len(view) - SAMPLE) // (SAMPLES - 1)
    c = _compressor()
    packed = sum(len(c.compress(view[i * step : i * step + SAMPLE])) for i in range(SAMPLES))
    whole = SAMPLES * SAMPLE
    return packed < whole - whole // 16


def encode(data: bytes | bytearray | memoryview) -> bytes:
    """The blob for `data`: zstd when it saves space, else raw."""
    if compressible(data):
        packed = _compressor().compress(data)
        if len(packed) < len(data) - len(data) // 16:
            return bytes([ZSTD]) + packed
    return bytes([RAW]) + data


def raw_size(blob: bytes | bytearray | memoryview) -> int:
    """The size of the chunk a blob decodes to, as its header claims; -1 if it claims none."""
    if len(blob) and blob[0] == RAW:
        return len(blob) - 1
    if len(blob) and blob[0] == ZSTD:
        try:
            return zstandard.frame_content_size(blob[1:])
        except zstandard.ZstdError:
            return -1
    return -1


def decode(cid: bytes, blob: bytes | bytearray | memoryview,
           max_size: int = MAX_CHUNK_SIZE) -> bytes | memoryview:
    """The raw bytes of a blob, verified against `cid`. Raises CorruptChunk, never wrong bytes.
    A raw blob comes back as a view of itself: the read path moves 4 MiB chunks, and a copy
    costs as much as the hash."""
    if len(blob) < 1:
        raise CorruptChunk(f"chunk {cid.hex()}: empty blob")
    codec = blob[0]
    data: bytes | memoryview
    if codec == RAW:
        data = memoryview(blob)[1:]
    elif codec == ZSTD:
        try:
            # The frame header may claim any size, and zstandard allocates what it claims:
            # check the claim before decompressing.
            claimed = zstandard.frame_content_size(blob[1:])
            if claimed > max_size:
                raise CorruptChunk(f"chunk {cid.hex()}: claims {claimed} bytes, over the limit")
            data = _decompressor().decompress(blob[1:], max_output_size=max_size)
        except zstandard.ZstdError as e:
            raise CorruptChunk(f"chunk {cid.hex()}: bad zstd data ({e})") from None
    else:
        raise CorruptChunk(f"chunk {cid.hex()}: unknown codec {codec}")
    if len(data) > max_size or chunk_id(data) != cid:
        raise CorruptChunk(f"chunk {cid.hex()}: content does not match its id")
    return data
