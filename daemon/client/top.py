"""`monarch-fs top`: a live view of every node: the version each workspace serves, how fast the
mount reads and how much of it the chunk cache answers, what is being pushed to it, and the
processes it runs.

Each refresh asks every node for its counters at once (the `stats` request: cheap, nothing read
from disk) and shows the difference from the refresh before, per second of the node's own
clock. A node that does not answer is a line saying why; the others go on. On a terminal the
view is redrawn in place; `--once` prints one view (rates over one interval), `--json` one JSON
object per view, for scripts and tests.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import trio

from ..wire.telemetry_calls import StatsReply
from .progress import fmt_bytes
from .status import ask_all

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


@dataclass(frozen=True)
class NodeLine:
    """One node's line of the view; rates are per second over the last interval (None on the
    first view of a node, or when it served nothing)."""

    host: str
    node: str = ""
    versions: dict[str, str] | None = None  # workspace -> current version (12 hex digits)
    read_bytes_s: float | None = None
    requests_s: float | None = None
    hit_rate: float | None = None  # decoded-chunk cache hits / lookups, over the interval
    busy: float | None = None  # share of the interval the mount's handlers ran
    received_bytes_s: float | None = None  # pushed to this node
    procs: list[dict[str, Any]] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def lines(hosts: Sequence[str], before: dict[str, StatsReply],
          now: dict[str, StatsReply | Exception]) -> list[NodeLine]:
    """The view from two rounds of `stats` replies (`before` may lack a node)."""
    out = []
    for host in hosts:
        cur = now[host]
        if isinstance(cur, Exception):
            out.append(NodeLine(host, error=str(cur).removeprefix(f"{host}: ")
                                or type(cur).__name__))
            continue
        versions = {n: v[:12] for n, v in sorted(cur.workspaces.items())}
        prev = before.get(host)
        dt = cur.time - prev.time if prev is not None else 0.0
        if prev is None or dt <= 0 or cur.uptime < prev.uptime:  # first look, or restarted
            out.append(NodeLine(host, cur.node, versions, procs=cur.procs))
            continue
        r, p = cur.reads, prev.reads
        requests = sum(r["ops"].values()) - sum(p["ops"].values())
        lookups = (r["hits"] - p["hits"]) + (r["misses"] - p["misses"])
        out.append(NodeLine(
            host, cur.node, versions,
            read_bytes_s=(r["bytes"] - p["bytes"]) / dt, requests_s=requests / dt,
            hit_rate=(r["hits"] - p["hits"]) / lookups if lookups else None,
            busy=(r["busy_ns"] - p["busy_ns"]) / 1e9 / dt,
            received_bytes_s=(cur.received - prev.received) / dt, procs=cur.procs))
    return out


def render(view: list[NodeLine], interval: float) -> str:
    """The view as a table, a line per node."""
    head = ["HOST", "NODE", "VERSION", "READ/s", "REQ/s", "HIT%", "BUSY%", "PUSH/s", "PROCS"]
    rows = []
    for n in view:
        if n.error is not None:
            rows.append([n.host, "UNREACHABLE", n.error, "", "", "", "", "", ""])
            continue
        ranks = sorted(p["rank"] for p in n.procs or [] if p.get("rank") is not None)
        procs = str(len(n.procs or []))
        if ranks:
            procs += f" (ranks {','.join(map(str, ranks[:8]))}{'...' if len(ranks) > 8 else ''})"
        rows.append([
            n.host, n.node,
            " ".join(f"{w}={v}" for w, v in (n.versions or {}).items()) or "-",
            _rate(n.read_bytes_s), "-" if n.requests_s is None else f"{n.requests_s:.0f}",
            "-" if n.hit_rate is None else f"{100 * n.hit_rate:.0f}",
            "-" if n.busy is None else f"{100 * n.busy:.0f}",
            _rate(n.received_bytes_s), procs])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return (f"monarch-fs top: {len(view)} nodes, every {interval:g} s (Ctrl-C stops)\n"
            + "\n".join(text) + "\n")


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{fmt_bytes(int(v))}"


async def sample(hosts: Sequence[str], token: bytes) -> dict[str, StatsReply | Exception]:
    return dict(await ask_all(hosts, token, "stats", StatsReply.from_wire))


async def top(hosts: Sequence[str], token: bytes, *, interval: float = 1.0,
              once: bool = False, as_json: bool = False, out: TextIO = sys.stdout) -> int:
    """Show the view every `interval` seconds until cancelled (or once); 1 if a node did not
    answer the last view, else 0."""
    before: dict[str, StatsReply] = {}
    first = True
    tty = out.isatty() and not as_json
    while True:
        now = await sample(hosts, token)
        if not (once and first):
            view = lines(hosts, before, now)
            if as_json:
                out.write(json.dumps([n.to_json() for n in view]) + "\n")
            else:
                out.write((CLEAR if tty else "") + render(view, interval)
                          + ("" if tty or once else "\n"))
            out.flush()
            if once:
                return 0 if all(n.error is None for n in view) else 1
        before = {h: r for h, r in now.items() if isinstance(r, StatsReply)}
        first = False
        await trio.sleep(interval)
