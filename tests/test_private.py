"""A node's state is private to the daemon's user (issue 16, finding 7).

The store and the backing files hold the bytes of every pushed file whatever its mode, so they,
refs.json and the log (which names every process the daemon starts, argv included) are kept
from other local users: folders 0700, files without group or other bits, whatever the umask,
and a state folder an older version left readable is tightened at start. The mount, with
`default_permissions`, is then the only way to read content, and a file's own mode rules there.
Checked as `nobody`, through setpriv.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers import mfs, start_cluster, stop_cluster, wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root, pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="reading as another user needs root and setpriv")]

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3"]
# Run as nobody: try to list each folder and read each file; print what happened to each.
PROBE = """
import json, os, sys
out = {}
for path, is_dir in json.load(sys.stdin):
    try:
        if is_dir:
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                out[path] = f.read().decode("latin-1")
                continue
        out[path] = "listed"
    except OSError as e:
        out[path] = e.strerror
print(json.dumps(out))
"""


def as_nobody(paths: list[tuple[Path, bool]]) -> dict[str, str]:
    """What `nobody` gets for each (path, is a folder): the file's content, "listed", or the
    error's text."""
    out = subprocess.run(NOBODY + ["-c", PROBE], capture_output=True, text=True, check=True,
                         input=json.dumps([(str(p), d) for p, d in paths]))
    return json.loads(out.stdout)


def everything_under(root: Path) -> list[tuple[Path, bool]]:
    out = [(root, True)]
    for dirpath, dirnames, filenames in os.walk(root):
        out += [(Path(dirpath, n), True) for n in dirnames]
        out += [(Path(dirpath, n), False) for n in filenames]
    return out


@pytest.fixture
def open_dir():
    """A folder every user may enter (pytest's own are 0700), so `nobody` reaches the mount."""
    d = Path(tempfile.mkdtemp(prefix="mfs-private-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_state_and_log_are_private_and_the_mount_applies_each_files_mode(open_dir):
    cdir = open_dir / "cluster"
    cdir.mkdir(mode=0o755)
    src = open_dir / "ws"
    src.mkdir()
    (src / "old").write_bytes(b"pushed by an older version " * 20000)  # 540 KB: a backing file
    state = cdir / "node-0" / "state"
    log = cdir / "node-0" / "log"

    # A node whose state an older version left readable to everyone (folders 0755, packs and
    # refs 0644, backing files 0444, the log 0644).
    c = start_cluster(cdir, 1)
    try:
        c.push(src)
        backing = 1  # a pushed large file is a file object of the store, passthrough or not
        wait_for(lambda: c.status()[0]["backing_files"] == backing, 20, "the backing file")
    finally:
        stop_cluster(c)
    for p, is_dir in everything_under(state):
        p.chmod(0o755 if is_dir else 0o444 if p.parent.name in ("backing", "files") else 0o644)
    log.chmod(0o644)

    secret = b"0600 content: only root may read this " * 10000  # 390 KB: a backing file too
    (src / "secret").write_bytes(secret)
    (src / "secret").chmod(0o600)
    (src / "public").write_bytes(b"0644 content, for everyone")
    (src / "public").chmod(0o644)
    src.chmod(0o755)
    umask = os.umask(0)  # the daemon starts with the loosest umask: its modes must not depend on it
    try:
        c = start_cluster(cdir, 1)
    finally:
        os.umask(umask)
    try:
        c.push(src)
        wait_for(lambda: c.status()[0]["backing_files"] == 2 * backing, 20, "the backing files")
        mfs("run", "--hosts", c.hostfile, "--token-file", c.token_file, "--",
            "true", "argv-that-names-a-secret")
        assert "argv-that-names-a-secret" in log.read_text()  # still logged, for root

        # Nothing under the state folder, nor the log, is readable or listable by nobody:
        # not through the folders, and not by the files' own modes either.
        paths = everything_under(state)
        assert any(p.parent.name == "packs" for p, _ in paths)
        assert any(p.parent.name == "files" for p, _ in paths)  # the store's file objects
        assert (state / "refs.json", False) in paths
        seen = as_nobody(paths + [(log, False)])
        assert seen == {str(p): "Permission denied" for p, _ in paths + [(log, False)]}
        for p, is_dir in paths + [(log, False)]:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode & 0o077 == 0, f"{p} is {mode:o}"
            if is_dir:
                assert mode == 0o700, f"{p} is {mode:o}"

        # Through the mount, each file's own mode rules (default_permissions).
        mnt = c.mnt(0) / "ws"
        version = os.listdir(c.mnt(0) / ".versions" / "ws")[0]
        pinned = c.mnt(0) / ".versions" / "ws" / version
        seen = as_nobody([(mnt / "public", False), (mnt / "secret", False),
                          (pinned / "secret", False), (mnt / "old", False), (mnt, True)])
        assert seen == {str(mnt / "public"): "0644 content, for everyone",
                        str(mnt / "secret"): "Permission denied",
                        str(pinned / "secret"): "Permission denied",
                        str(mnt / "old"): (src / "old").read_bytes().decode("latin-1"),
                        str(mnt): "listed"}
        assert (mnt / "secret").read_bytes() == secret  # root reads it
    finally:
        stop_cluster(c)
