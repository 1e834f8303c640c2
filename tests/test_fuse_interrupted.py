"""A process killed while its FUSE request waits in the kernel's queue takes the request back
with it; the daemon must go on answering everything else (fs/pyfuse3.patch: the session's
/dev/fuse descriptor is non-blocking). Before, the daemon's trio thread could block reading a
request that was no longer there, and answered nothing (no request, no exit report) until some
other process touched its mount: `monarch-fs run` waited forever for the answer to the kill of
ranks that were starting on the mount (tests/test_repro.py, once in a dozen runs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import connect

pytestmark = pytest.mark.mount

# Lookups of names that do not exist: each is a round trip to the daemon (none is cached).
LOOKUPS = """
import os, sys
i = 0
while True:
    i += 1
    try:
        os.stat(f"{sys.argv[1]}/nope-{os.getpid()}-{i}")
    except FileNotFoundError:
        pass
"""
ROUNDS = 40  # the old daemon stopped answering in about one round in ten
ANSWER_WITHIN = 3.0


async def test_a_process_killed_in_a_fuse_request_leaves_the_daemon_answering(fresh_cluster):
    c = fresh_cluster(1)
    mnt = c.mnt(0)
    async with await connect(c.hosts[0], load_token(c.token_file)) as chan:
        for round_ in range(ROUNDS):
            readers = [subprocess.Popen([sys.executable, "-c", LOOKUPS, str(mnt)])
                       for _ in range(4)]
            await trio.sleep(0.15)
            for reader in readers:  # started by this test: killed by pid
                reader.kill()
            for reader in readers:
                reader.wait()
            with trio.move_on_after(ANSWER_WITHIN) as late:
                await chan.request("status")
            if late.cancelled_caught:
                os.statvfs(mnt)  # a request of ours wakes it, so that the cluster can stop
                pytest.fail(f"round {round_}: the daemon answered nothing for "
                            f"{ANSWER_WITHIN:g} s after processes in FUSE requests were killed")
