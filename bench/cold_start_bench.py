#!/usr/bin/env python3
"""Cold start on a fresh allocation (issue 19): from `monarch-fs push` of a venv the dev box has
pushed before, to nodes that have nothing, until the first `import torch` is done there.

    .venv/bin/python -m bench.cold_start_bench            # torch venv, 1 and 8 nodes (~5 min)
    .venv/bin/python -m bench.cold_start_bench --quick    # sympy, small data (~1-2 min)

What it reports, next to the issue's targets:

1. push of the staged torch venv (import_bench.ensure_venv: the project's venv with fresh
   bytecode) to a fresh 1-node cluster, when the dev box has pushed it before: a warm-up push to
   another cluster fills a $MONARCH_FS_HOME (scan cache, and the dev box's store where there is
   one) that the measured pushes keep. Wall clock of the CLI, interpreter start included.
2. cold start, default mode: from the start of that push to the end of the first
   `VENV/bin/python -c "import torch"` on the node's mount (import_bench's fresh interpreter).
3. the same in the usable-early mode, when `push --help` offers `--early`: the import starts
   when push prints its `{"event": "usable"}` line; both the import's end and the push's
   `complete_seconds` are reported. Without the flag: "not available", never a figure.
4. what users would do instead: the venv already on local disk (import only, page cache
   dropped), `rsync -a` of the venv to a fresh local folder and the import from there (the
   source warm, as for the pushes), and Monarch 0.7 remotemount's 9.6 s, quoted from the issue.
5. the node's disk per content byte: allocated blocks of its state folder (store, backing
   files; not the mount), once the daemon has finished writing, over the files' bytes; and
   the floors a cold start cannot beat here, from the same run: the first import from the
   mount once the version is whole on the node (page cache dropped, after each default run),
   and the disk's write of the venv's bytes (4 MiB O_DIRECT writes and an fsync).
6. daemon CPU seconds per GB ingested and MB/s of content, for 1 GiB of incompressible data to 1
   and to 8 local nodes: /proc/PID/stat of every daemon, summed, over content x nodes.
7. (root: network namespaces, tests/netns.py) item 2 on 8 hosts behind 1 Gbit/s links against
   1 host behind the same link: until every host has finished its first import, one run each.
   Node stores go to tmpfs when the machine has the memory for them, else to disk (said).

Cases 2-4 alternate in rounds (common.rounds), each cold-start run on its own fresh cluster.
The dev box's files stay in the page cache (it pushed them before); the local-disk import runs
with the page cache dropped. Figures from a shared 2-core machine: read the spread.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.netns import NetCluster, NetnsUnsupported

from . import import_bench
from .cold_start_report import MONARCH_REMOTEMOUNT_S, TARGETS, table  # noqa: F401 (run_all)
from .common import (
    DEFAULT_CACHE,
    BenchError,
    LocalCluster,
    MiB,
    PageCache,
    cpu_seconds,
    disk_bytes,
    fmt_bytes,
    last_json,
    log,
    mfs_cli,
    remove_work,
    rounds,
    run,
    summary,
    sync,
    workload_main,
)
from .machine import CpuMeter, loadavg
from .node_settled import flushed, settled

NAME = "venv"
SHM = "/dev/shm"
# The child each import runs: the wall clock at its end, so a run that overlaps a push still
# gives the moment its import was done.
CHILD = """\
import json, time
import {module} as m
print(json.dumps({{"end": time.time(), "file": m.__file__}}))
"""


# ---- imports ------------------------------------------------------------------------------

def start_import(root: Path, module: str, prefix: list[str] | None = None) -> subprocess.Popen:
    """`ROOT/bin/python -c "import MODULE"` in a fresh interpreter (behind `prefix`, e.g.
    nsenter into a node), as import_bench runs it."""
    return subprocess.Popen([*(prefix or []), str(root / "bin" / "python"), "-W", "ignore", "-c",
                             CHILD.format(module=module)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=import_bench.child_env())


def import_end(proc: subprocess.Popen, root: Path, timeout: float = 300) -> float:
    """When the import of `start_import` was done (time.time()); checks it came from `root`."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"import from {root} exited {proc.returncode}: {err.strip()[-1500:]}")
    got = json.loads(out.strip().splitlines()[-1])
    if not got["file"].startswith(str(root) + "/"):
        raise BenchError(f"the import came from {got['file']}, not from {root}")
    return float(got["end"])


def early_available() -> bool:
    """Whether this monarch-fs has the usable-early mode (`push --early`)."""
    _, proc = run([mfs_cli(), "push", "--help"], timeout=60)
    return "--early" in proc.stdout


# ---- cold start on a local cluster --------------------------------------------------------

class ColdStart:
    """Cold-start runs, each on a fresh 1-node cluster sharing the dev box's `home`."""

    def __init__(self, work: Path, home: Path, venv: Path, module: str,
                 excludes: tuple[str, ...], page_cache: PageCache | None = None):
        self.work = work
        self.page_cache = page_cache  # given: a default run times the mount's import too
        self.home = home
        self.venv = venv
        self.module = module
        self.patterns = excludes
        self.excludes = [a for p in excludes for a in ("--exclude", p)]
        self.runs: dict[str, list[dict]] = {"default": [], "early": []}
        self.count = 0

    def warm_up(self, early: bool) -> dict:
        """The push that fills the dev box's home, as a user's earlier job did: push, the
        job's first import, then (with `early`: this push has it) a push --early of the same
        version, which learns the files that import read first (first reads) and keeps them
        on the dev box for the fresh nodes of the next allocation. Its own cluster, removed
        afterwards."""
        d = self.work / "warm-up"
        try:
            with LocalCluster(d, 1, home=self.home) as cl:
                seconds, pushed = cl.push(self.venv, NAME, self.patterns)
                root = cl.mount() / NAME
                import_end(start_import(root, self.module), root)
                if early:
                    cmd, env = cl.push_args(self.venv, "--json", "--name", NAME,
                                            *self.excludes, "--early")
                    _, proc = run(cmd, env=env, timeout=900)
                    pushed["first_reads"] = last_json(proc.stdout).get("first_reads")
        finally:
            remove_work(d)
        return {"seconds": round(seconds, 2), **pushed}

    def once(self, early: bool) -> float:
        """One cold start: seconds from the push's start to the import's end."""
        self.count += 1
        d = self.work / f"cold-{self.count}"
        try:
            with LocalCluster(d, 1, home=self.home) as cl:
                # CPU seconds next to the wall clock: on a shared machine the wall clock moves
                # with everyone's load, the CPU a run costs far less.
                cpu0, kids0 = cpu_seconds([cl.pid()]), children_cpu_s()
                rec = self._measure(cl, early)
                rec["daemon_cpu_s"] = round(cpu_seconds([cl.pid()]) - cpu0, 2)
                rec["push_and_import_cpu_s"] = round(children_cpu_s() - kids0, 2)
                settled(cl)
                flushed(cl.state())
                rec["node_disk_bytes"] = disk_bytes(cl.state())
                if not early and (mounted := self.mount_import(cl)) is not None:
                    rec["mount_import_s"] = round(mounted, 3)
        finally:
            remove_work(d)
        self.runs["early" if early else "default"].append(rec)
        return rec["import_done_s"]

    def mount_import(self, cl: LocalCluster) -> float | None:
        """The first import from the mount of a node that holds the version whole, its page
        cache (and dentries) dropped as for the local cold import: what the mount adds to an
        import with no push before it, the floor of a cold start's import. None where the
        page cache cannot be dropped (a warm import is no floor)."""
        if self.page_cache is None or not self.page_cache.drop():
            return None
        root = cl.mount() / NAME
        t0 = time.time()
        return import_end(start_import(root, self.module), root) - t0

    def _measure(self, cl: LocalCluster, early: bool) -> dict:
        cmd, env = cl.push_args(self.venv, "--json", "--name", NAME, *self.excludes,
                                *(["--early"] if early else []))
        root = cl.mount() / NAME
        errors = cl.dir / "push.stderr"
        sync()
        with open(errors, "w") as err:
            t0 = time.time()
            push = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            imp = usable = result = None
            assert push.stdout is not None
            for line in push.stdout:
                if not line.startswith("{"):
                    continue
                obj = json.loads(line)
                if obj.get("event") == "usable":
                    usable = time.time() - t0
                    imp = start_import(root, self.module)
                else:
                    result = obj
            rc = push.wait()
            pushed_s = time.time() - t0
        if rc != 0 or result is None:
            if imp is not None:
                imp.kill()
                imp.wait()
            raise BenchError(f"push exited {rc}: {errors.read_text()[-2000:]}")
        if imp is None:
            if early:
                raise BenchError("push --early printed no usable line")
            imp = start_import(root, self.module)
        done = import_end(imp, root) - t0
        rec = {"push_s": round(pushed_s, 3), "import_done_s": round(done, 3),
               "bytes": result["bytes"], "files": result["files"],
               "bytes_sent": result["bytes_sent"], "phases": result.get("phases")}
        if early:
            rec.update(usable_s=round(usable or 0.0, 3),
                       usable_seconds=result.get("usable_seconds"),
                       complete_seconds=result.get("complete_seconds"),
                       first_reads=result.get("first_reads"),
                       first_read_bytes=result.get("first_read_bytes"),
                       chunks_wanted=result.get("chunks_wanted"))
        return rec


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the push and import processes)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def local_import(venv: Path, module: str, page_cache: PageCache) -> float:
    page_cache.drop()
    t0 = time.time()
    return import_end(start_import(venv, module), venv) - t0


def rsync_then_import(venv: Path, dest: Path, module: str) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.time()
    try:
        run(["rsync", "-a", f"{venv}/", f"{dest}/"], timeout=900)
        return import_end(start_import(dest, module), dest) - t0
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def disk_floor(directory: Path, size: int) -> dict:
    """How long this disk takes to write `size` bytes once, durably, at its best: 4 MiB
    O_DIRECT writes and an fsync, as `dd oflag=direct` does. A fresh node must write every
    pushed byte, so no push to it can finish sooner."""
    block = 4 * MiB
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT asks
    buf.write(os.urandom(block))
    path = directory / "disk-floor.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.monotonic()
        for _ in range(-(-size // block)):
            os.write(fd, buf)
        os.fsync(fd)
        seconds = time.monotonic() - t0
    finally:
        os.close(fd)
        path.unlink()
        buf.close()
    return {"bytes": size, "seconds": round(seconds, 3), "mb_s": round(size / 1e6 / seconds)}


# ---- ingest -------------------------------------------------------------------------------

def incompressible(cache: Path, size_mb: int) -> Path:
    """A folder holding one file of `size_mb` MiB of random bytes (made once, then reused)."""
    d = cache / f"ingest-{size_mb}"
    f = d / "data.bin"
    if not (f.exists() and f.stat().st_size == size_mb * MiB):
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "data.partial", "wb") as out:
            for _ in range(size_mb):
                out.write(os.urandom(MiB))
        os.replace(d / "data.partial", f)
    return d


def ingest(work: Path, src: Path, nodes: int) -> dict:
    """Push `src` to a fresh cluster of `nodes`: the daemons' CPU and the push's wall clock."""
    d = work / f"ingest-{nodes}"
    try:
        with LocalCluster(d, nodes) as cl:
            pids = [cl.pid(i) for i in range(nodes)]
            cpu0 = cpu_seconds(pids)
            seconds, pushed = cl.push(src, "ingest")
            settled(cl)
            cpu = cpu_seconds(pids) - cpu0
    finally:
        remove_work(d)
    content = pushed["bytes"]
    return {"nodes": nodes, "bytes": content, "push_s": round(seconds, 3),
            "daemon_cpu_s": round(cpu, 2),
            "cpu_s_per_gb": round(cpu / (content * nodes / 1e9), 3),
            "mb_s_per_node": round(content / 1e6 / seconds, 1),
            "mb_s_all_nodes": round(content * nodes / 1e6 / seconds, 1)}


# ---- hosts behind links -------------------------------------------------------------------

def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def stores_dir(content: int, hosts: int, work: Path) -> Path:
    """Where the netns nodes keep their stores, the same for every host count: tmpfs when the
    machine has the memory for the largest cluster (today's 1.7x per content byte, with room),
    else `work` on disk."""
    need = 2 * content * hosts
    return Path(SHM) if os.path.isdir(SHM) and mem_available() > 1.5 * need else work


def netns_cold(venv: Path, home: Path, n: int, rate: str, module: str,
               excludes: tuple[str, ...], base: Path) -> dict:
    """Item 2 on `n` namespaced hosts: push start until every host's first import is done."""
    workdir = base / f"coldstart-netns-{os.getpid()}-{n}"
    try:
        with NetCluster(n, rate=rate, workdir=workdir) as c:
            argv = c.push_argv(venv, "--json", "--name", NAME, "--timeout", "300",
                               *[a for p in excludes for a in ("--exclude", p)])
            t0 = time.time()
            proc = c.run_devbox(argv, timeout=1800, env={"MONARCH_FS_HOME": str(home)})
            pushed_s = time.time() - t0
            if proc.returncode != 0:
                raise BenchError(f"push to {n} hosts failed: {proc.stderr.strip()[-2000:]}")
            root = Path(c.mount) / NAME
            kids0 = children_cpu_s()
            imports = [start_import(root, module, ["nsenter", "--target", str(node.pid),
                                                   "--mount", "--net"]) for node in c.nodes]
            ends = [import_end(p, root) - t0 for p in imports]
            # The hosts' share of the work (their daemons from the start, their imports): it
            # grows with the host count, and here every host runs on the same cores.
            hosts_cpu = cpu_seconds(c.pids) + children_cpu_s() - kids0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"hosts": n, "push_s": round(pushed_s, 3), "all_imported_s": round(max(ends), 3),
            "first_imported_s": round(min(ends), 3), "hosts_cpu_s": round(hosts_cpu, 2),
            "stores_on": f"tmpfs {SHM}" if str(base) == SHM else f"disk ({base})",
            "pushed": last_json(proc.stdout)}


# ---- the whole workload -------------------------------------------------------------------

def measure(work: Path, cache: Path = DEFAULT_CACHE, module: str = "torch",
            excludes: tuple[str, ...] = (), runs: int = 3, ingest_mb: int = 1024,
            ingest_nodes: tuple[int, ...] = (1, 8), hosts: tuple[int, ...] = (1, 8),
            rate: str = "1gbit", page_cache: PageCache | None = None) -> dict:
    page_cache = page_cache or PageCache()
    load0, busy = loadavg(), CpuMeter()
    venv, staged = import_bench.ensure_venv(cache)
    home = work / "devbox-home"
    cold = ColdStart(work, home, venv, module, excludes, page_cache)
    has_early = early_available()
    warm_up = cold.warm_up(has_early)
    log(f"  warm-up push: {warm_up['files']:,} files, {fmt_bytes(warm_up['bytes'])} in "
        f"{warm_up['seconds']:.2f}s")
    sides = {"default": lambda: cold.once(False),
             "local": lambda: local_import(venv, module, page_cache),
             "rsync": lambda: rsync_then_import(venv, work / "rsync-copy", module)}
    if has_early:
        sides["early"] = lambda: cold.once(True)
    log(f"  cold start ({runs} rounds{', usable-early mode too' if has_early else ''}) ...")
    out = rounds(runs, sides)
    res: dict = {"module": module, "venv": {**staged, "path": str(venv),
                                            "excludes": list(excludes)},
                 "warm_up_push": warm_up, "page_cache": page_cache.describe()}
    res["sides"] = {k: summary([round(s, 3) for s in v]) for k, v in out.items()}
    res["cold_runs"] = cold.runs
    res["push_s"] = summary([r["push_s"] for r in cold.runs["default"]])
    mounted = [r["mount_import_s"] for r in cold.runs["default"] if "mount_import_s" in r]
    if mounted:
        res["mount_import_s"] = summary(mounted)
    res["cpu_s"] = {k: {"daemon": summary([r["daemon_cpu_s"] for r in v]),
                        "push_and_import": summary([r["push_and_import_cpu_s"] for r in v])}
                    for k, v in cold.runs.items() if v}
    res["early"] = ({"import_done_s": summary([r["import_done_s"] for r in cold.runs["early"]]),
                     "usable_s": summary([r["usable_s"] for r in cold.runs["early"]]),
                     "complete_s": summary([r["complete_seconds"] or r["push_s"]
                                            for r in cold.runs["early"]])}
                    if has_early else "not available")
    last = cold.runs["default"][-1]
    res["disk"] = {"content_bytes": last["bytes"], "node_disk_bytes": last["node_disk_bytes"],
                   "ratio": round(last["node_disk_bytes"] / last["bytes"], 3)}
    res["disk_floor"] = disk_floor(work, last["bytes"])
    log(f"  default {res['sides']['default']['median']:.2f}s, local "
        f"{res['sides']['local']['median']:.2f}s, rsync {res['sides']['rsync']['median']:.2f}s"
        + (f", early {res['sides']['early']['median']:.2f}s" if has_early else ""))

    res["ingest"] = []
    if not ingest_nodes and not hosts:  # --cold-only
        res["hosts"] = {"skipped": "--cold-only"}
        res["machine_load"] = {"loadavg": [load0, loadavg()], "cpu_busy_pct": busy.busy()}
        return res
    src = incompressible(cache, ingest_mb)
    for n in ingest_nodes:
        res["ingest"].append(ingest(work, src, n))
        r = res["ingest"][-1]
        log(f"  ingest {fmt_bytes(r['bytes'])} to {n} nodes: {r['push_s']:.2f}s, daemon CPU "
            f"{r['cpu_s_per_gb']:.2f} s/GB, {r['mb_s_per_node']:.0f} MB/s per node")

    try:
        base = stores_dir(last["bytes"], max(hosts), work)
        res["hosts"] = [netns_cold(venv, home, n, rate, module, excludes, base) for n in hosts]
        one, many = res["hosts"][0], res["hosts"][-1]
        res["hosts_ratio"] = round(many["all_imported_s"] / one["all_imported_s"], 3)
        # This machine's cores run every host: the hosts' CPU over its cores is a floor.
        res["hosts_cpu_floor_s"] = round(many["hosts_cpu_s"] / (os.cpu_count() or 1), 2)
        res["rate"] = rate
        log(f"  {many['hosts']} hosts behind {rate}: {many['all_imported_s']:.2f}s, "
            f"1 host {one['all_imported_s']:.2f}s ({res['hosts_ratio']:.2f}x)")
    except NetnsUnsupported as e:
        res["hosts"] = {"skipped": f"network namespaces unavailable: {e}"}
    res["machine_load"] = {"loadavg": [load0, loadavg()], "cpu_busy_pct": busy.busy()}
    return res


OPTIONS = [
    ("--quick", {"action": "store_true", "help": "sympy without torch, 256 MiB, 2 nodes"}),
    ("--rate", {"default": "1gbit", "help": "the netns links (tc units)"}),
    ("--cold-only", {"action": "store_true",
                     "help": "the cold starts and the local import only (no ingest, no netns)"}),
]


def main(argv: list[str] | None = None) -> int:
    def run_it(work: Path, a) -> dict:
        q = a.quick
        res = measure(work, a.cache, "sympy" if q else "torch",
                      ("torch", "torchgen", "functorch") if q else (),
                      runs=1 if q else a.cold_runs, ingest_mb=256 if q else 1024,
                      ingest_nodes=() if a.cold_only else (1, 2) if q else (1, 8),
                      hosts=() if a.cold_only else (1, 2) if q else (1, 8),
                      rate=a.rate)
        print("\n".join(table(res)), file=sys.stderr)
        return res

    return workload_main(argv, __doc__, OPTIONS, run_it)


if __name__ == "__main__":
    sys.exit(main())
