"""Shared fixtures: real local clusters of real daemons with real FUSE mounts, driven through
the real command line. Every cluster a test starts is stopped, and its mounts checked gone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from monarch_fs.daemon import cluster as cluster_mod


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory, monkeypatch):
    """The CLI keeps a scan cache and a default cluster under $MONARCH_FS_HOME: never the
    user's own, in tests."""
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path_factory.mktemp("home")))


def mfs(*args: str, env: dict | None = None, check: bool = True, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run the `monarch-fs` command line in a child process."""
    proc = subprocess.run([sys.executable, "-m", "monarch_fs.cli", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"monarch-fs {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def umount_tmpfs(path: Path, timeout: float = 10) -> None:
    """Unmount a tmpfs a test mounted. Right after a daemon that used it exits, the kernel may
    hold it a little longer (`fuser -m` says "kernel": its last files are released
    asynchronously), so a busy unmount is retried until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if proc.returncode == 0:
            return
        if "busy" not in proc.stderr or time.monotonic() > deadline:
            raise AssertionError(f"cannot unmount {path}: {proc.stderr.strip()}")
        time.sleep(0.1)


def wait_for(cond, timeout: float, what: str) -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def mounted(path: Path) -> bool:
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        return any(line.split()[4] == target for line in f)


@dataclass
class Cluster:
    dir: Path
    hosts: list[str]

    @property
    def hostfile(self) -> str:
        return f"@{self.dir / 'hosts'}"

    @property
    def token_file(self) -> str:
        return str(self.dir / "token")

    def mnt(self, i: int) -> Path:
        return self.dir / f"node-{i}" / "mnt"

    def mounts(self) -> list[Path]:
        return [self.mnt(i) for i in range(len(self.hosts))]

    def push(self, src: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return mfs("push", str(src), "--hosts", self.hostfile, "--token-file", self.token_file,
                   "--json", *args, check=check)

    def push_json(self, src: Path, *args: str) -> dict:
        return json.loads(self.push(src, *args).stdout)

    def status(self) -> list[dict]:
        out = mfs("status", "--hosts", self.hostfile, "--token-file", self.token_file, "--json",
                  check=False)
        return json.loads(out.stdout)

    def pid(self, i: int) -> int:
        return int((self.dir / f"node-{i}" / "pid").read_text())


def start_cluster(d: Path, nodes: int) -> Cluster:
    hosts = cluster_mod.up(nodes, d)
    return Cluster(d, hosts)


def stop_cluster(c: Cluster) -> None:
    cluster_mod.down(c.dir)
    left = [m for m in c.mounts() if mounted(m)]
    assert not left, f"mounts left behind: {left}"
    assert not cluster_mod.running(c.dir), "daemons left running"


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), 2)
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), 3)
    yield c
    stop_cluster(c)


@pytest.fixture
def fresh_cluster(tmp_path):
    """Start clusters of any size inside the test; all are stopped afterwards."""
    started: list[Cluster] = []

    def start(nodes: int = 2) -> Cluster:
        c = start_cluster(tmp_path / f"cluster{len(started)}", nodes)
        started.append(c)
        return c

    yield start
    for c in started:
        stop_cluster(c)


@dataclass
class Daemon:
    """One `monarch-fs daemon` started by a test, with its own flags."""

    proc: subprocess.Popen
    dir: Path
    addr: str
    token_file: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def mnt(self) -> Path:
        return self.dir / "mnt"

    def log(self) -> str:
        return (self.dir / "log").read_text(errors="replace")


@pytest.fixture
def lone_daemon(tmp_path):
    """Start daemons on loopback with extra command-line flags; each is stopped (SIGTERM, by
    its pid) and its mount checked gone afterwards."""
    from monarch_fs.daemon.auth import write_new_token

    started: list[Daemon] = []

    def start(*flags: str, env: dict | None = None) -> Daemon:
        d = tmp_path / f"daemon{len(started)}"
        d.mkdir()
        write_new_token(d / "token")
        with open(d / "log", "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "monarch_fs.cli", "daemon", "--listen",
                 "127.0.0.1:0", "--mount", str(d / "mnt"), "--state", str(d / "state"),
                 "--token-file", str(d / "token"), "--ready-file", str(d / "ready"),
                 "--node-name", d.name, *flags],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})})
        daemon = Daemon(proc, d, "", str(d / "token"))
        started.append(daemon)
        deadline = time.monotonic() + 30
        while not (d / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"daemon did not start:\n{daemon.log()}")
            time.sleep(0.05)
        daemon.addr = json.loads((d / "ready").read_text())["addr"]
        return daemon

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.proc.terminate()
            try:
                daemon.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                daemon.proc.wait()
        if mounted(daemon.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(daemon.mnt)], check=False)
            raise AssertionError(f"{daemon.mnt} was left mounted")


def tree(root: Path) -> dict[bytes, tuple]:
    """Everything a reader can see of a tree: per path, type, mode, size, mtime, target, bytes."""
    out = {}
    base = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            kind = stat.S_IFMT(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                body = os.readlink(full)
            elif stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    body = f.read()
            else:
                body = None
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_mtime_ns, body)
    return out
