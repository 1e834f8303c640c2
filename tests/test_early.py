"""push --early: a version is served as soon as every node holds its manifest and the chunks
its first reads need; a read of a chunk that has not arrived fetches it ahead of the stream,
and one that cannot be had fails with EIO, never with wrong bytes.

Real daemons, real mounts, real pushes (the CLI in a subprocess this test starts); every read
is made from this process, never from a daemon's serving thread."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLI_MODULE, Cluster, tree, wait_for

MiB = 1 << 20
CHUNK = 4 * MiB
pytestmark = pytest.mark.mount


def start_early_push(c: Cluster, src: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts", c.hostfile,
         "--token-file", c.token_file, "--json", "--early", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_usable(push: subprocess.Popen) -> dict:
    """The push's first line: {"event": "usable", ...}."""
    assert push.stdout is not None
    line = push.stdout.readline()
    if not line:
        raise AssertionError(f"push ended before usable: {push.wait()} {push.stderr.read()}")
    event = json.loads(line)
    assert event["event"] == "usable", event
    return event


def finish(push: subprocess.Popen) -> dict:
    out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def make_tree(src: Path, big_mib: int) -> bytes:
    """A small file (sent first) and a large random file (streamed after the publish)."""
    src.mkdir()
    (src / "small.txt").write_text("hello\n")
    big = os.urandom(big_mib * MiB)
    (src / "big.bin").write_bytes(big)
    return big


def read_at(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def incomplete(c: Cluster) -> list[list[str]]:
    return [n.get("incomplete", []) for n in c.status()]


def test_early_read_of_a_late_chunk_is_fetched_and_correct(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    big = make_tree(src, 192)
    push = start_early_push(c, src)
    try:
        event = wait_usable(push)
        assert event["nodes"] == 1
        f = c.mnt(0) / "ws" / "big.bin"
        last = len(big) - CHUNK  # the last chunk streams last: read it first
        assert read_at(f, last, CHUNK) == big[last:]
        assert (c.mnt(0) / "ws" / "small.txt").read_text() == "hello\n"
    finally:
        out = finish(push)
    assert out["chunks_wanted"] >= 1, out  # the read came before the stream brought it
    assert out["usable_seconds"] <= out["complete_seconds"]
    assert incomplete(c) == [[]]
    assert tree(c.mnt(0) / "ws") == tree(src)
