#!/usr/bin/env python3
"""The data path (issue 34) in one run: what `make bench` needs for issue 34's table beyond
the coldstart workload's cold starts, each next to the limit it is held to, measured the same
minute.

    .venv/bin/python -m bench.datapath_bench             # 1 GiB pushes, the 8 GiB env (~2-4 min)
    .venv/bin/python -m bench.datapath_bench --quick     # 128 MiB, a 0.25 GiB env (~1 min)

1. node ingest (bench/ingest_bench.py): the same incompressible file (cached in --cache) to a
   fresh 1-node cluster with `--encrypt auto`, then `--encrypt on`: MB/s of the whole push
   process, the daemon's CPU per GB beside a node's floor (bench/limits.node_floor: receive,
   check, hash and write with O_DIRECT in a plain Python loop, same run),
   node disk per content byte; each push beside the raw loopback stream (bench/limits.py: one
   Python TCP stream, 4 MiB sendall/recv_into) measured right before it;
2. relays: the same file to a chain of 3 fresh nodes, CPU per GB of each relay hop beside the
   floor of a hop (the node's work, and each piece sent on, same run);
3. a large env (bench/large_env_bench.py): the torch venv plus random .so-sized files up to
   `--env-gib` GiB to a fresh node, its rate over the 1 GiB rate measured before and after it,
   the daemon's peak RSS, the node's disk per content byte.

bench/datapath_report.py puts these and the coldstart workload's cold starts (over the local
cold import) in one table. The limit of an ingest is the best loopback sample of the workload.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import cold_start_bench, ingest_bench, large_env_bench
from .common import DEFAULT_CACHE, log, remove_work, workload_main
from .datapath_report import table


def measure(work: Path, cache: Path = DEFAULT_CACHE, ingest_mib: int = 1024,
            relay_nodes: int = 3, env_gib: float = 8.0, env_venv: bool = True) -> dict:
    """Issue 34's figures but the cold starts (see the module's docstring); `env_venv` False:
    the env is random files alone (a smoke run's tiny sizes)."""
    src = cold_start_bench.incompressible(cache, ingest_mib)
    ingest = {}
    for mode in ("auto", "on"):
        log(f"  ingest {ingest_mib} MiB, 1 node, --encrypt {mode} ...")
        ingest[mode] = ingest_bench.measure(src, work, 1, encrypt=mode)
        log(f"    {ingest[mode]['MB_per_s']} MB/s = {ingest[mode]['of_loopback']}x loopback, "
            f"daemon {ingest[mode]['daemon_cpu_s_per_gb_incl_backing']} CPU-s/GB")
    log(f"  relay: {ingest_mib} MiB down a chain of {relay_nodes} ...")
    relay = ingest_bench.measure(src, work, relay_nodes, topology="chain")
    log(f"    CPU-s/GB per node {relay['per_node_cpu_s_per_gb']}, a hop's floor "
        f"{relay['hop_floor_cpu_s_per_gb']}")
    env_work = work / "large-env"
    env_work.mkdir()
    try:
        env = large_env_bench.measure(env_work, cache, env_gib, one_mib=ingest_mib,
                                      with_venv=env_venv)
    finally:
        remove_work(env_work)
    samples = [r["loopback_MB_per_s"] for r in (*ingest.values(), relay)]
    return {"ingest_mib": ingest_mib, "ingest": ingest, "relay": relay, "large_env": env,
            "loopback_samples_MB_per_s": samples, "loopback_MB_per_s": max(samples)}


OPTIONS = [
    ("--quick", {"action": "store_true", "help": "128 MiB pushes, a 0.25 GiB env, no venv"}),
    ("--env-gib", {"type": float, "default": 8.0, "help": "the large env's size (default 8)"}),
]


def main(argv: list[str] | None = None) -> int:
    def run_it(work: Path, a) -> dict:
        res = (measure(work, a.cache, 128, env_gib=0.25, env_venv=False) if a.quick
               else measure(work, a.cache, env_gib=a.env_gib))
        print("\n".join(table({"datapath": res})), file=sys.stderr)
        return res

    return workload_main(argv, __doc__, OPTIONS, run_it)


if __name__ == "__main__":
    sys.exit(main())
