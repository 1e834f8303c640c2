"""A large frame received in place (connection.py), checked while it arrives.

A 4 MiB chunk does not fit in a core's L2 cache here (2 MiB): checked once whole, its tag (GMAC)
and then its id (xxh3, on the worker thread that stores it) each read all of it back from L3
or memory. Fed a piece at a time right after each recv_into, both read what the kernel has
just written there. So a frame's tag is checked as it arrives (an encrypted frame decrypted
in place on the way), and a raw PUT_CHUNK's bytes are hashed too: its message carries that
digest (PutChunk.digest), which the store compares with the chunk's id instead of hashing
the chunk again. Nothing is trusted before the whole frame's tag has verified.
"""

from __future__ import annotations

import xxhash

from ...fs.chunk import RAW
from .chunk_seals import TAIL, SealedCheck
from .frames import HEADER, Buffer, FrameType
from .protocol import ID_SIZE
from .seal import TAG_SIZE, FrameCheck

# A chunk's raw bytes start this far into its PUT_CHUNK frame: header, chunk id, codec byte
# (and into a SEALED_CHUNK: header, seal nonce, codec byte).
CHUNK_DATA = HEADER.size + ID_SIZE + 1
CHUNKS = (FrameType.PUT_CHUNK, FrameType.SEALED_CHUNK)
# fed to the tag (or the decryption) and the hash in turn, so the hash reads it from cache
_PIECE = 256 * 1024


class Arriving:
    """One large frame's own buffer, how much of it has arrived, and (`check` given) its
    tag's and chunk's checks so far."""

    def __init__(self, ftype: FrameType, frame: memoryview, got: int,
                 check: FrameCheck | SealedCheck | None) -> None:
        self.ftype = ftype
        self.frame = frame
        self.got = got
        self._check = check
        self._covered = len(frame) - TAG_SIZE  # what a sealed frame's tag covers
        # where a raw chunk's bytes end (a SEALED_CHUNK's chunk id and seal tag follow them)
        self._data_end = self._covered - (TAIL if ftype is FrameType.SEALED_CHUNK else 0)
        # an encrypted frame's header was given to its check (the associated data)
        self._fed = HEADER.size if check is not None and check.decrypts else 0
        self._hash: xxhash.xxh3_128 | None = None
        self._hash_decided = ftype not in CHUNKS or check is None
        self._feed()

    @property
    def whole(self) -> bool:
        return self.got == len(self.frame)

    def rest(self) -> memoryview:
        """Where the frame's next bytes go."""
        return self.frame[self.got :]

    def add(self, data: Buffer) -> memoryview:
        """Copy as much of `data` as the frame still lacks into it; what is left over."""
        view = memoryview(data)
        take = min(len(view), len(self.frame) - self.got)
        self.frame[self.got : self.got + take] = view[:take]
        self.received(take)
        return view[take:]

    def received(self, n: int) -> None:
        """`n` more bytes were written at rest()."""
        if n > len(self.frame) - self.got:
            raise ValueError("buffer_updated() past the end of get_buffer()")
        self.got += n
        self._feed()

    def _feed(self) -> None:
        if self._check is None:
            return
        end = min(self.got, self._covered)
        while self._fed < end:
            stop = min(end, self._fed + _PIECE)
            self._check.update(self.frame[self._fed : stop])  # plaintext from here on
            if not self._hash_decided and stop >= CHUNK_DATA:  # the codec byte is in
                self._hash_decided = True
                if self.frame[CHUNK_DATA - 1] == RAW:
                    self._hash = xxhash.xxh3_128()
            if self._hash is not None and min(stop, self._data_end) > CHUNK_DATA:
                self._hash.update(self.frame[max(self._fed, CHUNK_DATA) :
                                             min(stop, self._data_end)])
            self._fed = stop

    @property
    def checked(self) -> bool:
        """Whether the frame's tag is checked as it arrives (else open it whole)."""
        return self._check is not None

    def finish(self) -> tuple[memoryview, bytes | None]:
        """The whole frame's payload, its tag checked, and a raw chunk's digest (None if not
        hashed here). Raises seal.SealError."""
        if self._check is None or not self.whole:
            raise ValueError("finish() of a frame not checked here, or not whole")
        self._check.finish(self.frame[self._covered :])
        digest = self._hash.digest() if self._hash is not None else None
        return self.frame[HEADER.size : self._covered], digest
