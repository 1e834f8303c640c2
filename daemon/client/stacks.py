"""`monarch-fs stacks [JOB]`: what every rank of a job is doing now, from every node at once,
with identical stacks folded across ranks.

Each node's daemon dumps its own ranks with py-spy (daemon/node/stacks.py), so this costs one
round trip per node whatever the number of ranks. Without JOB, each node dumps its newest job
and says which jobs it runs; if the nodes disagree, the nodes that did not dump the newest
job of all are asked again for it (a second round trip, only then).

Folding: ranks whose threads have the same frames (function, file, line) print once, under
`ranks 0-2,4-7`; a headline shows where each group is and what differs, in one line: the
innermost frame of its main thread (or of the first thread that differs between groups), and,
where the groups part ways below a common caller, the first frame that differs (`ranks 0-2:
wait_all (train.py:20) | rank 3: read (train.py:9) in load_batch`). A node that cannot dump
some ranks says why in one line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import trio

from ..wire.stacks import Frame, RankDump, StacksReply, Thread
from .status import ask_all

TIMEOUT = 15.0  # seconds a node may take to connect and dump its ranks

# Ask one host for stacks: (host index, request arguments) -> its reply.
Ask = Callable[[int, dict[str, Any]], Awaitable[StacksReply]]


@dataclass
class NodeStacks:
    """One host's answer: its reply, or why there is none."""

    host: str
    reply: StacksReply | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.reply.node if self.reply is not None and self.reply.node else self.host


@dataclass
class Group:
    """Ranks with the same stacks (or the same reason for having none)."""

    ranks: list[int | None]
    nodes: list[str]
    threads: tuple[Thread, ...]
    main: Thread | None


@dataclass
class Report:
    """The dumps of one job from every node."""

    job: str
    nodes: list[NodeStacks]
    seconds: float
    groups: list[Group] = field(default_factory=list)

    def dumps(self) -> list[tuple[str, RankDump]]:
        """(node name, dump) of every rank of the job, by rank."""
        out = [(n.name, d) for n in self.nodes if n.reply is not None and n.reply.job == self.job
               for d in n.reply.dumps]
        return sorted(out, key=lambda nd: (nd[1].rank is None, nd[1].rank or 0))

    def failures(self) -> list[str]:
        """One line per node that did not answer or could not dump some of its ranks."""
        lines = []
        for n in self.nodes:
            if n.error is not None:
                lines.append(f"{n.name}: no stacks: {n.error}")
            elif n.reply is not None and n.reply.job == self.job:
                bad = [d for d in n.reply.dumps if d.error]
                if bad:
                    why = "; ".join(dict.fromkeys(d.error or "" for d in bad))
                    lines.append(f"{n.name}: cannot dump {ranks_text([d.rank for d in bad])} "
                                 f"(pid {', '.join(str(d.pid) for d in bad)}): {why}")
        return lines

    def ok(self) -> bool:
        return bool(self.dumps()) and not self.failures()


def ranks_text(ranks: Sequence[int | None]) -> str:
    """`rank 3`, `ranks 0-2,4-7`."""
    known = sorted(r for r in ranks if r is not None)
    parts: list[str] = []
    i = 0
    while i < len(known):
        j = i
        while j + 1 < len(known) and known[j + 1] == known[j] + 1:
            j += 1
        parts.append(str(known[i]) if i == j else f"{known[i]}-{known[j]}")
        i = j + 1
    if len(known) < len(ranks):
        parts.append("?")
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def fold(dumps: list[tuple[str, RankDump]]) -> list[Group]:
    """Group ranks whose threads have the same frames; dumps that failed are left out (see
    Report.failures)."""
    groups: dict[tuple, Group] = {}
    for node, d in dumps:
        if d.error:
            continue
        key = tuple(t.key() for t in d.threads)
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group([], [], d.threads, d.main_thread())
        g.ranks.append(d.rank)
        if node not in g.nodes:
            g.nodes.append(node)
    return sorted(groups.values(), key=lambda g: (-len(g.ranks), min(
        (r for r in g.ranks if r is not None), default=0)))


def _python(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """The Python frames (with --native, the C ones come between them), if any."""
    py = tuple(f for f in frames if f.line > 0 or f.file.endswith(".py"))
    return py or frames


def telling(groups: list[Group]) -> list[Thread | None]:
    """Per group, the thread that tells the groups apart: the first one (main first) whose
    frames differ between groups (an actor's endpoint runs in a thread of its own); else the
    main thread."""
    if len(groups) > 1:
        for name in dict.fromkeys(t.name for g in groups for t in g.threads):
            frames = {next((t.frames for t in g.threads if t.name == name), None)
                      for g in groups}
            if len(frames) > 1:
                return [next((t for t in g.threads if t.name == name), g.main) for g in groups]
    return [g.main for g in groups]


def headline(groups: list[Group]) -> str:
    """Where each group is (in the thread that tells them apart), and the first function in
    which it differs from the others below their common callers: the outermost such frame in
    the callers' own file (the user's code, not a library's decorator) when it is not the
    innermost frame itself."""
    outer = [list(reversed(_python(t.frames))) if t is not None else []
             for t in telling(groups)]
    common = 0
    if len(outer) > 1:
        while all(len(o) > common for o in outer) and len(
                {(o[common].name, o[common].file) for o in outer}) == 1:
            common += 1
    parts = []
    for g, frames in zip(groups, outer):
        if not frames:
            parts.append(f"{ranks_text(g.ranks)}: no Python frames")
            continue
        inner = frames[-1]
        text = str(inner)
        if len(groups) > 1 and 0 < common < len(frames) - 1:
            own = [f for f in frames[common:-1] if f.file == frames[common - 1].file]
            if own:
                text += f" in {own[0].name}"
        parts.append(f"{ranks_text(g.ranks)}: {text}")
    return " | ".join(parts)


def render(report: Report) -> str:
    dumps = report.dumps()
    nodes = {n for n, _ in dumps}
    out = [f"job {report.job}: {len(dumps)} rank{'s' * (len(dumps) != 1)} on {len(nodes)} "
           f"node{'s' * (len(nodes) != 1)}, dumped in {report.seconds:.2f} s"]
    if report.groups:
        out.append(headline(report.groups))
    for g in report.groups:
        out.append(f"\n{ranks_text(g.ranks)} ({', '.join(g.nodes)}):")
        for t in g.threads:
            out.append(f"  Thread {t.name} ({'active' if t.active else 'idle'})")
            out.extend(f"    {f}" for f in t.frames)
    fails = report.failures()
    if fails:
        out.append("")
        out.extend(fails)
    return "\n".join(out) + "\n"


def to_json(report: Report) -> dict[str, Any]:
    def thread(t: Thread, with_id: bool) -> dict[str, Any]:
        return {"name": t.name, **({"id": t.id} if with_id else {}), "active": t.active,
                "frames": [{"name": f.name, "file": f.file, "line": f.line} for f in t.frames]}

    return {
        "job": report.job, "seconds": round(report.seconds, 3),
        "summary": headline(report.groups) if report.groups else "",
        "groups": [{"ranks": g.ranks, "nodes": g.nodes,
                    "threads": [thread(t, False) for t in g.threads]} for g in report.groups],
        "ranks": [{"rank": d.rank, "node": n, "pid": d.pid, "error": d.error,
                   "threads": [thread(t, True) for t in d.threads]}
                  for n, d in report.dumps()],
        "errors": report.failures(),
    }


async def collect(hosts: Sequence[str], ask: Ask, job: str = "", native: bool = False,
                  hang: str = "") -> Report:
    """Every host's dumps of `job` (default: the newest job any host runs for the asker)."""
    start = time.monotonic()
    nodes = [NodeStacks(h) for h in hosts]

    async def one(i: int, args: dict[str, Any]) -> None:
        try:
            with trio.fail_after(TIMEOUT):
                nodes[i].reply, nodes[i].error = await ask(i, args), None
        except trio.TooSlowError:
            nodes[i].error = f"did not answer within {TIMEOUT:g} s"
        except Exception as e:
            nodes[i].error = str(e).removeprefix(f"{hosts[i]}: ") or type(e).__name__

    async def each(which: list[int], args: dict[str, Any]) -> None:
        async with trio.open_nursery() as nursery:
            for i in which:
                nursery.start_soon(one, i, args)

    args = {"job": job, "native": native, "hang": hang}
    await each(list(range(len(hosts))), args)
    if not job:  # the newest job of all: the one with the youngest process
        seen = [s for n in nodes if n.reply is not None for s in n.reply.jobs]
        job = min(seen, key=lambda s: s.age).job if seen else ""
        again = [i for i, n in enumerate(nodes) if n.reply is not None and n.reply.job != job
                 and any(s.job == job for s in n.reply.jobs)]
        if again:
            await each(again, {**args, "job": job})
    report = Report(job, nodes, time.monotonic() - start)
    report.groups = fold(report.dumps())
    return report


def connecting(hosts: Sequence[str], token: bytes) -> Ask:
    """An Ask over a fresh connection per request (status.ask_all: with a MUNGE credential
    where the node asks who is asking)."""
    async def ask(i: int, args: dict[str, Any]) -> StacksReply:
        [(_, reply)] = await ask_all([hosts[i]], token, "stacks", StacksReply.from_wire,
                                     **args)
        if isinstance(reply, Exception):
            raise reply
        return reply
    return ask


async def stacks(hosts: Sequence[str], token: bytes, job: str = "", *, native: bool = False,
                 as_json: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr
                 ) -> int:
    """Print the folded stacks of `job`; 0 if every rank was dumped, else 1."""
    report = await collect(hosts, connecting(hosts, token), job, native)
    if not report.dumps():
        running = sorted({s.job for n in report.nodes if n.reply is not None
                          for s in n.reply.jobs})
        refused = any(n.error is not None for n in report.nodes)
        what = (f"no stacks of job {job}" if refused else f"job {job} runs on no node") \
            if job else "no job runs on any node"
        print(f"monarch-fs stacks: {what}" + (f" (running: {', '.join(running)})"
                                              if running else ""), file=err)
        for n in report.nodes:
            if n.error is not None:
                print(f"{n.name}: {n.error}", file=err)
        if as_json:
            out.write(json.dumps(to_json(report)) + "\n")
        return 1
    out.write(json.dumps(to_json(report)) + "\n" if as_json else render(report))
    out.flush()
    return 0 if report.ok() else 1
