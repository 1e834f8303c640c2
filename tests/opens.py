"""What was opened below a folder, as the kernel's inotify IN_OPEN events tell it: how the scan
cache tests see which files a push read. A helper, not a test file."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

IN_OPEN = 0x20
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class Opens:
    """The files below `root` that anything opened since the last call, as inotify saw it."""

    def __init__(self, root: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.dirs: dict[int, bytes] = {}
        self.root = os.fsencode(root)
        self.rewatch()

    def rewatch(self) -> None:
        """Watch every folder of the tree (call after creating folders)."""
        for dirpath, _, _ in os.walk(self.root):
            wd = self.libc.inotify_add_watch(self.fd, dirpath, IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self.dirs[wd] = dirpath

    def files(self) -> list[str]:
        opened = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return sorted(opened)
            pos = 0
            while pos < len(buf):
                wd, mask, _, n = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size:pos + _EVENT.size + n].rstrip(b"\0")
                pos += _EVENT.size + n
                if mask & IN_OPEN and not mask & IN_ISDIR and name:
                    full = os.path.join(self.dirs[wd], name)
                    opened.append(os.fsdecode(os.path.relpath(full, self.root)))

    def close(self) -> None:
        os.close(self.fd)
