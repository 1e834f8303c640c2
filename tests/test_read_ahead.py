"""The first-read chunks the dev box knows, read into a node's page cache at a default push's
commit (fs/readahead.py): a pushed large file is written with O_DIRECT, past the page cache,
and the first `import torch` on a fresh node faulted libtorch_cpu.so in from disk. Only those
chunks: a passthrough file's first reads are recorded from its pages in memory
(fs/residency.py), and a whole-file readahead made every page look read (c19eb01, reverted).

Real daemons and mounts (root: passthrough), real pushes (the CLI), real files on the disk the
tests run on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_early import BIG_MIB, CHUNK, finish, make_tree, read_at, start_early_push
from test_passthrough import backing_dir, file_objects, require_passthrough, written

from helpers import wait_for
from monarch_fs.daemon.wire.read_lists import save_reads
from monarch_fs.daemon.wire.requests import Commit, RequestError
from monarch_fs.fs.readahead import read_ahead
from monarch_fs.fs.residency import resident_chunks

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


def recorded(c, node: int = 0) -> set[int]:
    """The chunks of big.bin node `node` recorded as first reads (its saved list)."""
    data = json.loads((c.dir / f"node-{node}" / "state" / "first-reads" / "ws.json").read_text())
    return {k for i, k in data["reads"] if data["paths"][i] == "big.bin" and k >= 0}


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="FUSE passthrough needs root")
def test_a_default_push_reads_ahead_the_known_first_reads_and_only_those(fresh_cluster,
                                                                        tmp_path):
    """After a default push to a fresh node whose dev box knows what was read first (chunks 5
    and 11 of big.bin), those chunks are in the node's page cache before anyone reads them,
    and no other chunk is; the next recording holds what was read (chunk 2) and the list,
    not the whole file. Before, every chunk stayed on disk until read."""
    needs_a_disk(tmp_path)
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    save_reads(Path(os.environ["MONARCH_FS_HOME"]) / "first-reads" / "ws.json",
               [(b"small.txt", None), (b"big.bin", None), (b"big.bin", 5), (b"big.bin", 11)])
    c = fresh_cluster(1)
    require_passthrough(c)
    c.push(src)
    written(c)
    (name,) = [n for n in file_objects(c) if not n.endswith((".part", ".settled"))]
    obj = backing_dir(c) / name
    wait_for(lambda: {5, 11} <= set(resident_chunks(obj, CHUNK)), 10,
             f"chunks 5 and 11 to be read ahead (in memory: {resident_chunks(obj, CHUNK)})")
    assert resident_chunks(obj, CHUNK) == [5, 11]  # those only
    f = c.mnt(0) / "ws" / "big.bin"
    assert read_at(f, 2 * CHUNK + MiB, 4096) == big[2 * CHUNK + MiB:][:4096]
    assert read_at(f, 5 * CHUNK, 4096) == big[5 * CHUNK:][:4096]
    finish(start_early_push(c, src))  # nothing to send: the node saves what it recorded
    got = recorded(c)
    assert {2, 5, 11} <= got <= {2, 3, 5, 6, 11, 12}, got  # (readahead may take the next one)


def test_read_ahead_keeps_to_its_budget_in_order(tmp_path):
    """What a commit asks for is bounded (the list of an 8 GiB env must not flush the page
    cache), in the order given, and a range past the budget is not read."""
    needs_a_disk(tmp_path)
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    cold_file(a, 8 * MiB)
    cold_file(b, 8 * MiB)
    if resident_chunks(a, MiB) or resident_chunks(b, MiB):
        pytest.skip("this filesystem keeps pages in memory after DONTNEED")
    assert read_ahead([(a, 2 * MiB, 2 * MiB), (b, 0, 8 * MiB)], 3 * MiB) == 3 * MiB
    wait_for(lambda: resident_chunks(b, MiB) == [0], 10, "b.so's first MiB to be read ahead")
    assert resident_chunks(a, MiB) == [2, 3]
    assert read_ahead([(tmp_path / "gone.so", 0, MiB), (a, 0, MiB)], MiB) == MiB  # skipped


def test_a_commit_with_a_bad_ahead_list_is_refused_saying_so():
    with pytest.raises(RequestError, match="commit: ahead must be a list of chunk ids"):
        Commit.parse({"name": "ws", "version": "00" * 16, "ahead": ["zz"]})
    assert Commit.parse({"name": "ws", "version": "00" * 16}).ahead == ()
