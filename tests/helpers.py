"""Helpers the tests share: the command line in a child process, local clusters of real daemons,
polling with a deadline, what a reader sees of a tree, the content layer's small tools, and
which files a process opened (inotify).

conftest.py holds only fixtures (built from these); test modules import from here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings

from monarch_fs import cli
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Manifest

# The module `monarch-fs` runs (`python -m CLI_MODULE ...`), named by the module itself.
CLI_MODULE = cli.__name__


# ---- the command line -------------------------------------------------------------------------

def mfs(*args: str, env: dict | None = None, check: bool = True, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run the `monarch-fs` command line in a child process."""
    proc = subprocess.run([sys.executable, "-m", CLI_MODULE, *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"monarch-fs {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


# ---- waiting ----------------------------------------------------------------------------------

def wait_for(cond, timeout: float = 30.0, what: str = "condition",
             interval: float = 0.05) -> float:
    """Poll `cond` every `interval` seconds until it holds, and return how long that took; fail
    naming `what` after `timeout` seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0


def holds_for(cond, seconds: float, what: str, interval: float = 0.05) -> None:
    """Check that `cond` keeps holding for `seconds` (for what must NOT happen: there is no
    event to wait for, so a quiet period is the assertion)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert cond(), f"{what} stopped holding"
        time.sleep(interval)
    assert cond(), f"{what} stopped holding"


# ---- mounts -----------------------------------------------------------------------------------

def job_files(folder: Path, script: str) -> tuple[Path, Path]:
    """A job script (FOLDER/job.py) and an empty FOLDER/out beside it, for a test that runs it."""
    (folder / "job.py").write_text(script)
    out = folder / "out"
    out.mkdir()
    return folder / "job.py", out


def mounted(path: Path) -> bool:
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        return any(line.split()[4] == target for line in f)


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


def mount_ops(root: Path | str) -> dict[str, int]:
    """The requests a mount has served, by operation (its root's `user.monarch.ops`)."""
    raw = os.getxattr(root, "user.monarch.ops").decode().split()
    return {k: int(v) for k, v in (kv.split("=") for kv in raw)}


def write_files(folder: Path, files: dict[str, str | bytes]) -> Path:
    """Make `folder` holding `files` ({relative path: text or bytes}); the folder."""
    for rel, content in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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


# ---- local clusters and lone daemons ----------------------------------------------------------

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


def stop_node(c: Cluster, i: int = 0) -> None:
    """SIGTERM one node of `c` (by its pid) and wait until it has exited and unmounted."""
    pid = c.pid(i)
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not cluster_mod.running_node(c.dir, i), 20, f"node-{i} to stop")
    try:
        os.waitpid(pid, 0)  # started by this process: collect it
    except ChildProcessError:
        pass
    wait_for(lambda: not mounted(c.mnt(i)), 10, f"node-{i} to unmount")


def start_cluster(d: Path, nodes: int) -> Cluster:
    hosts = cluster_mod.up(nodes, d)
    return Cluster(d, hosts)


def stop_cluster(c: Cluster) -> None:
    cluster_mod.down(c.dir)
    left = [m for m in c.mounts() if mounted(m)]
    assert not left, f"mounts left behind: {left}"
    assert not cluster_mod.running(c.dir), "daemons left running"


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


def start_daemon(d: Path, *flags: str, env: dict | None = None,
                 token: Path | None = None) -> Daemon:
    """Start `monarch-fs daemon` on loopback in folder `d` (created), with extra flags, and wait
    until it is ready; with a new token, or a copy of `token` (daemons that relay to each
    other share one). The caller stops it (stop_daemon)."""
    from monarch_fs.daemon.wire.auth import write_new_token

    d.mkdir()
    if token is None:
        write_new_token(d / "token")
    else:
        (d / "token").write_bytes(token.read_bytes())
        (d / "token").chmod(0o600)
    with open(d / "log", "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", CLI_MODULE, "daemon", "--listen",
             "127.0.0.1:0", "--mount", str(d / "mnt"), "--state", str(d / "state"),
             "--token-file", str(d / "token"), "--ready-file", str(d / "ready"),
             "--node-name", d.name, *flags],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})})
    daemon = Daemon(proc, d, "", str(d / "token"))
    deadline = time.monotonic() + 30
    while not (d / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = daemon.log()
            stop_daemon(daemon)
            raise AssertionError(f"daemon did not start:\n{log}")
        time.sleep(0.05)
    daemon.addr = json.loads((d / "ready").read_text())["addr"]
    return daemon


def terminate(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM a process this test started (by its pid), SIGKILL if it outlives `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_serving(proc: subprocess.Popen, mount: Path) -> None:
    """SIGTERM a daemon this test started (by its pid), and check its mount is gone."""
    terminate(proc)
    if mounted(mount):
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], check=False)
        raise AssertionError(f"{mount} was left mounted")


def stop_daemon(daemon: Daemon) -> None:
    stop_serving(daemon.proc, daemon.mnt)


# ---- push --watch ------------------------------------------------------------------------------

class Watcher:
    """A `monarch-fs push --watch` child process; its output lines are read as they come."""

    def __init__(self, src: Path, hosts: str, token_file: str | None, home: Path, *args: str):
        cmd = [sys.executable, "-m", CLI_MODULE, "push", str(src), "--watch",
               "--hosts", hosts, *args]
        if token_file:
            cmd += ["--token-file", token_file]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "MONARCH_FS_HOME": str(home)})
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        self.pumps = [threading.Thread(target=self._pump, args=(stream, q), daemon=True)
                      for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.pumps:
            t.start()

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))

    def line(self, timeout: float = 20) -> str:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no push reported within {timeout}s; stderr so far: "
                                 f"{self.stderr()}") from None

    def push(self, timeout: float = 20) -> dict:
        return json.loads(self.line(timeout))

    def no_push(self, seconds: float) -> None:
        try:
            extra = self.out.get(timeout=seconds)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected push: {extra}")

    def pushes_for(self, seconds: float) -> list[dict]:
        """Every push reported within the next `seconds`."""
        deadline = time.monotonic() + seconds
        out = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                out.append(json.loads(self.out.get(timeout=left)))
            except queue.Empty:
                break
        return out

    def stderr(self, wait_for: str | None = None, timeout: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            while not self.err.empty():
                self.err_lines.append(self.err.get())
            if wait_for is None or any(wait_for in ln for ln in self.err_lines):
                return self.err_lines
            if time.monotonic() > deadline:
                raise AssertionError(f"never printed {wait_for!r}: {self.err_lines}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT) -> int:
        self.proc.send_signal(sig)  # by PID: this process only
        try:
            return self.proc.wait(timeout=20)
        finally:
            for t in self.pumps:  # they end at the pipes' end: everything printed is queued
                t.join(timeout=10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def reads(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def watcher(c: Cluster, src: Path, tmp_path: Path, *args: str) -> Watcher:
    return Watcher(src, c.hostfile, c.token_file, tmp_path / "home", "--json", *args)


def peer_ports(pid: int, ports: set[int]) -> set[tuple[int, int]]:
    """(local port, remote port) of process `pid`'s established TCP connections to `ports`,
    from /proc (the sockets its descriptors hold)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            port = int(remote.split(":")[1], 16)
            if state == "01" and inode in inodes and port in ports:
                out.add((int(local.split(":")[1], 16), port))
    return out


# ---- the content layer ------------------------------------------------------------------------

# Hypothesis settings for the decoders' fuzz tests.
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SMALL = 64 * 1024  # the smallest chunk size a manifest allows


def flip_bits(path: Path, index: int, mask: int) -> None:
    """XOR byte `index` of a file with `mask`, as a failing disk might."""
    b = bytearray(path.read_bytes())
    b[index] ^= mask
    path.write_bytes(bytes(b))


# The documented layout of a folder object (fs/manifest.py), written out independently so that
# tests can hand-craft objects Manifest.objects() would never produce.
FOLDER_MAGIC = b"MFSD\x01"
FOLDER_HEAD = struct.Struct("<5sIIqI")  # magic, chunk size, mode, mtime_ns, children
RECORD = struct.Struct("<BIQqHHI")  # kind, mode, size, mtime_ns, name len, target len, chunks


def folder_object(records, mode: int = 0o755, mtime: int = 0,
                  chunk_size: int = chunk.CHUNK_SIZE, magic: bytes = FOLDER_MAGIC,
                  count: int | None = None) -> bytes:
    """records: (kind, mode, size, mtime_ns, name, target, chunks), encoded in the given order
    (a child folder's: (Kind.DIR, 0, 0, 0, name, b"", (its object id,)))."""
    out = [FOLDER_HEAD.pack(magic, chunk_size, mode, mtime,
                            len(records) if count is None else count)]
    for kind, rmode, size, rmtime, name, target, chunks in records:
        out.append(RECORD.pack(kind, rmode, size, rmtime, len(name), len(target), len(chunks)))
        out += [name, target, *chunks]
    return b"".join(out)


def staged(m: Manifest | list[bytes]) -> tuple[str, dict[bytes, bytes]]:
    """(version, encoded chunks) of a manifest as a client stages it: the folder objects of `m`
    (Manifest.objects() checks nothing but that each entry has a parent), or objects built by
    hand, the root last. The version is the root's id, in hex."""
    blobs = list(m.objects().values()) if isinstance(m, Manifest) else m
    return (chunk.chunk_id(blobs[-1]).hex(),
            {chunk.chunk_id(b): chunk.encode(b) for b in blobs})
