"""Stacks of the processes this node runs, taken with py-spy (`monarch-fs stacks`, and `run
--hang-timeout` when a job goes quiet).

py-spy reads a process's memory from outside (ptrace / process_vm_readv), so it sees a rank
that is stuck in a C call, a lock or a collective, which no in-process handler could. Every
rank of the job is dumped at once, each by its own `py-spy dump --json` (a tenth of a second
each); a rank that cannot be dumped gets one line saying why, and the others still come back.
Each dump is also a row of the `stacks` table (wire/telemetry_tables.py), and a hang's dumps a
`job.hang` event.

Who may see what: under --identity munge a request carries the asker's credential, and only
processes running as the asker's uid are dumped (a stack shows arguments, file names, what a
process is doing). With the shared token alone every holder is the same user.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..wire.identity import Identity
from ..wire.requests import RequestError
from ..wire.stacks import Frame, JobSeen, RankDump, Stacks, StacksReply, Thread
from .events import EventLog

if TYPE_CHECKING:
    from .procs import ProcessTable, RunningProcess

DUMP_TIMEOUT = 10.0  # seconds one py-spy dump may take
MAX_STACK_CHARS = 64 * 1024  # of a rank's stack in the `stacks` table
PTRACE_HINT = ("ptrace refused (another user's process, a non-dumpable one, or "
               "kernel.yama.ptrace_scope above 0): the daemon needs CAP_SYS_PTRACE, e.g. run it "
               "as root")


def py_spy() -> str | None:
    """The py-spy command: next to this interpreter (the venv monarch-fs runs from), else the
    one the installed py-spy package put in its scripts folder (an interpreter outside the
    venv that imports monarch-fs from it), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(here, os.X_OK):
        return here
    try:
        files = importlib.metadata.distribution("py-spy").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "py-spy" and os.access(path := os.path.normpath(f.locate()), os.X_OK):
            return path
    return shutil.which("py-spy")


def _why(stderr: str, code: int) -> str:
    """py-spy's error, in one line, with what to do about the usual ones."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    first = next((x for x in lines if x.startswith("Error:")), lines[0] if lines else "")
    text = first.removeprefix("Error:").strip() or f"py-spy exited {code}"
    low = text.lower()
    if "permission denied" in low or "operation not permitted" in low:
        return f"py-spy may not read its memory: {PTRACE_HINT}"  # (py-spy says: use sudo)
    if "no such process" in low or "no such file" in low:
        return f"{text} (the process exited)"
    if "python version" in low or "python interpreter" in low:
        return (f"{text} (not a Python process: a wrapper's child is not dumped; exec the "
                "interpreter)")
    return text


def _frame(f: dict) -> Frame:
    name = str(f.get("name") or "?")
    if name.startswith("0x"):  # a native frame without a symbol: its address differs per rank
        name = "?"
    return Frame(name, str(f.get("short_filename") or f.get("filename") or "?"),
                 int(f.get("line") or 0))


def _threads(out: str, pid: int) -> tuple[Thread, ...]:
    """py-spy's JSON, cut down to what folds across ranks: no address, no thread id in a
    name (py-spy does not always learn the names)."""
    threads = []
    for t in json.loads(out):
        tid = int(t.get("os_thread_id") or t.get("thread_id") or 0)
        name = t.get("thread_name") or ("MainThread" if tid == pid else "unnamed")
        threads.append(Thread(str(name), tid, bool(t.get("active")),
                              tuple(_frame(f) for f in t.get("frames") or ())))
    # the main thread first, then by name: the same order on every rank
    return tuple(sorted(threads, key=lambda t: (t.id != pid, t.name, t.frames, t.id)))


async def dump(proc: RunningProcess, native: bool) -> RankDump:
    """One process's stacks, or why not (never raises)."""
    pid = proc.process.pid
    command = py_spy()
    if command is None:
        return RankDump(proc.rank, pid, proc.id, error="py-spy is not installed on this node "
                        "(pip install py-spy, next to monarch-fs)")
    argv = [command, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
    try:
        with trio.fail_after(DUMP_TIMEOUT):
            out = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                         check=False, stdin=b"")
    except trio.TooSlowError:
        return RankDump(proc.rank, pid, proc.id,
                        error=f"py-spy did not answer within {DUMP_TIMEOUT:g} s")
    except OSError as e:
        return RankDump(proc.rank, pid, proc.id, error=f"cannot run {command}: {e}")
    if out.returncode != 0:
        return RankDump(proc.rank, pid, proc.id,
                        error=_why(out.stderr.decode(errors="replace"), out.returncode))
    try:  # (file names need not be UTF-8)
        threads = _threads(out.stdout.decode(errors="replace"), pid)
    except (ValueError, KeyError, TypeError) as e:
        return RankDump(proc.rank, pid, proc.id, error=f"py-spy's output: {e!r}")
    return RankDump(proc.rank, pid, proc.id, threads)


def jobs_seen(procs: list[RunningProcess]) -> dict[str, list[RunningProcess]]:
    """The running processes by job (those with one), newest job first."""
    jobs: dict[str, list[RunningProcess]] = {}
    for p in procs:
        if p.job:
            jobs.setdefault(p.job, []).append(p)
    return dict(sorted(jobs.items(), key=lambda kv: -max(p.started for p in kv[1])))


def visible(table: ProcessTable, asker: Identity | None, job: str) -> list[RunningProcess]:
    """The processes `asker` may see (all, without --identity munge); RequestError if `job`
    runs here but only as someone else."""
    every = list(table.procs.values())
    mine = [p for p in every if asker is None or p.uid == asker.uid]
    if job and asker is not None and not any(p.job == job for p in mine):
        others = sorted({p.uid for p in every if p.job == job and p.uid is not None})
        if others:
            raise RequestError(
                f"stacks: job {job} runs here as uid {', '.join(map(str, others))}, not as "
                f"you (uid {asker.uid}): a user gets the stacks of their own processes only")
    return mine


def show(d: RankDump) -> str:
    """A rank's stack as text: a line per thread, its frames under it, innermost first."""
    out = []
    for t in d.threads:
        out.append(f"Thread {t.id} ({'active' if t.active else 'idle'}): {t.name}")
        out.extend(f"    {f}" for f in t.frames)
    return "\n".join(out)[:MAX_STACK_CHARS]


def top_frame(d: RankDump) -> str | None:
    main = d.main_thread()
    return str(main.frames[0]) if main is not None and main.frames else None


async def take(table: ProcessTable, events: EventLog, node: str, req: Stacks,
               asker: Identity | None) -> StacksReply:
    """Answer a `stacks` request: dump every rank of the job, record the dumps (and the hang),
    and write them at once, so a query right after sees them."""
    procs = visible(table, asker, req.job)
    jobs = jobs_seen(procs)
    now = time.monotonic()
    seen = [JobSeen(j, round(now - max(p.started for p in ps), 3), sorted(
        (p.rank for p in ps), key=lambda r: -1 if r is None else r)) for j, ps in jobs.items()]
    job = req.job or next(iter(jobs), "")
    targets = sorted(jobs.get(job, []), key=lambda p: (p.rank is None, p.rank or 0, p.id))
    dumps: list[RankDump] = [RankDump(p.rank, p.process.pid, p.id) for p in targets]

    async def one(i: int, p: RunningProcess) -> None:
        dumps[i] = await dump(p, req.native)

    async with trio.open_nursery() as nursery:
        for i, p in enumerate(targets):
            nursery.start_soon(one, i, p)
    for d, p in zip(dumps, targets):
        events.add("stacks", job=job, rank=d.rank, pid=d.pid, proc=d.proc,
                   native=int(req.native), hang=req.hang or None, top=top_frame(d),
                   stack=show(d) or None, error=d.error, uid=p.uid)
    if req.hang and dumps:
        events.record("job.hang", text="\n".join(
            f"rank {d.rank}: {top_frame(d) or d.error}" for d in dumps),
            detail={"job": job, "why": req.hang, "ranks": [d.rank for d in dumps]})
    if dumps:
        await events.flush()
    return StacksReply(node, job, seen, dumps)


class _Session(Protocol):
    """What the handler reads of daemon/node/session.py's Session (not imported: it imports
    this module)."""

    procs: ProcessTable
    events: EventLog
    asker: Identity | None
    service: Any


async def _answer(session: _Session, req: Stacks) -> StacksReply:
    return await take(session.procs, session.events, session.service.node_name, req,
                      session.asker)


# The ops of this module, for session.py's dispatch table: (request class, handler).
ROUTES: list[tuple[Any, Callable[..., Any]]] = [(Stacks, _answer)]
