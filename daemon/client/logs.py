"""`monarch-fs logs [JOB]`: what every rank of a job printed, read back from every node's
`logs` table (daemon/node/logs.py), in the order it was printed.

Each node answers for the lines its own processes printed, after writing what it still held
in memory (so a job that just ended is all there); the lines of all nodes are merged by time
(a node's own lines keep the order it read them in). Without JOB, the newest job any node
holds lines of. `--follow` asks again every FOLLOW_EVERY seconds for the lines after the last
one each node sent, until interrupted. Under --identity munge each request carries a
credential, and a node answers with the asker's own processes' lines only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TextIO

import trio

from ..wire import identity
from ..wire.logs import MAX_ROWS, Logs, LogsReply
from ..wire.transport import Channel, describe_failure
from .fold import FoldedOutput
from .status import TIMEOUT, ask_each

FOLLOW_EVERY = 1.0  # seconds between two asks of --follow
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class LogsError(ValueError):
    """Nothing to show, or a request that cannot be made; the message says why."""


def parse_since(text: str, now: float | None = None) -> float:
    """`--since`: a time ago (90s, 10m, 2h, 1d) or a date and time (2026-12-06T01:30, local
    time), as seconds since the epoch."""
    now = time.time() if now is None else now
    m = _AGO.fullmatch(text.strip())
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise LogsError(f"--since {text!r}: expected a time ago (90s, 10m, 2h, 1d) or a date "
                        "and time (2026-12-06T01:30)") from None


@dataclass(frozen=True)
class Line:
    ts: float
    host: int  # the node's index in the host list (ties keep its order)
    id: int
    rank: int
    restart: int | None
    stream: str
    text: str


@dataclass
class Fetched:
    """What the nodes sent: lines in printed order, and per node that did not answer, why."""

    lines: list[Line] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


async def _ask(chan: Channel, req: Logs) -> LogsReply:
    args = req.to_wire()
    signed = await identity.sign(chan, "logs", args)  # if the node asks who
    return LogsReply.from_wire(await chan.request("logs", **signed))


async def newest_job(hosts: Sequence[str], token: bytes) -> tuple[str, dict[str, str]]:
    """The job whose last line is the newest on any node, and the nodes that failed."""
    best: tuple[float, str] | None = None
    failed: dict[str, str] = {}

    async def talk(host: str, chan: Channel) -> None:
        nonlocal best
        for job, ts in (await _ask(chan, Logs())).jobs:
            if best is None or ts > best[0]:
                best = (ts, job)

    for host, e in await ask_each(hosts, token, talk):
        if e is not None:
            failed[host] = describe_failure(e, TIMEOUT)
    if best is None:
        why = "; ".join(f"{h}: {w}" for h, w in failed.items())
        raise LogsError("no node holds the output of any job" + (f" ({why})" if why else ""))
    return best[1], failed


async def fetch(hosts: Sequence[str], token: bytes, job: str, *, rank: int | None = None,
                grep: str | None = None, since: float | None = None,
                after: dict[str, int] | None = None) -> Fetched:
    """Every line of `job` the nodes hold (after `after[host]`, which is moved on)."""
    after = {} if after is None else after
    got = Fetched()

    async def talk(host: str, chan: Channel) -> None:
        index = list(hosts).index(host)
        while True:
            reply = await _ask(chan, Logs(job, rank, grep, since, after.get(host, 0)))
            for id_, ts, r, restart, stream, text in reply.rows:
                got.lines.append(Line(ts, index, id_, r, restart, stream, text))
            if reply.rows:
                after[host] = reply.rows[-1][0]
            if len(reply.rows) < MAX_ROWS:
                return

    for host, e in await ask_each(hosts, token, talk, timeout=60.0):
        if e is not None:
            got.failed[host] = describe_failure(e, TIMEOUT)
    got.lines.sort(key=lambda ln: (ln.ts, ln.host, ln.id))
    return got


def show(lines: Sequence[Line], out: TextIO, fold: bool) -> None:
    """Print `lines` as `run` did: folded by the time each was read, or every one."""
    if not fold:  # in one write: a million lines take a second, not ten
        out.write("".join(f"[rank {ln.rank}] {ln.text}\n" for ln in lines))
        out.flush()
        return
    printer = FoldedOutput(out, out)  # one stream: grep and pipes see it all
    for ln in lines:
        printer.lines(ln.rank, ln.stream, [ln.text], at=ln.ts)
    printer.flush()


async def logs(hosts: Sequence[str], token: bytes, job: str | None, *, rank: int | None,
               grep: str | None, since: float | None, follow: bool, fold: bool,
               out: TextIO, err: TextIO) -> int:
    """The `logs` command: print, then with `follow` keep printing; the exit status."""
    if grep is not None:
        try:
            re.compile(grep)
        except re.error as e:
            raise LogsError(f"--grep {grep!r} is not a regular expression: {e}") from None
    failed: dict[str, str] = {}
    if job is None:
        job, failed = await newest_job(hosts, token)
        err.write(f"monarch-fs logs: job {job}\n")
    fold = fold and rank is None  # one rank's lines have nothing to fold
    after: dict[str, int] = {}
    total = 0
    while True:
        got = await fetch(hosts, token, job, rank=rank, grep=grep, since=since, after=after)
        show(got.lines, out, fold)
        total += len(got.lines)
        for host, why in got.failed.items():
            if failed.get(host) != why:
                err.write(f"monarch-fs logs: {host}: {why}\n")
        failed.update(got.failed)
        if not follow:
            break
        await trio.sleep(FOLLOW_EVERY)
    if not total and not failed:
        err.write(f"monarch-fs logs: no lines of job {job}"
                  + (f" from rank {rank}" if rank is not None else "")
                  + (" matching" if grep or since else "") + "\n")
    return 1 if failed or not total else 0  # as grep: 1 when no line was printed
