"""A node's telemetry: what happened on it, as rows of a local SQLite database
(STATE/events.db), kept within an age and a size, and the read-only queries that `monarch-fs
query` sends it.

Two tables (SCHEMA): `events`, one row per thing that happened (a push's phases, a version
published or dropped, a collect, a process started or ended, an error...), and `reads`, one
row per interval in which the mount served requests (by operation, cache hits and misses,
bytes, time in the handlers and time loading chunks from disk).
Other modules add their tables through `add`. Every table's columns and schema:
wire/telemetry_tables.py.

Recording never waits on the disk: `record` appends a row to a list in memory (any thread may
call it: worker threads and the logging handler do), and `run` writes what gathered, with the
interval's read counters, in one transaction on a worker thread, once per interval. The FUSE
read path only bumps counters (fs/fuse_ops.py), which `run` samples. A writer that falls
behind drops rows past MAX_PENDING and says how many in an `events.dropped` row.

Retention, after each write: rows older than the age bound go, and when the database's pages
in use pass the size bound, the oldest rows of each table go until a tenth of the bound is
free; freed pages go back to the file system at once (incremental auto-vacuum), and the
write-ahead log is truncated, so the files stay within the bound plus what one write adds.

A query first writes what gathered, so it sees every event that happened before it was asked
(issue 35: a push's events right after the push), then runs on a connection of its own, read
only, bounded in time and size, and under --identity munge over the asker's rows only: the
rules of events_query.py, which apply to every table of this database.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from ...settings import EVENTS_INTERVAL as DEFAULT_INTERVAL
from ...settings import EVENTS_MAX_AGE as DEFAULT_MAX_AGE
from ...settings import EVENTS_MAX_BYTES as DEFAULT_MAX_BYTES
from ..wire.identity import Identity
from ..wire.requests import RequestError
from ..wire.telemetry_tables import EVENT_COLUMNS, READ_COLUMNS, SCHEMA, TABLES
from . import events_query
from .events_query import MAX_ROWS, QUERY_TIMEOUT, Answer
from .logs import INSERT as INSERT_LOGS
from .logs import LogLines

log = logging.getLogger("monarch_fs.daemon")


MAX_PENDING = 100_000  # rows held in memory for the next write; more are dropped (counted)
TAIL_CHARS = 4096  # of a text column (an error, an argv, a stderr tail)
# Of a detail's JSON: a value past a query's bound (events_query.MAX_VALUE_BYTES) would make
# every query that reads the column fail, so a longer detail keeps its short values only.
DETAIL_CHARS = 32 * 1024


def _utf8(text: str) -> str:
    """`text` as SQLite can store it: a lone surrogate (a file or workspace name that is not
    UTF-8, decoded with surrogateescape, or any JSON could carry) becomes its \\u escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _detail_json(detail: Mapping[str, Any]) -> str:
    """`detail` as JSON, at most DETAIL_CHARS: a longer one keeps its short values, and
    says how long each value it cut was (still JSON: json_extract must read every row)."""
    text = json.dumps(detail, default=str)
    if len(text) <= DETAIL_CHARS:
        return text
    parts = {k: json.dumps(v, default=str) for k, v in detail.items()}
    kept = {str(k): json.loads(v) if len(v) <= 1024 else f"(cut: {len(v)} characters of JSON)"
            for k, v in parts.items()}
    text = json.dumps(kept)
    return text if len(text) <= DETAIL_CHARS else json.dumps({"cut": len(text)})


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
        self._rows: collections.deque[tuple[str, tuple]] = collections.deque()  # add()'s
        self._dropped = 0
        self._last: Mapping[str, Any] | None = None
        self._last_at = time.time()
        self._db: sqlite3.Connection | None = None
        self._write_lock = threading.Lock()  # one write (and prune) at a time
        self._queries = trio.CapacityLimiter(2)
        self.pruned = 0  # rows deleted by retention since start
        self.lines = LogLines(node)  # processes' output, written with the events (logs.py)

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
                      detail=_detail_json(detail) if detail else None)
        self._pending.append(tuple(fields.get(c) for c in EVENT_COLUMNS))

    def add(self, table: str, **fields: Any) -> None:
        """Note a row of another table than `events` (TABLES: `stacks`); written with the
        next interval's events, bounded and pruned as they are. Never waits."""
        if not self.enabled:
            return
        if len(self._pending) + len(self._rows) >= MAX_PENDING:
            self._dropped += 1
            return
        fields.update(ts=time.time(), node=self.node)
        self._rows.append((table, tuple(fields.get(c) for c in TABLES[table][1:])))

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
        except (sqlite3.OperationalError, OSError, MemoryError) as e:  # rows kept, tried again
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
        if "uid" not in {r[1] for r in db.execute("PRAGMA table_info(events)")}:
            db.execute("ALTER TABLE events ADD COLUMN uid INTEGER")  # made before it existed
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
            extra = [self._rows.popleft() for _ in range(len(self._rows))]
            lines, lost = self.lines.take() if self.enabled else ([], 0)
            if lost:
                rows.append(tuple({"ts": time.time(), "node": self.node,
                                   "kind": "logs.dropped", "count": lost}.get(c)
                                  for c in EVENT_COLUMNS))
            if not rows and reads is None and not extra and not lines:
                return
            try:
                db.execute("BEGIN")
                db.executemany(f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES "
                               f"({', '.join('?' * len(EVENT_COLUMNS))})", rows)
                if reads is not None:
                    db.execute(f"INSERT INTO reads ({', '.join(READ_COLUMNS)}) VALUES "
                               f"({', '.join('?' * len(READ_COLUMNS))})", reads)
                for table, row in extra:
                    cols = TABLES[table][1:]
                    db.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                               f"({', '.join('?' * len(cols))})", row)
                db.executemany(INSERT_LOGS, lines)
                db.execute("COMMIT")
            except BaseException as e:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                # a full disk, a lock, SQLite's memory bound reached by queries (events_query)
                if isinstance(e, (sqlite3.OperationalError, OSError, MemoryError)):
                    self._pending.extendleft(reversed(rows))  # tried again at the next write
                    self._rows.extendleft(reversed(extra))
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
                    timeout: float = QUERY_TIMEOUT, max_rows: int = MAX_ROWS,
                    asker: Identity | None = None) -> Answer:
        """Write what gathered, then run one read-only statement (events_query.run): with an
        `asker` who is not root (--identity munge), over their rows only. RequestError saying
        why one is refused (not a read, too slow, too large, an SQL error)."""
        if self._db is None:
            raise RequestError("query: this node records no events (MONARCH_FS_EVENTS=0)")
        await self.flush()  # a query sees every event that happened before it was asked
        owner = asker.uid if asker is not None and asker.uid != 0 else None
        return await events_query.run(self.path, sql, params, self._queries, timeout=timeout,
                                      max_rows=max_rows, owner=owner)


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
