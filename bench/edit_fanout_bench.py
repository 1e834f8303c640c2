#!/usr/bin/env python3
"""One edit pushed to N nodes in network namespaces (issue 20's scale figure): what a small
change costs per node, measured on 1, 2, 4 and 8 nodes, to fit and check the small-change model
in bench/fanout_model.py (`small_change`), which projects 1024 nodes.

    sudo .venv/bin/python -m bench.edit_fanout_bench [--nodes 1,2,4,8] [--edits 7]

For each N: a fresh netns cluster (tests/netns.py), a tree of 300 small files pushed once, then
`--edits` pushes of one edited file. Each push's `phases` (push --json) give the part a kept
`push --watch` session pays: current + negotiate + send + publish (the interpreter's start, the
scan and the connect are the one-shot's, not the edit loop's). The dev box's CPU (the push
process) and the daemons' CPU are read around each push. Medians per N go to
bench/results/editfanout-DATE.{json,md}, with the model's fit on N < 8 and its error at N = 8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from tests.netns import NetCluster

from . import fanout_model as model
from .fanout_bench import proc_cpu_seconds

REPO = Path(__file__).resolve().parent.parent
PHASES = ("current", "negotiate", "send", "publish")  # what a kept session pays per edit


def make_tree(root: Path, files: int = 300) -> Path:
    for i in range(files):
        d = root / f"pkg{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 20)
    return root


def one_n(n: int, edits: int, rate: str, workdir: Path) -> dict:
    src = make_tree(workdir / f"tree-{n}")
    with NetCluster(n, rate=rate, workdir=workdir / f"cluster-{n}") as cluster:
        argv = cluster.push_argv(src, "--json", "--name", "edit")
        first = cluster.run_devbox(argv, timeout=120)
        if first.returncode != 0:
            raise RuntimeError(f"N={n}: first push failed: {first.stderr[-1000:]}")
        runs = []
        target = src / "pkg0" / "mod0.py"
        for k in range(edits):
            target.write_text(f"EDIT = {k}\n")
            d0 = sum(proc_cpu_seconds(p) for p in cluster.pids)
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = cluster.run_devbox(argv, timeout=120)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            daemons = sum(proc_cpu_seconds(p) for p in cluster.pids) - d0
            if proc.returncode != 0:
                raise RuntimeError(f"N={n}: push failed: {proc.stderr[-1000:]}")
            result = json.loads(proc.stdout)
            phases = result["phases"]
            runs.append({"seconds": sum(phases.get(p, 0.0) for p in PHASES),
                         "phases": phases, "daemon_cpu": daemons,
                         "client_cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                         "nodes": result["nodes"]})
    med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "daemon_cpu",
                                                                "client_cpu")}
    return {"nodes": n, **med, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--edits", type=int, default=7)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="editfanout-"))
    try:
        per_n = []
        for n in args.nodes:
            per_n.append(one_n(n, args.edits, args.rate, work))
            print(f"  N={n}: {per_n[-1]['seconds']:.3f} s per edit (phases), daemons "
                  f"{per_n[-1]['daemon_cpu']:.3f} CPU-s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cores = os.cpu_count() or 2
    fit = model.fit_small_change([r for r in per_n if r["nodes"] < max(args.nodes)], cores)
    now = datetime.datetime.now()
    report = {"date": now.isoformat(timespec="seconds"), "rate": args.rate, "cores": cores,
              "per_n": per_n, "fit": fit}
    lines = model.small_change_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"editfanout-{now:%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
