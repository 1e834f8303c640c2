"""A one-shot `monarch-fs push` handed to a `push --watch` of the same folder, to the same
hosts, that already runs: it holds the tree as the watcher saw it and its sessions with the
nodes, so the push costs what changed (as git's fsmonitor or Bazel's server spare a rescan),
where a new process would start Python, import everything and walk the whole tree.

The watch listens on a unix socket in HOME/watch (HOME is private to its user). This side
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
import sys
from pathlib import Path

from ...settings import settings

ASK_TIMEOUT = 1.0  # seconds for a watch to say whether a push is its own


def sockets() -> Path:
    """Where the running watches listen: one socket each."""
    return settings.home / "watch"


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
        names = sorted(n for n in os.listdir(folder) if n.endswith(".sock"))
    except OSError:
        return None
    line = request(argv)
    for name in names:
        path = folder / name
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(ASK_TIMEOUT)
                s.connect(str(path))
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
