"""A large env to a fresh node (issue 34): does the push keep its 1 GiB rate at 8 GiB, with
the daemon's memory bounded?

    .venv/bin/python -m bench.large_env_bench             # 8 GiB (2-6 min, ~17 GB of disk)
    .venv/bin/python -m bench.large_env_bench --gib 2     # small, while iterating

The env is the staged torch venv (import_bench.ensure_venv, as cold_start_bench pushes it,
hard-linked, so it costs no disk) plus files of random bytes of a shared library's sizes
(10-400 MB, a fixed sequence) up to `--gib` GiB: the CUDA and NCCL libraries of a real GPU
env, which no compression shrinks. The rate it is held to is the 1 GiB rate measured in the
same run, as bench/ingest_bench.py measures it (one 1 GiB incompressible file to a fresh
node), before and after the large push, so a change of the machine's load shows as a spread.

Every push goes to its own fresh 1-node cluster with its own dev box home (nothing pushed
before, as ingest_bench). Reported: MB/s of content (the push's wall clock, CLI start
included), the ratio to the 1 GiB rate, the push's phases (`push --json`), the daemon's peak
RSS (VmHWM: its whole life, the push included) and its RSS sampled every 0.2 s during the push,
CPU seconds of the daemon and the push process, and the node's disk per content byte once it
has finished writing. Everything it writes is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import import_bench
from .common import (
    DEFAULT_CACHE,
    LocalCluster,
    MiB,
    cpu_seconds,
    disk_bytes,
    log,
    remove_work,
)
from .machine import loadavg
from .node_settled import flushed, settled

GiB = 1024 * MiB
TARGETS = {"rate_ratio": 0.9, "peak_rss_mb": 250, "disk_ratio": 1.05}
SIZES_MB = (10, 25, 60, 120, 400, 35, 200, 15, 90, 300, 50, 150)  # a .so-like mix, cycled
BLOCK = 4 * MiB


def random_file(path: Path, size: int) -> None:
    """`size` bytes no compressor shrinks and no other file shares (os.urandom)."""
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(BLOCK, left)
            f.write(os.urandom(n))
            left -= n


def make_env(folder: Path, venv: Path | None, total: int) -> dict:
    """`folder` = the venv (hard links; none: no venv) + random .so-sized files under lib/big/
    up to `total` bytes of content."""
    if venv is None:
        folder.mkdir()
    else:
        subprocess.run(["cp", "-al", str(venv), str(folder)], check=True)
    have = sum(os.lstat(os.path.join(d, f)).st_size
               for d, _, fs in os.walk(folder) for f in fs)
    venv_bytes = have
    big = folder / "lib" / "big"
    big.mkdir(parents=True, exist_ok=True)
    sizes = []
    rng = random.Random(34)
    i = 0
    while have < total:
        size = min(SIZES_MB[i % len(SIZES_MB)] * 1_000_000 + rng.randrange(4096), total - have)
        random_file(big / f"libbig{i:03d}.so", size)
        sizes.append(size)
        have += size
        i += 1
    return {"venv_bytes": venv_bytes, "big_files": len(sizes), "big_bytes": sum(sizes),
            "bytes": have}


class RssSampler:
    """The daemon's RSS every 0.2 s while a push runs (a bench thread, not the daemon's)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append(status_kb(self.pid)["VmRSS"])

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def status_kb(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process, in kB (/proc/PID/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def push_fresh(work: Path, label: str, src: Path) -> dict:
    """Push `src` to a fresh 1-node cluster with a fresh dev box home; the figures."""
    d = work / f"cluster-{label}"
    try:
        with LocalCluster(d, 1) as cl:
            pid = cl.pid()
            cpu0 = cpu_seconds([pid])
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            with RssSampler(pid) as rss:
                seconds, res = cl.push(src, "env", timeout=1800)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            daemon_cpu = cpu_seconds([pid]) - cpu0
            settled(cl, timeout=600)
            flushed(cl.state())
            mem = status_kb(pid)
            disk = disk_bytes(cl.state())
    finally:
        remove_work(d)
    content = res["bytes"]
    return {"label": label, "bytes": content, "files": res.get("files"),
            "push_s": round(seconds, 2), "MB_per_s": round(content / 1e6 / seconds, 1),
            "phases": res.get("phases"),
            "daemon_peak_rss_mb": round(mem["VmHWM"] / 1024, 1),
            "daemon_rss_during_push_mb": {
                "max": round(max(rss.samples, default=0) / 1024, 1),
                "last": round((rss.samples or [0])[-1] / 1024, 1)},
            "daemon_rss_after_mb": {k: round(v / 1024, 1) for k, v in mem.items()},
            "daemon_cpu_s": round(daemon_cpu, 2),
            "daemon_cpu_s_per_gb": round(daemon_cpu / (content / 1e9), 3),
            "push_cpu_s": round(after.ru_utime + after.ru_stime
                                - kids.ru_utime - kids.ru_stime, 2),
            "push_peak_rss_mb": round(after.ru_maxrss / 1024, 1),
            "disk_per_content_byte": round(disk / content, 4)}


def measure(work: Path, cache: Path, gib: float, one_mib: int = 1024,
            with_venv: bool = True) -> dict:
    """The env of `gib` GiB against `one_mib` MiB of one incompressible file, each pushed to a
    fresh node; `with_venv` False: the env is the random files alone and the venv is not pushed
    (a smoke run's tiny sizes)."""
    venv, staged = import_bench.ensure_venv(cache) if with_venv else (None, {})
    one = work / "one"
    one.mkdir()
    random_file(one / "big.bin", one_mib * MiB)
    env = work / "env"
    log(f"making the {gib:g} GiB env (the venv + random .so-sized files) ...")
    made = make_env(env, venv, int(gib * GiB))
    load0 = loadavg()
    runs = []
    # The venv alone too: its 43k small, compressible files cost the push far more per byte
    # than incompressible .so files (scan, zstd for the dev box store), which the ratio mixes.
    for label, src in (("1gib-before", one), ("venv-alone", venv), ("env", env),
                       ("1gib-after", one)):
        if src is None:
            continue
        log(f"  push {label} ...")
        runs.append(push_fresh(work, label, src))
        log(f"    {runs[-1]['MB_per_s']} MB/s, daemon peak RSS "
            f"{runs[-1]['daemon_peak_rss_mb']} MB")
    base = [r["MB_per_s"] for r in runs if r["label"].startswith("1gib")]
    large = next(r for r in runs if r["label"] == "env")
    alone = next((r for r in runs if r["label"] == "venv-alone"), None)
    # The .so-sized files' share of the env's push: its seconds less the venv's alone.
    big_s = large["push_s"] - (alone["push_s"] if alone else 0.0)
    ratio = large["MB_per_s"] / (sum(base) / len(base))
    return {"gib": gib, "one_mib": one_mib, "env": made, "venv_files": staged.get("files"),
            "runs": runs, "one_gib_MB_per_s": base, "env_MB_per_s": large["MB_per_s"],
            "rate_ratio": round(ratio, 3),
            "big_files_MB_per_s": round(made["big_bytes"] / 1e6 / big_s, 1) if big_s > 0 else None,
            "venv_alone_MB_per_s": alone["MB_per_s"] if alone else None,
            "rate_ratio_range": [round(large["MB_per_s"] / max(base), 3),
                                 round(large["MB_per_s"] / min(base), 3)],
            "daemon_peak_rss_mb": large["daemon_peak_rss_mb"],
            "disk_per_content_byte": large["disk_per_content_byte"],
            "loadavg": [load0, loadavg()], "targets": TARGETS}


def report(res: dict) -> list[str]:
    """The targets next to this run's figures (markdown lines)."""
    def met(ok: bool) -> str:
        return "**met**" if ok else "**not met**"
    t = res["targets"]
    lo, hi = res["rate_ratio_range"]
    return [
        "| what (issue 34) | target | this run | |", "| --- | --- | --- | --- |",
        f"| {res['gib']:g} GiB env to a fresh node: rate / the 1 GiB rate | >= "
        f"{t['rate_ratio']}x | {res['rate_ratio']:.2f}x ({lo:.2f}-{hi:.2f}): "
        f"{res['env_MB_per_s']} MB/s vs {res['one_gib_MB_per_s']} MB/s | "
        f"{met(res['rate_ratio'] >= t['rate_ratio'])} |",
        f"| ... the venv alone; the .so-sized files (the env's push less the venv's) | | "
        f"{res['venv_alone_MB_per_s']} MB/s; {res['big_files_MB_per_s']} MB/s | |",
        f"| daemon peak RSS | <= {t['peak_rss_mb']} MB | {res['daemon_peak_rss_mb']} MB | "
        f"{met(res['daemon_peak_rss_mb'] <= t['peak_rss_mb'])} |",
        f"| node disk per content byte | <= {t['disk_ratio']}x | "
        f"{res['disk_per_content_byte']:.3f}x | "
        f"{met(res['disk_per_content_byte'] <= t['disk_ratio'])} |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="the env's size in GiB (default 8)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="where the staged venv is kept and the run's files are written")
    args = ap.parse_args(argv)
    if args.gib < 1.5:
        ap.error("--gib must be at least 1.5 (the venv alone is about 1 GiB)")
    args.cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="large-env-", dir=args.cache))
    try:
        res = measure(work, args.cache, args.gib)
    finally:
        remove_work(work)
    print("\n".join(report(res)), file=sys.stderr)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
