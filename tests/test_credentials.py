"""Issue 16, finding 2: a daemon always needs a credential. A root daemon started without a token
on loopback used to run `sh -c id` as root for any local user; now no daemon starts without
one, clients do not connect without one, and a local user who lacks the cluster's token gets a
clear refusal and nothing runs."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import CLI_MODULE, mfs, mounted
from monarch_fs.daemon.node.daemon import NodeDaemon
from monarch_fs.daemon.wire.auth import load_token

NO_TOKEN = ("monarch-fs: error: no token: pass --token-file F or set $MONARCH_FS_TOKEN_FILE; "
            "`monarch-fs token new F` makes one (`monarch-fs cluster up` writes ")


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "0.0.0.0:0"])
def test_a_daemon_without_a_token_does_not_start(tmp_path, monkeypatch, listen):
    monkeypatch.delenv("MONARCH_FS_TOKEN_FILE", raising=False)
    out = mfs("daemon", "--listen", listen, "--mount", str(tmp_path / "m"), "--state",
              str(tmp_path / "s"), check=False, timeout=30)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr  # one line, no traceback
    assert lines[0].startswith(NO_TOKEN), lines[0]
    assert not (tmp_path / "s").exists() and not mounted(tmp_path / "m")
    # A token file that is named but missing is no better.
    out = mfs("daemon", "--listen", listen, "--mount", str(tmp_path / "m"), "--state",
              str(tmp_path / "s"), env={"MONARCH_FS_TOKEN_FILE": str(tmp_path / "nope")},
              check=False, timeout=30)
    assert out.returncode == 1
    assert out.stderr.strip() == f"monarch-fs: error: token file {tmp_path / 'nope'} does not exist"
    with pytest.raises(ValueError, match="a daemon needs a token"):  # the library, too
        NodeDaemon(state=tmp_path / "s", mount=tmp_path / "m", listen=listen, token=b"")


@pytest.mark.mount
def test_token_new_makes_a_token_a_daemon_and_clients_use(tmp_path, monkeypatch):
    """`monarch-fs token new PATH`: 0600, never silently replaced; a daemon started with it (by
    $MONARCH_FS_TOKEN_FILE) serves clients holding it."""
    path = tmp_path / "keys" / "token"
    out = mfs("token", "new", str(path))
    assert str(path) in out.stdout and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = load_token(path)
    again = mfs("token", "new", str(path), check=False)
    assert again.returncode == 1 and "already exists" in again.stderr and "--force" in again.stderr
    assert load_token(path) == token
    mfs("token", "new", str(path), "--force")
    assert load_token(path) != token

    monkeypatch.setenv("MONARCH_FS_TOKEN_FILE", str(path))
    ready = tmp_path / "ready"
    with open(tmp_path / "log", "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", CLI_MODULE, "daemon", "--listen", "127.0.0.1:0",
             "--mount", str(tmp_path / "m"), "--state", str(tmp_path / "s"),
             "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "log").read_text()
            time.sleep(0.05)
        addr = json.loads(ready.read_text())["addr"]
        status = mfs("status", "--hosts", addr, "--json")  # the token from the environment
        assert json.loads(status.stdout)[0]["reachable"]
        monkeypatch.delenv("MONARCH_FS_TOKEN_FILE")
        out = mfs("status", "--hosts", addr, check=False)
        assert out.returncode == 1 and out.stderr.startswith(NO_TOKEN), out.stderr
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=20) == 0
    assert not mounted(tmp_path / "m")


def _as_nobody(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`monarch-fs ARGS` as user nobody, in an environment of its own: no token file anywhere
    it could find one ($MONARCH_FS_HOME does not exist)."""
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent",
           "MONARCH_FS_HOME": "/nonexistent/monarch-fs"}
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
         "-m", CLI_MODULE, *args], capture_output=True, text=True, env=env,
        cwd="/", timeout=timeout)


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to act as another local user")
def test_another_local_user_cannot_run_commands_through_the_daemon(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    addr = c.hosts[0]
    marker = tmp_path / "ran"
    cmd = ["--", "sh", "-c", f"id; touch {marker}"]

    no_token = _as_nobody("run", "--hosts", addr, *cmd)
    assert no_token.returncode == 1 and no_token.stdout == ""
    assert no_token.stderr.startswith(NO_TOKEN), no_token.stderr

    # The cluster's token file is root's, mode 0600: naming it does not help.
    theirs = _as_nobody("run", "--hosts", addr, "--token-file", c.token_file, *cmd)
    assert theirs.returncode == 1 and theirs.stdout == ""
    assert theirs.stderr.strip() == (f"monarch-fs: error: cannot read token file {c.token_file}: "
                                     "Permission denied"), theirs.stderr

    # A token of its own is refused by the daemon, which says so once in its log.
    own = tempfile.mkdtemp(prefix="nobody-token-")
    try:
        os.chmod(own, 0o755)
        with open(os.path.join(own, "token"), "w") as f:
            f.write("a-guess\n")
        os.chmod(os.path.join(own, "token"), 0o644)
        wrong = _as_nobody("run", "--hosts", addr, "--token-file", os.path.join(own, "token"),
                           *cmd)
    finally:
        shutil.rmtree(own)
    assert wrong.returncode == 1 and wrong.stdout == "" and "uid=" not in wrong.stdout
    assert wrong.stderr.strip() == (f"monarch-fs run: error: cannot reach every host: {addr}: "
                                    "authentication failed: wrong token"), wrong.stderr
    assert not marker.exists()  # nothing ran, as root or anyone
    log = (c.dir / "node-0" / "log").read_text()
    assert log.count("authentication failed: wrong token") == 1, log
    assert "started proc" not in log
