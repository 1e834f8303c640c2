"""The chunks a version's first reads need, read into the page cache at its commit.

A large file's chunks are written with O_DIRECT (fs/file_objects.py), past the page cache, so
on a fresh node the first `import torch` after a push faulted libtorch_cpu.so in from disk
through passthrough: 4.3-5.5 s for the import against 2.1-3.6 s with the pages in memory
(bench/results/coldstart-profile-20261206.md). The push hands the nodes the chunks the dev box
knows were read first after earlier publishes (daemon/client/first_reads.py), and the node
asks the kernel for exactly those, in that order, in the background.

Only those: a passthrough file's first reads are recorded from its pages in the page cache
(fs/residency.py), so a read ahead of whole files would make every page look read (tried in
c19eb01 and reverted). Read ahead of the list, a recording holds what was read plus what was
read the time before: the list stays the import's.

posix_fadvise(WILLNEED) reads at most one readahead window per call (the kernel caps it at the
device's read_ahead_kb or its largest request), so a range is asked for window by window. It
is only advice: the kernel may drop the pages again under memory pressure, nothing waits for
it, and a version asks for at most a quarter of the memory available (at most BUDGET).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from .backing import BackingFiles, wanted
from .manifest import Manifest

log = logging.getLogger(__name__)

BUDGET = 2 << 30  # bytes read ahead per version, at most
DEFAULT_WINDOW = 128 << 10  # the kernel's default read_ahead_kb

Range = tuple[Path, int, int]  # a file, an offset, a length


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


def budget(most: int = BUDGET) -> int:
    """What one version may read ahead: a quarter of the memory available, at most `most`."""
    return min(most, memory_available() // 4 or most)


def chunk_ranges(manifest: Manifest, backing: BackingFiles, ids: Sequence[bytes]
                 ) -> list[Range]:
    """Where `ids` lie in the backing files of `manifest`'s large files, in the order of
    `ids` (a chunk in several files: in each). Chunks of small files (read through the
    daemon from packs written through the page cache) and of files without a whole backing
    file yet are left out. Blocking: a worker thread."""
    wanted_ids = set(ids)
    places: dict[bytes, list[Range]] = {}
    size = manifest.chunk_size
    for e in manifest:
        if not wanted(e) or wanted_ids.isdisjoint(e.chunks):
            continue
        if (path := backing.ready(e)) is None:
            continue
        for k, cid in enumerate(e.chunks):
            if cid in wanted_ids:
                places.setdefault(cid, []).append((path, k * size, min(size, e.size - k * size)))
    return [r for cid in dict.fromkeys(ids) for r in places.get(cid, ())]


def read_ahead(ranges: Iterable[Range], most: int) -> int:
    """Ask the kernel to read `ranges` into the page cache, in order, until `most` bytes are
    asked for; the bytes asked. A file that cannot be opened (renamed or pruned meanwhile) is
    skipped. Blocking (an open and a few syscalls per window): a worker thread."""
    asked = 0
    fds: dict[Path, int] = {}
    steps: dict[int, int] = {}  # window by device
    try:
        for path, off, length in ranges:
            if asked >= most:
                break
            fd = fds.get(path)
            if fd is None:
                try:
                    fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    log.debug("reading %s ahead: %s", path, e)
                    continue
            dev = os.fstat(fd).st_dev
            step = steps.get(dev) or steps.setdefault(dev, window(path))
            length = min(length, most - asked)
            for at in range(off, off + length, step):
                os.posix_fadvise(fd, at, min(step, off + length - at), os.POSIX_FADV_WILLNEED)
            asked += length
    finally:
        for fd in fds.values():
            os.close(fd)
    return asked


def chunks(manifest: Manifest, backing: BackingFiles, ids: Sequence[bytes]) -> int:
    """Read `ids` of `manifest`'s large files ahead (chunk_ranges, read_ahead), within this
    version's budget; the bytes asked. Blocking: a worker thread."""
    asked = read_ahead(chunk_ranges(manifest, backing, ids), budget())
    log.debug("read %d bytes of %d first-read chunks ahead", asked, len(ids))
    return asked
