#!/usr/bin/env python3
"""The actor mesh side by side with Monarch's, from one script written against Monarch's API:
the same file runs with `monarch.actor` imported or with `monarch_fs.mesh` (issue 36).

    .venv/bin/python -m bench.mesh_side_by_side --monarch-python /tmp/monarch-venv/bin/python

Monarch goes in a venv of its own (`python3 -m venv /tmp/monarch-venv &&
/tmp/monarch-venv/bin/pip install torchmonarch==0.7.* torch==2.13.0`), never in the project's.
Runs alternate (monarch_fs, Monarch, monarch_fs, ...) on 1 host x 4 procs, and a raw loopback
TCP stream is measured in each round, next to its runs (bench/limits.py): the tensor round trip
is reported as a share of it, round by round. Figures: to the first call (spawn 4
procs, spawn an actor on each, one call), call_one round trip (median), call() on all 4
(median), a 64 MiB float32 tensor there and back (MiB/s of payload, both ways counted).
monarch_fs starts its one-node local cluster in this_host() first; that is not counted.
`call()` on all 4 is also reported as CPU time per call, of every process under the script
(procs, daemons, agents, the script itself): what the call costs, whatever else the machine
runs meanwhile, where wall time on a shared machine mostly says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

if __name__ in ("__main__", "__mp_main__") and "--impl" in sys.argv:
    impl = sys.argv[sys.argv.index("--impl") + 1]
else:
    impl = "monarch_fs"
if impl == "monarch":
    from monarch.actor import Actor, endpoint, this_host  # type: ignore[import-not-found]
else:
    from monarch_fs.mesh import Actor, endpoint, this_host


class Bench(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def echo(self, value):
        return value


def run(calls: int) -> dict:
    import torch

    host = this_host()
    t = time.perf_counter()
    procs = host.spawn_procs(per_host={"gpus": 4})
    actors = procs.spawn("bench", Bench)
    one = actors.slice(gpus=0)
    one.noop.call_one().get()
    first = time.perf_counter() - t
    call_one = statistics.median(call_times(lambda: one.noop.call_one().get(), calls, warm=50))
    cpu = _tree_cpu()
    times = call_times(lambda: actors.noop.call().get(), calls // 4)
    call_all = statistics.median(times)
    after = _tree_cpu()
    call_all_cpu = sum(after[p] - cpu[p] for p in after.keys() & cpu.keys()) / len(times)
    big = torch.ones(16 * 1024 * 1024)
    one.echo.call_one(big).get()
    best = min(_timed(lambda: one.echo.call_one(big).get()) for _ in range(5))
    procs.stop().get()
    return {"first_call_s": first, "call_one_ms": call_one * 1e3, "call_all_4_ms": call_all * 1e3,
            "call_all_4_cpu_ms": call_all_cpu * 1e3, "tensor_64MiB_MiB_per_s": 2 * 64 / best}


def _tree_cpu() -> dict[int, float]:
    """pid -> CPU seconds (user + system, all threads) of this process and its descendants."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu)
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    mine = {os.getpid()}
    while grown := {p for p, (parent, _) in stats.items() if parent in mine} - mine:
        mine |= grown
    return {p: stats[p][1] for p in mine if p in stats}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def call_times(call, n: int, warm: int = 0) -> list[float]:
    """Seconds of each of `n` calls of `call`, after `warm` untimed ones (bench/mesh_bench.py
    times its calls with it too: this module runs under either API, that one under ours)."""
    for _ in range(warm):
        call()
    return [_timed(call) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--monarch-python", default="/tmp/monarch-venv/bin/python")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--impl", choices=["monarch", "monarch_fs"], default=None)
    args = ap.parse_args()
    if args.impl:  # one run, in this process
        print(json.dumps(run(args.calls)), flush=True)
        return 0
    from bench.limits import loopback_stream

    results: dict[str, list[dict]] = {"monarch_fs": [], "monarch": []}
    loopbacks: list[float] = []  # one per round, next to that round's runs
    for _ in range(args.rounds):
        loopbacks.append(max(loopback_stream(256 << 20) for _ in range(2)) / (1024 * 1024))
        for name, python in (("monarch_fs", sys.executable), ("monarch", args.monarch_python)):
            out = subprocess.run([python, str(Path(__file__).resolve()), "--impl", name,
                                  "--calls", str(args.calls)], capture_output=True, text=True,
                                 timeout=300, cwd=str(Path(__file__).parent))
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not lines:
                print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[name].append(json.loads(lines[-1]))
    print(f"{'':24} {'monarch_fs':>22} {'Monarch 0.7':>22}")
    for key in ("first_call_s", "call_one_ms", "call_all_4_ms", "call_all_4_cpu_ms",
                "tensor_64MiB_MiB_per_s"):
        cells = []
        for name in ("monarch_fs", "monarch"):
            xs = [r[key] for r in results[name]]
            cells.append(f"{min(xs):.3g}-{max(xs):.3g}")
        print(f"{key:24} {cells[0]:>22} {cells[1]:>22}")
    ratios = {name: [r["tensor_64MiB_MiB_per_s"] / lb for r, lb in zip(results[name], loopbacks)]
              for name in results}
    print(f"{'tensor / raw loopback':24} " + " ".join(
        f"{min(ratios[n]):.2f}-{max(ratios[n]):.2f}".rjust(22) for n in ("monarch_fs", "monarch")))
    print(f"raw loopback stream, each round: {min(loopbacks):.0f}-{max(loopbacks):.0f} MiB/s")
    print(json.dumps({"results": results, "loopback_MiB_per_s": loopbacks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
