"""What crosses an RDMA bulk connection besides chunk bytes: fragment headers, credit messages,
and the ring geometry a sender proposes; all checked on receipt (BulkProtocolError).

How these are used is rdma_engines.py's docstring. Pure: no pyverbs, no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .frames import MAX_FRAME  # a chunk blob never exceeds one frame
from .protocol import ID_SIZE

HEADER_SIZE = 64
MSG_SIZE = 64  # small SEND/RECV buffers: credit messages, SRD fragment announcements
_MAGIC = b"MFSB"
_HEADER = struct.Struct("<4sQ16sQQI")  # magic, fseq, chunk id, blob length, offset, length
_CREDIT = struct.Struct("<4sQ")  # magic, cumulative fragments released
_CREDIT_MAGIC = b"MFSC"

MAX_SLOTS = 1024
MIN_SLOT_SIZE = 4096
MAX_SLOT_SIZE = 64 << 20
MAX_RING = 1 << 30  # registered bytes per ring (pyverbs MR offsets are C ints)

RC = "rdma-rc"
SRD = "rdma-srd"
TCP = "tcp"


class BulkProtocolError(Exception):
    """The peer broke the bulk protocol (bad slot, sequence, header or credit count)."""


# ---- headers and small messages ---------------------------------------------------------------


@dataclass(frozen=True)
class Fragment:
    """The 64-byte header in front of each fragment in a ring slot (and, on SRD, the message
    that announces it): which fragment of which chunk this is."""

    fseq: int
    cid: bytes
    total: int  # length of the whole blob
    offset: int  # where this fragment starts in the blob
    length: int

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.fseq, self.cid, self.total, self.offset,
                            self.length).ljust(HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes | memoryview, payload_limit: int) -> Fragment:
        if len(data) < _HEADER.size:
            raise BulkProtocolError(f"fragment header of {len(data)} bytes is truncated")
        magic, fseq, cid, total, offset, length = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise BulkProtocolError("fragment header has a bad magic number")
        if length > payload_limit:
            raise BulkProtocolError(
                f"fragment of {length} bytes exceeds the slot ({payload_limit})")
        if total > MAX_FRAME or offset + length > total or (length == 0 and total != 0):
            raise BulkProtocolError(
                f"fragment {fseq}: offset {offset} + length {length} does not fit a blob of "
                f"{total} bytes")
        return cls(fseq, cid, total, offset, length)


def encode_credit(released: int) -> bytes:
    """The receiver's credit message: how many fragments it has released, cumulatively."""
    return _CREDIT.pack(_CREDIT_MAGIC, released).ljust(MSG_SIZE, b"\0")


def decode_credit(data: bytes | memoryview) -> int:
    if len(data) < _CREDIT.size:
        raise BulkProtocolError("credit message is truncated")
    magic, released = _CREDIT.unpack_from(data)
    if magic != _CREDIT_MAGIC:
        raise BulkProtocolError("credit message has a bad magic number")
    return released


def fragments(cid: bytes, blob: bytes | memoryview, payload: int) -> list[tuple[int, int]]:
    """(offset, length) of each fragment of `blob`; an empty blob is one empty fragment."""
    if len(cid) != ID_SIZE:
        raise ValueError(f"chunk id must be {ID_SIZE} bytes")
    if len(blob) > MAX_FRAME:
        raise ValueError(f"blob of {len(blob)} bytes exceeds {MAX_FRAME}")
    if payload <= 0:
        raise ValueError("slot payload must be positive")
    if not len(blob):
        return [(0, 0)]
    return [(off, min(payload, len(blob) - off)) for off in range(0, len(blob), payload)]


def check_geometry(slots: object, slot_size: object) -> tuple[int, int]:
    """Ring geometry a peer proposes, checked before anything is registered; (slots, slot_size)
    as ints once checked."""
    if not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise BulkProtocolError(f"ring of {slots!r} slots: must be 1..{MAX_SLOTS}")
    if not isinstance(slot_size, int) or not MIN_SLOT_SIZE <= slot_size <= MAX_SLOT_SIZE:
        raise BulkProtocolError(
            f"slot size {slot_size!r}: must be {MIN_SLOT_SIZE}..{MAX_SLOT_SIZE} bytes")
    if slots * slot_size > MAX_RING:
        raise BulkProtocolError(f"ring of {slots} x {slot_size} bytes exceeds {MAX_RING}")
    return slots, slot_size


def unwrap32(value: int, reference: int) -> int:
    """The 64-bit count nearest `reference` whose low 32 bits are `value` (for immediates)."""
    base = reference - (1 << 31)
    return base + ((value - base) & 0xFFFFFFFF)

