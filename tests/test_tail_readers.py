"""The rest of a push --early gives way to the job reading the version it published
(daemon/node/readers.py): while the mount serves requests the node takes the stream slowly,
and at full speed once they stop; the bytes are right either way. Real daemons, real pushes."""

from __future__ import annotations

import os
import threading

import pytest
from test_early import PACED, MiB, finish, make_tree, read_at, start_early_push, wait_usable

from monarch_fs.daemon.node.readers import BUSY_RATE

BIG_MIB = 48  # the tail: at BUSY_RATE, seconds of a busy reader


def held_ms(c) -> int:
    return c.status()[0]["tail_held_ms"]


@pytest.mark.mount
def test_the_tail_waits_while_readers_are_busy_and_the_bytes_are_right(fresh_cluster,
                                                                      tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    stop = threading.Event()
    looked = [0]

    def reader() -> None:
        """A job on the node: lookups of names never asked before, each a FUSE request (busy
        from before the push, so that the whole tail finds it busy)."""
        while not stop.is_set():
            os.path.exists(c.mnt(0) / f"absent-{looked[0]}")
            looked[0] += 1

    job = threading.Thread(target=reader)
    job.start()
    try:
        push = start_early_push(c, src, *PACED)  # so the tail comes after the publish
        wait_usable(push)
        out = finish(push)
    finally:
        stop.set()
        if job.is_alive():
            job.join()
    assert looked[0] > 100
    held = held_ms(c)
    # Most of the large file came while the reader was busy (the head was the small file).
    assert held > 0.25 * BIG_MIB * MiB / BUSY_RATE * 1000, (held, out)
    f = c.mnt(0) / "ws" / "big.bin"
    assert read_at(f, 0, len(big)) == big


@pytest.mark.mount
def test_without_readers_the_tail_is_not_held(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    big = make_tree(src, BIG_MIB)
    push = start_early_push(c, src)
    wait_usable(push)
    finish(push)
    assert held_ms(c) == 0
    assert read_at(c.mnt(0) / "ws" / "big.bin", len(big) - MiB, MiB) == big[-MiB:]
