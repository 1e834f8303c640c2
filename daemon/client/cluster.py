"""A local cluster: N node daemons on loopback, each with its own state and mount, sharing a
fresh token. It is the embedded default every example uses, and what the tests run against.

    D/token          the cluster token (0600)
    D/hosts          one host:port per line, for --hosts @D/hosts
    D/node-I/state   the daemon's store and refs
    D/node-I/mnt     its mount
    D/node-I/pid     its process id; D/node-I/log its log

A local cluster is one user's: started as root, its daemons get --allow-root-procs (they run
`run`'s and meshes' processes as root, which a root daemon otherwise refuses), and `cluster up`
says so; `root_procs=False` (`cluster up --no-root-procs`) leaves it out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..wire.auth import default_token_file, write_new_token
from ..wire.identity import ROOT_PROCS_FLAG

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class ClusterError(Exception):
    pass


def default_cluster_dir() -> Path:
    return default_token_file().parent


def _node_dirs(d: Path) -> list[Path]:
    return sorted((p for p in d.glob("node-*") if p.is_dir()), key=lambda p: int(p.name[5:]))


def _our_daemon(pid: int, node_dir: Path) -> bool:
    """True if `pid` is still the daemon we started for `node_dir` (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"daemon" in cmdline and os.fsencode(node_dir / "state") in cmdline


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _live_daemons(d: Path) -> list[tuple[int, Path]]:
    """(pid, node folder) of every daemon of the cluster that still runs."""
    live = []
    for nd in _node_dirs(d):
        try:
            pid = int((nd / "pid").read_text())
        except (OSError, ValueError):
            continue
        if _our_daemon(pid, nd):
            live.append((pid, nd))
    return live


def running(d: Path) -> list[int]:
    return [pid for pid, _ in _live_daemons(d)]


def describe_procs(root_procs: bool = True) -> str:
    """What `cluster up` says about the processes its daemons will run."""
    if os.geteuid() != 0:
        return "processes run as this user"
    if root_procs:
        return f"processes run as root: {ROOT_PROCS_FLAG} (local cluster)"
    return f"processes are refused: the daemons run as root without {ROOT_PROCS_FLAG}"


def _root_flags(root_procs: bool) -> list[str]:
    return [ROOT_PROCS_FLAG] if root_procs and os.geteuid() == 0 else []


def up(nodes: int, directory: str | os.PathLike[str] | None = None, *,
       root_procs: bool = True) -> list[str]:
    """Start `nodes` daemons and return their addresses once every one is mounted and ready.
    As root, `root_procs` lets them run processes as root (see the module docstring)."""
    if nodes < 1:
        raise ClusterError("--nodes must be at least 1")
    d = Path(directory) if directory else default_cluster_dir()
    d.mkdir(parents=True, exist_ok=True)
    if running(d):
        raise ClusterError(f"a cluster is already running in {d}; run `monarch-fs cluster down"
                           f" --dir {d}` first")
    write_new_token(d / "token")
    (d / "flags").write_text(json.dumps(_root_flags(root_procs)))  # for restart_node
    procs = [_spawn(d, i) for i in range(nodes)]
    addrs = []
    for i, proc in enumerate(procs):
        try:
            addrs.append(_wait_ready(d, i, proc))
        except ClusterError:
            down(d)
            raise
    (d / "hosts").write_text("".join(a + "\n" for a in addrs))
    return addrs


def restart_node(directory: str | os.PathLike[str], i: int) -> str:
    """Start node I again on its state, mount and address (after it died or was stopped)."""
    d = Path(directory)
    addr = (d / "hosts").read_text().split()[i]
    if running_node(d, i):
        raise ClusterError(f"node-{i} is still running")
    return _wait_ready(d, i, _spawn(d, i, listen=addr))


def running_node(d: Path, i: int) -> bool:
    return any(nd.name == f"node-{i}" for _, nd in _live_daemons(d))


def _flags(d: Path) -> list[str]:
    """The flags `up` chose for this cluster's daemons."""
    try:
        return list(json.loads((d / "flags").read_text()))
    except (OSError, ValueError):
        return []


def _spawn(d: Path, i: int, listen: str = "127.0.0.1:0") -> subprocess.Popen:
    nd = d / f"node-{i}"
    nd.mkdir(parents=True, exist_ok=True)
    try:
        (nd / "mnt").mkdir()
    except FileExistsError:  # maybe a dead daemon's stale mount: the new daemon clears it
        pass
    (nd / "ready").unlink(missing_ok=True)
    # The log names every process the daemon starts, argv included: only for this user.
    with os.fdopen(os.open(nd / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
                   "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_fs.cli", "daemon",
             "--listen", listen, "--mount", str(nd / "mnt"), "--state", str(nd / "state"),
             "--token-file", str(d / "token"), "--ready-file", str(nd / "ready"),
             "--node-name", f"node-{i}", *_flags(d)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True)
    (nd / "pid").write_text(str(proc.pid))
    return proc


def _wait_ready(d: Path, i: int, proc: subprocess.Popen) -> str:
    nd = d / f"node-{i}"
    deadline = time.monotonic() + START_TIMEOUT
    while not (nd / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with status {proc.returncode}" if proc.returncode is not None
                   else f"not ready after {START_TIMEOUT:.0f}s")
            raise ClusterError(f"{nd.name} {why}; its log ends:\n{_tail(nd / 'log')}")
        time.sleep(0.05)
    return json.loads((nd / "ready").read_text())["addr"]


def down(directory: str | os.PathLike[str] | None = None) -> int:
    """Stop the cluster's daemons (by pid, only ours) and make sure no mount is left behind.
    Returns how many daemons were stopped."""
    d = Path(directory) if directory else default_cluster_dir()
    stopped = 0
    waiting = _live_daemons(d)
    for pid, _ in waiting:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for pid, nd in waiting:
        while _our_daemon(pid, nd) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.05)
        if _our_daemon(pid, nd):
            os.kill(pid, signal.SIGKILL)
            while _our_daemon(pid, nd):
                _reap(pid)
                time.sleep(0.05)
        stopped += 1
    for nd in _node_dirs(d):
        mnt = nd / "mnt"
        if _is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False,
                           stderr=subprocess.DEVNULL)
        (nd / "pid").unlink(missing_ok=True)
        (nd / "ready").unlink(missing_ok=True)
    (d / "hosts").unlink(missing_ok=True)
    return stopped


def _reap(pid: int) -> None:
    """Collect the exit status if the daemon is our child (started in this process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _is_mounted(path: Path) -> bool:
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        return any(line.split()[4] == target for line in f)
