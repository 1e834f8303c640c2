"""A node's telemetry: what happened on it, as rows of a local SQLite database
(STATE/events.db), kept within an age and a size, and the read-only queries that `monarch-fs
query` sends it.

Two tables (SCHEMA): `events`, one row per thing that happened (a push's phases, a version
published or dropped, a collect, a process started or ended, an error...), and `reads`, one
row per interval in which the mount served requests (by operation, cache hits and misses,
bytes, time in the handlers and time loading chunks from disk).

Recording never waits on the disk: `record` appends a row to a list in memory (any thread may
call it: worker threads and the logging handler do), and `run` writes what gathered, with the
interval's read counters, in one transaction on a worker thread, once per interval. The FUSE
read path only bumps counters (fs/fuse_ops.py), which `run` samples. A writer that falls
behind drops rows past MAX_PENDING and says how many in an `events.dropped` row.

Retention, after each write: rows older than the age bound go, and when the database's pages
in use pass the size bound, the oldest rows of each table go until a tenth of the bound is
free; freed pages go back to the file system at once (incremental auto-vacuum), and the
write-ahead log is truncated, so the files stay within the bound plus what one write adds.

Queries run on a connection of their own, opened read-only (`mode=ro`), with an authorizer that
allows nothing but reading (SELECT, reads of columns, functions): no statement can change,
delete or attach anything, whatever the token holder sends. A progress handler ends a query
that runs past its time, and the rows and bytes of an answer are bounded.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ..wire.requests import RequestError
from .logs import INSERT as INSERT_LOGS
from .logs import LOG_COLUMNS, LOGS_SCHEMA, LogLines

log = logging.getLogger("monarch_fs.daemon")

# Columns of `events`, after id. Kinds and which columns each fills: docs/reference/events.md.
EVENT_COLUMNS = ("ts", "node", "kind", "workspace", "version", "peer", "proc", "pid", "rank",
                 "restart", "code", "signal", "count", "bytes", "seconds", "topology",
                 "transport", "text", "detail")
# Columns of `reads`, after id: one row per interval in which the mount served requests.
READ_COLUMNS = ("ts", "node", "interval", "requests", "reads", "bytes", "hits", "misses",
                "busy", "disk", "ops")
# Every column a query may name, per table.
TABLES: dict[str, tuple[str, ...]] = {"events": ("id", *EVENT_COLUMNS),
                                      "reads": ("id", *READ_COLUMNS),
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
    detail TEXT             -- a JSON object: what else the kind carries
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
""" + LOGS_SCHEMA

DEFAULT_INTERVAL = 2.0  # seconds between writes (and the length of a `reads` row)
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_MAX_AGE = 30 * 86400.0
MAX_PENDING = 100_000  # rows held in memory for the next write; more are dropped (counted)
TAIL_CHARS = 4096  # of a text column (an error, an argv, a stderr tail)

# What a query may do: read (SELECT, a column read, a function call). Everything else is
# denied, so no statement can insert, update, delete, create, drop, attach or set a pragma.
_ALLOWED = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                      getattr(sqlite3, "SQLITE_RECURSIVE", 33)})
QUERY_TIMEOUT = 10.0  # seconds a query may run on a node
MAX_ROWS = 200_000  # rows one node returns for one query
MAX_REPLY_BYTES = 48 << 20  # of the JSON rows (a frame holds 80 MiB)
MAX_VALUE_BYTES = 1 << 20  # the longest string or blob a query may make (SQLITE_LIMIT_LENGTH)


def _utf8(text: str) -> str:
    """`text` as SQLite can store it: a lone surrogate (a file or workspace name that is not
    UTF-8, decoded with surrogateescape, or any JSON could carry) becomes its \\u escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


@dataclass(frozen=True)
class Answer:
    """A query's result on one node."""

    columns: list[str]
    rows: list[list[Any]]


class EventLog:
    """The node's events database: `record` from anywhere, `run` (a task) to write and prune,
    `query` for reads. `sample` gives the mount's cumulative read counters (SnapshotFS.
    read_counters), whose differences make the `reads` rows; None records none. Not
    `enabled` (MONARCH_FS_EVENTS=0), it records and opens nothing, and refuses queries."""

    def __init__(self, path: Path, node: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_age: float = DEFAULT_MAX_AGE, interval: float = DEFAULT_INTERVAL,
                 sample: Callable[[], Mapping[str, Any]] | None = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(path)
        self.node = node
        self.max_bytes = max(1 << 20, max_bytes)
        self.max_age = max_age
        self.interval = interval
        self.sample = sample
        self._pending: collections.deque[tuple] = collections.deque()
        self._dropped = 0
        self._last: Mapping[str, Any] | None = None
        self._last_at = time.time()
        self._db: sqlite3.Connection | None = None
        self._write_lock = threading.Lock()  # one write (and prune) at a time
        self._queries = trio.CapacityLimiter(2)
        self.pruned = 0  # rows deleted by retention since start
        self.lines = LogLines(node)  # processes' output, written with the events (logs.py)
        # Tables `query` may not read (the daemon sets it: logs under --identity munge).
        self.hidden: frozenset[str] = frozenset()

    # ---- recording --------------------------------------------------------------------------

    def record(self, kind: str, *, detail: Mapping[str, Any] | None = None,
               **fields: Any) -> None:
        """Note an event now; written at the next interval. `fields` are EVENT_COLUMNS (a
        text is cut to its last TAIL_CHARS); `detail`, anything else, as JSON. Cheap and
        thread-safe: never waits."""
        if not self.enabled:
            return
        if len(self._pending) >= MAX_PENDING:
            self._dropped += 1
            return
        text = fields.get("text")
        if isinstance(text, str) and len(text) > TAIL_CHARS:
            fields["text"] = text[-TAIL_CHARS:]
        for key, value in fields.items():
            if isinstance(value, str):
                fields[key] = _utf8(value)
        fields.update(ts=time.time(), node=self.node, kind=kind,
                      detail=json.dumps(detail, default=str) if detail else None)
        self._pending.append(tuple(fields.get(c) for c in EVENT_COLUMNS))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Open the database, then write what gathered once per interval, until cancelled
        (`close` writes the rest)."""
        if self.enabled:
            try:
                await trio.to_thread.run_sync(self._open)
            except (sqlite3.Error, OSError) as e:  # telemetry must never stop the daemon
                log.error("events: cannot open %s (%s): recording nothing until restarted",
                          self.path, e)
                self.enabled = False
        if not self.enabled:
            task_status.started()
            return
        self._last = self.sample() if self.sample is not None else None
        self._last_at = time.time()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> None:
        """Write what gathered, and the read counters since the last write, now. A failure is
        logged, never raised: telemetry must not stop the daemon."""
        reads = self._reads_row()
        try:
            await trio.to_thread.run_sync(self._write, reads)
        except (sqlite3.OperationalError, OSError) as e:  # a full disk: rows kept, tried again
            log.warning("events: writing %s: %s", self.path, e)
        except Exception as e:  # rows the database refuses: dropped (by _write), not retried
            log.error("events: writing %s: dropped rows the database refused: %r", self.path, e)

    async def close(self) -> None:
        """Write what is left and close; shielded (the daemon is stopping)."""
        with trio.CancelScope(shield=True):
            if self._db is not None:
                await self.flush()
                await trio.to_thread.run_sync(self._close)

    def _reads_row(self) -> tuple | None:
        """The interval's `reads` row from two samples of the counters; None if idle."""
        if self.sample is None:
            return None
        now, cur = time.time(), self.sample()
        last, self._last, since, self._last_at = self._last or {}, cur, self._last_at, now
        ops = {k: v - last.get("ops", {}).get(k, 0) for k, v in cur["ops"].items()}
        ops = {k: v for k, v in ops.items() if v > 0}
        if not ops:
            return None

        def delta(key: str) -> Any:
            return cur[key] - last.get(key, 0)

        requests = sum(v for k, v in ops.items() if k != "failed")  # failed: a count, not an op
        return (now, self.node, round(now - since, 3), requests, ops.get("read", 0),
                delta("bytes"), delta("hits"), delta("misses"), round(delta("busy_ns") / 1e9, 6),
                round(delta("disk_ns") / 1e9, 6), json.dumps(ops))

    # ---- the database (worker threads) ------------------------------------------------------

    def _open(self) -> None:
        """Open (or make) the database; one that is damaged is moved aside to NAME.broken
        (kept for a look) and a new one made: telemetry is not worth a daemon that won't
        start."""
        try:
            self._connect()
        except sqlite3.DatabaseError as e:
            log.error("events: %s is damaged (%s): moved to %s.broken; starting a new one",
                      self.path, e, self.path.name)
            for suffix in ("", "-wal", "-shm"):
                old = Path(f"{self.path}{suffix}")
                if old.exists():
                    os.replace(old, f"{self.path}.broken{suffix}")
            self._connect()

    def _connect(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # private, as all state is
        os.close(fd)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Set before the first table exists, auto_vacuum lets deletes give pages back.
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        db.execute("PRAGMA journal_mode = WAL")  # queries read while the recorder writes
        db.execute("PRAGMA synchronous = NORMAL")  # a power cut may lose the last interval
        db.execute(f"PRAGMA journal_size_limit = {self.max_bytes // 8}")
        db.executescript(SCHEMA)
        self._db = db

    def _close(self) -> None:
        with self._write_lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _write(self, reads: tuple | None) -> None:
        with self._write_lock:
            db = self._db
            if db is None:
                return
            rows: list[tuple] = []
            while self._pending and len(rows) < MAX_PENDING:
                rows.append(self._pending.popleft())
            if self._dropped:
                dropped, self._dropped = self._dropped, 0
                rows.append(tuple({"ts": time.time(), "node": self.node,
                                   "kind": "events.dropped", "count": dropped}.get(c)
                                  for c in EVENT_COLUMNS))
            lines, lost = self.lines.take() if self.enabled else ([], 0)
            if lost:
                rows.append(tuple({"ts": time.time(), "node": self.node,
                                   "kind": "logs.dropped", "count": lost}.get(c)
                                  for c in EVENT_COLUMNS))
            if not rows and reads is None and not lines:
                return
            try:
                db.execute("BEGIN")
                db.executemany(f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES "
                               f"({', '.join('?' * len(EVENT_COLUMNS))})", rows)
                if reads is not None:
                    db.execute(f"INSERT INTO reads ({', '.join(READ_COLUMNS)}) VALUES "
                               f"({', '.join('?' * len(READ_COLUMNS))})", reads)
                db.executemany(INSERT_LOGS, lines)
                db.execute("COMMIT")
            except BaseException as e:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(e, (sqlite3.OperationalError, OSError)):  # a full disk, a lock
                    self._pending.extendleft(reversed(rows))  # tried again at the next write
                    self.lines.put_back(lines)
                raise
            self._retain(db)

    def used_bytes(self) -> int:
        """Bytes of the database's pages in use (the file, less its free pages)."""
        with self._write_lock:
            return self._used(self._db) if self._db is not None else 0

    @staticmethod
    def _used(db: sqlite3.Connection) -> int:
        size = db.execute("PRAGMA page_size").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * size

    def _retain(self, db: sqlite3.Connection) -> None:
        """Delete rows past the age bound, then the oldest until the size bound holds with a
        tenth of it to spare; give the pages back and truncate the log."""
        deleted = 0
        cutoff = time.time() - self.max_age
        for table in TABLES:
            deleted += db.execute(f"DELETE FROM {table} WHERE ts < ?", (cutoff,)).rowcount
        used = self._used(db)
        passes = 0
        while used > self.max_bytes and passes < 8:  # rows differ in size: a few passes
            passes += 1
            share = 1 - 0.9 * self.max_bytes / used
            db.execute("BEGIN")
            for table in TABLES:
                lo, hi = db.execute(f"SELECT min(id), max(id) FROM {table}").fetchone()
                if lo is None:
                    continue
                cut = lo + max(1, int((hi - lo + 1) * share))
                deleted += db.execute(f"DELETE FROM {table} WHERE id < ?", (cut,)).rowcount
            db.execute("COMMIT")
            used = self._used(db)
        if deleted:
            self.pruned += deleted
            db.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ---- queries ----------------------------------------------------------------------------

    async def query(self, sql: str, params: Mapping[str, Any] | Sequence[Any] = (), *,
                    timeout: float = QUERY_TIMEOUT, max_rows: int = MAX_ROWS) -> Answer:
        """Run one read-only statement; RequestError saying why one is refused (not a read,
        too slow, too many rows, an SQL error)."""
        if self._db is None:
            raise RequestError("query: this node records no events (MONARCH_FS_EVENTS=0)")
        return await trio.to_thread.run_sync(self._query, sql, params, timeout, max_rows,
                                             limiter=self._queries)

    def _query(self, sql: str, params: Mapping[str, Any] | Sequence[Any], timeout: float,
               max_rows: int) -> Answer:
        uri = f"file:{urllib.parse.quote(str(self.path))}?mode=ro"
        db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        try:
            db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
            db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            hidden: list[str] = []  # the hidden tables the query read (refused)

            def authorize(action: int, table: object, *rest: object) -> int:
                if action == sqlite3.SQLITE_READ and table in self.hidden:
                    hidden.append(str(table))
                    return sqlite3.SQLITE_DENY
                return _authorize(action, table, *rest)

            db.set_authorizer(authorize)
            deadline = time.monotonic() + timeout
            db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
            try:
                cur = db.execute(sql, params)
                columns = [d[0] for d in cur.description or ()]
                rows: list[list[Any]] = []
                size = 0
                while batch := cur.fetchmany(4096):
                    for row in batch:
                        out = [v.hex() if isinstance(v, bytes) else v for v in row]
                        size += sum(len(v) if isinstance(v, str) else 8 for v in out)
                        rows.append(out)
                    if len(rows) > max_rows or size > MAX_REPLY_BYTES:
                        raise RequestError(
                            f"query: more than {min(len(rows), max_rows):,} rows or "
                            f"{MAX_REPLY_BYTES >> 20} MiB would travel from this node; narrow "
                            "it with WHERE, or aggregate")
            except sqlite3.DatabaseError as e:
                why = str(e)
                if hidden:
                    raise RequestError(f"query refused: this daemon acts for each user "
                                       f"(--identity munge), so {hidden[0]} is read with "
                                       f"`monarch-fs {hidden[0]}`, which checks whose it is"
                                       ) from None
                if why == "not authorized" or "prohibited" in why:
                    raise RequestError("query refused: only reading statements run here "
                                       "(SELECT); events cannot be changed or deleted"
                                       ) from None
                if why == "interrupted":
                    raise RequestError(f"query: stopped after {timeout:g} s") from None
                if "readonly" in why or "read-only" in why:
                    raise RequestError(f"query refused: {why}") from None
                raise RequestError(f"query: {why}") from None
            return Answer(columns, rows)
        finally:
            db.close()


class EventLogHandler(logging.Handler):
    """Warnings and errors the daemon logs, as `warning` and `error` events: their message is
    the cause (a failed collect, a refused handshake, a FUSE request answered EIO...)."""

    def __init__(self, events: EventLog) -> None:
        super().__init__(logging.WARNING)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:  # log.exception: the cause
                e = record.exc_info[1]
                text = f"{text}: {type(e).__name__}: {e}"
            self.events.record("error" if record.levelno >= logging.ERROR else "warning",
                               text=text, detail={"logger": record.name})
        except Exception:  # a log line that cannot be recorded is still logged
            self.handleError(record)
