"""The read-only queries `monarch-fs query` sends a node, over its telemetry database
(events.py): whatever a token holder sends, a query reads and nothing else, sees only the rows
its asker may see, ends at its time, and holds at most its reply's bound. Every rule here is
about the database, not one table: a table added beside `events` (logs, stacks...) gets them
all, and says in OWNERS which column names the user a row belongs to.

- Reading only: the connection is opened read-only (`mode=ro`) and an authorizer allows
  SELECT, column reads and the functions of FUNCTIONS, nothing else (no write, ATTACH, pragma,
  temp table, extension). Functions outside FUNCTIONS are refused by name: `fts3_tokenizer`
  answers a memory address, `load_extension` loads code, the FTS and R-tree helpers read
  internals, `json_patch` is quadratic.
- Time: at the deadline a trio task calls the connection's `interrupt()` from outside the
  worker thread, so a statement stops whatever it is doing, between two steps of SQLite's VM;
  the same happens when the daemon stops (its cancellation), so SIGTERM is not kept waiting.
  A single function call cannot be interrupted, so none may be long: values are at most
  MAX_VALUE_BYTES, LIKE and GLOB patterns at most MAX_PATTERN_CHARS, and the built-ins whose
  time grows with the product of their arguments' lengths (instr, replace, trim, ltrim,
  rtrim: 5 minutes for one ltrim of 1 MiB) are replaced by linear ones (LINEAR).
- Memory: SQLite's sorts and temporary b-trees stay in memory, within MAX_HEAP_BYTES for
  the whole process; each value of the answer costs its size in the reply's JSON plus
  CELL_COST (an empty string is not free: 200,000 rows of 500 empty strings held 1.4 GB), and
  the rows are counted one at a time, so one error ("the answer is larger than this node
  sends") comes before the bound is passed, not after; 48 MiB so counted always fits an 80
  MiB frame.
- Privacy (--identity munge): a query is signed, and an asker who is not root reads a table
  of OWNERS through a view of the same name that holds their rows and the node's own (owner
  NULL); the authorizer refuses a read of the table itself (`main.events`) outside that view.
"""

from __future__ import annotations

import re
import sqlite3
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_string  # the wire's own (frames.py)
from pathlib import Path
from typing import Any

import trio

from ..wire.requests import RequestError

QUERY_TIMEOUT = 10.0  # seconds a query may run on a node
MAX_ROWS = 200_000  # rows one node returns for one query
MAX_REPLY_BYTES = 48 << 20  # what the rows cost (their bytes, CELL_COST a value); frames: 80 MiB
CELL_COST = 16  # bytes a value costs besides its JSON: its slot in the row, its separators
MAX_VALUE_BYTES = 256 << 10  # the longest string or blob a query may make (SQLITE_LIMIT_LENGTH)
MAX_COLUMNS = 100  # of a result (SQLITE_LIMIT_COLUMN)
MAX_PATTERN_CHARS = 1000  # of a LIKE or GLOB pattern (its time is the product of the lengths)
# All the memory SQLite may hold in this process (hard_heap_limit: the events writer's too,
# which needs a few MiB). A query's sorts, DISTINCTs and temporary b-trees stay in memory
# (temp_store = MEMORY), so they count here instead of filling temporary files (8 s of a
# sort wrote 880 MB of them).
MAX_HEAP_BYTES = 256 << 20

# Table -> the column holding the uid a row belongs to (NULL: the node's own, everyone's).
# Under --identity munge a non-root asker reads only their rows and the node's own.
OWNERS: dict[str, str] = {"events": "uid", "stacks": "uid", "logs": "uid"}

# Functions a query may call: SQLite's core scalar, aggregate, window, date, math and JSON
# functions; nothing that reads internals or pointers, loads code, or is quadratic.
FUNCTIONS = frozenset("""
abs char coalesce concat concat_ws format glob hex ifnull iif instr length like likelihood
likely lower ltrim max min nullif octet_length printf quote random randomblob replace round
rtrim sign soundex substr substring trim typeof unhex unicode unlikely upper zeroblob
avg count group_concat string_agg sum total
cume_dist dense_rank first_value lag last_value lead nth_value ntile percent_rank rank
row_number
date time datetime julianday strftime unixepoch timediff current_date current_time
current_timestamp
acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10
log2 mod pi pow power radians sin sinh sqrt tan tanh trunc
json json_array json_array_length json_extract json_insert json_object json_quote
json_remove json_replace json_set json_type json_valid json_group_array json_group_object
-> ->> sqlite_version
""".split())
_READING = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ,
                      getattr(sqlite3, "SQLITE_RECURSIVE", 33)})


@dataclass(frozen=True)
class Answer:
    """A query's result on one node."""

    columns: list[str]
    rows: list[list[Any]]


async def run(path: Path, sql: str, params: Mapping[str, Any] | Sequence[Any],
              limiter: trio.CapacityLimiter, *, timeout: float = QUERY_TIMEOUT,
              max_rows: int = MAX_ROWS, owner: int | None = None) -> Answer:
    """Run one read-only statement over the database at `path` (see the module docstring),
    at most `limiter`'s number at once; with `owner` (a uid), the tables of OWNERS show that
    user's rows only. RequestError saying why one is refused: not a read, too slow, too
    large, an SQL error."""
    async with limiter:
        db, auth = await trio.to_thread.run_sync(_connect, path, owner)
        done = False

        async def interrupt_at_deadline() -> None:
            try:
                await trio.sleep(timeout)
            finally:  # the deadline, or the daemon stopping (cancelled): stop the statement
                if not done:
                    db.interrupt()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(interrupt_at_deadline)
                # a refusal comes back as a value: raised in a nursery, it would be a group
                got = await trio.to_thread.run_sync(_capture, db, auth, sql, params, timeout,
                                                    max_rows)
                done = True
                nursery.cancel_scope.cancel()
        finally:
            done = True
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(db.close)
    if isinstance(got, RequestError):
        raise got
    return got


def _connect(path: Path, owner: int | None) -> tuple[sqlite3.Connection, _Authorizer]:
    uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
    db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        db.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
        db.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_PATTERN_CHARS)
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        db.execute("PRAGMA temp_store = MEMORY")
        db.execute(f"PRAGMA hard_heap_limit = {MAX_HEAP_BYTES}")
        for name, nargs, fn in LINEAR:
            db.create_function(name, nargs, fn, deterministic=True)
        owned = _owned_tables(db)
        if owner is not None:  # before the authorizer, which allows no CREATE
            for table in owned:
                column = OWNERS[table]
                db.execute(f'CREATE TEMP VIEW "{table}" AS SELECT * FROM main."{table}" '
                           f'WHERE "{column}" IS NULL OR "{column}" = {int(owner)}')
        auth = _Authorizer(owned if owner is not None else set())
        db.set_authorizer(auth)
    except BaseException:
        db.close()
        raise
    return db, auth


def _owned_tables(db: sqlite3.Connection) -> set[str]:
    names = {r[0] for r in db.execute("SELECT name FROM main.sqlite_schema WHERE type = 'table'")}
    return {t for t in OWNERS if t in names}


class _Authorizer:
    """Reading only, the functions of FUNCTIONS, and the `restricted` tables through the
    asker's views only; what it denied last, for the error."""

    def __init__(self, restricted: set[str]) -> None:
        self.restricted = restricted
        self.denied = ""

    def __call__(self, action: int, arg1: str | None, arg2: str | None, schema: str | None,
                 inside: str | None) -> int:
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in FUNCTIONS:
                return sqlite3.SQLITE_OK
            self.denied = f"function {arg2}"
        elif action not in _READING:
            self.denied = ""
        elif action == sqlite3.SQLITE_READ and arg1 in self.restricted and schema == "main" \
                and inside != arg1:  # the table itself, not through the asker's view
            self.denied = f"table main.{arg1}"
        else:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY


def _capture(db: sqlite3.Connection, auth: _Authorizer, sql: str,
             params: Mapping[str, Any] | Sequence[Any], timeout: float,
             max_rows: int) -> Answer | RequestError:
    try:
        return _rows(db, auth, sql, params, timeout, max_rows)
    except RequestError as e:
        return e


def _rows(db: sqlite3.Connection, auth: _Authorizer, sql: str,
          params: Mapping[str, Any] | Sequence[Any], timeout: float, max_rows: int) -> Answer:
    """The statement's rows, counted one at a time against the bounds (worker thread)."""
    try:
        cur = db.execute(sql, params)
        columns = [d[0] for d in cur.description or ()]
        rows: list[list[Any]] = []
        size = 0
        for row in cur:
            out = [v.hex() if isinstance(v, bytes) else v for v in row]
            size += _cost(out)
            rows.append(out)
            if len(rows) > max_rows or size > MAX_REPLY_BYTES:
                raise RequestError(
                    f"query: the answer is larger than this node sends (more than "
                    f"{max_rows:,} rows or {MAX_REPLY_BYTES >> 20} MiB; values count "
                    f"{CELL_COST} bytes each besides their own): narrow it with WHERE or "
                    "fewer columns, or aggregate")
        return Answer(columns, rows)
    except MemoryError:  # SQLite's own bound (MAX_HEAP_BYTES), or this process's
        raise RequestError(f"query: it needs more than the {MAX_HEAP_BYTES >> 20} MiB a node's "
                           "queries may hold (a sort or DISTINCT over too many rows): narrow "
                           "it with WHERE, or aggregate") from None
    except (sqlite3.Error, OverflowError) as e:  # OverflowError: a parameter past 64 bits
        raise RequestError(_why(str(e), auth.denied, timeout)) from None


def _cost(row: list[Any]) -> int:
    """At least the row's size in the reply's JSON: a string as encoded (escapes included:
    a control character or a non-ASCII one takes 6 bytes there), a number at most 24."""
    size = CELL_COST * (len(row) + 1)
    for v in row:
        if isinstance(v, str):
            size += len(_json_string(v))
        elif isinstance(v, (int, float)):
            size += 8
    return size


def _why(why: str, denied: str, timeout: float) -> str:
    if why == "interrupted":
        return f"query: stopped after {timeout:g} s"
    if why.startswith("not authorized") or "prohibited" in why:
        if denied.startswith("function "):
            return (f"query refused: {denied} is not allowed here (SQLite's core, date, math "
                    "and JSON functions are; none that reads internals or addresses)")
        if denied.startswith("table "):
            return (f"query refused: {denied} is not read directly here: this node acts for "
                    f"each user (--identity munge), and `{denied[len('table main.'):]}` alone "
                    "holds the rows you may read")
        return ("query refused: only reading statements run here (SELECT); events cannot be "
                "changed or deleted")
    if "too big" in why:
        return (f"query: {why} (a value here is at most {MAX_VALUE_BYTES >> 10} KiB, a LIKE "
                f"or GLOB pattern {MAX_PATTERN_CHARS} characters)")
    if "too many columns" in why:
        return f"query: {why} (at most {MAX_COLUMNS} here)"
    if "readonly" in why or "read-only" in why:
        return f"query refused: {why}"
    return f"query: {why}"


# ---- linear replacements of the built-ins whose time is the product of two lengths -----------

def _text(v: Any) -> Any:
    if v is None or isinstance(v, (str, bytes)):
        return v
    return str(v)


def _instr(haystack: Any, needle: Any) -> int | None:
    h, n = _text(haystack), _text(needle)
    if h is None or n is None:
        return None
    if isinstance(h, bytes) and isinstance(n, bytes):  # SQLite: bytes of two blobs
        return h.find(n) + 1
    h = h.decode("utf-8", "replace") if isinstance(h, bytes) else h
    n = n.decode("utf-8", "replace") if isinstance(n, bytes) else n
    return h.find(n) + 1


def _replace(x: Any, old: Any, new: Any) -> Any:
    if x is None or old is None or new is None:
        return None
    old_t = _str(old)
    if old_t == "":
        return _str(x) if isinstance(x, bytes) else x  # SQLite: as it was, a blob as text
    return _str(x).replace(old_t, _str(new))


def _str(v: Any) -> str:
    v = _text(v)
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _trimmer(left: bool, right: bool) -> Any:
    def trim(x: Any, chars: Any = " ") -> Any:
        if x is None or chars is None:
            return None
        x, chars = _str(x), _str(chars)  # SQLite trims text, a blob's bytes read as text
        charset = "".join(set(chars))
        if len(charset) <= 64:  # strip() scans the set per character: fine while it is small
            return x.strip(charset) if left and right else (
                x.lstrip(charset) if left else x.rstrip(charset))
        run = re.compile("[" + re.escape(charset) + "]+")  # a match from the start: linear
        if left and (m := run.match(x)):
            x = x[m.end():]
        if right and (m := run.match(x[::-1])):
            x = x[:len(x) - m.end()]
        return x
    return trim


LINEAR = [("instr", 2, _instr), ("replace", 3, _replace)] + [
    (name, n, _trimmer(left, right)) for name, left, right in (
        ("trim", True, True), ("ltrim", True, False), ("rtrim", False, True)) for n in (1, 2)]
