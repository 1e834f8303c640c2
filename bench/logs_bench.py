#!/usr/bin/env python3
"""Every rank's output in SQL (issue 35): how fast questions over the `logs` table of many nodes
answer.

    .venv/bin/python -m bench.logs_bench [--nodes 8] [--lines 1000000] [--runs 5]

A local cluster of N nodes (8), each of whose events database gets M lines (1,000,000) of a
64-rank job in its `logs` table, 8 ranks a node, written by this bench straight into the
node's STATE/events.db through SQLite while the daemon runs (as telemetry_bench fills its
events: printing that many lines through real processes would take as long as the job). Each
question of QUESTIONS then runs five times through the real command line (`monarch-fs query
--json`, or `monarch-fs logs`): the figure is the median of what the query itself took (the
`seconds` of its answer; for `logs`, the command's wall clock, its start included), against a
1 s target.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from .common import log, run, summary, workload_main
from .query_timing import filled_cluster, target, time_query

TARGET_S = 1.0
JOB = "1206-000000-beef"
QUERIES = {
    "lines per rank": f"SELECT rank, count(*) AS n FROM logs WHERE job = '{JOB}' GROUP BY rank",
    "one rank's last 20 lines": (f"SELECT host, line FROM logs WHERE job = '{JOB}' AND rank = 5 "
                                 "ORDER BY id DESC LIMIT 20"),
    "stderr lines that name NCCL": ("SELECT host, rank, line FROM logs WHERE stream = 'stderr' "
                                    "AND line LIKE '%NCCL%'"),
}
LOGS_ARGS = {"logs --rank 5 --grep": [JOB, "--rank", "5", "--grep", r"step 99[0-9]{3}\b"]}


def fill(db_path: Path, node: int, lines: int) -> int:
    """Add `lines` rows to a node's `logs` table (ranks 8*node .. 8*node+7); the file's size."""
    db = sqlite3.connect(db_path, timeout=60, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("""
            WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
            INSERT INTO logs (ts, node, job, rank, restart, proc, uid, stream, line)
            SELECT strftime('%s', 'now') - 3600.0 * (? - i) / ?, ?, ?, ? * 8 + i % 8, 0,
                   i % 8 + 1, 0,
                   CASE WHEN i % 101 = 0 OR i % 10007 = 0 THEN 'stderr' ELSE 'stdout' END,
                   CASE WHEN i % 10007 = 0 THEN 'NCCL WARN timeout on rank ' || (i % 8)
                        ELSE 'step ' || (i / 8) || ' loss ' || printf('%.4f', 2.0 / (1 + i))
                   END
            FROM n
        """, (lines, lines, lines, f"node-{node}", JOB, node))
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        db.close()
    return db_path.stat().st_size


def measure(work: Path, nodes: int = 8, lines: int = 1_000_000, runs: int = 5) -> dict:
    with filled_cluster(work, "cl-logs", nodes, f"{lines:,} lines", max(256, lines // 2000),
                        lambda db, i: fill(db, i, lines)) as (cl, mib):
        out: dict = {"nodes": nodes, "lines_per_node": lines, "db_mib_per_node": mib,
                     "questions": {label: time_query(cl, label, sql, runs, TARGET_S)
                                   for label, sql in QUERIES.items()}}
        for label, args in LOGS_ARGS.items():
            walls, printed = [], 0
            for _ in range(runs):
                s, proc = run([cl.cli, "logs", *args, *target(cl)])
                walls.append(s)
                printed = proc.stdout.count("\n")
            q = out["questions"][label] = {"args": args, "cli_seconds": summary(walls),
                                           "lines": printed}
            q["met"] = q["cli_seconds"]["median"] < TARGET_S
            log(f"  {label}: {q['cli_seconds']['median']:.3f} s with the command's start "
                f"({printed} lines)")
        return out


OPTIONS = [
    ("--nodes", {"type": int, "default": 8}),
    ("--lines", {"type": int, "default": 1_000_000}),
    ("--runs", {"type": int, "default": 5}),
]


def main(argv: list[str] | None = None) -> int:
    return workload_main(argv, __doc__, OPTIONS,
                         lambda work, a: measure(work, a.nodes, a.lines, a.runs))


if __name__ == "__main__":
    sys.exit(main())
