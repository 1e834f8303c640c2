"""Chunk seals: a large chunk's bytes are authenticated once, by the first node (or dev box)
that sends it, and every relay hop checks that seal and forwards it with the same bytes, instead
of checking each frame under its upstream link's key and sealing it again under each child's.

A SEALED_CHUNK frame carries a chunk of at least MIN_BLOB bytes on a link that is not
encrypted, laid out so that its bytes start where a PUT_CHUNK's do (on a page, for O_DIRECT):

    header (5) | seal nonce r (16) | blob | chunk id (16) | seal tag (16) | link tag (16)

* The seal: AES-256-GCM with an empty plaintext (GMAC) over blob + chunk id, under the key
  HMAC-SHA256(token, "monarch-fs chunk seal" + r), with r random (os.urandom) for every chunk
  sealed and a fixed GCM nonce. Every key seals one message, so no GCM nonce ever repeats
  under a key, whoever seals (the dev box, or a hop that got the chunk unsealed: over RDMA,
  from its store). The key never travels: every node holds the token, and r alone says
  nothing without it.
* The link tag: the session's own seal (seal.py), with its sequence number as the nonce, over
  the header, r, the chunk id and the seal tag, not the blob. So a frame changed, injected,
  replayed, reordered or dropped on a link still fails the link's check, and a changed blob
  fails the chunk's seal (and its id, in the store): a hop runs one GMAC per byte, not two.

A frame is checked as it arrives (arriving.py): `SealedCheck` feeds the link's check and the
chunk's as the bytes come. Only a peer whose Welcome offered CAPABILITY is sent these frames.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import TypeGuard

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .frames import HEADER, Buffer, FrameType
from .protocol import ID_SIZE, ProtocolError, PutChunk
from .seal import NONCE_SIZE, TAG_SIZE, FrameCheck, Sealer, SealError

CAPABILITY = "chunk_seals"  # in a server's Welcome info: it takes SEALED_CHUNK frames
MIN_BLOB = 64 * 1024  # smaller chunks go grouped in PUT_CHUNKS frames (bulk.SMALL_CHUNK)
SEAL_NONCE = 16
SEAL_SIZE = SEAL_NONCE + TAG_SIZE  # PutChunk.seal: r, then the seal's tag
HEAD = HEADER.size + SEAL_NONCE  # what the frame holds before its blob
TAIL = ID_SIZE + TAG_SIZE  # ... and after it, before the link's tag
_LABEL = b"monarch-fs chunk seal"
_GCM_NONCE = bytes(NONCE_SIZE)  # every key seals one chunk (see the module docstring)


def applies(msg: object, encrypted: bool) -> TypeGuard[PutChunk]:
    """Whether `msg` goes as a SEALED_CHUNK frame on a link that takes them."""
    return isinstance(msg, PutChunk) and not encrypted and len(msg.blob) >= MIN_BLOB


def _key(token: bytes, r: Buffer) -> bytes:
    return hmac.new(token, _LABEL + bytes(r), hashlib.sha256).digest()


def seal(token: bytes, cid: bytes, blob: Buffer) -> bytes:
    """A new seal of (cid, blob): r and the tag, SEAL_SIZE bytes (PutChunk.seal)."""
    r = os.urandom(SEAL_NONCE)
    gcm = Cipher(algorithms.AES(_key(token, r)), modes.GCM(_GCM_NONCE)).encryptor()
    gcm.authenticate_additional_data(blob)
    gcm.authenticate_additional_data(cid)
    gcm.finalize()
    return r + gcm.tag


def sealed_frame(sealer: Sealer, token: bytes, msg: PutChunk, limit: int) -> list[Buffer]:
    """The buffers of `msg` as a SEALED_CHUNK frame: its own seal forwarded if it came with one
    (a relay hop), else sealed now (the dev box); the link's tag covers all but the blob."""
    if len(msg.cid) != ID_SIZE:
        raise ProtocolError(f"PUT_CHUNK: chunk id must be {ID_SIZE} bytes")
    got = msg.seal if msg.seal is not None else seal(token, msg.cid, msg.blob)
    if len(got) != SEAL_SIZE:
        raise ProtocolError(f"chunk {msg.cid.hex()}: a seal is {SEAL_SIZE} bytes")
    size = SEAL_NONCE + len(msg.blob) + TAIL + TAG_SIZE
    if size > limit:
        raise ProtocolError(f"SEALED_CHUNK frame of {size} bytes exceeds the limit of {limit}")
    head, link_tag = sealer.seal(HEADER.pack(size, FrameType.SEALED_CHUNK),
                                 [got[:SEAL_NONCE], msg.cid, got[SEAL_NONCE:]])
    view = memoryview(head)
    return [view[:HEAD], msg.blob, view[HEAD:], link_tag]


class SealedCheck:
    """The checks of one SEALED_CHUNK frame, fed its bytes in order as they arrive (the link
    tag left out): the link's over the header, r, the chunk id and the seal tag, the chunk's
    seal over the blob and the chunk id, under the key r names."""

    decrypts = False

    def __init__(self, link: FrameCheck, token: bytes, covered: int, encrypted: bool) -> None:
        if encrypted:  # such a session encrypts every chunk (--encrypt): never sent in clear
            raise ProtocolError("SEALED_CHUNK frame on an encrypted session")
        if covered < HEAD + TAIL:
            raise ProtocolError("SEALED_CHUNK frame too short")
        self._link = link
        self._token = token
        self._blob_end = covered - TAIL
        self._at = 0
        self._head = bytearray()  # the header and r, until both are in
        self._tail = bytearray()  # the chunk id and the seal tag
        self._chunk: FrameCheck | None = None

    def update(self, piece: memoryview) -> None:
        at = self._at
        self._at += len(piece)
        if at < HEAD:
            take = min(len(piece), HEAD - at)
            self._head += piece[:take]
            piece, at = piece[take:], at + take
            if len(self._head) == HEAD:
                self._link.update(memoryview(self._head))
                key = _key(self._token, self._head[HEADER.size :])
                self._chunk = FrameCheck(key, _GCM_NONCE)
        blob = piece[: max(0, self._blob_end - at)]
        if len(blob) and self._chunk is not None:
            self._chunk.update(blob)
        self._tail += piece[len(blob) :]

    def finish(self, tag: Buffer) -> None:
        """Raises SealError: the link's (a frame changed, replayed, reordered, dropped), else
        the chunk's (its bytes changed on the way), naming the chunk."""
        tail = memoryview(self._tail)
        self._link.update(tail)
        self._link.finish(tag)
        if self._chunk is None or len(tail) != TAIL:
            raise SealError("SEALED_CHUNK frame ended before its seal")
        self._chunk.update(tail[:ID_SIZE])
        try:
            self._chunk.finish(tail[ID_SIZE:])
        except SealError:
            raise SealError(f"chunk {bytes(tail[:ID_SIZE]).hex()} failed its seal: its bytes "
                            "were changed on the way") from None
