"""Local users for tests that need another identity than root: made with useradd, deleted with
userdel by whoever made them (SlurmCluster, test_unprivileged). Root only."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shlex
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path


class UserError(RuntimeError):
    pass


def create_user(name: str, home: Path) -> tuple[pwd.struct_passwd, bool]:
    """User `name` and whether it was made now: made (no password, shell /bin/sh, a group of its
    own, `home` made and owned by it, 0755) if missing; an existing user is returned as it is.
    The caller deletes a user it made (delete_user)."""
    try:
        return pwd.getpwnam(name), False
    except KeyError:
        pass
    argv = ["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh",
            "--user-group", name]
    deadline = time.monotonic() + 30
    while (out := subprocess.run(argv, capture_output=True)).returncode != 0:
        # another process (a parallel test) may hold /etc/passwd's lock for a moment
        if b"lock" not in out.stderr or time.monotonic() > deadline:
            raise UserError(f"useradd {name} exited {out.returncode}: "
                            f"{out.stderr.decode(errors='replace').strip()}")
        time.sleep(0.1)
    entry = pwd.getpwnam(name)
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    home.chmod(0o755)
    return entry, True


def delete_user(name: str) -> str | None:
    """userdel `name` (retried while /etc/passwd is locked); None, or what went wrong."""
    deadline = time.monotonic() + 30
    while (out := subprocess.run(["userdel", name], capture_output=True)).returncode != 0:
        if b"lock" not in out.stderr or time.monotonic() > deadline:
            return f"user {name}: {out.stderr.decode(errors='replace').strip()}"
        time.sleep(0.1)
    return None


# ---- monarch-fs as another user ----------------------------------------------------------------
# This interpreter may sit where another user cannot reach it (pyenv under /root, 0700): a test
# user runs the system's python3 of the same version, with this environment's packages.

SYSTEM_PYTHON = "/usr/bin/python3"
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
CLI_MODULE = "monarch_fs.cli"


def launch_code(argv0: str | None = None) -> str:
    """`python -I -c CODE SITE_PACKAGES [ARGV0] ARGS...` runs monarch-fs from SITE_PACKAGES;
    with `argv0`, the first argument after SITE_PACKAGES becomes sys.argv[0] (a wrapper's own
    path, which `slurm up` then runs on every node)."""
    name = "sys.argv.pop(1)" if argv0 else repr("monarch-fs")
    # alter_sys would set sys.argv[0] to the module's file, hiding the wrapper's path
    return ("import runpy, site, sys; "
            # Debian's own packages (another msgpack, cryptography...) must not shadow this
            # environment's
            "sys.path[:] = [p for p in sys.path if 'dist-packages' not in p]; "
            f"site.addsitedir(sys.argv.pop(1)); sys.argv[0] = {name}; "
            f"runpy.run_module({CLI_MODULE!r}, run_name='__main__', alter_sys={not argv0})")


def system_python_reason() -> str | None:
    """Why a test user has no python to run monarch-fs with, or None."""
    try:
        version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        version = "none"
    if version != str(sys.version_info[:2]):
        return (f"{SYSTEM_PYTHON} is {version}, not {sys.version_info[:2]}: no python for the "
                "test user")
    return None


def write_monarch_fs_command(path: Path) -> Path:
    """A `monarch-fs` command any user can run (0755), as a user's own install would give:
    a shell script that starts this environment's monarch-fs with SYSTEM_PYTHON."""
    code = launch_code(argv0="$0")
    path.write_text("#!/bin/sh\n"
                    f'exec {SYSTEM_PYTHON} -I -c {shlex.quote(code)} {SITE_PACKAGES} "$0" "$@"\n')
    path.chmod(0o755)
    return path


# Tests of several pytest sessions may change /dev/fuse's mode at once: each would restore the
# mode another one set. One at a time (an flock), so each finds, and restores, the real one.
FUSE_MODE_LOCK = "/tmp/.monarch-fs-tests-dev-fuse.lock"
FUSE_MODE_WAIT = 600.0


@contextlib.contextmanager
def fuse_device_mode(mode: int, device: str = "/dev/fuse") -> Iterator[None]:
    """`device` with `mode` for the body; the mode it had, always, afterwards. Waits while
    another test (of any session) has changed it."""
    fd = os.open(FUSE_MODE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + FUSE_MODE_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"{device}: another test held {FUSE_MODE_LOCK} for "
                                    f"{FUSE_MODE_WAIT:g}s") from None
                time.sleep(0.1)
        before = stat.S_IMODE(os.stat(device).st_mode)
        os.chmod(device, mode)
        try:
            yield
        finally:
            os.chmod(device, before)
    finally:
        os.close(fd)  # releases the lock
