"""A local cluster that lives exactly as long as the script that asked for it.

`HostMesh.local(n)` starts n daemons on loopback in a fresh temporary folder and stops them when
the mesh closes or the script exits. If the script is killed outright (SIGKILL), nothing of it
runs any more, so a small reaper process, started first, watches a pipe from the script: when
the pipe closes (the script ended, whichever way) the reaper stops the daemons and removes the
folder. The daemons in turn kill every proc of the script.

The cluster is the script's own, so its procs run as the script's user: as root, its daemons are
started with --allow-root-procs (a root daemon refuses processes otherwise).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from ..daemon.client import cluster
from ..daemon.wire.auth import load_token


@asynccontextmanager
async def local_cluster(nodes: int) -> AsyncIterator[tuple[list[str], bytes, Path]]:
    """(daemon addresses, token, folder) of a fresh local cluster, stopped on the way out."""
    d = Path(tempfile.mkdtemp(prefix="monarch-fs-local-"))
    read_end, write_end = os.pipe()
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "monarch_fs.mesh.local", str(d)], stdin=read_end,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read_end)
    try:
        addrs = await trio.to_thread.run_sync(
            functools.partial(cluster.up, nodes, d, root_procs=True))
        yield addrs, load_token(d / "token"), d
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(cluster.down, d)
            shutil.rmtree(d, ignore_errors=True)
            os.close(write_end)  # the reaper finds nothing left to do, and exits
            await trio.to_thread.run_sync(reaper.wait)


def _reap(d: Path) -> None:
    sys.stdin.buffer.read()  # returns at EOF: the script closed the pipe, or died
    cluster.down(d)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    _reap(Path(sys.argv[1]))
