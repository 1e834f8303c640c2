"""Large files read into the page cache ahead of their first reader, from the commit on.

A large file's chunks are written with O_DIRECT (fs/file_objects.py), past the page cache, so
on a fresh node the first `import torch` after a push read libtorch_cpu.so and its neighbours
from disk through passthrough, one fault-around window at a time: 4.3-5.5 s for the import,
against 2.5 s with the same pages in memory (bench/results/coldstart-profile-20261206.md). A
read ahead of whole files is large sequential I/O the disk does in the background, while the
push finishes and the job starts.

posix_fadvise(WILLNEED) reads at most one readahead window per call (the kernel caps it at
the device's read_ahead_kb or its largest request), so a file is asked for window by window.
It is only advice: the kernel may drop the pages again under memory pressure, and nothing
waits for it. At most `budget` bytes per call (a quarter of the memory available, at most
BUDGET), each file object once per daemon: a file kept across versions is not read again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

BUDGET = 2 << 30  # bytes read ahead per version, at most
DEFAULT_WINDOW = 128 << 10  # the kernel's default read_ahead_kb


def window(path: str | os.PathLike[str]) -> int:
    """Bytes one WILLNEED reads at most for a file on `path`'s device: its queue's
    read_ahead_kb (a partition's is its disk's), else the kernel's default."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for q in (base / "queue", base / ".." / "queue"):
        try:
            kb = int((q / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
        if kb > 0:
            return kb << 10
    return DEFAULT_WINDOW


def memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


class Readahead:
    """Asks the kernel to read whole files into the page cache, each once, within a budget."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget = budget
        self.done: set[str] = set()  # files asked for, by name (a file object's key)
        self.asked = 0  # bytes asked for since start (telemetry, tests)
        self._window: dict[int, int] = {}  # by device

    def files(self, paths: Iterable[Path]) -> int:
        """Read `paths` ahead, in order, until the budget for this call is spent; the bytes
        asked for. Blocking (an open and a few syscalls per window): a worker thread."""
        left = min(self.budget, memory_available() // 4 or self.budget)
        asked = 0
        for path in paths:
            if path.name in self.done:
                continue
            try:
                asked += self._file(path, left - asked)
            except OSError as e:  # advice only: a file pruned meanwhile, an odd filesystem
                log.debug("reading %s ahead: %s", path, e)
                continue
            self.done.add(path.name)
            if asked >= left:
                break
        self.asked += asked
        return asked

    def _file(self, path: Path, most: int) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            step = self._window.get(st.st_dev)
            if step is None:
                step = self._window[st.st_dev] = window(path)
            size = min(st.st_size, max(most, 0))
            for off in range(0, size, step):
                os.posix_fadvise(fd, off, min(step, size - off), os.POSIX_FADV_WILLNEED)
            return size
        finally:
            os.close(fd)
