"""Every line the node's processes printed, as rows of a `logs` table in the node's events
database (events.py): what `monarch-fs logs` reads after the fact, and what `monarch-fs query`
can count, group and search like any other telemetry.

Recording never blocks the process that prints: the supervisor (procs.py) hands each batch of
lines it read from a pipe to `LogLines.add`, which appends to a list in memory and returns;
EventLog's writer takes them at its next interval and writes them in the same transaction as
the events. Past MAX_PENDING_LINES waiting lines, new ones are dropped and counted (a
`logs.dropped` event says how many), so a process printing faster than the disk takes it
costs lines, never its own progress. The table is kept within the events' age and size bounds
(events.py's retention covers every table).

Who may read them: the token's holder, on a daemon without --identity; under --identity munge
each row carries the uid the process ran as, `monarch-fs logs` is answered with the asker's
rows only (a job of another user is refused, naming whose it is), and `monarch-fs query`
may not read the table at all (EventLog.hidden).
"""

from __future__ import annotations

import collections
import functools
import re
import sqlite3
import time
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from ..wire.identity import Identity
from ..wire.logs import MAX_ROWS, Logs, LogsReply
from ..wire.requests import RequestError
from ..wire.telemetry_tables import LOG_COLUMNS

INSERT = (f"INSERT INTO logs ({', '.join(LOG_COLUMNS)}) VALUES "
          f"({', '.join('?' * len(LOG_COLUMNS))})")
MAX_PENDING_LINES = 200_000  # lines held in memory for the next write; more are dropped
MAX_LINE_CHARS = 16 * 1024
READ_TIMEOUT = 10.0


class Printed(Protocol):
    """What a line's row says of the process that printed it (procs.RunningProcess)."""

    id: int
    job: str
    rank: int | None
    restart: int | None
    uid: int | None


class LogLines:
    """Lines waiting for the events database's next write."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._pending: collections.deque[tuple] = collections.deque()
        self.dropped = 0

    def add(self, proc: Printed, stream: str, lines: list[str]) -> None:
        """Keep `lines` for the next write: never waits (see the module docstring)."""
        room = MAX_PENDING_LINES - len(self._pending)
        if room < len(lines):
            self.dropped += len(lines) - max(room, 0)
            lines = lines[:max(room, 0)]
        now = time.time()
        job = proc.job or None
        for line in lines:
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS]
            self._pending.append((now, self.node, job, proc.rank, proc.restart, proc.id,
                                  proc.uid, stream, line))  # (decoded with "replace")

    def take(self) -> tuple[list[tuple], int]:
        """The rows to write now and how many lines were dropped since the last take."""
        rows = list(self._pending)
        self._pending.clear()
        dropped, self.dropped = self.dropped, 0
        return rows, dropped

    def put_back(self, rows: list[tuple]) -> None:
        """Rows a failed write could not store: first in line for the next (within bounds)."""
        room = MAX_PENDING_LINES - len(self._pending)
        if room < len(rows):
            self.dropped += len(rows) - max(room, 0)
            rows = rows[:max(room, 0)]
        self._pending.extendleft(reversed(rows))


@functools.lru_cache(maxsize=16)
def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text)


def _regexp(pattern: str, value: Any) -> bool:
    return isinstance(value, str) and _pattern(pattern).search(value) is not None


def read(path: Path, req: Logs, asker: Identity | None) -> LogsReply:
    """Answer a `logs` request from the database at `path` (a worker thread): the newest job
    when `req.job` is None, else that job's rows after `req.after`. Under --identity munge
    (`asker` is who asks), only the asker's: a job that is another user's is refused."""
    uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
    db = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        deadline = time.monotonic() + READ_TIMEOUT
        db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        db.create_function("regexp", 2, _regexp, deterministic=True)
        uid = None if asker is None or asker.uid == 0 else asker.uid  # root reads all
        try:
            if req.job is None:
                where, args = ("WHERE job IS NOT NULL", []) if uid is None else (
                    "WHERE job IS NOT NULL AND uid = ?", [uid])
                row = db.execute(f"SELECT job, ts FROM logs {where} ORDER BY id DESC LIMIT 1",
                                 args).fetchone()
                return LogsReply(jobs=[[row[0], row[1]]] if row else [], rows=[])
            if uid is not None:
                owner = db.execute("SELECT uid FROM logs WHERE job = ? LIMIT 1",
                                   (req.job,)).fetchone()
                if owner is not None and owner[0] != uid:
                    raise RequestError(
                        f"logs: job {req.job} ran as uid {owner[0]}, not as you (uid {uid}): "
                        "under --identity munge a user reads their own processes' output "
                        "only")
            clauses, params = ["job = ?", "id > ?"], [req.job, req.after]
            if req.rank is not None:
                clauses.append("rank = ?")
                params.append(req.rank)
            if req.since is not None:
                clauses.append("ts >= ?")
                params.append(req.since)
            if req.grep is not None:
                clauses.append("line REGEXP ?")
                params.append(req.grep)
            if uid is not None:
                clauses.append("uid = ?")
                params.append(uid)
            rows = db.execute(
                "SELECT id, ts, rank, restart, stream, line FROM logs WHERE "
                f"{' AND '.join(clauses)} ORDER BY id LIMIT ?",
                [*params, min(req.limit, MAX_ROWS)]).fetchall()
        except sqlite3.OperationalError as e:
            if str(e) == "interrupted":
                raise RequestError(f"logs: stopped after {READ_TIMEOUT:g} s; narrow it with "
                                   "--rank, --since or --grep") from None
            if "no such table" in str(e):  # a daemon that has recorded nothing yet
                return LogsReply(jobs=[], rows=[])
            raise RequestError(f"logs: {e}") from None
        return LogsReply(jobs=[], rows=[list(r) for r in rows])
    finally:
        db.close()
