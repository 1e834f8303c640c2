"""The source tree the scan cache tests scan and push, and waiting until a tree is past the
racy window (the scan caches only what changed longer ago). A helper, not a test file."""

from __future__ import annotations

import os
import time
from pathlib import Path

from helpers import SMALL, wait_for, write_files

RACY = 50_000_000  # 50 ms: tests wait this long after writing instead of the default 2 s


def make_tree(root: Path) -> dict[str, bytes]:
    """Every kind of entry below `root`: small modules in three folders, a file of four chunks,
    one of exactly two, an empty one, two with the same bytes, a hard link and a symlink; the
    files' contents by relative path."""
    files = {f"pkg{i % 3}/mod{i}.py": b"x = %d\n" % i * (i + 1) for i in range(30)}
    files["big.bin"] = os.urandom(3 * SMALL + 5)  # four chunks
    files["exact.bin"] = os.urandom(2 * SMALL)
    files["empty"] = b""
    files["dup1"] = files["dup2"] = b"same bytes in two files"
    write_files(root, files)
    os.link(root / "big.bin", root / "pkg0" / "big-hardlink.bin")
    files["pkg0/big-hardlink.bin"] = files["big.bin"]
    os.symlink("pkg0/mod0.py", root / "link")
    return files


def past_racy_window(root: Path, racy_ns: int = RACY) -> None:
    """Wait until every entry below `root` was last changed (mtime and ctime) more than
    `racy_ns` ago, so that a scan starting now caches it: the condition the scan cache checks,
    polled, instead of a fixed sleep."""
    newest = max(max(st.st_mtime_ns, st.st_ctime_ns)
                 for st in map(os.lstat, [root, *root.rglob("*")]))
    wait_for(lambda: time.time_ns() - racy_ns > newest, racy_ns / 1e9 + 10,
             f"the files below {root} to be older than the racy window", interval=0.01)
