"""The staged torch venv (43k small files) pushed to a fresh node, alone (issue 34): the part of
a cold start whose cost is per file and per small chunk, not per byte.

    .venv/bin/python -m bench.venv_push_bench                 # 3 pushes, ~1-2 min
    .venv/bin/python -m bench.venv_push_bench --runs 4 --alternate MONARCH_FS_X=a,b
    .venv/bin/python -m bench.venv_push_bench --runs 8 --alternate-flags="--helpers 0"
    .venv/bin/python -m bench.venv_push_bench --runs 2 --profile /tmp/prof

The dev box home pushes the venv once first (its scan cache and store then hold it: the cold
start's case, as cold_start_bench), then each measured push goes to a fresh 1-node cluster.
Reported per push: seconds, MB/s of content, the push's phases (`push --json`), the CPU
seconds of the push process and of the daemon (on a shared machine those move less than the wall
clock), and the dev box store's size after it. `--alternate VAR=A,B` sets VAR in the push's
and the daemon's environment to A, B, A, B... run by run (an A/B on the same load), and
`--alternate-flags FLAGS` pushes without and with FLAGS in turn (`--helpers 0`: the push
alone, against its send helpers);
`--profile DIR` records both ends of the last push with py-spy (--idle --threads) into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import import_bench
from .common import (
    DEFAULT_CACHE,
    LocalCluster,
    cpu_seconds,
    last_json,
    log,
    remove_work,
)
from .machine import loadavg

SPY = str(Path(sys.executable).parent / "py-spy")


def push_once(work: Path, home: Path, venv: Path, label: str, env: dict[str, str],
              profile: Path | None = None, flags: Sequence[str] = ()) -> dict:
    """One push of `venv` to a fresh 1-node cluster with the dev box home `home`."""
    d = work / f"cluster-{label}"
    spies: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the daemons' (cluster.up) and the push's
    try:
        with LocalCluster(d, 1, home=home) as cl:
            pid = cl.pid()
            cpu0 = cpu_seconds([pid])
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            cmd, penv = cl.push_args(venv, "--json", "--name", "venv", *flags)
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
                spies.append(spy(["--pid", str(pid)], profile / f"{label}-daemon.txt"))
                cmd = [SPY, "record", "--idle", "--threads", "-r", "100", "-f", "raw",
                       "-o", str(profile / f"{label}-push.txt"), "--", *cmd]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=penv, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=900)
            seconds = time.perf_counter() - t0
            res = last_json(proc.stdout)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            daemon_cpu = cpu_seconds([pid]) - cpu0
    finally:
        for s in spies:
            s.terminate()
            s.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remove_work(d)
    content = res["bytes"]
    return {"label": label, "env": env, "flags": list(flags), "bytes": content,
            "files": res.get("files"),
            "push_s": round(seconds, 2), "MB_per_s": round(content / 1e6 / seconds, 1),
            "phases": res.get("phases"), "daemon_cpu_s": round(daemon_cpu, 2),
            "push_cpu_s": round(after.ru_utime + after.ru_stime
                                - kids.ru_utime - kids.ru_stime, 2),
            "store": res.get("store"), "store_mb": round(store_bytes(home) / 1e6, 1)}


def store_bytes(home: Path) -> int:
    """The dev box store's packs, after the push."""
    return sum(p.stat().st_size for p in (home / "store" / "packs").glob("*.pack"))


def spy(target: list[str], out: Path) -> subprocess.Popen:
    return subprocess.Popen([SPY, "record", "--idle", "--threads", "-r", "100", "-f", "raw",
                             "-o", str(out), *target],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def compared(runs: list[dict]) -> dict:
    """The median push seconds of each set of flags, when runs alternated them."""
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(" ".join(r["flags"]) or "(none)", []).append(r["push_s"])
    if len(by) < 2:
        return {}
    return {"median_push_s": {k: statistics.median(v) for k, v in by.items()},
            "range_push_s": {k: [min(v), max(v)] for k, v in by.items()}}


def alternation(spec: str | None) -> list[dict[str, str]]:
    """[{VAR: A}, {VAR: B}] from "VAR=A,B"; [{}] without one."""
    if not spec:
        return [{}]
    var, _, values = spec.partition("=")
    return [{var: v} for v in values.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="measured pushes (default 3)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="where the staged venv is kept")
    ap.add_argument("--alternate", metavar="VAR=A,B",
                    help="alternate an environment variable's value run by run")
    ap.add_argument("--alternate-flags", metavar="FLAGS", default="",
                    help="push without, then with these flags, run by run")
    ap.add_argument("--profile", type=Path, help="record both ends with py-spy into this folder")
    a = ap.parse_args(argv)
    envs = alternation(a.alternate)
    flags = [[], a.alternate_flags.split()] if a.alternate_flags else [[]]
    venv, staged = import_bench.ensure_venv(a.cache)
    work = Path(tempfile.mkdtemp(prefix="venv-push-", dir=a.cache))
    try:
        home = work / "home"
        log("warm-up: the dev box home pushes the venv once ...")
        warm = push_once(work, home, venv, "warm", envs[0])
        log(f"  warm-up: {warm['push_s']} s, push {warm['push_cpu_s']} CPU-s, store "
            f"{warm['store_mb']} MB after it")
        load0 = loadavg()
        runs = []
        for i in range(a.runs):
            last = i == a.runs - 1
            runs.append(push_once(work, home, venv, f"run{i}", envs[i % len(envs)],
                                  a.profile if last else None, flags[i % len(flags)]))
            r = runs[-1]
            log(f"  {r['env']} {' '.join(r['flags'])} {r['push_s']} s, {r['MB_per_s']} MB/s, "
                f"push {r['push_cpu_s']} CPU-s, daemon {r['daemon_cpu_s']} CPU-s, "
                f"send {r['phases'].get('send')} s, store {r['store_mb']} MB")
    finally:
        remove_work(work)
    print(json.dumps({"venv_files": staged.get("files"), "warm": warm, "runs": runs,
                      "loadavg": [load0, loadavg()], **compared(runs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
