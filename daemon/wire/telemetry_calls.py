"""The telemetry requests (query, stats) and their replies: what `monarch-fs query` and `top`
ask of a node's events database and live figures (daemon/node/events.py answers).

Apart from requests.py and replies.py, which hold what a push asks and the node's status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .replies import MalformedReply, number_field, typed_field
from .requests import NoArguments, RequestError

MAX_QUERY_CHARS = 64 * 1024
MAX_QUERY_SECONDS = 60.0


@dataclass(frozen=True)
class Query:
    """Run one read-only SQL statement over this node's events (daemon/node/events.py) and
    answer its rows: what `monarch-fs query` sends each node, after taking out of the user's
    query what every node can do alone (daemon/client/query.py). `params` binds named
    parameters (`:host` is how the controller names the node); `timeout` bounds its run."""

    op: ClassVar[str] = "query"
    after_chunks: ClassVar[bool] = False
    sql: str
    params: dict = field(default_factory=dict)
    timeout: float = 10.0

    @classmethod
    def parse(cls, args: dict) -> Query:
        sql = args.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise RequestError("query: sql must be a statement")
        if len(sql) > MAX_QUERY_CHARS:
            raise RequestError(f"query: sql is longer than {MAX_QUERY_CHARS} characters")
        params = args.get("params", {})
        if not isinstance(params, dict) or not all(
                isinstance(k, str) and (v is None or isinstance(v, (str, int, float)))
                for k, v in params.items()):
            raise RequestError("query: params must map names to strings or numbers")
        timeout = args.get("timeout", 10.0)
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout <= MAX_QUERY_SECONDS):
            raise RequestError(f"query: timeout must be 0 to {MAX_QUERY_SECONDS:g} seconds, "
                               f"not {timeout!r}")
        return cls(sql, dict(params), float(timeout))


@dataclass(frozen=True)
class Stats(NoArguments):
    """This node's live figures for `monarch-fs top`: what it serves, what the mount has
    served so far, what it received, its running processes."""

    op: ClassVar[str] = "stats"
    after_chunks: ClassVar[bool] = False




@dataclass(frozen=True)
class QueryReply:
    """A query's result on one node: column names and rows (lists of JSON scalars; blobs as
    hex)."""

    op: ClassVar[str] = "query"
    columns: list[str]
    rows: list[list[Any]]

    def to_wire(self) -> dict[str, Any]:
        return {"columns": self.columns, "rows": self.rows}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> QueryReply:
        columns = typed_field(cls.op, value, "columns", list)
        rows = typed_field(cls.op, value, "rows", list)
        if not all(isinstance(c, str) for c in columns):
            raise MalformedReply(f"malformed {cls.op} reply: 'columns' holds a non-string")
        scalar = (str, int, float, type(None))
        if not all(isinstance(r, list) and len(r) == len(columns)
                   and all(isinstance(v, scalar) for v in r) for r in rows):
            raise MalformedReply(f"malformed {cls.op} reply: a row is not {len(columns)} "
                                 "scalars")
        return cls(list(columns), rows)


@dataclass(frozen=True)
class StatsReply:
    """A node's live figures (`monarch-fs top`): `reads` is the mount's cumulative counters
    (SnapshotFS.read_counters), `received` the bytes pushed to it so far, `procs` its running
    processes (proc, pid, rank, argv, seconds), `workspaces` the current version of each."""

    op: ClassVar[str] = "stats"
    node: str
    time: float  # the node's clock when it answered
    uptime: float
    workspaces: dict[str, str]
    reads: dict[str, Any]
    received: int
    procs: list[dict[str, Any]]

    def to_wire(self) -> dict[str, Any]:
        return {"node": self.node, "time": self.time, "uptime": self.uptime,
                "workspaces": self.workspaces, "reads": self.reads, "received": self.received,
                "procs": self.procs}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> StatsReply:
        op = cls.op
        reads = typed_field(op, value, "reads", dict)
        for key in ("bytes", "hits", "misses", "busy_ns", "disk_ns"):
            typed_field(op, reads, key, int)
        ops = typed_field(op, reads, "ops", dict)
        if not all(isinstance(k, str) and isinstance(v, int) for k, v in ops.items()):
            raise MalformedReply(f"malformed {op} reply: 'ops' is {ops!r}")
        workspaces = typed_field(op, value, "workspaces", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in workspaces.items()):
            raise MalformedReply(f"malformed {op} reply: 'workspaces' is {workspaces!r}")
        procs = typed_field(op, value, "procs", list)
        if not all(isinstance(p, dict) for p in procs):
            raise MalformedReply(f"malformed {op} reply: 'procs' is {procs!r}")
        return cls(typed_field(op, value, "node", str), number_field(op, value, "time"),
                   number_field(op, value, "uptime"), dict(workspaces), dict(reads),
                   typed_field(op, value, "received", int), list(procs))
