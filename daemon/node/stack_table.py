"""The `stacks` table of a node's telemetry database (events.py): one row per rank per dump
that `monarch-fs stacks` or a hang (`run --hang-timeout`) took on this node, so that what a
hung job was doing can still be asked after it was killed."""

from __future__ import annotations

# Columns of `stacks`, after id.
STACK_COLUMNS = ("ts", "node", "job", "rank", "pid", "proc", "native", "hang", "top", "stack",
                 "error", "uid")

STACK_SCHEMA = """
CREATE TABLE IF NOT EXISTS stacks (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,       -- when the dump was taken
    node TEXT NOT NULL,
    job TEXT,               -- the run job or proc mesh (monarch-fs stacks JOB)
    rank INTEGER, pid INTEGER, proc INTEGER,
    native INTEGER,         -- 1: with native frames (--native)
    hang TEXT,              -- why, when a hang took it (run --hang-timeout); else NULL
    top TEXT,               -- the main thread's innermost frame: "load_batch (train.py:12)"
    stack TEXT,             -- every thread, innermost frame first, a line each
    error TEXT,             -- why this rank has no stack (py-spy could not attach...)
    uid INTEGER             -- whose process it was: under --identity munge a user reads theirs
);
CREATE INDEX IF NOT EXISTS stacks_ts ON stacks (ts);
"""
