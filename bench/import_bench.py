#!/usr/bin/env python3
"""`import torch` from a pushed virtualenv: the mount of a 1-node local cluster vs the same
venv on local disk, first import after the publish (cold) and warm.

    .venv/bin/python -m bench.import_bench [--module torch] [--cold-runs 3] [--warm-runs 5]

The venv is the project's own (.venv: torch 2.13 CPU and the test dependencies, ~960 MB, ~23k
files), staged once into the cache folder: copied without its __pycache__ folders (the test
runs keep writing there, so they are neither stable nor the same from one run to the next),
then byte-compiled afresh with compileall, as pip does at install time. Pushing it without
bytecode would not be what a user pushes, and would make the mount compile every module on
every import (the read-only mount cannot keep .pyc files: torch imports in 0.8 s with bytecode,
2.3 s without, on this machine) while the local side reads its .pyc files. The staged copy is
both the pushed source and the local side, so both import identical bytes. It is rebuilt when
the set of installed distributions changes.

Each run is a fresh interpreter, `VENV/bin/python -c "import torch"`, timed by wall clock from
here (interpreter start-up included, as a rank waits for it); the child also reports the time of
the import statement alone and where torch came from (checked: the mount or the local copy).
PYTHONDONTWRITEBYTECODE keeps the local copy pristine.

Cold: the page cache (and dentries, inodes) dropped before each run; the first mount run comes
right after the publish, before every later one the daemon is restarted on its store so its
decoded-chunk cache is empty too. Warm: one untimed import on each side, then the median of the
runs. Mount and local runs alternate; a warm run during which the machine read from disk
(someone else dropped the page cache) is run again (common.rounds). The daemon's request
counters, chunk-cache hits and misses and CPU time are recorded for the cold and the warm mount
runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import (
    DEFAULT_CACHE,
    REPO,
    BenchError,
    LocalCluster,
    Observed,
    PageCache,
    fmt_bytes,
    log,
    own_disk_kib,
    rounds,
    run,
    summary,
    workload_main,
)

STAGE_VERSION = 1
NAME = "venv"
CHILD = """\
import json, time
t = time.perf_counter()
import {module} as m
t = time.perf_counter() - t
print(json.dumps({{"import_s": t, "file": m.__file__, "version": getattr(m, "__version__", "")}}))
"""


def _fingerprint(venv: Path) -> str:
    """What is installed: the distributions' names and versions (their dist-info folders) and
    the interpreter the venv points at. The project's own editable install is left out: `make`
    reinstalls it whenever pyproject.toml changes, and it plays no part in importing torch."""
    h = hashlib.sha256((venv / "pyvenv.cfg").read_bytes())
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for d in sorted(site.glob("*.dist-info")):
            if not d.name.startswith("monarch_fs-"):
                h.update(d.name.encode() + b"\0")
    return h.hexdigest()[:16]


def ensure_venv(cache: Path, source: Path = REPO / ".venv") -> tuple[Path, dict]:
    """The staged copy of `source` (see the module docstring) and its description."""
    staged = cache / "venv"
    marker = cache / "venv.json"
    fp = _fingerprint(source)
    if staged.is_dir() and marker.exists():
        info = json.loads(marker.read_text())
        if info.get("version") == STAGE_VERSION and info.get("fingerprint") == fp:
            return staged, info
    log(f"staging {source} into {staged} without __pycache__, then compileall "
        "(once; later runs reuse it)")
    partial = cache / "venv.partial"
    cache.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    run(["rsync", "-a", "--exclude", "__pycache__", f"{source}/", f"{partial}/"], timeout=900)
    sites = [str(p) for p in sorted(partial.glob("lib/python*/site-packages"))]
    # Some packages ship files that do not compile (templates, tests for other versions):
    # compileall reports them and goes on, as pip does.
    proc = subprocess.run([str(partial / "bin" / "python"), "-m", "compileall", "-q", "-j", "0",
                           *sites], capture_output=True, text=True, timeout=900)
    failed = proc.stdout.count("***")
    os.rename(partial, staged)
    files = sum(len(fs) for _, _, fs in os.walk(staged))
    size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(staged) for f in fs)
    info = {"version": STAGE_VERSION, "fingerprint": fp, "source": str(source), "files": files,
            "bytes": size, "compile_failures": failed}
    marker.write_text(json.dumps(info))
    return staged, info


def child_env() -> dict:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    return env


def import_once(venv: Path, module: str, results: list[dict]) -> float:
    seconds, proc = run([str(venv / "bin" / "python"), "-W", "ignore", "-c",
                         CHILD.format(module=module)], env=child_env(), timeout=300)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(str(venv) + "/"):
        raise BenchError(f"{module} came from {out['file']}, not from {venv}")
    out["wall_s"] = seconds
    results.append(out)
    return seconds


# Requests the importer does not wait for: the kernel sends releases and forgets in the
# background, and the getxattr calls are the bench reading the counters.
NOT_WAITED = ("release", "forget", "getxattr")


def round_trip_us(path: Path, n: int = 2000) -> float:
    """Microseconds for one request to the daemon and its answer, as the importer waits for
    it: the terminal check Python's open() makes on every file (an ioctl, answered at once).
    The median of three loops of `n`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        loops = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                os.isatty(fd)
            loops.append((time.perf_counter() - t) / n * 1e6)
        return round(statistics.median(loops), 1)
    finally:
        os.close(fd)


def floor(counters: dict, round_trip: float, local_s: float) -> dict:
    """What the requests of one warm run cost at `round_trip` us each, however fast the daemon
    answers: the best ratio this machine allows."""
    runs = max(1, counters.get("mount_runs", 1))
    waited = sum(v for k, v in counters.get("ops", {}).items() if k not in NOT_WAITED) / runs
    seconds = waited * round_trip / 1e6
    return {"requests": round(waited), "seconds": round(seconds, 3),
            "ratio": round((local_s + seconds) / local_s, 3)}


def measure(work: Path, cache: Path = DEFAULT_CACHE, module: str = "torch", cold_runs: int = 3,
            warm_runs: int = 5, excludes: tuple[str, ...] = (),
            page_cache: PageCache | None = None) -> dict:
    page_cache = page_cache or PageCache()
    local, staged = ensure_venv(cache)
    log(f"  venv {local}: {staged['files']} files, {fmt_bytes(staged['bytes'])}")
    with LocalCluster(work / "cl-import", 1) as cl:
        push_s, pushed = cl.push(local, name=NAME, excludes=excludes)
        log(f"  pushed {pushed['files']} files, {fmt_bytes(pushed['bytes'])} to 1 node "
            f"in {push_s:.2f}s")
        mounted = cl.mount() / NAME
        children: dict[str, dict[str, list]] = {}
        counters: dict[str, dict] = {}

        def phase(label: str, n: int, cold: bool) -> dict:
            kids = children[label] = {"mount": [], "local": []}
            mount = Observed(cl, lambda: import_once(mounted, module, kids["mount"]))

            def before(side: str) -> None:
                if cold and side == "mount" and mount.runs:
                    cl.restart()
                if cold:
                    page_cache.drop()

            log(f"  {label}: ", end="")
            out = rounds(n, {"mount": mount,
                             "local": lambda: import_once(local, module, kids["local"])}, before,
                         None if cold else {"mount": cl.disk_probe(), "local": own_disk_kib})
            counters[label] = mount.report()
            for side, secs in out.items():  # the children of discarded runs go too
                kids[side] = [k for k in kids[side] if k["wall_s"] in set(secs)]
            res = {side: {"wall_s": summary(secs), "discarded": out.discarded[side],
                          "import_s": summary([k["import_s"] for k in kids[side]])}
                   for side, secs in out.items()}
            log("  ".join(f"{side} {r['wall_s']['median']:.2f}s" for side, r in res.items()))
            return res

        cold = phase("cold", cold_runs, cold=True)
        import_once(mounted, module, [])  # warm-up
        import_once(local, module, [])
        warm = phase("warm", warm_runs, cold=False)
        daemon = cl.proc()
        round_trip = round_trip_us(mounted / "pyvenv.cfg")

    result = {
        "module": module,
        "version": children["warm"]["local"][-1].get("version", ""),
        "venv": {**staged, "path": str(local), "excludes": list(excludes)},
        "push_seconds": round(push_s, 2),
        "push": pushed,
        "cold": cold,
        "warm": warm,
        "counters": counters,
        "daemon": daemon,
        "round_trip_us": round_trip,
        "page_cache": page_cache.describe(),
    }
    for case in ("cold", "warm"):
        r = result[case]
        r["ratio"] = round(r["mount"]["wall_s"]["median"] / r["local"]["wall_s"]["median"], 3)
        r["import_ratio"] = round(r["mount"]["import_s"]["median"]
                                  / r["local"]["import_s"]["median"], 3)
    result["warm"]["floor"] = floor(counters["warm"], round_trip,
                                    result["warm"]["local"]["wall_s"]["median"])
    return result


OPTIONS = [
    ("--module", {"default": "torch"}),
    ("--exclude", {"action": "append", "default": [],
                   "help": "leave these out of the push (e.g. torch, for a quick run)"}),
]


def main(argv: list[str] | None = None) -> int:
    return workload_main(argv, __doc__, OPTIONS, lambda work, a: measure(
        work, a.cache, a.module, a.cold_runs, a.warm_runs, tuple(a.exclude)))


if __name__ == "__main__":
    sys.exit(main())
