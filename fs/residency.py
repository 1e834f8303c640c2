"""Which parts of a file are in the page cache (mincore(2) over a shared read-only mapping, as
fincore and vmtouch ask).

A file read by FUSE passthrough is read by the kernel from its backing file, and no request
reaches the daemon: what a job's start read of it (`import torch` maps libtorch_cpu.so and
touches part of it) shows only as the backing file's pages in memory. Large files are written
with O_DIRECT (fs/file_objects.py), past the page cache, so on a node those pages are what was
read since (and the readahead around it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident_pages(path: str | os.PathLike[str]) -> bytes:
    """One byte per page of the file at `path`, odd where that page is in the page cache.
    Maps it without reading anything. OSError if it cannot."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise _error(path)
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise _error(path)
            return vec.raw
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_chunks(path: str | os.PathLike[str], chunk_size: int) -> list[int]:
    """The indices of the `chunk_size` pieces of the file at `path` of which some page is in
    the page cache, in order."""
    pages = resident_pages(path).translate(_LOW_BIT)  # the other bits are reserved
    per = max(1, chunk_size // PAGE)
    return [i for i in range((len(pages) + per - 1) // per)
            if b"\x01" in pages[i * per:(i + 1) * per]]


def _error(path: str | os.PathLike[str]) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err), str(Path(path)))
