"""The dev box store's background filler seen from outside it: a push starts one, a push that
wants the store asks it to stop, and whatever started pushes (a test, a benchmark) stops the
fillers they left before it removes their home. The filler itself is store_filler.py.

    STORE/filler.pid        the filler's pid, while it holds the store's lock
    STORE/filler.stop.PID   a request that filler PID stop: it looks between chunks
    STORE/fill-pending.json what fillers stopped that way left (their specs): the next
                            filler fills it after its own push's chunks
    HOME/store-fill.log     one line per filler run, and a crashed one's traceback
    HOME/store-fill.pids    "PID STORE" for each filler a push started, pruned of the dead
                            at the next start: what stop_all and wait_all wait for

A request is a file, not a signal: a pid file left by a filler that was killed may name
another process by now, and a file asks nothing of it. An asker writes it again at every try
of its wait (a filler that had not taken the lock at the first may hold it at the next), and
the filler removes it as it exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...fs.private_files import replace_file

# The filler's module, run as `python -m MODULE SPEC` (a sibling of this one).
MODULE = __name__.rpartition(".")[0] + ".store_filler"
PID_FILE = "filler.pid"
STOP_FILE = "filler.stop."
LOG_FILE = "store-fill.log"
STARTED_FILE = "store-fill.pids"
PENDING_FILE = "fill-pending.json"
MAX_PENDING = 8  # folders whose fill waits for the next filler, at most (the latest kept)
STOP_TIMEOUT = 10.0  # seconds stop_all waits for a filler to stop before it kills it
_children: list[subprocess.Popen] = []


def pid_path(store: Path) -> Path:
    return store / PID_FILE


def stop_path(store: Path, pid: int) -> Path:
    return store / f"{STOP_FILE}{pid}"


def log_path(home: Path) -> Path:
    return home / LOG_FILE


def read_pending(store: Path) -> list[dict]:
    """The specs of the fills that fillers stopped by a push left unfinished."""
    try:
        specs = json.loads((store / PENDING_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [s for s in specs if isinstance(s, dict)] if isinstance(specs, list) else []


def write_pending(store: Path, specs: list[dict]) -> None:
    """Record `specs` as pending (by the store's lock holder only), the latest MAX_PENDING."""
    path = store / PENDING_FILE
    if not specs:
        path.unlink(missing_ok=True)
        return
    replace_file(path, json.dumps(specs[-MAX_PENDING:]).encode(),
                 store / f"{PENDING_FILE}.{os.getpid()}.tmp")


def holder(store: Path) -> int | None:
    """The pid the store's filler recorded (it holds the lock, or was killed holding it)."""
    try:
        return int(pid_path(store).read_text())
    except (OSError, ValueError):
        return None


def ask_to_stop(store: Path) -> int | None:
    """Ask the filler holding `store` to stop, if one does; its pid. Never waits."""
    pid = holder(store)
    if pid is not None:
        request(store, pid)
    return pid


def request(store: Path, pid: int) -> None:
    try:
        os.close(os.open(stop_path(store, pid), os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError:  # the store's folder is gone: nothing left to stop for
        pass


def drop_stale_requests(store: Path) -> None:
    """Remove the requests to fillers that are gone (one killed, and asked after)."""
    for path in store.glob(f"{STOP_FILE}*"):
        pid = path.name[len(STOP_FILE):]
        if pid.isdigit() and not is_filler(int(pid)):
            path.unlink(missing_ok=True)


def is_filler(pid: int) -> bool:
    """Whether `pid` is a filler still running (not a zombie, not a reused pid). A process
    in the middle of its exec shows no command line yet: one that is no zombie counts."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if cmdline:
            return MODULE.encode() in cmdline
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def start(spec: dict, home: Path) -> int:
    """Start a filler for `spec` (store_filler.py reads it), detached: a session of its own
    (a Ctrl-C at the terminal does not reach it), no terminal on its stdio, its stderr
    appended to the log. Its pid, recorded in HOME/store-fill.pids. Blocking (fork, exec)."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = os.open(log_path(home), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        proc = subprocess.Popen([sys.executable, "-m", MODULE, json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=log, start_new_session=True)
    finally:
        os.close(log)
    # A long-lived caller (push --watch, a test) reaps the fillers it started as it starts more.
    _children[:] = [p for p in _children if p.poll() is None] + [proc]
    started = [(p, s) for p, s in _started(home) if is_filler(p)] + [(proc.pid, spec["store"])]
    replace_file(home / STARTED_FILE, "".join(f"{p} {s}\n" for p, s in started).encode(),
                 home / f"{STARTED_FILE}.{os.getpid()}.tmp")
    return proc.pid


def _started(home: Path) -> list[tuple[int, str]]:
    try:
        lines = (home / STARTED_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        pid, _, store = line.partition(" ")
        if pid.isdigit() and store:
            out.append((int(pid), store))
    return out


def running(home: Path) -> list[int]:
    """The fillers started with this home that still run."""
    return [pid for pid, _ in _started(home) if is_filler(pid)]


def wait_all(home: Path, timeout: float) -> bool:
    """Wait until every filler started with this home has exited; whether they all did
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while running(home):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def stop_all(home: Path, timeout: float = STOP_TIMEOUT) -> list[int]:
    """Ask every filler started with this home to stop, and wait for them to exit (before
    the home is removed); one that outlives `timeout` is killed. The pids asked."""
    asked = [(pid, Path(store)) for pid, store in _started(home) if is_filler(pid)]
    stop(asked, timeout)
    return [pid for pid, _ in asked]


def stop(fillers: list[tuple[int, Path]], timeout: float = STOP_TIMEOUT) -> None:
    """Ask each filler (pid, store) to stop and wait for it to exit; one that outlives
    `timeout` is killed (a filler its caller's pushes started), and waited for as long."""
    for pid, store in fillers:
        request(store, pid)
    deadline, killed = time.monotonic() + timeout, False
    while left := [pid for pid, _ in fillers if is_filler(pid)]:
        if time.monotonic() > deadline:
            if killed:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            deadline, killed = time.monotonic() + timeout, True
        time.sleep(0.02)
