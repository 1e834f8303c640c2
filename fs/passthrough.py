"""FUSE passthrough: bind an open FUSE file to a backing file the kernel reads directly.

The daemon registers an open file descriptor with the kernel (FUSE_DEV_IOC_BACKING_OPEN on the
/dev/fuse descriptor, root only), and answers the FUSE open with the id it got back; reads and
mmaps of that open file then never reach the daemon. The id is closed when no open file of the
inode is left (the kernel keeps its own reference for as long as a file uses it).

Available with the patched pyfuse3 the Makefile builds (`fs/pyfuse3.patch`: it negotiates
passthrough at INIT and carries `FileInfo.backing_id`, through libfuse's own API on 3.16+ and
through `fuse_session_custom_io()` on Debian 12's 3.14), on Linux 6.9+ with
CONFIG_FUSE_PASSTHROUGH, and for a daemon that has CAP_SYS_ADMIN. The INIT reply alone proves
little, so the mount registers one backing file before it serves opens (`probe`): passthrough
is on only when the kernel hands back an id.
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
from typing import Protocol, cast

import pyfuse3

# From <linux/fuse.h>: struct fuse_backing_map { int32_t fd; uint32_t flags; uint64_t padding; }
_MAP = struct.Struct("<iIQ")
_IOC_WRITE, _FUSE_DEV_IOC_MAGIC = 1, 229


def _iow(nr: int, size: int) -> int:
    return _IOC_WRITE << 30 | size << 16 | _FUSE_DEV_IOC_MAGIC << 8 | nr


BACKING_OPEN = _iow(1, _MAP.size)
BACKING_CLOSE = _iow(2, 4)


class _Patched(Protocol):
    """What fs/pyfuse3.patch adds to pyfuse3 (its stubs describe the stock module). Used only
    where built_in() or hasattr() has shown the patched build."""

    WANT_PASSTHROUGH: bool

    def passthrough_negotiated(self) -> bool: ...

    def passthrough_why(self) -> str: ...

    def fuse_fd(self) -> int: ...


_patched = cast(_Patched, pyfuse3)


def built_in() -> bool:
    """Whether this pyfuse3 can negotiate passthrough (the Makefile's patched build)."""
    return hasattr(pyfuse3, "WANT_PASSTHROUGH")


def request(want: bool) -> None:
    """Ask for passthrough at the next FUSE INIT (call before pyfuse3.init)."""
    if built_in():
        _patched.WANT_PASSTHROUGH = want


def asked() -> bool:
    """Whether FUSE INIT asked the kernel for passthrough (known inside Operations.init)."""
    return bool(getattr(pyfuse3, "PASSTHROUGH", False))


def negotiated() -> tuple[bool, str]:
    """(whether the INIT reply took passthrough, why not); known once INIT is answered."""
    if not hasattr(pyfuse3, "passthrough_negotiated"):
        return asked(), "" if asked() else "the kernel offers no passthrough"
    return _patched.passthrough_negotiated(), _patched.passthrough_why()


def probe(folder: os.PathLike[str] | str) -> int:
    """Register (and release) a file of `folder` as a backing file: the id the kernel gave,
    which is > 0 when passthrough works for files there. Raises OSError when it refuses."""
    fd, path = tempfile.mkstemp(prefix=".probe", suffix=".tmp", dir=folder)
    try:
        os.close(fd)
        backing_id = open_backing(path)
        if backing_id > 0:
            close_backing(backing_id)
        return backing_id
    finally:
        os.unlink(path)


def open_backing(path: os.PathLike[str] | str) -> int:
    """Register `path` with the kernel; returns the backing id for FileInfo.backing_id."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        arg = bytearray(_MAP.pack(fd, 0, 0))
        return fcntl.ioctl(_patched.fuse_fd(), BACKING_OPEN, arg, True)
    finally:
        os.close(fd)


def close_backing(backing_id: int) -> None:
    fcntl.ioctl(_patched.fuse_fd(), BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)
