"""Large files read into the page cache ahead of their first reader (fs/readahead.py): a
pushed file object is written with O_DIRECT, past the page cache, and the first `import
torch` on a fresh node read libtorch_cpu.so from disk, one fault at a time.

Real daemons and mounts (root: passthrough), real files on the disk the tests run on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_passthrough import backing_dir, file_objects, require_passthrough

from helpers import wait_for
from monarch_fs.fs.readahead import Readahead
from monarch_fs.fs.residency import resident_pages

MiB = 1 << 20


def fs_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts, longest mount point)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        point, what = line.split()[1], line.split()[2]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, what
    return kind


def needs_a_disk(path: Path) -> None:
    """On tmpfs every page is in memory anyway (and O_DIRECT is refused): nothing to see."""
    if fs_type(path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{path} is on {fs_type(path)}: every page is in memory anyway")


def in_memory(path: Path) -> float:
    """The share of `path`'s pages in the page cache."""
    pages = resident_pages(path)
    return sum(pages) / max(len(pages), 1)


def cold_file(path: Path, size: int) -> None:
    """A file of random bytes whose pages are not in the page cache (written, flushed,
    dropped)."""
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="FUSE passthrough needs root")
def test_a_pushed_large_file_is_in_memory_before_its_first_read(fresh_cluster, tmp_path):
    """Right after a push to a fresh node, a large file's pages are in the page cache before
    anyone reads it: the first reader (a loader mapping a .so) is not left to fault it in
    from disk. Before, they stayed on disk until read (O_DIRECT wrote them)."""
    needs_a_disk(tmp_path)
    c = fresh_cluster(1)
    require_passthrough(c)
    src = tmp_path / "ws"
    src.mkdir()
    data = os.urandom(24 * MiB)
    (src / "libbig.so").write_bytes(data)
    c.push(src)
    wait_for(lambda: len([n for n in file_objects(c) if not n.endswith((".part", ".settled"))])
             == 1, 30, "the file object to be whole")
    (name,) = [n for n in file_objects(c) if not n.endswith((".part", ".settled"))]
    obj = backing_dir(c) / name
    wait_for(lambda: in_memory(obj) > 0.9, 10, f"{obj} to be read into the page cache "
             f"(in memory: {in_memory(obj):.0%})")
    assert (c.mnt(0) / "ws" / "libbig.so").read_bytes() == data


def test_readahead_keeps_to_its_budget_and_reads_a_file_once(tmp_path):
    """What a version's commit asks for is bounded (an 8 GiB env must not flush the page
    cache), in the order given, and a file kept across versions is not asked for again."""
    needs_a_disk(tmp_path)
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    cold_file(a, 8 * MiB)
    cold_file(b, 8 * MiB)
    if in_memory(a) > 0.1:
        pytest.skip("this filesystem keeps pages in memory after DONTNEED")
    ra = Readahead(budget=8 * MiB)
    assert ra.files([a, b]) == 8 * MiB
    wait_for(lambda: in_memory(a) > 0.9, 10, "a.so to be read ahead")
    assert in_memory(b) < 0.1, "read ahead past the budget"
    assert ra.files([a]) == 0  # once per file
    assert ra.files([b]) == 8 * MiB
    wait_for(lambda: in_memory(b) > 0.9, 10, "b.so to be read ahead")
