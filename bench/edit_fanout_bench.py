#!/usr/bin/env python3
"""One edit pushed to N nodes in network namespaces (issue 20's scale figure): what a small
change costs per node, measured on 1, 2, 4 and 8 nodes, to fit and check the small-change model
in bench/fanout_model.py (`small_change`), which projects 1024 nodes.

    sudo .venv/bin/python -m bench.edit_fanout_bench [--nodes 1,2,4,8] [--edits 9] [--fanout 2]

For each N: a fresh netns cluster (tests/netns.py), a tree of 300 small files, and a `push
--watch --json` of it running on the dev box (its network namespace), which keeps its sessions
with the nodes. For each of `--edits` edits of one file, the watch's line for its push gives
the edit's time: current + negotiate + send + publish (its `phases`). The watch process's CPU
and the daemons' CPU (every thread's, from /proc/PID/task/*/schedstat: nanoseconds, where
/proc/PID/stat counts 10 ms ticks) are read around each push, not the collect a commit starts
a second later (the edits are 1.5 s apart). Every N pushes over the star control plane
(--control star), and each N above --fanout again down a control tree (--control tree, --fanout
children a node: 2 makes 8 nodes three hops deep). Medians per N go to
bench/results/editfanout-DATE.{json,md}, with the model fitted on the runs with N < 8 (what a
node spends per child, from the tree runs' extra daemon CPU) and its error at N = 8 for both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.netns import NetCluster

from . import fanout_model as model
from .common import interrupt

REPO = Path(__file__).resolve().parent.parent
PHASES = ("current", "negotiate", "send", "publish")  # what a kept session pays per edit


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` so far, to the nanosecond."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return total / 1e9


def make_tree(root: Path, files: int = 300) -> Path:
    for i in range(files):
        d = root / f"pkg{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 20)
    return root


def one_n(n: int, edits: int, rate: str, workdir: Path, fanout: int = 0) -> dict:
    """Medians of `edits` edits pushed to n nodes: over the star control plane, or down the
    control tree with `fanout` children a node."""
    label = f"{n}-tree{fanout}" if fanout else f"{n}"
    src = make_tree(workdir / f"tree-{label}")
    home = workdir / f"home-{label}"
    env = {**os.environ, "MONARCH_FS_HOME": str(home)}
    control = (["--control", "tree", "--control-fanout", str(fanout)] if fanout
               else ["--control", "star"])
    with NetCluster(n, rate=rate, workdir=workdir / f"cluster-{label}") as cluster:
        argv = cluster.push_argv(src, "--name", "edit", "--watch", "--json", *control)
        # (`ip netns exec` execs the command: the watch is this pid)
        watch = subprocess.Popen(["ip", "netns", "exec", cluster.devbox, *argv], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert watch.stdout is not None

        def pushed() -> dict:
            if not select.select([watch.stdout], [], [], 60)[0]:
                raise RuntimeError(f"N={n}: push --watch printed no push in 60 s")
            return json.loads(watch.stdout.readline())

        try:
            pushed()  # its first push
            runs = []
            target = src / "pkg0" / "mod0.py"
            for k in range(edits):
                d0 = sum(cpu_seconds(p) for p in cluster.pids)
                w0 = cpu_seconds(watch.pid)
                target.write_text(f"EDIT = {k}\n")
                result = pushed()
                time.sleep(0.3)  # the nodes' work after the reply (their collect comes later)
                client = cpu_seconds(watch.pid) - w0
                daemons = sum(cpu_seconds(p) for p in cluster.pids) - d0
                if result["nodes"] != n or result["chunks_sent"] < 1:
                    raise RuntimeError(f"N={n}: the edit's push: {result}")
                runs.append({"seconds": sum(result["phases"].get(p, 0.0) for p in PHASES),
                             "phases": result["phases"], "daemon_cpu": daemons,
                             "client_cpu": client, "nodes": n})
                time.sleep(1.2)  # past the collect a commit starts a second later
        finally:
            interrupt(watch)
    med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "daemon_cpu",
                                                                "client_cpu")}
    return {"nodes": n, **med, "runs": runs}


def measure(nodes: list[int], edits: int = 9, rate: str = "1gbit", fanout: int = 2) -> dict:
    """Every N's medians over the star control plane and, for each N above `fanout` (0:
    none), down a control tree with `fanout` children a node; the model fitted on the runs
    with N < max(nodes) (a node's cost per child from the tree runs' extra daemon CPU), its
    error at max(nodes) for both, and the report's date."""
    work = Path(tempfile.mkdtemp(prefix="editfanout-"))

    def show(r: dict, what: str = "") -> None:
        print(f"  N={r['nodes']}{what}: {r['seconds']:.3f} s per edit (phases), daemons "
              f"{r['daemon_cpu']:.3f} CPU-s, the watch {r['client_cpu']:.3f} CPU-s",
              file=sys.stderr)

    try:
        per_n, trees = [], []
        for n in nodes:
            per_n.append(one_n(n, edits, rate, work))
            show(per_n[-1])
            if fanout and n > fanout:
                trees.append({**one_n(n, edits, rate, work, fanout), "fanout": fanout})
                show(trees[-1], f", control tree k={fanout}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cores = os.cpu_count() or 2
    top = max(nodes)
    fitted = [r for r in per_n if r["nodes"] < top] or per_n
    star_at = {r["nodes"]: r for r in per_n}
    fit = model.fit_small_change(fitted, cores, [
        (t["nodes"], fanout, t["daemon_cpu"] - star_at[t["nodes"]]["daemon_cpu"])
        for t in trees if t["nodes"] < top])

    def error(r: dict, k: int = 0) -> float:
        return (model.small_change_seconds(r["nodes"], fit, "machine", fanout=k)
                - r["seconds"]) / r["seconds"]

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "rate": rate,
            "cores": cores, "per_n": per_n, "trees": trees, "fit": fit,
            **({"error_tree_at_max": error(trees[-1], fanout)}
               if trees and trees[-1]["nodes"] == top else {}),
            # above 16 nodes a push goes down the control tree (k = 16) unless told otherwise
            "projected_1024_s": model.small_change_seconds(1024, fit, fanout=16),
            "projected_1024_star_s": model.small_change_seconds(1024, fit),
            "error_at_max": error(per_n[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--edits", type=int, default=9)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--fanout", type=int, default=2,
                        help="the control tree's fanout for the tree runs (0: none)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    report = measure(args.nodes, args.edits, args.rate, args.fanout)
    lines = model.small_change_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"editfanout-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
