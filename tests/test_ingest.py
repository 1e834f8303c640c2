"""Node ingest: a large file is written once, into its file object in the store, and that is
what passthrough binds (issue 19, "Ingest at disk speed"). Real daemons, real mounts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CLI_MODULE, mfs, wait_for
from monarch_fs.daemon.client import cluster as cluster_mod

pytestmark = [pytest.mark.mount]

MiB = 1 << 20


def state(c, i: int = 0) -> Path:
    return c.dir / f"node-{i}" / "state"


def files(c, i: int = 0) -> list[str]:
    return sorted(os.listdir(state(c, i) / "store" / "files"))


def disk(folder: Path) -> int:
    """Bytes the disk holds for everything under `folder` (allocated blocks)."""
    return sum(os.lstat(os.path.join(d, n)).st_blocks * 512
               for d, _, names in os.walk(folder) for n in names)


def listing(folder: Path) -> list[tuple[str, int]]:
    return [(os.path.join(d, n), os.lstat(os.path.join(d, n)).st_blocks * 512)
            for d, _, names in os.walk(folder) for n in names]


def settled(c) -> None:
    wait_for(lambda: all(n["backing_writing"] == 0 for n in c.status()), 30,
             "the backing copies to finish")


def recorded(c, count: int, i: int = 0) -> None:
    """Wait for `count` file objects recorded on node `i`: flushed after the publish
    (--durable background, daemon/node/flusher.py)."""
    wait_for(lambda: len([n for n in files(c, i) if n.endswith(".ids")]) == count, 20,
             f"{count} file objects to be flushed and recorded")


def test_a_large_file_takes_its_size_once_on_the_node(fresh_cluster, tmp_path):
    c = fresh_cluster(2)  # the second node gets it through the first one's relay
    src = tmp_path / "ws"
    src.mkdir()
    big = os.urandom(24 * MiB + 4097)
    (src / "model.bin").write_bytes(big)
    (src / "tail.bin").write_bytes(os.urandom(300 * 1024))  # one chunk, not a page multiple
    (src / "small.py").write_text("x = 1\n")
    c.push(src)
    settled(c)
    content = len(big) + 300 * 1024
    for i in range(2):
        used = disk(state(c, i))
        assert used <= 1.1 * content, (f"node-{i}: {used} bytes on disk for {content} of "
                                       f"content: {listing(state(c, i))}")
        recorded(c, 2, i)
        assert (c.mnt(i) / "ws" / "model.bin").read_bytes() == big
    if c.status()[0]["fuse"] == "passthrough":
        bound = os.getxattr(c.mnt(0) / "ws" / "model.bin", "user.monarch.backing").decode()
        assert bound.startswith(str(state(c) / "store" / "files"))


def test_large_files_are_written_once_behind_small_files_that_lead(fresh_cluster, tmp_path):
    """A push sends small files first, right after the manifest, while each node loads it to
    place the large files (daemon/client/stream.py `lead`): the large files' chunks still go
    to their file objects only, through a relay too, and every byte reads back right."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    for d in range(20):
        (src / f"pkg{d:02d}").mkdir(parents=True)
        for f in range(150):  # 3000 small files: the manifest takes a while to place
            (src / f"pkg{d:02d}" / f"m{f:03d}.py").write_bytes(os.urandom(3000))
    large = {"lib/a.so": os.urandom(9 * MiB + 100), "lib/b.so": os.urandom(2 * MiB),
             "zz.bin": os.urandom(56 * MiB)}  # a tail of 100 bytes, one chunk, whole ones
    # (more than send_order.LEAD in all: a push that small sends no lead)
    for name, data in large.items():
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes(data)
    c.push(src)
    settled(c)
    content = sum(len(d) for d in large.values()) + 3000 * 3000
    for i in range(2):
        recorded(c, 3, i)
        used = disk(state(c, i))
        assert used <= 1.1 * content + 3000 * 4096, (
            f"node-{i}: {used} bytes on disk for {content} of content")
        for name, data in large.items():
            assert (c.mnt(i) / "ws" / name).read_bytes() == data
        assert (c.mnt(i) / "ws" / "pkg19" / "m149.py").read_bytes() == (
            src / "pkg19" / "m149.py").read_bytes()


def test_a_large_chunk_waits_for_its_place_while_the_manifest_loads(fresh_cluster, tmp_path):
    """Nothing small leads here: 30,000 empty files make a manifest slow to load, and the
    large file's chunks come right after it. They wait for each node to place the file, and
    are written once, in place (two nodes: not streamed while scanning, scan_stream.py)."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    for d in range(30):
        (src / f"d{d:02d}").mkdir(parents=True)
        for f in range(1000):
            (src / f"d{d:02d}" / f"e{f:03d}").touch()
    data = os.urandom(16 * MiB)
    (src / "w.bin").write_bytes(data)
    c.push(src)
    settled(c)
    for i in range(2):
        recorded(c, 1, i)
        used = disk(state(c, i))
        assert used <= 1.1 * len(data) + 8 * MiB, f"node-{i}: {used} bytes for {len(data)}"
        assert (c.mnt(i) / "ws" / "w.bin").read_bytes() == data


def _kill(c, i: int = 0) -> None:
    os.kill(c.pid(i), signal.SIGKILL)
    wait_for(lambda: not cluster_mod.running_node(c.dir, i), 20, f"node-{i} to die")


def test_a_daemon_killed_mid_ingest_serves_the_last_good_version(fresh_cluster, tmp_path):
    """SIGKILL while a large file arrives: at restart no partial file object is left or
    trusted, the last published version serves, and a new push completes, byte-correct."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    first = os.urandom(3 * MiB)
    (src / "lib.so").write_bytes(first)
    c.push(src)
    second = os.urandom(400 * MiB)
    (src / "lib.so").write_bytes(second)
    push = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts", c.hostfile,
         "--token-file", c.token_file], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(n.endswith(".part") for n in files(c)), 60,
                 "the new file object to be written")
        _kill(c)
    finally:
        push.wait(60)
    assert push.returncode != 0
    cluster_mod.restart_node(c.dir, 0)
    assert not any(n.endswith(".part") for n in files(c))
    assert (c.mnt(0) / "ws" / "lib.so").read_bytes() == first
    c.push(src)
    assert (c.mnt(0) / "ws" / "lib.so").read_bytes() == second


def test_a_daemon_killed_after_publish_keeps_the_file_object(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    data = os.urandom(9 * MiB + 5)
    (src / "w.bin").write_bytes(data)
    c.push(src)
    before = {n.split(".")[0] for n in files(c)}  # flushed or not yet (--durable background)
    _kill(c)
    cluster_mod.restart_node(c.dir, 0)
    assert files(c) == sorted(k + suffix for k in before for suffix in ("", ".ids"))
    assert (c.mnt(0) / "ws" / "w.bin").read_bytes() == data
    assert not c.status()[0]["problems"]


def test_removing_a_workspace_deletes_its_file_objects(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    for name in ("gone", "kept"):
        src = tmp_path / name
        src.mkdir()
        (src / "big.bin").write_bytes(os.urandom(5 * MiB))
        c.push(src)
    recorded(c, 2)
    mfs("rm", "gone", "--hosts", c.hostfile, "--token-file", c.token_file)
    wait_for(lambda: len([n for n in files(c) if n.endswith(".ids")]) == 1, 20,
             "the removed workspace's file object to be collected")
    assert (c.mnt(0) / "kept" / "big.bin").read_bytes() == (tmp_path / "kept" / "big.bin"
                                                             ).read_bytes()


def test_the_relay_request_names_the_manifest_or_nothing():
    """Older clients send no `version`: every chunk goes to a pack, as before."""
    from monarch_fs.daemon.wire.requests import OpenRelay, RequestError

    assert OpenRelay.parse({"children": []}).version is None
    assert OpenRelay.parse({"version": "ab" * 16}).version == bytes.fromhex("ab" * 16)
    with pytest.raises(RequestError, match="relay: bad version"):
        OpenRelay.parse({"version": "not hex"})
