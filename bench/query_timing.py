"""Timing questions over many nodes' telemetry through the real command line: a local cluster
whose events databases this bench fills straight through SQLite while the daemons run (as
many rows as a long job leaves, without running one), then each question asked several times.
telemetry_bench asks its questions of the `events` table, logs_bench of the `logs` table."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .common import BenchError, LocalCluster, log, run, summary


@contextmanager
def filled_cluster(work: Path, name: str, nodes: int, rows: str, events_mib: int,
                   fill: Callable[[Path, int], int]) -> Iterator[tuple[LocalCluster, float]]:
    """A local cluster of `nodes` daemons, given room for `events_mib` MiB of events each,
    whose databases fill(STATE/events.db, node index) filled (with `rows`, for the progress
    line; fill returns the file's size): the cluster, and the mean database size in MiB."""
    os.environ["MONARCH_FS_EVENTS_MIB"] = str(events_mib)
    try:
        with LocalCluster(work / name, nodes) as cl:
            sizes = []
            for i in range(nodes):
                log(f"\r  filling node {i + 1}/{nodes} with {rows}", end="")
                sizes.append(fill(cl.state(i) / "events.db", i))
            log("")
            yield cl, round(sum(sizes) / nodes / (1 << 20), 1)
    finally:
        os.environ.pop("MONARCH_FS_EVENTS_MIB", None)


def target(cl: LocalCluster) -> list[str]:
    """The options that point a command at every node of `cl`."""
    return ["--hosts", f"@{cl.dir / 'hosts'}", "--token-file", str(cl.dir / "token")]


def time_query(cl: LocalCluster, label: str, sql: str, runs: int, target_s: float) -> dict:
    """`monarch-fs query --json SQL` over every node of `cl`, `runs` times: the time the query
    itself took (its answer's `seconds`: planning, every node's part, the controller's), the
    command's wall clock (interpreter start and imports too) and whether the median is under
    `target_s`."""
    own, walls, rows = [], [], 0
    for _ in range(runs):
        s, proc = run([cl.cli, "query", *target(cl), "--json", sql])
        answer = json.loads(proc.stdout)
        if answer["unreachable"]:
            raise BenchError(f"{label}: {answer['unreachable']}")
        own.append(answer["seconds"])
        walls.append(s)
        rows = len(answer["rows"])
    q = {"sql": sql, "seconds": summary(own), "cli_seconds": summary(walls), "rows": rows}
    q["met"] = q["seconds"]["median"] < target_s
    log(f"  {label}: {q['seconds']['median']:.3f} s ({q['cli_seconds']['median']:.3f} s with "
        f"the command's start; {rows} rows)")
    return q
