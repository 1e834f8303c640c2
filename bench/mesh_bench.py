#!/usr/bin/env python3
"""Actor-mesh benchmark on a local 2-node cluster: how long it takes to get 8 procs (2 nodes x 4)
and an actor on each, and what one endpoint call costs, round trip.

    .venv/bin/python -m bench.mesh_bench [--nodes 2] [--per-host 4] [--calls 2000]
                                         [--out bench/results]

What is measured, and why:

- spawn_procs: from the request until every proc has started its interpreter, imported the
  runtime, connected back and authenticated (what a script waits for before its first call).
  Repeated (spawn, stop) so one cold start does not decide the figure; the first run is reported
  separately because it is the one that pays for a cold page cache.
- spawn actors: constructing one actor per proc (import by name, __init__, reply).
- call round trip: a no-op endpoint on one actor, call_one().get() from a plain script (through
  the background loop: two thread hops) and `await call_one()` from trio code in the mesh's
  loop, to a sync endpoint and to an async one (which runs on the proc's asyncio loop);
  median and 90th percentile of many calls. Also call() on all 8 actors at once.
- tensor echo: a 64 MiB float32 tensor to one actor and back (out-of-band buffers), MiB/s of
  payload moved (both directions counted), and the same as a share of one raw loopback TCP
  stream measured in the same run (bench/limits.py's loopback_stream, 256 MiB).
- issue 36 compares these with Monarch 0.7 on one host x 4 procs: `--nodes 1 --per-host 4`.

Wall-clock figures on a shared 2-core machine: the procs, the daemons and the controller all
compete for the same cores, so spawn time grows with the number of procs here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import trio

from bench.mesh_side_by_side import call_times
from monarch_fs.mesh import Actor, HostMesh, endpoint


class Bench(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    async def anoop(self) -> None:
        return None

    @endpoint
    def echo(self, value):
        return value


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3),
            "p90_ms": round(xs[int(len(xs) * 0.9)] * 1e3, 3), "n": len(xs)}


def measure_sync(nodes: int, per_host: int, calls: int, repeats: int) -> dict:
    import torch

    out: dict = {}
    t = time.monotonic()
    hosts = HostMesh.local(nodes)
    out["cluster_up_s"] = round(time.monotonic() - t, 3)
    try:
        spawns = []
        for _ in range(repeats):
            t = time.monotonic()
            procs = hosts.spawn_procs(per_host=per_host, python_path=[str(Path(__file__).parent)])
            spawns.append(time.monotonic() - t)
            procs.stop()
        out["spawn_procs_s"] = {"first": round(spawns[0], 3),
                                "median": round(statistics.median(spawns), 3),
                                "all": [round(s, 3) for s in spawns]}
        procs = hosts.spawn_procs(per_host=per_host, python_path=[str(Path(__file__).parent)])
        t = time.monotonic()
        actors = procs.spawn("bench", "mesh_bench:Bench")
        out["spawn_actors_s"] = round(time.monotonic() - t, 4)
        out["procs"] = len(procs)

        one = actors.slice(host=0, proc=0)
        out["call_one_sync"] = _ms(call_times(lambda: one.noop.call_one().get(), calls, warm=50))
        out[f"call_all_{len(procs)}_sync"] = _ms(call_times(lambda: actors.noop.call().get(),
                                                             calls // 4))

        big = torch.ones(16 * 1024 * 1024)  # float32: 64 MiB
        mib = big.numel() * big.element_size() / (1024 * 1024)
        one.echo.call_one(big).get()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            back = one.echo.call_one(big).get()
            times.append(time.perf_counter() - t)
        assert torch.equal(back, big)
        best = min(times)
        rate = 2 * mib / best
        from bench.limits import loopback_stream  # here: the procs import this module too

        loopback = max(loopback_stream(256 << 20) for _ in range(2)) / (1024 * 1024)
        out[f"tensor_echo_{mib:g}MiB"] = {"best_s": round(best, 4),
                                         "MiB_per_s_both_ways": round(rate, 1),
                                         "raw_loopback_MiB_per_s": round(loopback, 1),
                                         "share_of_loopback": round(rate / loopback, 3)}
    finally:
        hosts.close()
    return out


async def measure_async(nodes: int, calls: int) -> dict:
    async with HostMesh.open_local(nodes) as hosts:
        procs = await hosts.spawn_procs_async(per_host=1,
                                              python_path=[str(Path(__file__).parent)])
        one = (await procs.spawn_async("bench", "mesh_bench:Bench")).slice(host=0)
        out = {}
        for name, endpoint_ in (("call_one_async_in_loop", one.noop),
                                ("call_one_async_endpoint_on_asyncio", one.anoop)):
            for _ in range(50):
                await endpoint_.call_one()
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                await endpoint_.call_one()
                times.append(time.perf_counter() - t)
            out[name] = _ms(times)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    result = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                          "python": platform.python_version()},
              "nodes": args.nodes, "per_host": args.per_host}
    result.update(measure_sync(args.nodes, args.per_host, args.calls, args.repeats))
    result.update(trio.run(measure_async, args.nodes, args.calls))
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"mesh-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
