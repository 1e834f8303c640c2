"""The lock that makes one process the owner of a store (a node's, or the dev box's).

A store is appended to and collected by one process at a time: another one on the same folder
would interleave records, or delete a pack the first still indexes.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .private_files import PRIVATE_FILE


class StoreBusy(Exception):
    """Another process owns this store."""


def lock(root: Path) -> int:
    """The lock of the store at `root`, taken: a file descriptor, closed to release it.
    StoreBusy when another process holds it."""
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreBusy(f"store {root} is in use by another process") from None
    return fd
