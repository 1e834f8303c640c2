"""What every benchmark in bench/ shares: a local cluster started and always stopped, pushes
through the real CLI, dropping the page cache, timing and medians, the daemon's own figures
(counters on the mount, peak RSS, CPU time); the machine's facts and load are machine.py's.

bench/ is a package: run a module from the repository root as `python -m bench.NAME` (which
also makes the network-namespace harness importable as `tests.netns`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from monarch_fs.daemon.client import cluster
from monarch_fs.daemon.client.progress import fmt_bytes as _fmt_bytes
from tests.netns import NetnsUnsupported

from . import store_fillers

MiB = 1024 * 1024
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "monarch-fs-bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """The benchmark cannot go on (a tool failed, or what was served is wrong)."""


def interrupt(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a process the bench started (a `push --watch`) as Ctrl-C would, by its pid;
    SIGKILL if it outlives `timeout`."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


# ---- timing -------------------------------------------------------------------------------

def sync() -> float:
    """Flush dirty pages; returns how long it took."""
    t = time.monotonic()
    subprocess.run(["sync"], check=True)
    return time.monotonic() - t


class PageCache:
    """Drops the page cache (and dentries and inodes) before cold runs when it can, and
    remembers whether it did: a cold figure taken with a warm cache must say so."""

    def __init__(self) -> None:
        self.reason: str | None = None if os.geteuid() == 0 else "not root"
        self.drops = 0

    def drop(self) -> bool:
        sync()
        if self.reason:
            return False
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as e:
            self.reason = f"cannot write /proc/sys/vm/drop_caches: {e.strerror}"
            return False
        self.drops += 1
        return True

    @property
    def works(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        if self.reason:
            return f"NOT dropped ({self.reason}): cold figures are warm-cache figures"
        return "dropped before each cold run (sync; echo 3 > /proc/sys/vm/drop_caches)"


def run(cmd: Sequence[str], *, env: dict | None = None, timeout: float | None = 600,
        **kw) -> tuple[float, subprocess.CompletedProcess]:
    """Run a command to completion: wall-clock seconds and its result. Fails loudly."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env,
                              timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{shlex.join(cmd)} took more than {timeout:g}s") from e
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise BenchError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-2000:]}")
    return seconds, proc


def last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if not lines:
        raise BenchError(f"expected a JSON line in:\n{text[-2000:]}")
    return json.loads(lines[-1])


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summary(xs: Sequence[float]) -> dict:
    """Median with the spread, so a noisy figure shows it is noisy."""
    return {"median": median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


def own_disk_kib() -> int:
    """KiB this process and its finished children read from disk (getrusage ru_inblock)."""
    blocks = sum(resource.getrusage(who).ru_inblock
                 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return blocks // 2  # 512-byte blocks


def pid_disk_kib(pid: int) -> int:
    """KiB process `pid` read from disk so far (/proc/PID/io read_bytes; root or our own)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1]) // 1024
    return 0


WARM_DISK_LIMIT_KIB = 4 * 1024  # a warm run that read more than this from disk was disturbed


class Rounds(dict):
    """{side: [seconds, ...]} from `rounds()`, and how many warm runs were thrown away."""

    discarded: dict[str, int]


def rounds(n: int, sides: dict[str, Callable[[], float]],
           before: Callable[[str], None] | None = None,
           probes: dict[str, Callable[[], int]] | None = None) -> Rounds:
    """Run every side `n` times, alternating which goes first (ABBA...), so a drift in the
    machine's load falls on both sides alike. `before(side)` runs untimed before each run.

    probes (warm runs): for each side, the KiB read from disk so far by the processes doing its
    work. A warm run reads nothing from disk; on a shared machine someone else may drop the page
    cache (other benchmarks do) in the middle of ours, which turns a warm run into a cold one.
    A run whose side read more than WARM_DISK_LIMIT_KIB is thrown away and run again (at most n
    times per side); the count is kept."""
    out = Rounds({k: [] for k in sides})
    out.discarded = {k: 0 for k in sides}
    names = list(sides)
    for r in range(n):
        for name in (names if r % 2 == 0 else names[::-1]):
            while True:
                if before:
                    before(name)
                probe = probes[name] if probes else None
                disk = probe() if probe else 0
                seconds = sides[name]()
                if (probe and probe() - disk > WARM_DISK_LIMIT_KIB
                        and out.discarded[name] < n):
                    out.discarded[name] += 1
                    continue
                out[name].append(seconds)
                break
    return out


# ---- a local cluster ----------------------------------------------------------------------

def mfs_cli() -> str:
    cli = (shutil.which("monarch-fs", path=str(Path(sys.executable).parent))
           or shutil.which("monarch-fs"))
    if not cli:
        raise BenchError("monarch-fs is not installed next to this python (pip install -e .)")
    return cli


def parse_ops(text: str) -> Counter:
    return Counter({k: int(v) for k, v in (kv.split("=", 1) for kv in text.split())})


# The daemon's chunk-cache counters (root xattrs user.monarch.KEY): hits, misses, and the
# misses answered from the page cache without a worker thread.
CACHE_KEYS = ("cache_hits", "cache_misses", "cache_nowait")


class LocalCluster:
    """N daemons started by daemon/client/cluster.py in `directory`, stopped (cluster.down) at
    exit whatever happens. Pushes go through the real CLI with $MONARCH_FS_HOME inside the cluster
    folder, so scan caches of earlier runs never make a cold push look warm. The benchmarks
    launch no processes through the daemons, so they run without --allow-root-procs."""

    def __init__(self, directory: Path, nodes: int = 1, home: Path | None = None):
        self.dir = Path(directory)
        self.nodes = nodes
        # `home`: a $MONARCH_FS_HOME kept across clusters (the dev box's scan cache and store),
        # for pushes of what the dev box has pushed before to nodes that have nothing.
        self.home = Path(home) if home else self.dir / "home"
        self.cli = mfs_cli()

    def __enter__(self) -> "LocalCluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            cluster.up(self.nodes, self.dir, root_procs=False)
        except BaseException:
            cluster.down(self.dir)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:  # the dev box store's fillers: waited for if the home outlives the cluster
            store_fillers.settle(self.home, kept=self.home != self.dir / "home")
        finally:
            cluster.down(self.dir)

    def restart(self) -> None:
        """Stop every daemon and start them again on the same state and mounts: the store
        keeps the published snapshots, the new processes start with empty caches."""
        cluster.down(self.dir)
        cluster.up(self.nodes, self.dir, root_procs=False)

    def push(self, src: Path, name: str | None = None, excludes: Sequence[str] = (),
             timeout: float = 900, args: Sequence[str] = ()) -> tuple[float, dict]:
        """Wall-clock seconds around `monarch-fs push --json [ARGS]` and its JSON result."""
        sync()
        cmd = [self.cli, "push", str(src), "--hosts", f"@{self.dir / 'hosts'}",
               "--token-file", str(self.dir / "token"), "--json", *args]
        if name:
            cmd += ["--name", name]
        for pattern in excludes:
            cmd += ["--exclude", pattern]
        env = {**os.environ, "MONARCH_FS_HOME": str(self.home)}
        seconds, proc = run(cmd, env=env, timeout=timeout)
        return seconds, last_json(proc.stdout)

    def push_args(self, src: Path, *args: str) -> tuple[list[str], dict]:
        """The `monarch-fs push` command line for this cluster and its environment, for a
        bench that runs it itself (to read its output as it comes)."""
        cmd = [self.cli, "push", str(src), "--hosts", f"@{self.dir / 'hosts'}",
               "--token-file", str(self.dir / "token"), *args]
        return cmd, {**os.environ, "MONARCH_FS_HOME": str(self.home)}

    def state(self, node: int = 0) -> Path:
        return self.dir / f"node-{node}" / "state"

    def mount(self, node: int = 0) -> Path:
        return self.dir / f"node-{node}" / "mnt"

    def pid(self, node: int = 0) -> int:
        return int((self.dir / f"node-{node}" / "pid").read_text())

    def counters(self, node: int = 0) -> dict:
        """The daemon's request counters (root xattr user.monarch.ops) and chunk-cache hits
        and misses. Reading them costs one getxattr each, which the counters include."""
        root = self.mount(node)
        ops = parse_ops(os.getxattr(root, "user.monarch.ops").decode())
        out = {"ops": ops}
        for key in CACHE_KEYS:
            try:
                out[key] = int(os.getxattr(root, f"user.monarch.{key}"))
            except OSError:
                pass
        return out

    def disk_probe(self, node: int = 0) -> Callable[[], int]:
        """For rounds(): KiB the daemon and this process (and its children) read from disk."""
        return lambda: pid_disk_kib(self.pid(node)) + own_disk_kib()

    def proc(self, node: int = 0) -> dict:
        """The daemon's memory (kB, from /proc/PID/status) and CPU seconds so far."""
        pid = self.pid(node)
        status = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                status[key + "_kb"] = int(value.split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status["cpu_s"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
        return status


def counter_delta(after: dict, before: dict) -> dict:
    """What happened between two `counters()` readings (minus the getxattr calls that read
    them)."""
    ops = Counter(after["ops"])
    ops.subtract(before["ops"])
    ops["getxattr"] -= 3  # the readings themselves
    out = {"ops": {k: v for k, v in sorted(ops.items()) if v > 0}}
    for key in CACHE_KEYS:
        if key in after and key in before:
            out[key] = after[key] - before[key]
    return out


def add_deltas(a: dict | None, b: dict) -> dict:
    if a is None:
        return {"ops": dict(b["ops"]), **{k: v for k, v in b.items() if k != "ops"}}
    ops = Counter(a["ops"])
    ops.update(b["ops"])
    out = {"ops": dict(sorted(ops.items()))}
    for key in CACHE_KEYS:
        out[key] = a.get(key, 0) + b.get(key, 0)
    return out


def mounts_under(path: Path) -> list[bytes]:
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split()[4] for line in f]
    prefix = os.fsencode(str(path)) + b"/"
    return [m for m in mounts if m.startswith(prefix)]


def remove_work(work: Path) -> None:
    """Remove a run's folder, but never descend into a mount a daemon failed to release."""
    left = mounts_under(work)
    if left:
        log(f"warning: mounts still active under {work}: {left}; leaving it in place")
        return
    shutil.rmtree(work, ignore_errors=True)


def exit_codes(name: str, main: Callable[[], int]) -> int:
    """Run a network bench's main: a machine that cannot make network namespaces exits 2, a
    failed or wrong run exits 1, each said in one line instead of a traceback."""
    try:
        return main()
    except NetnsUnsupported as e:
        print(f"{name}: cannot run here: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"\n{name}: FAILED: {e}", file=sys.stderr)
        return 1


def workload_main(argv: list[str] | None, doc: str,
                  options: Sequence[tuple[str, dict]],
                  measure: Callable[[Path, argparse.Namespace], dict]) -> int:
    """A workload bench run on its own: its options (flag, add_argument keywords) plus the
    runs and cache every workload takes; `measure(work, args)` runs in a fresh folder under
    the cache, and its result is printed as JSON."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for flag, spec in options:
        parser.add_argument(flag, **spec)
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--warm-runs", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.cache))
    try:
        result = measure(work, args)
    finally:
        remove_work(work)
    print(json.dumps(result, indent=1))
    return 0


def disk_bytes(root: Path) -> int:
    """Bytes of disk the files under `root` take (allocated blocks, as `du` counts them; hard
    links once), without crossing into other file systems (a mount inside it)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    dev = os.lstat(root).st_dev
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) processes `pids` have used so far, summed
    (/proc/PID/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def fmt_bytes(n: float) -> str:
    return _fmt_bytes(n)


class Observed:
    """Wraps the mount side of a comparison: around each run, reads the daemon's counters and
    CPU time, and sums what the runs cost the daemon (requests by type, chunk-cache hits and
    misses, CPU seconds). Works across daemon restarts (each run is read within one daemon)."""

    def __init__(self, cl: LocalCluster, fn: Callable[[], float]):
        self.cl = cl
        self.fn = fn
        self.runs = 0
        self.deltas: dict | None = None
        self.cpu_s = 0.0

    def __call__(self) -> float:
        c0, p0 = self.cl.counters(), self.cl.proc()
        seconds = self.fn()
        p1, c1 = self.cl.proc(), self.cl.counters()
        self.deltas = add_deltas(self.deltas, counter_delta(c1, c0))
        self.cpu_s += p1["cpu_s"] - p0["cpu_s"]
        self.runs += 1
        return seconds

    def report(self) -> dict:
        return {"mount_runs": self.runs, **(self.deltas or {"ops": {}}),
                "daemon_cpu_s": round(self.cpu_s, 2)}
