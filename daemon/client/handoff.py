"""A one-shot `monarch-fs push` handed to a `push --watch` of the same folder, to the same
hosts, that already runs: it holds the tree as the watcher saw it and its sessions with the
nodes, so the push costs what changed (as git's fsmonitor or Bazel's server spare a rescan),
where a new process would start Python, import everything and walk the whole tree.

The watch listens on a unix socket in HOME/watch, a folder only its user may enter (0700). Both
sides check, as HOME may be shared (issue 33, finding 9): the folder must be this user's alone
(else nothing is handed off, and a watch refuses to listen there), and each end asks the kernel
who the other is (SO_PEERCRED): a socket another user's process listens on is told nothing, and
a watch answers only its own user's pushes. This side
asks each socket there in turn, sending its command line, working folder and the environment
that changes a push (MONARCH_FS_*, SLURM_JOB_ID). The watch answers whether the push is its
own (the same folder, hosts, token, name and options, as the files say now), and if so pushes
and sends back what the command would have printed and its exit code. Anything else (no
watch, another folder, a watch that dies meanwhile) and the command runs as usual. Only the
standard library here: this runs before anything else is imported.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from ...fs.private_files import own_private_dir, untrusted
from ...settings import settings

ASK_TIMEOUT = 1.0  # seconds for a watch to say whether a push is its own
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def sockets() -> Path:
    """Where the running watches listen: one socket each."""
    return settings.home / "watch"


def own_sockets() -> Path:
    """sockets(), made 0700 or checked to be this user's alone (a watch's side): a folder
    another user made first in a shared HOME is refused (PermissionError, saying whose)."""
    folder = sockets()
    own_private_dir(folder)
    return folder


def peer_uid(sock: Any) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    return PEERCRED.unpack(raw)[1]


def shared_setting(name: str) -> bool:
    """Whether an environment variable can change what a push does (its settings, or which
    SLURM job's hosts it goes to): a push is handed off only where these are the watch's."""
    return name.startswith("MONARCH_FS_") or name == "SLURM_JOB_ID"


def request(argv: list[str]) -> bytes:
    """The request line: what the watch needs to tell whether the push is its own."""
    env = {k: v for k, v in os.environ.items() if shared_setting(k)}
    return json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env}).encode() + b"\n"


def hand_off(argv: list[str]) -> int | None:
    """Run `monarch-fs ARGV` in a watch that can, printing what it prints: its exit code, or
    None when no watch took it."""
    if not argv or argv[0] != "push" or {"--watch", "-h", "--help"} & set(argv):
        return None
    folder = sockets()
    try:
        why = untrusted(os.lstat(folder))
        names = sorted(n for n in os.listdir(folder) if n.endswith(".sock"))
    except OSError:
        return None
    if why is not None:  # another user's socket would get this command line and environment
        print(f"monarch-fs: warning: {folder} {why}: no push is handed to a watch there",
              file=sys.stderr)
        return None
    line = request(argv)
    for name in names:
        path = folder / name
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(ASK_TIMEOUT)
                s.connect(str(path))
                if peer_uid(s) != os.geteuid():  # not this user's watch: told nothing
                    continue
                s.sendall(line)
                answers = s.makefile("rb")
                if not json.loads(answers.readline()).get("mine"):
                    continue
                s.settimeout(None)  # the push's own timeouts bound it
                reply = json.loads(answers.readline())
        except ConnectionRefusedError:  # a watch that died without removing its socket
            try:
                path.unlink()
            except OSError:
                pass
            continue
        except (OSError, ValueError, AttributeError):  # gone meanwhile: push as usual
            continue
        sys.stdout.write(reply.get("stdout", ""))
        sys.stderr.write(reply.get("stderr", ""))
        return int(reply.get("code", 1))
    return None


def start_warm(argv: list[str], idle_minutes: float) -> int:
    """Leave `monarch-fs ARGV --watch --on-demand` running in the background (push --keep-warm),
    in a session of its own so that closing the terminal does not stop it, its stderr appended
    to HOME/watch/warm.log; it stops after `idle_minutes` without a push. Its pid."""
    import subprocess  # (here: every command imports this module first, and few need it)

    folder = sockets()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = os.open(folder / "warm.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                  0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_fs", *argv, "--watch", "--on-demand", "--idle",
             f"{idle_minutes:g}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log, start_new_session=True)
    finally:
        os.close(log)
    return proc.pid
