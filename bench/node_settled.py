"""When a node has finished writing what a push sent it: the backing copies made after the
commit, and the file objects flushed and renamed (--durable background does both after the
publish). Disk and CPU figures are read after that, or a walk of the store races the renames.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .common import BenchError, LocalCluster, run

SETTLE_TIMEOUT = 120.0


def settled(cl: LocalCluster, timeout: float = SETTLE_TIMEOUT) -> None:
    """Wait until every daemon of `cl` has finished writing what it received (backing files
    are written after the publish): disk and CPU figures are read after that."""
    deadline = time.monotonic() + timeout
    while True:
        _, proc = run([cl.cli, "status", "--hosts", f"@{cl.dir / 'hosts'}", "--token-file",
                       str(cl.dir / "token"), "--json"], timeout=60)
        nodes = json.loads(proc.stdout)
        if all(n.get("backing_writing", 0) == 0 for n in nodes):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"daemons still writing backing files after {timeout:g}s")
        time.sleep(0.2)


def flushed(state: Path, timeout: float = 300) -> None:
    """Wait until the node has flushed and renamed its file objects (--durable background
    does it after the publish): no `.part`, `.settled` or `.tmp` left in its store."""
    files = state / "store" / "files"
    deadline = time.monotonic() + timeout
    busy = (".part", ".settled", ".tmp")
    while files.is_dir() and any(n.endswith(busy) for n in os.listdir(files)):
        if time.monotonic() > deadline:
            raise BenchError(f"file objects in {files} still not flushed after {timeout:g}s")
        time.sleep(0.2)
