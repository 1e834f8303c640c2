"""`monarch-fs rm NAME` (issue 16, finding 9): a workspace is deleted on every node. Its names
leave the mount at once, its chunks and backing files are collected, a file a reader holds open
keeps reading until closed, and a workspace a running process is pinned to is refused. Real
daemons and mounts; 1 MiB packs so a workspace fills several."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import CLI_MODULE, mfs, tree, wait_for

pytestmark = pytest.mark.mount

KiB, MiB = 1 << 10, 1 << 20


def rm(c, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return mfs("rm", *args, "--hosts", c.hostfile, "--token-file", c.token_file, check=check)


def test_rm_deletes_a_workspace_on_every_node_and_gives_its_disk_back(small_packs, fresh_cluster,
                                                                       tmp_path):
    c = fresh_cluster(2)
    keep, gone = tmp_path / "keep", tmp_path / "gone"
    keep.mkdir()
    gone.mkdir()
    (keep / "k.py").write_text("kept")
    files = {f"m{i}.py": os.urandom(200 * KiB) for i in range(12)}
    files["big.bin"] = os.urandom(MiB)  # large enough for a backing file
    for name, data in files.items():
        (gone / name).write_bytes(data)
    c.push(keep)
    c.push(gone)
    (gone / "m0.py").write_bytes(os.urandom(200 * KiB))
    c.push(gone)  # two versions of gone
    backing = 1  # big.bin is a file object of the store (what passthrough binds, if on)
    wait_for(lambda: all(n["backing_files"] == backing and not n["backing_writing"]
                         for n in c.status()), 20, "the backing files")
    before = c.status()
    for i in range(2):  # the kernel now caches these names (for a day: TIMEOUT)
        assert (c.mnt(i) / "gone" / "m1.py").stat().st_size == 200 * KiB
        assert "gone" in os.listdir(c.mnt(i))
        assert len(os.listdir(c.mnt(i) / ".versions" / "gone")) == 2
    # A reader on node 0 keeps two files open: m1 (read through the daemon) and big.bin (a
    # backing file, and a chunk filling more than half of its pack).
    held = [open(c.mnt(0) / "gone" / name, "rb") for name in ("m1.py", "big.bin")]
    try:
        out = json.loads(rm(c, "gone", "--json").stdout)
        assert [(n["host"], n["removed"], len(n["versions"]), n["error"]) for n in out] == [
            (h, True, 2, None) for h in c.hosts]

        for i in range(2):  # gone from every node's mount at once, kernel caches included
            mnt = c.mnt(i)
            assert not (mnt / "gone").exists()
            assert not (mnt / "gone" / "m1.py").exists()
            assert os.listdir(mnt) == [".versions", "keep"]
            assert os.listdir(mnt / ".versions") == ["keep"]
            assert tree(mnt / "keep") == tree(keep)
        assert all(sorted(n["workspaces"]) == ["keep"] for n in c.status())

        # Node 1 (no reader) gives back the packs and the backing file at once.
        def freed(i: int, below: int, objects: int = 0) -> bool:
            n = c.status()[i]
            return n["store_bytes"] < below and n["backing_files"] == objects
        wait_for(lambda: freed(1, 64 * KiB), 20, "node 1's collect")
        assert before[1]["store_bytes"] + before[1]["backing_bytes"] > 3 * MiB
        assert c.status()[1]["bytes_collected"] > 3 * MiB

        # Node 0's reader still reads both, m1 from the store (not only the page cache).
        for f, name in zip(held, ("m1.py", "big.bin")):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert f.read() == files[name]
        # big.bin's file object is kept for its reader (it is where the store has its chunk).
        wait_for(lambda: freed(0, 2560 * KiB, objects=1), 20, "node 0's collect")
        assert c.status()[0]["backing_bytes"] == MiB
    finally:
        for f in held:
            f.close()
    if backing:  # passthrough: opens and releases reach the daemon (not so under no-open)
        # Once closed, the kernel forgets them and big.bin's file object goes too (m1's chunk,
        # copied to the open pack by the collect above, waits for that pack to be sealed).
        wait_for(lambda: freed(0, 512 * KiB), 20, "node 0's collect after the close")

    # Removing it again: a clear error per node, exit 1.
    out = rm(c, "gone", check=False)
    assert out.returncode == 1
    for h in c.hosts:
        assert f"{h}: no workspace 'gone' on this node" in out.stderr
    out = json.loads(rm(c, "gone", "--json", check=False).stdout)
    assert [(n["removed"], n["error"]) for n in out] == [
        (False, "no workspace 'gone' on this node")] * 2

    # The name can be pushed again, and serves the new content.
    c.push(gone)
    assert tree(c.mnt(1) / "gone") == tree(gone)


def test_rm_is_refused_while_a_process_is_pinned_to_the_workspace(fresh_cluster, tmp_path):
    """A process started with --workspace runs from MOUNT/.versions/NAME/VERSION: removing it
    would pull its files from under it, so the node refuses, naming the process."""
    c = fresh_cluster(1)
    src = tmp_path / "job"
    src.mkdir()
    (src / "f").write_text("code")
    c.push(src)
    marker = tmp_path / "started"
    run = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "run", "--hosts", c.hostfile,
         "--token-file", c.token_file, "--workspace", "job", "--",
         "sh", "-c", f"touch {marker}; exec sleep 60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(marker.exists, 20, "the job to start")
        out = rm(c, "job", check=False)
        assert out.returncode == 1
        assert f"{c.hosts[0]}: workspace 'job' is in use by 1 process" in out.stderr
        assert (c.mnt(0) / "job" / "f").read_text() == "code"
    finally:
        run.terminate()  # the daemon stops the ranks of a controller that went away
        run.wait(20)

    def removed() -> bool:
        return rm(c, "job", check=False).returncode == 0
    wait_for(removed, 20, "rm once the job ended")
    assert not (c.mnt(0) / "job").exists()
