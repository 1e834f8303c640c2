#!/usr/bin/env python3
"""The benchmark suite behind `make bench`: monarch-fs next to what users would do instead, in
the same run on the same machine, as ratios.

    .venv/bin/python -m bench.run_all             # the full suite (about 20 minutes on 2 cores)
    .venv/bin/python -m bench.run_all --quick     # a smoke run of every workload (~1-2 minutes)
    .venv/bin/python -m bench.run_all --only read,tree

Workloads, one module each (each also runs on its own; see its docstring for the rules):

- push (push_bench.py): a generated 512 MB venv-like tree to 3 nodes, cold / no change / one
  file edited: `monarch-fs push` vs `rsync -a` vs `tar | zstd -1 | zstd -d | tar -x`;
- read (read_bench.py): sequential 1 MiB reads of a 1 GiB library-like file, mount vs local
  disk, page cache dropped and warm;
- import (import_bench.py): `import torch` (2.13, CPU) from the project's venv pushed to a
  1-node cluster, mount vs local, first import after the publish and warm;
- tree (tree_bench.py): `find | wc -l` and os.walk + lstat over 100,000 generated files, mount vs
  local, cold and warm; the daemon's peak RSS serving that snapshot;
- netpush (network_push_bench.py, root only): the push tree to 1, 3 and 8 hosts, each in its
  own network namespace behind 1 Gbit/s links, `monarch-fs push` vs `rsync -a` to an rsync
  daemon on each host. This is the question the push goal asks (the dev box sends each byte
  once; rsync sends it to every host); the push workload's local folders cost rsync no network;
- coldstart (cold_start_bench.py): issue 19's cold start on a fresh allocation: the staged torch
  venv pushed to fresh nodes by a dev box that pushed it before, until the first `import torch`
  is done there (default and usable-early modes), vs local disk and `rsync -a` + import; the
  node's disk per content byte; daemon CPU per GB for 1 GiB of incompressible data to 1 and 8
  nodes; and (root) 8 hosts behind 1 Gbit/s links against 1 (~5 minutes; --quick 1-2);
- datapath (datapath_bench.py): issue 34's data path: 1 GiB of incompressible data to a fresh
  node (`--encrypt auto` and `on`) over the raw loopback stream, daemon CPU per GB, CPU per GB
  per relay hop down a chain of 3, each beside a node's or a hop's work in a plain Python loop
  (limits.node_floor), and an 8 GiB env (--env-gib) over
  the 1 GiB rate with the daemon's peak RSS; with coldstart's cold starts over the local cold
  import, one table (datapath_report.py) (~2-4 minutes, ~17 GB of disk while it runs);
- editloop (edit_loop_bench.py): issue 20's edit-run loop: 15,000 and 100,000 small files on 4
  nodes, pushed with no change and after one edit until every node shows it (CLI start
  included; as a new process, and handed to a running `push --watch`), vs `rsync -a` into 4
  local folders; and `push --watch` from save to shown;
- editfanout (edit_fanout_bench.py, root): one edit in `push --watch` to 1, 2, 4 and 8 netns
  nodes, fitting the small-change model (fanout_model.py) on the smaller N, checking it at 8
  and projecting 1024 nodes (~1 minute);
- telemetry (telemetry_bench.py): issue 21: warm `import torch` and `find` over 100,000 files
  on a node recording events against one with MONARCH_FS_EVENTS=0, alternating; and
  `monarch-fs query` over 8 nodes holding 1,000,000 events each (~6 minutes).

Generated inputs are seeded and cached in --cache (default /tmp/monarch-fs-bench), so only the
first run pays for them. Every cluster runs from its own folder under a fresh run folder and is
stopped (cluster.down) whatever happens. Results: bench/results/bench-DATE.json and .md (a quick
run writes to bench/results/tmp/, which git ignores), and a full run replaces the section
"The latest run" of docs/benchmarks.md (the site's Benchmarks page). The goals of issue 5 are
judged from the figures of this run, and a full run also rewrites the README's figures (the
data path's table, between its markers) from the same results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.netns import NetnsUnsupported

from . import (
    cold_start_bench,
    datapath_bench,
    edit_fanout_bench,
    edit_loop_bench,
    import_bench,
    network_push_bench,
    push_bench,
    read_bench,
    telemetry_bench,
    tree_bench,
)
from .common import (
    DEFAULT_CACHE,
    REPO,
    RESULTS,
    PageCache,
    log,
    remove_work,
)
from .datapath_report import readme_section
from .machine import CpuMeter, loadavg, machine_facts
from .report import goals, machine_line, markdown, summary_tables

WORKLOADS = ("push", "read", "import", "tree", "netpush", "coldstart", "datapath", "editloop",
             "editfanout", "telemetry")
README_BEGIN = "<!-- bench:begin (bench/run_all.py rewrites this section) -->"
README_END = "<!-- bench:end -->"
FIGURES_BEGIN = "<!-- figures:begin (bench/run_all.py rewrites this table from a full run) -->"
FIGURES_END = "<!-- figures:end -->"

FULL = {
    "push": {"size_mb": 512, "nodes": 3},
    "read": {"size_mb": 1024, "cold_runs": 3, "warm_runs": 5},
    "import": {"module": "torch", "cold_runs": 3, "warm_runs": 9, "excludes": ()},
    "tree": {"files": 100_000, "cold_runs": 3, "warm_runs": 5},
    "netpush": {"size_mb": 512, "nodes": [1, 3, 8], "rate": "1gbit"},
    "coldstart": {"module": "torch", "excludes": (), "runs": 3, "ingest_mb": 1024,
                  "ingest_nodes": [1, 8], "hosts": [1, 8], "rate": "1gbit"},
    "datapath": {"ingest_mib": 1024, "relay_nodes": 3, "env_gib": 8.0, "env_venv": True},
    "editloop": {"files": [15_000, 100_000], "nodes": 4, "rounds": 5, "watch_edits": 20},
    "editfanout": {"nodes": [1, 2, 4, 8], "edits": 9, "rate": "1gbit"},
    "telemetry": {"module": "torch", "excludes": (), "files": 100_000, "runs": 9,
                  "cold_runs": 3, "nodes": 8, "events": 1_000_000},
}
QUICK = {
    "push": {"size_mb": 64, "nodes": 2},
    "read": {"size_mb": 128, "cold_runs": 2, "warm_runs": 3},
    # torch alone is 750 MB of the venv: a smoke run pushes the rest and imports sympy.
    "import": {"module": "sympy", "cold_runs": 2, "warm_runs": 3,
               "excludes": ("torch", "torchgen", "functorch")},
    "tree": {"files": 10_000, "cold_runs": 2, "warm_runs": 3},
    "netpush": {"size_mb": 64, "nodes": [2], "rate": "1gbit"},
    "coldstart": {"module": "sympy", "excludes": ("torch", "torchgen", "functorch"), "runs": 1,
                  "ingest_mb": 256, "ingest_nodes": [1, 2], "hosts": [1, 2], "rate": "1gbit"},
    "datapath": {"ingest_mib": 128, "relay_nodes": 3, "env_gib": 0.25, "env_venv": False},
    "editloop": {"files": [3_000], "nodes": 2, "rounds": 1, "watch_edits": 3},
    "editfanout": {"nodes": [1, 2], "edits": 3, "rate": "1gbit"},
    "telemetry": {"module": "sympy", "excludes": ("torch", "torchgen", "functorch"),
                  "files": 10_000, "runs": 3, "cold_runs": 2, "nodes": 2, "events": 100_000},
}


# ---- running ------------------------------------------------------------------------------

def run_workload(name: str, params: dict, work: Path, cache: Path, page_cache: PageCache) -> dict:
    if name == "push":
        return push_bench.measure(params["size_mb"], params["nodes"], cache)
    if name == "read":
        return read_bench.measure(work, cache, params["size_mb"], params["cold_runs"],
                                  params["warm_runs"], page_cache)
    if name == "import":
        return import_bench.measure(work, cache, params["module"], params["cold_runs"],
                                    params["warm_runs"], tuple(params["excludes"]), page_cache)
    if name == "tree":
        return tree_bench.measure(work, cache, params["files"], params["cold_runs"],
                                  params["warm_runs"], page_cache)
    if name == "netpush":
        try:
            return network_push_bench.measure(params["size_mb"], params["nodes"], params["rate"],
                                              network_push_bench.SHM, cache)
        except NetnsUnsupported as e:
            return {"skipped": f"network namespaces unavailable: {e}"}
    if name == "coldstart":
        return cold_start_bench.measure(
            work, cache, params["module"], tuple(params["excludes"]), params["runs"],
            params["ingest_mb"], tuple(params["ingest_nodes"]), tuple(params["hosts"]),
            params["rate"], page_cache)
    if name == "datapath":
        return datapath_bench.measure(work, cache, params["ingest_mib"], params["relay_nodes"],
                                      params["env_gib"], params["env_venv"])
    if name == "editloop":
        return edit_loop_bench.measure(work, cache, tuple(params["files"]), params["nodes"],
                                       params["rounds"], params["watch_edits"])
    if name == "editfanout":
        try:
            return edit_fanout_bench.measure(params["nodes"], params["edits"], params["rate"])
        except NetnsUnsupported as e:
            return {"skipped": f"network namespaces unavailable: {e}"}
    if name == "telemetry":
        return telemetry_bench.measure(work, cache, params["module"], params["files"],
                                       params["runs"], params["cold_runs"], params["nodes"],
                                       params["events"], tuple(params["excludes"]), page_cache)
    raise ValueError(name)


# ---- the report's place in the docs -------------------------------------------------------

def rewrite_between(page: Path, begin: str, end: str, body: list[str]) -> bool:
    """Replace what lies between the markers `begin` and `end` of `page` (kept) with `body`;
    nothing else on the page is touched. False, and the page unchanged, without the markers."""
    text = page.read_text()
    if begin not in text or end not in text.split(begin, 1)[1]:
        return False
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    tmp = page.with_suffix(".md.tmp")
    tmp.write_text(head + "\n".join([begin, "", *body, end]) + tail)
    os.replace(tmp, page)
    return True


def update_docs_page(report: dict, md_path: Path,
                     page: Path = REPO / "docs" / "benchmarks.md") -> bool:
    """The latest run's tables on the docs' Benchmarks page (its section "The latest run")."""
    rel = os.path.relpath(md_path, page.parent)
    return rewrite_between(page, README_BEGIN, README_END, [
        f"Latest `make bench` ({report['date']}, [full report]({rel})), on {machine_line(report)}. "
        f"The machine was shared with other jobs (load average {report['load'][0]:.1f} at the "
        f"start, CPUs {report['cpu_busy_pct']:.0f}% busy over the run), so treat single figures "
        "as noisy; the ratios are measured side by side in the same run.", "",
        *summary_tables(report)])


def update_readme_figures(report: dict, md_path: Path, readme: Path = REPO / "README.md") -> bool:
    """The README's figures (the data path's short table) from the same run as the docs'."""
    body = readme_section(report, os.path.relpath(md_path, readme.parent))
    return bool(body) and rewrite_between(readme, FIGURES_BEGIN, FIGURES_END, [*body, ""])


def publish(report: dict, md_path: Path) -> None:
    """A full run's figures into the docs' Benchmarks page and the README."""
    for what, done in (("the latest run in docs/benchmarks.md", update_docs_page),
                       ("the figures in README.md", update_readme_figures)):
        log(f"updated {what}" if done(report, md_path) else f"NOT updated {what} (no markers)")


def render(json_path: Path, readme: bool = True) -> int:
    report = json.loads(json_path.read_text())
    report["goals"] = goals(report["results"])
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown(report))
    print(md_path.read_text())
    complete = (list(report["results"]) == list(WORKLOADS)
                and not any("error" in r for r in report["results"].values()))
    if readme and complete and not report["quick"]:
        publish(report, md_path)
    return 0


# ---- main ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="small workloads (a smoke run of ~1-2 minutes; not for the goals)")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results, quick: bench/results/tmp)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"generated inputs are kept here (default {DEFAULT_CACHE})")
    parser.add_argument("--push-size-mb", type=int, help="push tree size (default 512)")
    parser.add_argument("--push-nodes", type=int, help="push nodes (default 3)")
    parser.add_argument("--read-size-mb", type=int, help="read file size (default 1024)")
    parser.add_argument("--files", type=int, help="files in the metadata tree (default 100000)")
    parser.add_argument("--cold-runs", type=int, help="cold runs per side (default 3)")
    parser.add_argument("--warm-runs", type=int, help="warm runs per side (default 5; import: 9)")
    parser.add_argument("--env-gib", type=float,
                        help="the datapath workload's large env, GiB (default 8)")
    parser.add_argument("--no-readme", action="store_true",
                        help="do not rewrite the latest run in docs/benchmarks.md and the "
                        "README's figures")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the .md next to a saved bench-*.json (and "
                        "docs/benchmarks.md and the README's figures, for a full run) from it, "
                        "e.g. after changing the report")
    args = parser.parse_args(argv)
    if args.render:
        return render(args.render, readme=not args.no_readme)
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    if bad := [w for w in only if w not in WORKLOADS]:
        parser.error(f"unknown workload(s) {bad}; choose from {WORKLOADS}")

    params = json.loads(json.dumps(QUICK if args.quick else FULL))
    for flag, (w, key) in {"push_size_mb": ("push", "size_mb"), "push_nodes": ("push", "nodes"),
                           "read_size_mb": ("read", "size_mb"), "files": ("tree", "files"),
                           "env_gib": ("datapath", "env_gib")}.items():
        if getattr(args, flag) is not None:
            params[w][key] = getattr(args, flag)
    for w in ("read", "import", "tree"):
        for key in ("cold_runs", "warm_runs"):
            if getattr(args, key) is not None:
                params[w][key] = max(1, getattr(args, key))

    out_dir = args.out or (RESULTS / "tmp" if args.quick else RESULTS)
    args.cache.mkdir(parents=True, exist_ok=True)
    page_cache = PageCache()
    if not page_cache.works:
        log(f"warning: cannot drop the page cache ({page_cache.reason}): cold figures will be "
            "warm ones")
    started = datetime.datetime.now()
    t0 = time.monotonic()
    load0, cpu = loadavg(), CpuMeter()
    results: dict[str, dict] = {}
    spent: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="suite-", dir=args.cache))
    try:
        for name in only:
            log(f"== {name} {params[name]}")
            t = time.monotonic()
            try:
                results[name] = run_workload(name, params[name], work, args.cache, page_cache)
            except Exception as e:  # one broken workload must not hide the others
                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {e}"}
            spent[name] = round(time.monotonic() - t, 1)
            log(f"   {name}: {spent[name]:.0f} s")
    finally:
        remove_work(work)

    report = {
        "date": started.isoformat(timespec="seconds"),
        "quick": args.quick,
        "params": params,
        "machine": machine_facts(),
        "load": [load0, loadavg()],
        "cpu_busy_pct": cpu.busy(),
        "page_cache": page_cache.describe(),
        "seconds": round(time.monotonic() - t0, 1),
        "workload_seconds": spent,
        "results": results,
    }
    report["goals"] = goals(results)
    md = markdown(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench-{'quick-' if args.quick else ''}{started:%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {stem}.json and {stem}.md")
    failed = [n for n, r in results.items() if "error" in r]
    if not args.quick and not args.no_readme and not failed and only == list(WORKLOADS):
        publish(report, stem.with_suffix(".md"))
    if failed:
        log(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
