"""The tables of a node's telemetry database (STATE/events.db): their columns and schema.

In wire/ because both sides read them: the node creates and fills the tables
(daemon/node/events.py, logs.py, stacks.py) and the client plans a query against them and
prints the schema (daemon/client/query_plan.py, query.py). The docs' schema page is generated
from SCHEMA's comments.
"""

from __future__ import annotations

# The `stacks` table: one row per rank per dump that `monarch-fs stacks` or a hang (`run
# --hang-timeout`) took on a node, so that what a hung job was doing can still be asked after
# it was killed (daemon/node/stacks.py).
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

# The `logs` table: every line the node's processes printed (daemon/node/logs.py).
LOG_COLUMNS = ("ts", "node", "job", "rank", "restart", "proc", "uid", "stream", "line")

LOGS_SCHEMA = """
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,       -- when the daemon read the line
    node TEXT NOT NULL,
    job TEXT,               -- the `run` job (MONARCH_FS_JOB) or proc mesh (MONARCH_MESH_NAME)
    rank INTEGER, restart INTEGER,
    proc INTEGER,           -- the daemon's id of the process (as in events)
    uid INTEGER,            -- the user it ran as
    stream TEXT,            -- stdout or stderr
    line TEXT               -- without its newline; a line over 16 KiB is cut
);
CREATE INDEX IF NOT EXISTS logs_ts ON logs (ts);
CREATE INDEX IF NOT EXISTS logs_job ON logs (job, rank, id);
"""

# Columns of `events`, after id. Kinds and which columns each fills: docs/reference/events.md.
EVENT_COLUMNS = ("ts", "node", "kind", "workspace", "version", "peer", "proc", "pid", "rank",
                 "restart", "code", "signal", "count", "bytes", "seconds", "topology",
                 "transport", "text", "detail", "uid")
# Columns of `reads`, after id: one row per interval in which the mount served requests.
READ_COLUMNS = ("ts", "node", "interval", "requests", "reads", "bytes", "hits", "misses",
                "busy", "disk", "ops")
# Every column a query may name, per table.
TABLES: dict[str, tuple[str, ...]] = {"events": ("id", *EVENT_COLUMNS),
                                      "reads": ("id", *READ_COLUMNS),
                                      "stacks": ("id", *STACK_COLUMNS),
                                      "logs": ("id", *LOG_COLUMNS)}  # processes' output: logs.py

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,       -- seconds since the epoch
    node TEXT NOT NULL,     -- the daemon's --node-name
    kind TEXT NOT NULL,     -- push.received, proc.exited, ... (docs: the kinds of event)
    workspace TEXT, version TEXT, peer TEXT,
    proc INTEGER, pid INTEGER, rank INTEGER, restart INTEGER, code INTEGER, signal TEXT,
    count INTEGER, bytes INTEGER, seconds REAL,
    topology TEXT, transport TEXT,
    text TEXT,              -- an error's cause, a process's argv or its stderr tail
    detail TEXT,            -- a JSON object: what else the kind carries
    uid INTEGER             -- whose row: a process's user (NULL: the node's own event)
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
-- Covers the usual aggregates by kind (counts, sums of bytes, seconds): no row lookups.
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, ts, count, bytes, seconds);
CREATE TABLE IF NOT EXISTS reads (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,       -- the end of the interval
    node TEXT NOT NULL,
    interval REAL,          -- seconds the row covers
    requests INTEGER,       -- FUSE requests served, all operations
    reads INTEGER,          -- of which reads
    bytes INTEGER,          -- bytes the reads returned
    hits INTEGER, misses INTEGER,  -- decoded-chunk cache
    busy REAL,              -- seconds spent in request handlers (waits included)
    disk REAL,              -- seconds spent loading chunks from the store (worker threads)
    ops TEXT                -- a JSON object: requests by operation
);
CREATE INDEX IF NOT EXISTS reads_ts ON reads (ts);
""" + STACK_SCHEMA + LOGS_SCHEMA
