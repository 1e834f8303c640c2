#!/usr/bin/env python3
"""Telemetry (issue 21): what recording costs the read path, and how fast a query over many
nodes answers.

    .venv/bin/python -m bench.telemetry_bench [--module torch] [--files 100000] [--runs 9]
                                              [--nodes 8] [--events 1000000]

Read path: two 1-node local clusters side by side, one recording events (the default) and
one started with MONARCH_FS_EVENTS=0, each serving the same pushed venv (import_bench's staged
copy) and the same 100,000-file tree (tree_bench's). Warm `import MODULE` (a fresh interpreter
each run, as import_bench) and `find -type f | wc -l` over the tree, warm and cold (page cache,
dentries and inodes dropped before each cold run: the daemon then answers every lookup),
alternate between the two mounts (common.rounds); the ratio is recording / not recording, 1.00
meaning no cost. The recording daemon writes its events and one `reads` row every 2 s meanwhile.

Query: a local cluster of N nodes (8), each of whose events database is filled with M events
(1,000,000): written by this bench straight into the node's STATE/events.db through SQLite
while the daemon runs (a realistic mix of kinds over 30 days; recording that many through the
daemon would take as long as the workload that makes them). Then each query of QUERIES runs
as `monarch-fs query --json` five times: the figure is the median of the time the query
itself took (planning, connecting to every node, every node's part, the controller's: the
`seconds` of its answer), against a 1 s target; the command's wall clock, interpreter start
and imports included, is reported beside it.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

from . import common
from .import_bench import ensure_venv, import_once
from .query_timing import filled_cluster, time_query
from .tree_bench import ensure_files, find_seconds

TARGET_QUERY_S = 1.0
KINDS = [("reads", 0), ("push.received", 6), ("push.prepared", 6), ("push.committed", 6),
         ("version.published", 6), ("version.dropped", 4), ("store.collected", 6),
         ("store.size", 6), ("proc.started", 25), ("proc.exited", 25), ("warning", 3),
         ("error", 1)]
# The questions of the README, and an aggregate that reads every row of every node.
QUERIES = {
    "first rank to die": (
        "SELECT host, rank, code, signal, text FROM events WHERE kind = 'proc.exited' "
        "AND code != 0 ORDER BY ts LIMIT 5"),
    "push phases per node": (
        "SELECT host, kind, count(*), avg(seconds), max(seconds) FROM events "
        "WHERE kind LIKE 'push.%' AND ts > strftime('%s', 'now') - 86400 GROUP BY host, kind"),
    "old version": (
        "WITH cur AS (SELECT host, workspace, version, max(ts) AS ts FROM events "
        "WHERE kind = 'version.published' GROUP BY host, workspace) "
        "SELECT host, workspace, version FROM cur WHERE version != (SELECT version FROM cur "
        "AS c WHERE c.workspace = cur.workspace ORDER BY ts DESC LIMIT 1)"),
    "every event, by kind": (
        "SELECT host, kind, count(*), sum(bytes), avg(seconds) FROM events GROUP BY host, kind"),
}


def fill(db_path: Path, node: str, events: int) -> int:
    """Add `events` rows to a node's events database (the daemon keeps running: WAL lets both
    write, one at a time); returns the database's size in bytes."""
    weights = [w for _, w in KINDS if w]
    kinds = [k for k, w in KINDS if w]
    case = " ".join(f"WHEN {sum(weights[:i + 1])} > x THEN '{k}'" for i, k in enumerate(kinds))
    total = sum(weights)
    db = sqlite3.connect(db_path, timeout=60, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute(f"""
            WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
            INSERT INTO events (ts, node, kind, workspace, version, rank, code, count, bytes,
                                seconds, text)
            SELECT strftime('%s', 'now') - 30 * 86400.0 * (? - i) / ?, ?,
                   CASE {case} END, 'env', printf('%032x', i / 5000), i % 64,
                   CASE WHEN i % 97 = 0 THEN 1 ELSE 0 END, i % 4096, (i * 7919) % 1048576,
                   (i % 1000) / 1000.0, 'line ' || i
            FROM (SELECT i, abs(random()) % {total} AS x FROM n)
        """, (events, events, events, node))
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        db.close()
    return db_path.stat().st_size


def measure_queries(work: Path, nodes: int, events: int, runs: int = 5) -> dict:
    """The QUERIES over `nodes` daemons holding `events` events each, as `monarch-fs query`."""
    with filled_cluster(work, "cl-query", nodes, f"{events:,} events", max(256, events // 1000),
                        lambda db, i: fill(db, f"node-{i}", events)) as (cl, mib):
        return {"nodes": nodes, "events_per_node": events, "db_mib_per_node": mib,
                "queries": {label: time_query(cl, label, sql, runs, TARGET_QUERY_S)
                            for label, sql in QUERIES.items()}}


def _cluster(work: Path, name: str, recording: bool) -> common.LocalCluster:
    """A 1-node cluster, started with or without recording (the daemon reads the switch from
    the environment it is started with)."""
    cl = common.LocalCluster(work / name, 1)
    before = os.environ.get("MONARCH_FS_EVENTS")
    os.environ["MONARCH_FS_EVENTS"] = "1" if recording else "0"
    try:
        cl.__enter__()
    finally:
        if before is None:
            os.environ.pop("MONARCH_FS_EVENTS")
        else:
            os.environ["MONARCH_FS_EVENTS"] = before
    return cl


def measure_reads(work: Path, cache: Path, module: str, files: int, runs: int,
                  cold_runs: int, excludes: tuple[str, ...] = (),
                  page_cache: common.PageCache | None = None) -> dict:
    """Warm `import MODULE` and `find` (warm and cold) on a recording node against one that
    records nothing, alternating."""
    page_cache = page_cache or common.PageCache()
    venv, _ = ensure_venv(cache)
    tree = ensure_files(cache, files)
    sides = {"on": _cluster(work, "cl-on", True), "off": _cluster(work, "cl-off", False)}
    try:
        mounts = {}
        for side, cl in sides.items():
            cl.push(venv, name="venv", excludes=excludes)
            cl.push(tree, name="files")
            mounts[side] = cl.mount()
            if side == "on" and not (cl.state() / "events.db").exists():
                raise common.BenchError("the recording node has no events.db")
            if side == "off" and (cl.state() / "events.db").exists():
                raise common.BenchError("MONARCH_FS_EVENTS=0 did not turn recording off")
        common.log(f"  pushed the venv and {files:,} files to both nodes")
        result: dict = {"module": module, "files": files}

        def compare(label: str, fn: Callable[[Path], float], n: int, cold: bool) -> None:
            for side in sides:  # warm-up (a cold run drops the cache itself)
                fn(mounts[side])
            probes = None if cold else {s: (lambda cl=cl: common.own_disk_kib())
                                        for s, cl in sides.items()}
            out = common.rounds(n, {s: (lambda s=s: fn(mounts[s])) for s in sides},
                                (lambda side: page_cache.drop()) if cold else None, probes)
            res = {s: common.summary(v) for s, v in out.items()}
            res["ratio"] = round(res["on"]["median"] / res["off"]["median"], 3)
            result[label] = res
            common.log(f"  {label}: recording {res['on']['median']:.3f} s, not "
                       f"{res['off']['median']:.3f} s: {res['ratio']:.3f}x")

        compare(f"import {module}, warm",
                lambda m: import_once(m / "venv", module, []), runs, cold=False)
        compare("find, warm", lambda m: find_seconds(m / "files", files), runs, cold=False)
        compare("find, cold", lambda m: find_seconds(m / "files", files), cold_runs, cold=True)
        result["page_cache"] = page_cache.describe()
        return result
    finally:
        for cl in sides.values():
            cl.__exit__(None, None, None)


def measure(work: Path, cache: Path = common.DEFAULT_CACHE, module: str = "torch",
            files: int = 100_000, runs: int = 9, cold_runs: int = 3, nodes: int = 8,
            events: int = 1_000_000, excludes: tuple[str, ...] = (),
            page_cache: common.PageCache | None = None) -> dict:
    common.log("  read path, recording vs not:")
    reads = measure_reads(work, cache, module, files, runs, cold_runs, excludes, page_cache)
    common.log(f"  a query over {nodes} nodes of {events:,} events each:")
    return {"reads": reads, "query": measure_queries(work, nodes, events)}


OPTIONS = [
    ("--module", {"default": "torch"}),
    ("--files", {"type": int, "default": 100_000}),
    ("--runs", {"type": int, "default": 9}),
    ("--nodes", {"type": int, "default": 8}),
    ("--events", {"type": int, "default": 1_000_000}),
    ("--exclude", {"action": "append", "default": [],
                   "help": "leave these out of the venv push (e.g. torch, for a quick run)"}),
]


def main(argv: list[str] | None = None) -> int:
    return common.workload_main(argv, __doc__, OPTIONS, lambda work, a: measure(
        work, a.cache, a.module, a.files, a.runs, a.cold_runs, a.nodes, a.events,
        tuple(a.exclude)))


if __name__ == "__main__":
    sys.exit(main())
