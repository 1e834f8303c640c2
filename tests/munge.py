"""A munged of a test's own: a fresh key, its socket in the test's folder, stopped by pid.

Two of them with different keys stand for a cluster and a forger: a credential the second
encodes is one the first cannot decode. (tests/slurm.py starts its cluster's munged the same
way, in its own folder.) Root only: munged refuses a key file it does not own.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

from helpers import terminate


class Munged:
    """munged in the foreground (its pid is the one we started), ready once a credential it
    encodes decodes. Its folder is 0711 and its socket 0777 (munged's own), so any local user's
    `munge` reaches it."""

    def __init__(self, folder: Path, timeout: float = 20) -> None:
        folder.mkdir(mode=0o711)
        folder.chmod(0o711)
        self.folder = folder
        self.socket = folder / "socket"
        fd = os.open(folder / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(128))
        self.log = open(folder / "log", "wb")
        self.proc = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={folder / 'munge.key'}",
             f"--socket={self.socket}", f"--pid-file={folder / 'munged.pid'}",
             f"--seed-file={folder / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            cred = self.munge("-n")
            if cred.returncode == 0 and subprocess.run(
                    ["unmunge", "-S", str(self.socket)], input=cred.stdout,
                    capture_output=True).returncode == 0:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"munged did not start: {cred.stderr.decode().strip()}; "
                                   f"{(folder / 'log').read_text(errors='replace')}")
            time.sleep(0.05)

    def munge(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """`munge -S SOCKET ARGS` as this process's user."""
        return subprocess.run(["munge", "-S", str(self.socket), *args], capture_output=True,
                              stdin=subprocess.DEVNULL)

    def close(self) -> None:
        """SIGTERM (by pid), SIGKILL after 10 s."""
        terminate(self.proc, timeout=10)
        self.log.close()
