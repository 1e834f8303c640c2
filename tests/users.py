"""Local users for tests that need another identity than root: made with useradd, deleted with
userdel by whoever made them (SlurmCluster, test_unprivileged, test_identity). Root only.
LocalUser is one with a home of its own, and CLI the monarch-fs command line it can run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from helpers import CLI_MODULE, stop_serving, wait_for
from monarch_fs.daemon.wire.auth import write_new_token
from monarch_fs.fs.mount_check import FUSE_DEVICE


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


# This interpreter may sit where another user cannot reach it (pyenv under /root, 0700): the
# test user runs the system's python3 of the same version, with this environment's packages.
SYSTEM_PYTHON = "/usr/bin/python3"
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
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


LAUNCH = launch_code()
CLI = [SYSTEM_PYTHON, "-I", "-c", LAUNCH, SITE_PACKAGES]  # + monarch-fs ARGS, as any user


class LocalUser:
    """A fresh local user and a folder of its own (its home) to run a daemon in."""

    def __init__(self, prefix: str = "unpriv") -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"mfs-{prefix}-"))
        self.base.chmod(0o755)
        self.name = f"mfsu{secrets.token_hex(3)}"
        self.home = self.base / "home"
        self.pw, made = create_user(self.name, self.home)
        assert made, f"user {self.name} already existed"

    def close(self) -> None:
        problem = delete_user(self.name)
        shutil.rmtree(self.base, ignore_errors=True)
        assert problem is None, problem

    def env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
                "USER": self.name, "LANG": "C.UTF-8"}

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, user=self.pw.pw_uid, group=self.pw.pw_gid,
                                extra_groups=[], env=self.env(), cwd=self.home, **kw)

    def run(self, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """`argv` as this user, in its home, with its environment plus `env`."""
        return subprocess.run(argv, user=self.pw.pw_uid, group=self.pw.pw_gid, extra_groups=[],
                              env={**self.env(), **(env or {})}, cwd=self.home,
                              capture_output=True, text=True, timeout=timeout)

    def daemon_argv(self, mount: Path, *flags: str, state: str = "state") -> list[str]:
        token = self.home / "token"
        if not token.exists():
            write_new_token(token)
            os.chown(token, self.pw.pw_uid, self.pw.pw_gid)
        return [*CLI, "daemon",
                "--listen", "127.0.0.1:0",
                "--mount", str(mount), "--state", str(self.home / state),
                "--token-file", str(token), "--node-name", "unpriv", *flags]

    @contextlib.contextmanager
    def daemon(self, mount: Path) -> Iterator[str]:
        """This user's daemon serving `mount` (/dev/fuse open to all meanwhile), its output in
        HOME/log: its address, once it is mounted and listening; stopped, and its mount checked
        gone, when the block ends."""
        ready = self.home / "ready"
        with open(self.home / "log", "wb") as log, fuse_device_mode(0o666):
            proc = self.popen(self.daemon_argv(mount, "--ready-file", str(ready)),
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the daemon")
                assert proc.poll() is None, (self.home / "log").read_text()
                yield json.loads(ready.read_text())["addr"]
            finally:
                stop_serving(proc, mount)


FUSE_DEVICE_LOCK = Path(tempfile.gettempdir()) / "monarch-fs-tests-dev-fuse.lock"


@contextlib.contextmanager
def fuse_device_mode(mode: int, timeout: float = 900):
    """/dev/fuse with `mode` for the body, and the mode it had, always, afterwards. The mode is
    the whole machine's: test runs in other processes (parallel checkouts) that change it too
    take turns through an exclusive lock, so one never restores 0600 under another's feet."""
    with open(FUSE_DEVICE_LOCK, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{FUSE_DEVICE_LOCK}: held by another test for "
                                       f"{timeout:g}s") from None
                time.sleep(0.2)
        before = stat.S_IMODE(os.stat(FUSE_DEVICE).st_mode)
        os.chmod(FUSE_DEVICE, mode)
        try:
            yield
        finally:
            os.chmod(FUSE_DEVICE, before)
