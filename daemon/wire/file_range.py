"""Bytes of an open file that a socket takes straight from the page cache (sendfile(2)).

A new large file's chunk is already in the dev box's page cache when the push sends it: the
scan read it there to hash it (daemon/client/scan_stream.py). Sending it from the buffer it was
read into copied it once more into the socket, 14% of the push process's CPU for 1 GiB; from
the file, the socket refers to the cached pages and the receiver's copy is the only one.

What is sealed is what was read and hashed. The file could change between that read and the
sendfile: then the peer receives bytes that do not match the frame's seal (or the chunk's id),
refuses them and ends the session. Never wrong bytes; the push names the changed file
(scan_stream checks each file's stat key once its chunks are sent).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import trio


@dataclass(frozen=True)
class FileRange:
    """`length` bytes of the open file `fd` from `offset`: a part of a frame to write."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


class FileShrank(Exception):
    """The file ended before the range did: it was cut while its bytes were being sent."""


async def send_range(sock: trio.socket.SocketType, part: FileRange) -> None:
    """Write `part` to `sock` with sendfile(2), waiting while the socket is full."""
    sent = 0
    while sent < part.length:
        try:
            n = os.sendfile(sock.fileno(), part.fd, part.offset + sent, part.length - sent)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        if n == 0:
            raise FileShrank(f"the file ended {part.length - sent} bytes before the chunk sent "
                             "from it: it changed while it was pushed")
        sent += n
    await trio.lowlevel.checkpoint()


def from_file(parts: list, blob: bytes | memoryview, source: FileRange) -> list:
    """A sealed frame's `parts` with the chunk's bytes taken from its file where they are
    written as they are (an authenticated, not encrypted, large frame passes the blob on as
    one part): the blob's lead (its codec byte) stays, the rest becomes `source`."""
    lead = len(blob) - source.length
    if lead < 0:
        raise ValueError("a chunk's source is longer than its blob")
    return [p for part in parts
            for p in ((memoryview(blob)[:lead], source) if part is blob else (part,))]


def read_range(part: FileRange) -> bytes:
    """The bytes of `part`, read (for a stream that is not a socket)."""
    data = os.pread(part.fd, part.length, part.offset)
    if len(data) != part.length:
        raise FileShrank("the file ended before the chunk read from it: it changed while it "
                         "was pushed")
    return data


def more_flag(follows_file: bool) -> int:
    """sendmsg's flags before a FileRange: hold the header back for the bytes that follow."""
    return socket.MSG_MORE if follows_file else 0
