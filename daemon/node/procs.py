"""Processes a daemon runs for a controller: launched on request, their output streamed back line
by line, their end reported (exit code or signal, with the tail of stderr), and killed when asked,
when the controller goes away, or when the daemon stops. No orphans: each process leads its own
process group and the whole group is killed, and it gets SIGKILL if the daemon itself is killed
(PR_SET_PDEATHSIG).

Which thread forks matters twice, so every proc is forked by one dedicated thread:
- not a trio worker thread (what trio.lowlevel.open_process uses): the kernel ties
  PR_SET_PDEATHSIG to the *thread* that forked, not the process, and trio retires idle worker
  threads after 10 s, so every child was SIGKILLed 10 s after it started;
- not the trio thread: Popen blocks until the child has exec'd, and exec'ing an interpreter
  that lives on this daemon's own mount (`{workspace}/bin/python`), or a chdir into it, needs the
  trio thread to answer the kernel's FUSE requests meanwhile: a deadlock.
That thread comes from trio.lowlevel.start_thread_soon and lives as long as the daemon.
Exits are awaited through a pidfd, as trio does.

A process starts from a clean environment, not the daemon's: the daemon's holds its own
settings (MONARCH_FS_HOME, which leads to the cluster token, MONARCH_FS_TOKEN_FILE, ...) and
whatever the shell that started it had. What a process gets, in this order (later wins):
- from the daemon's environment, only BASE_ENV (PATH, LANG, LANGUAGE, LC_*, TZ, TERM, TMPDIR);
  PATH defaults to DEFAULT_PATH;
- HOME, USER, LOGNAME and SHELL of the user the process runs as (the password database; the
  daemon's own values where it has no entry);
- what the spawn request's `env` sets (`run --env`, `spawn_procs(env=...)`, RANK & co.);
- MONARCH_FS_MOUNT (this node's mount root), MONARCH_FS_WORKSPACE (the pinned version's folder,
  with a workspace) and MONARCH_FS_SECRETS_FD (with secrets).

No process runs as root unless asked: a daemon running as root refuses every spawn (one line,
naming the flag) unless it was started with --allow-root-procs. Without a way to learn who asks
(the shared token only says "someone holding the token"), a process runs as the daemon's own
user, so a root daemon would run root processes for every holder of the token.

With --identity munge (wire/identity.py), a request says who asks, and a root daemon runs the
process as that user instead: the user's uid, primary gid and groups (initgroups' list), the
user's HOME & co. in the clean environment, and, with no `cwd`, the user's home (else /). The
working folder is entered as the user, after the switch, so it must be one the user can enter.
A credential of root is refused unless --allow-root-procs; a user this node's password database
does not know is refused (no groups to give it).

Secrets (a proc mesh's token) never go into an environment, which any process of the same user
can read in /proc/PID/environ for as long as the process lives (removing a variable from
os.environ does not change that block). A spawn request carries them in `secrets` ({name:
value}); the daemon writes them to a pipe and hands the child its read end as file descriptor
$MONARCH_FS_SECRETS_FD; read_secrets() in the child reads them, closes it and drops the
variable, first thing, so nothing it starts later inherits either.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ..wire.identity import Identity
from ..wire.jobs import job_of
from ..wire.process_calls import SpawnReply
from . import spawn_args
from .dedicated_thread import DedicatedThread
from .events import EventLog
from .launches import launch_record
from .process_start import (
    ROOT_REFUSED,
    SECRETS_FD_ENV,
    RunAs,
    SpawnRefused,
    base_env,
    die_with_parent,
    procs_user,
    secrets_pipe,
)
from .process_start import read_secrets as read_secrets  # mesh/runtime.py's import path

log = logging.getLogger("monarch_fs.procs")

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
DRAIN_GRACE = 2.0  # seconds to read what is left in the pipes once the process has exited
TAIL_LINES = 20
_MAX_LINE = 64 * 1024

Emit = Callable[[str, dict], Awaitable[None]]  # (event kind, data) to the owner

def describe_status(returncode: int) -> dict:
    if returncode < 0:
        return {"code": None, "signal": _signal_name(-returncode)}
    return {"code": returncode, "signal": None}


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT); like torchrun, racy by nature."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Child:
    """A started process: its Popen, and an exit that any number of tasks may await."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    async def wait(self) -> int:
        """Reap the process once it exits. Each waiter opens its own pidfd, so the supervisor and
        a concurrent stop() never contend for one fd."""
        while self.popen.poll() is None:
            try:
                fd = os.pidfd_open(self.pid)
            except ProcessLookupError:  # exited and reaped between poll() and here
                continue
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        return self.popen.returncode


@dataclass
class RunningProcess:
    """One process this daemon started, the connection that owns it, and where its events go."""

    id: int
    process: _Child
    owner: object
    emit: Emit
    workspace: str = ""  # the workspace it was pinned to (--workspace), if any
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    # For telemetry: its rank and attempt (RANK or MONARCH_MESH_RANK, and
    # TORCHELASTIC_RESTART_COUNT, from its environment), whether it is a proc mesh's, when it
    # started, its argv, and why this daemon stopped it, if it did.
    rank: int | None = None
    restart: int | None = None
    mesh: bool = False
    started: float = field(default_factory=time.monotonic)
    argv: str = ""
    stopped: str = ""
    job: str = ""  # its run job or proc mesh (wire/jobs.py): `monarch-fs stacks`, its logs rows
    uid: int | None = None  # the user it runs as

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


class ProcessTable:
    """Every process this daemon supervises: started with a clean environment, killed when
    its owner's connection goes, and never outliving the daemon."""

    def __init__(self, mount: Path, nursery: trio.Nursery, *, allow_root: bool = False,
                 events: EventLog | None = None):
        self.mount = mount
        self.events = events  # starts, ends and refusals are recorded there
        self.nursery = nursery
        # Run processes even when they would run as root (this daemon is root): only when its
        # operator said so (ROOT_PROCS_FLAG).
        self.allow_root = allow_root
        self.procs: dict[int, RunningProcess] = {}
        self._ids = itertools.count(1)
        self._forker = DedicatedThread("monarch-fs forker")

    def expand(self, text: str, pins: dict[str, str]) -> str:
        """`{mount}` is this node's mount root, `{workspace}` the pinned version's folder."""
        return text.replace("{mount}", str(self.mount)).replace(
            "{workspace}", pins.get("workspace", "{workspace}"))

    async def spawn(self, owner: object, emit: Emit, args: dict, pin: str | None,
                    workspace: str = "", who: Identity | None = None,
                    source: str | None = None) -> SpawnReply:
        """Start `args["argv"]`; as user `who` (--identity munge), else as this daemon's.
        `source`: the folder the pinned workspace was pushed from (for repro's record)."""
        argv = args.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise SpawnRefused("spawn: argv must be a non-empty list of strings")
        extra = args.get("env") or {}
        if not isinstance(extra, dict):
            raise SpawnRefused("spawn: env must be an object")
        secrets = args.get("secrets") or {}
        if not isinstance(secrets, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in secrets.items()):
            raise SpawnRefused("spawn: secrets must be an object of strings")
        run_as = None if who is None else RunAs.of(who, self.allow_root)
        if run_as is None and not procs_user(self.allow_root):  # on the one way to a fork
            raise SpawnRefused(ROOT_REFUSED)
        pins = {"workspace": pin} if pin else {}
        argv = [self.expand(a, pins) for a in argv]
        env = base_env(None if run_as is None else run_as.uid)
        env.update({str(k): self.expand(str(v), pins) for k, v in extra.items()})
        env["MONARCH_FS_MOUNT"] = str(self.mount)
        if pin:
            env["MONARCH_FS_WORKSPACE"] = pin
        cwd = self.expand(str(args["cwd"]), pins) if args.get("cwd") else None
        enter = None
        user: dict = {}
        if run_as is not None:  # the child enters its folder as the user, after the switch
            enter = cwd or (run_as.home if os.path.isdir(run_as.home) else "/")
            cwd = None
            user = {"user": run_as.uid, "group": run_as.gid, "extra_groups": run_as.groups}
        if (bad := spawn_args.problem(argv, env, cwd or enter)) is not None:
            raise SpawnRefused(bad)  # before any descriptor is made for the child
        secrets_r = secrets_pipe(secrets) if secrets else None
        if secrets_r is not None:
            env[SECRETS_FD_ENV] = str(secrets_r)
        try:
            out_r, out_w = os.pipe()
            try:
                err_r, err_w = os.pipe()
            except BaseException:
                os.close(out_r)
                os.close(out_w)
                raise
            try:
                popen = await self._forker.run(lambda: subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, env=env,
                    cwd=cwd, pass_fds=() if secrets_r is None else (secrets_r,),
                    start_new_session=True, preexec_fn=die_with_parent(os.getpid(), enter),
                    **user), shield=True)
            except (OSError, subprocess.SubprocessError) as e:
                os.close(out_r)
                os.close(err_r)
                why = e.strerror if isinstance(e, OSError) and e.strerror else e
                if run_as is not None and not isinstance(e, OSError):  # preexec: the chdir
                    why = f"user {run_as.name} cannot enter that folder"
                where = f" in {cwd or enter}" if cwd or enter else ""
                raise SpawnRefused(f"cannot start {argv[0]}{where}: {why}") from None
            except BaseException:  # whatever else Popen raised: no descriptor outlives it
                os.close(out_r)
                os.close(err_r)
                raise
            finally:
                os.close(out_w)
                os.close(err_w)
        finally:
            if secrets_r is not None:  # the child has its own copy (or never started)
                os.close(secrets_r)
        env_of = args.get("env") or {}
        proc = RunningProcess(next(self._ids), _Child(popen), owner, emit, workspace=workspace,
                              rank=_int_or_none(env_of.get("RANK",
                                                           env_of.get("MONARCH_MESH_RANK"))),
                              restart=_int_or_none(env_of.get("TORCHELASTIC_RESTART_COUNT")),
                              mesh="MONARCH_MESH_NAME" in env_of, argv=" ".join(argv),
                              job=job_of(env_of),
                              uid=os.geteuid() if run_as is None else run_as.uid)
        self.procs[proc.id] = proc
        self._record("proc.started", proc, detail={
            "cwd": cwd or enter, **({"user": run_as.name} if run_as else {}),
            **({"job": proc.job} if proc.job else {}),
            "launch": launch_record(args, pin, source)})
        self.nursery.start_soon(self._supervise, proc, trio.lowlevel.FdStream(out_r),
                                trio.lowlevel.FdStream(err_r))
        log.info("started proc %d (pid %d%s): %s", proc.id, popen.pid,
                 "" if run_as is None else f", as {run_as.name}", " ".join(argv))
        return SpawnReply(proc.id, popen.pid)

    async def _supervise(self, proc: RunningProcess, stdout: trio.abc.ReceiveStream,
                         stderr: trio.abc.ReceiveStream) -> None:
        """Stream output until the process exits, then kill what it left in its group, read
        what is left in the pipes (bounded: a grandchild that escaped the group may hold them
        open), and report the exit after the last line."""
        async with trio.open_nursery() as nursery:
            pumps = trio.CancelScope()

            async def pump_all() -> None:
                with pumps:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(self._pump, proc, "stdout", stdout)
                        inner.start_soon(self._pump, proc, "stderr", stderr)

            nursery.start_soon(pump_all)
            returncode = await proc.process.wait()
            proc.signal_group(signal.SIGKILL)  # whatever it left behind in its group
            pumps.deadline = trio.current_time() + DRAIN_GRACE
        await stdout.aclose()
        await stderr.aclose()
        status = describe_status(returncode)
        self.procs.pop(proc.id, None)
        log.info("proc %d ended: %s", proc.id, status)
        self._record("proc.exited", proc, code=status["code"], signal=status["signal"],
                     seconds=round(time.monotonic() - proc.started, 3),
                     text="\n".join(proc.stderr_tail) or None,
                     detail={**({"stopped": proc.stopped} if proc.stopped else {}),
                             **({"job": proc.job} if proc.job else {})} or None)
        if proc.mesh and returncode != 0 and not proc.stopped:
            self._record("mesh.failure", proc, code=status["code"], signal=status["signal"],
                         text="\n".join(proc.stderr_tail) or None)
        await self._emit(proc, "exit", {"proc": proc.id, **status,
                                        "stderr_tail": list(proc.stderr_tail)})

    async def _pump(self, proc: RunningProcess, stream: str, pipe: trio.abc.ReceiveStream) -> None:
        """Forward complete lines, a batch per read, so chatty processes cost few frames."""
        pending = b""
        try:
            while True:
                data = await pipe.receive_some(65536)
                if not data:
                    break
                *lines, pending = (pending + data).split(b"\n")
                if len(pending) > _MAX_LINE:  # a line with no end in sight goes out in pieces
                    lines.append(pending)
                    pending = b""
                await self._lines(proc, stream, lines)
        finally:
            if pending:  # the last line had no newline; send it even when the drain timed out
                with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
                    await self._lines(proc, stream, [pending])

    async def _lines(self, proc: RunningProcess, stream: str, raw: list[bytes]) -> None:
        if not raw:
            return
        lines = [line.decode("utf-8", "replace") for line in raw]
        if stream == "stderr":
            proc.stderr_tail.extend(lines)
        if self.events is not None and self.events.enabled:
            self.events.lines.add(proc, stream, lines)  # the `logs` table; never waits
        await self._emit(proc, "output", {"proc": proc.id, "stream": stream, "lines": lines})

    async def _emit(self, proc: RunningProcess, kind: str, data: dict) -> None:
        try:
            await proc.emit(kind, data)
        except Exception as e:  # the owner is gone; kill_owned_by() stops its processes
            log.debug("proc %d: %s event not delivered: %r", proc.id, kind, e)

    def _record(self, kind: str, proc: RunningProcess, detail: dict | None = None,
                **fields: Any) -> None:
        if self.events is not None:
            if kind == "proc.started":
                fields["text"] = proc.argv
            self.events.record(kind, proc=proc.id, pid=proc.process.pid, rank=proc.rank,
                               restart=proc.restart, workspace=proc.workspace or None,
                               uid=proc.uid, detail=detail, **fields)

    def describe(self, uid: int | None = None) -> list[dict]:
        """The running processes, for `monarch-fs top`: with `uid`, that user's only."""
        now = time.monotonic()
        return [{"proc": p.id, "pid": p.process.pid, "rank": p.rank, "argv": p.argv[:200],
                 "seconds": round(now - p.started, 1)} for p in self.procs.values()
                if uid is None or p.uid == uid]

    def pinned_to(self, workspace: str) -> list[int]:
        """The pids of the running processes pinned to `workspace`."""
        return [p.process.pid for p in self.procs.values() if p.workspace == workspace]

    def kill(self, owner: object, proc_id: int, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.get(proc_id)
        if proc is None or proc.owner is not owner:
            raise SpawnRefused(f"no process {proc_id} of this connection is running")
        proc.stopped = proc.stopped or f"killed on request ({_signal_name(sig)})"
        proc.signal_group(sig)

    async def stop(self, procs: list[RunningProcess], why: str = "") -> None:
        """SIGTERM each process group, SIGKILL what is still running after STOP_GRACE.
        Safe to call while being cancelled (it shields itself): it is how the daemon exits."""
        with trio.CancelScope(shield=True):
            for proc in procs:
                proc.stopped = proc.stopped or why
                proc.signal_group(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE):
                for proc in procs:
                    await proc.process.wait()
            for proc in procs:
                proc.signal_group(signal.SIGKILL)
                await proc.process.wait()

    async def kill_owned_by(self, owner: object) -> None:
        await self.stop([p for p in self.procs.values() if p.owner is owner],
                        "its controller went away")

    async def stop_all(self) -> None:
        await self.stop(list(self.procs.values()), "the daemon stopped")
        self._forker.close()


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
