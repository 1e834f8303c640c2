"""`monarch-fs query "SQL"`: one SQL statement over the telemetry of every node (the `events`
and `reads` tables of daemon/node/events.py), answered as one table with a `host` column.

The engine is SQLite on both sides. Each node keeps its events in SQLite (the standard
library: nothing more to install on a node, one file, safe concurrent reads while the daemon
writes, and a read-only mode with an authorizer to enforce it); the controller finishes the
query in an in-memory SQLite database, so the user writes one dialect, and the part a node
runs is the same SQL the controller would run. DuckDB would aggregate faster on the
controller, but after the nodes have done their part the controller holds a few rows per
node: there is nothing left for it to be fast at.

What travels, and what runs where: query_plan.py.

A node that cannot be reached, or refuses, is reported with its cause (never an empty one: a
node that does not answer in time says so); the rest still answer. Under --identity munge each
request carries a MUNGE credential (wire/identity.py): a node shows a user who is not root the
rows of their own processes, and its own.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..wire import identity
from ..wire.telemetry_calls import QueryReply
from ..wire.telemetry_tables import SCHEMA
from .query_plan import Plan, QueryError, check, create_table, plan
from .status import ask_each

__all__ = ["Plan", "QueryError", "Result", "check", "plan", "query", "schema_text"]

NODE_TIMEOUT = 10.0  # seconds a node may spend on its part


@dataclass
class Result:
    """A query's answer: columns and rows, and per host that did not answer, why."""

    columns: list[str]
    rows: list[tuple]
    failed: dict[str, str] = field(default_factory=dict)
    plan: Plan | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"columns": self.columns,
                "rows": [dict(zip(self.columns, r)) for r in self.rows],
                "unreachable": [{"host": h, "error": e} for h, e in self.failed.items()],
                "seconds": self.seconds}


# ---- running ----------------------------------------------------------------------------------

async def query(hosts: Sequence[str], token: bytes, sql: str,
                timeout: float = NODE_TIMEOUT) -> Result:
    """Run `sql` over every host's telemetry: the nodes' parts at once, then the rest here.
    QueryError for a query that cannot run (before any node is asked)."""
    start = time.monotonic()
    p = plan(sql)
    check(p)
    got: dict[str, dict[str, QueryReply]] = {}

    async def talk(host: str, chan: Any) -> None:
        replies = {}
        for table, node_sql in p.nodes.items():
            args = await identity.sign(chan, "query", {"sql": node_sql, "params": {"host": host},
                                                       "timeout": timeout})
            replies[table] = QueryReply.from_wire(await chan.request("query", **args))
        got[host] = replies

    wait = timeout + 5
    failed = {h: _cause(e, wait) for h, e in await ask_each(hosts, token, talk, wait)
              if e is not None}
    columns, rows = await trio.to_thread.run_sync(_finish, p, got, timeout)
    return Result(columns, rows, failed, p, round(time.monotonic() - start, 3))


def _cause(e: Exception, wait: float) -> str:
    """Why a node gave no answer, in words: never empty (a timeout's exception has none)."""
    if isinstance(e, trio.TooSlowError):
        return f"no answer within {wait:g} s (the node is down, stuck or far behind)"
    return str(e) or type(e).__name__


def _finish(p: Plan, got: dict[str, dict[str, QueryReply]], timeout: float
            ) -> tuple[list[str], list[tuple]]:
    """The controller's part: the nodes' rows, `host` first, in an in-memory database, and
    the final query over them."""
    db = sqlite3.connect(":memory:")
    try:
        for table, cols in p.columns.items():
            db.execute(create_table(table, cols))
            marks = ", ".join("?" * (len(cols) + 1))
            for host, replies in got.items():
                db.executemany(f'INSERT INTO "{table}" VALUES ({marks})',
                               ([host, *r] for r in replies[table].rows))
        deadline = time.monotonic() + timeout
        db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        try:
            for name, sql in p.stages:
                db.execute(f'CREATE TABLE "{name}" AS {sql}')
            cur = db.execute(p.final)
        except sqlite3.Error as e:
            raise QueryError(f"query: {e}") from None
        return [d[0] for d in cur.description or ()], cur.fetchall()
    finally:
        db.close()


# ---- output -----------------------------------------------------------------------------------

MAX_CELL = 100  # characters of a cell in the table view (--json and --csv keep all)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e5 else f"{v:.6g}"
    text = str(v).replace("\n", "\\n")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def table(result: Result) -> str:
    """A readable table: a header, a rule, the rows (numbers right-aligned), then a line per
    host that did not answer."""
    cells = [[_cell(v) for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in result.rows)
               for i in range(len(result.columns))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(values, widths, numeric)).rstrip()

    out = [line(result.columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(result.rows)} row{'' if len(result.rows) == 1 else 's'})")
    out += [f"{h}: UNREACHABLE: {e}" for h, e in result.failed.items()]
    return "\n".join(out) + "\n"


def csv_text(result: Result) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(result.columns)
    writer.writerows(result.rows)
    return buf.getvalue()


def json_text(result: Result) -> str:
    return json.dumps(result.to_json())


def schema_text() -> str:
    """`query --schema`: the tables and their columns, as the nodes create them."""
    return SCHEMA.strip() + "\n"
