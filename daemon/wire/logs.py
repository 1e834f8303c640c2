"""The `logs` request and its reply: a job's output lines as a node recorded them
(daemon/node/logs.py), read by `monarch-fs logs` (daemon/client/logs.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .replies import MalformedReply
from .requests import RequestError

MAX_ROWS = 50_000  # lines one reply carries; the client asks again after the last id
MAX_GREP = 1000  # characters of a --grep pattern


@dataclass(frozen=True)
class Logs:
    """A job's lines after id `after` (rank, since, grep narrow them; at most `limit`), or,
    with no job, the newest job this node holds lines of (`LogsReply.jobs`)."""

    op: ClassVar[str] = "logs"
    after_chunks: ClassVar[bool] = False
    job: str | None = None
    rank: int | None = None
    grep: str | None = None
    since: float | None = None
    after: int = 0
    limit: int = MAX_ROWS

    @classmethod
    def parse(cls, args: dict) -> Logs:
        job, rank, grep, since = (args.get(k) for k in ("job", "rank", "grep", "since"))
        after, limit = args.get("after", 0), args.get("limit", MAX_ROWS)
        if job is not None and (not isinstance(job, str) or not job or len(job) > 256):
            raise RequestError("logs: job must be a name")
        for name, value in (("rank", rank), ("after", after), ("limit", limit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise RequestError(f"logs: {name} must be a whole number >= 0")
        if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
            raise RequestError("logs: since must be seconds since the epoch")
        if grep is not None:
            if not isinstance(grep, str) or len(grep) > MAX_GREP:
                raise RequestError(f"logs: grep must be a pattern of at most {MAX_GREP} "
                                   "characters")
            try:
                re.compile(grep)
            except re.error as e:
                raise RequestError(f"logs: grep {grep!r} is not a regular expression: {e}"
                                   ) from None
        return cls(job, rank, grep, None if since is None else float(since), after or 0,
                   min(limit or MAX_ROWS, MAX_ROWS))

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in (("job", self.job), ("rank", self.rank), ("grep", self.grep),
                                  ("since", self.since), ("after", self.after),
                                  ("limit", self.limit)) if v is not None}


@dataclass(frozen=True)
class LogsReply:
    """`jobs`: [[job, ts of its last line]] (the newest, when asked without a job); `rows`:
    [[id, ts, rank, restart, stream, line]] in the order the node read them."""

    op: ClassVar[str] = "logs"
    jobs: list[list[Any]]
    rows: list[list[Any]]

    def to_wire(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "rows": self.rows}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> LogsReply:
        if not isinstance(value, Mapping):
            raise MalformedReply(f"malformed logs reply: expected an object, not {value!r}")
        jobs, rows = value.get("jobs"), value.get("rows")
        if not isinstance(jobs, list) or not isinstance(rows, list):
            raise MalformedReply("malformed logs reply: 'jobs' and 'rows' must be lists")
        if not all(isinstance(j, list) and len(j) == 2 and isinstance(j[0], str)
                   and isinstance(j[1], (int, float)) for j in jobs):
            raise MalformedReply("malformed logs reply: a job is not [name, time]")
        if not all(isinstance(r, list) and len(r) == 6 and isinstance(r[0], int)
                   and isinstance(r[5], str) for r in rows):
            raise MalformedReply("malformed logs reply: a row is not [id, ts, rank, restart, "
                                 "stream, line]")
        return cls(jobs, rows)
