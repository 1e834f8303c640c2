"""Local users for tests that need another identity than root: made with useradd, deleted with
userdel by whoever made them (SlurmCluster, test_unprivileged). Root only."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
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
