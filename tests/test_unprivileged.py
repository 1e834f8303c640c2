"""The daemon as a normal user (a mount through fusermount3, no allow_other without
user_allow_other, no passthrough), a mount it cannot make told in one line, and the daemon as a
systemd service (READY=1 once mounted, STOPPING=1 at SIGTERM, the unit file verified).

The tests that switch users run as root: they make a test user (tests/users.py) and, while its
daemon mounts, set /dev/fuse to 0666 as Debian ships it (this machine has 0600), always
restoring the mode they found."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from users import LocalUser, fuse_device_mode, system_python_reason

from helpers import CLI_MODULE, mfs, mounted, stop_serving
from monarch_fs.daemon.node.notify import notify
from monarch_fs.daemon.wire.auth import write_new_token
from monarch_fs.fs.mount_check import FUSE_DEVICE, explain
from monarch_fs.fs.mount_options import mount_mode, user_allow_other

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "daemon" / "node" / "monarch-fs.service"
def _why_not() -> str | None:
    if os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(FUSE_DEVICE):
        return "switching users and /dev/fuse's mode need root, useradd and /dev/fuse"
    return system_python_reason()


needs_root = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


# ---- pure parts ------------------------------------------------------------------------------

def test_user_allow_other_reads_only_an_uncommented_line(tmp_path):
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\n#user_allow_other\nmount_max = 1000\n")
    assert not user_allow_other(str(conf))
    conf.write_text("mount_max = 1000\n  user_allow_other  # let users share\n")
    assert user_allow_other(str(conf))
    assert not user_allow_other(str(tmp_path / "missing"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the root mode")
def test_root_mounts_for_everyone():
    mode = mount_mode()
    assert mode.description == "root" and mode.allow_other and "ro" in mode.options
    assert not mount_mode(False).allow_other


def test_a_fusermount3_refusal_is_told_with_its_fix():
    said = ("fusermount3: option allow_other only allowed if 'user_allow_other' is set in "
            "/etc/fuse.conf\n")
    line = explain(said, mount_mode())
    assert "\n" not in line and line.startswith("fusermount3: option allow_other")
    assert "add a user_allow_other line to /etc/fuse.conf" in line


def test_notify_sends_one_datagram_to_a_path_socket(tmp_path, monkeypatch):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify(READY=1, STATUS="serving")
        assert s.recv(4096) == b"READY=1\nSTATUS=serving"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not notify(READY=1)  # not under systemd: nothing to do


# ---- a test user and /dev/fuse -------------------------------------------------------------

@pytest.fixture
def test_user():
    user = LocalUser()
    try:
        yield user
    finally:
        user.close()


def fails_in_one_line(user: LocalUser, argv: list[str]) -> str:
    """The daemon `argv` runs as `user`, exits 1 and prints exactly one line (no traceback,
    nothing of libfuse's), naming this host; that line."""
    out = user.run(argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"monarch-fs: error: {socket.gethostname()}: cannot mount "), lines
    return lines[0]


# ---- the unprivileged daemon ---------------------------------------------------------------

@pytest.mark.mount
@pytest.mark.root
@needs_root
def test_an_unprivileged_daemon_serves_a_push_to_its_user_only(test_user, tmp_path):
    user = test_user
    mnt = user.home / "mnt"
    src = tmp_path / "env"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    (src / "bin" / "tool").chmod(0o755)
    (src / "data.bin").write_bytes(os.urandom(300_000))
    digest = hashlib.sha256((src / "data.bin").read_bytes()).hexdigest()
    with user.daemon(mnt) as addr:
        token = str(user.home / "token")
        # pushed by root (another user) over the wire, as any client
        pushed = mfs("push", str(src), "--hosts", addr, "--token-file", token, check=False)
        assert pushed.returncode == 0, pushed.stderr + (user.home / "log").read_text()
        seen = user.run(["sh", "-c", f"sha256sum < {mnt}/env/data.bin; {mnt}/env/bin/tool; "
                                     f"stat -c %U {mnt}/env/data.bin"])
        assert seen.returncode == 0, seen.stderr
        assert seen.stdout.splitlines() == [f"{digest}  -", "tool", user.name]
        # no allow_other (this machine's fuse.conf has no user_allow_other): not even root
        # may look inside
        with pytest.raises(PermissionError):
            os.stat(mnt / "env")
        st = json.loads(mfs("status", "--hosts", addr, "--token-file", token,
                            "--json").stdout)[0]
        assert st["mode"] == (f"unprivileged (user {user.name}; fusermount3; other users "
                              "cannot read: no user_allow_other in /etc/fuse.conf)")
        assert "passthrough needs root" in st["fuse"]
        text = mfs("status", "--hosts", addr, "--token-file", token).stdout
        assert f"mode unprivileged (user {user.name};" in text
        # a second daemon on the same mount point is refused; the first keeps serving
        line = fails_in_one_line(user, user.daemon_argv(mnt, state="state2"))
        assert line.endswith(f"{mnt}: it is already a mount point (fuse.monarch-fs): stop "
                             f"what serves it, or unmount it (fusermount3 -u {mnt}), or "
                             "pick another --mount"), line
        assert user.run(["cat", f"{mnt}/env/bin/tool"]).returncode == 0
    log_text = (user.home / "log").read_text()
    assert "Traceback" not in log_text, log_text


@pytest.mark.mount
@pytest.mark.root
@needs_root
def test_a_mount_it_cannot_make_is_one_line_with_the_fix(test_user):
    user = test_user
    host = socket.gethostname()
    mnt = user.home / "mnt"
    fuse_mode = stat.filemode(os.stat(FUSE_DEVICE).st_mode)
    with fuse_device_mode(0o600):  # as this machine has it: root's alone
        line = fails_in_one_line(user, user.daemon_argv(mnt))
        assert line == (f"monarch-fs: error: {host}: cannot mount {mnt}: /dev/fuse is "
                        f"crw------- root:root, which user {user.name} cannot open: as root, "
                        "chmod 0666 /dev/fuse (as Debian ships it), or give it a group of "
                        f"{user.name}'s (chgrp fuse /dev/fuse; chmod 0660 /dev/fuse; "
                        f"usermod -aG fuse {user.name})"), line
    assert not (user.home / "state").exists()  # refused before making anything
    assert stat.filemode(os.stat(FUSE_DEVICE).st_mode) == fuse_mode  # restored

    with fuse_device_mode(0o666):
        full = user.home / "full"
        full.mkdir()
        (full / "notes.txt").write_text("mine")
        line = fails_in_one_line(user, user.daemon_argv(full))
        assert line.endswith(f"{full}: it is not empty (1 entries, e.g. 'notes.txt'), and the "
                             "mount would hide them: empty it, or pick another --mount"), line

        missing = user.base / "root-owned" / "mnt"  # its parent is root's, 0755
        missing.parent.mkdir()
        line = fails_in_one_line(user, user.daemon_argv(missing))
        assert line.endswith(f"{missing}: it does not exist, and user {user.name} cannot make "
                             f"it (Permission denied): make it (owned by {user.name}), or pick "
                             "another --mount"), line

        a_file = user.home / "token"
        line = fails_in_one_line(user, user.daemon_argv(a_file))
        assert f"{a_file}: it is not a folder (-rw------- {user.name}:" in line, line

        line = fails_in_one_line(user, user.daemon_argv(mnt, "--allow-other", "yes"))
        assert line.endswith(f"{mnt}: --allow-other yes, but /etc/fuse.conf has no "
                             "user_allow_other line: add one (as root), or drop --allow-other "
                             f"yes (then only {user.name} reads the mount)"), line

        # What only fusermount3 finds (a sticky folder of root's): its own words, in one line.
        sticky = user.base / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        out = user.run(user.daemon_argv(sticky))
        errors = [x for x in out.stderr.splitlines() if "fusermount3" in x or "error" in x]
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert errors == [f"monarch-fs: error: {host}: cannot mount {sticky}: fusermount3: "
                          f"mountpoint {sticky} not owned by user"], out.stderr
    assert not mounted(mnt) and not mounted(sticky)


# ---- as a service -----------------------------------------------------------------------------

@pytest.mark.mount
def test_ready_once_mounted_and_stopping_at_sigterm(tmp_path):
    """With NOTIFY_SOCKET (abstract, as systemd gives it), READY=1 arrives only once the mount is
    served, and STOPPING=1 as soon as SIGTERM is received."""
    name = f"mfs-notify-{secrets.token_hex(4)}"
    write_new_token(tmp_path / "token")
    mnt = tmp_path / "mnt"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(30)
        with open(tmp_path / "log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", CLI_MODULE, "daemon", "--listen", "127.0.0.1:0",
                 "--mount", str(mnt), "--state", str(tmp_path / "state"),
                 "--token-file", str(tmp_path / "token")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "NOTIFY_SOCKET": "@" + name})
        try:
            try:
                ready = sock.recv(4096).decode()
            except TimeoutError:
                raise AssertionError((tmp_path / "log").read_text()) from None
            # the mount is there and served the moment READY=1 arrives
            assert mounted(mnt) and os.stat(mnt).st_dev != os.stat(tmp_path).st_dev
            assert os.getxattr(mnt, "user.monarch.ops")
            fields = dict(line.split("=", 1) for line in ready.splitlines())
            assert fields["READY"] == "1" and fields["MAINPID"] == str(proc.pid)
            assert fields["STATUS"].startswith(f"serving {mnt} on 127.0.0.1:"), fields
            proc.send_signal(signal.SIGTERM)
            stopping = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
            assert stopping == {"STOPPING": "1", "STATUS": "stopping: received SIGTERM"}
            assert proc.wait(timeout=20) == 0
        finally:
            stop_serving(proc, mnt)


def test_the_unit_file_is_a_notify_service_with_rdma_limits(tmp_path):
    text = UNIT.read_text()
    for line in ("Type=notify", "LimitMEMLOCK=infinity", "LimitNOFILE=1048576",
                 "Restart=on-failure", "KillMode=mixed"):
        assert f"\n{line}\n" in text, line
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit is not verified")
    # verify checks that ExecStart's program exists: this install's monarch-fs
    exe = shutil.which("monarch-fs") or str(Path(sys.executable).parent / "monarch-fs")
    unit = tmp_path / "monarch-fs.service"
    unit.write_text(text.replace("/usr/local/bin/monarch-fs", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60)
    # a bad value is only a warning (exit 0): any line naming the unit is a failure
    complaints = [x for x in (out.stdout + out.stderr).splitlines() if unit.name in x]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr
