"""Processes a daemon runs for a controller: launched on request, their output streamed back line
by line, their end reported (exit code or signal, with the tail of stderr), and killed when asked,
when the controller goes away, or when the daemon stops. No orphans: each process leads its own
process group and the whole group is killed, and it gets SIGKILL if the daemon itself is killed
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import subprocess
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

log = logging.getLogger("monarch_fs.procs")

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
TAIL_LINES = 20
_MAX_LINE = 64 * 1024

Emit = Callable[[str, dict], Awaitable[None]]  # (event kind, data) to the owner


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def describe_status(returncode: int) -> dict:
    if returncode < 0:
        return {"code": None, "signal": signal.Signals(-returncode).name}
    return {"code": returncode, "signal": None}


class SpawnError(Exception):
    pass


@dataclass
class Proc:
    id: int
    argv: list[str]
    process: trio.Process
    owner: object
    emit: Emit
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ended: trio.Event = field(default_factory=trio.Event)
    status: dict | None = None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


class ProcessTable:
    def __init__(self, mount: Path, nursery: trio.Nursery):
        self.mount = mount
        self.nursery = nursery
        self.procs: dict[int, Proc] = {}
        self._ids = itertools.count(1)

    def expand(self, text: str, pins: dict[str, str]) -> str:
        """`{mount}` is this node's mount root, `{workspace}` the pinned version's folder."""
        return text.replace("{mount}", str(self.mount)).replace(
            "{workspace}", pins.get("workspace", "{workspace}"))

    async def spawn(self, owner: object, emit: Emit, args: dict, pin: str | None) -> dict:
        argv = args.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise SpawnError("spawn: argv must be a non-empty list of strings")
        pins = {"workspace": pin} if pin else {}
        argv = [self.expand(a, pins) for a in argv]
        env = dict(os.environ)
        env.update({k: self.expand(str(v), pins) for k, v in (args.get("env") or {}).items()})
        env["MONARCH_FS_MOUNT"] = str(self.mount)
        if pin:
            env["MONARCH_FS_WORKSPACE"] = pin
        cwd = self.expand(args["cwd"], pins) if args.get("cwd") else None
        try:
            process = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as e:
            raise SpawnError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        proc = Proc(next(self._ids), argv, process, owner, emit)
        self.procs[proc.id] = proc
        self.nursery.start_soon(self._supervise, proc)
        log.info("started proc %d (pid %d): %s", proc.id, process.pid, " ".join(argv))
        return {"proc": proc.id, "pid": process.pid}

    async def _supervise(self, proc: Proc) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, proc, "stdout", proc.process.stdout)
            nursery.start_soon(self._pump, proc, "stderr", proc.process.stderr)
        returncode = await proc.process.wait()
        proc.signal_group(signal.SIGKILL)  # whatever it left behind in its group
        proc.status = describe_status(returncode)
        proc.ended.set()
        self.procs.pop(proc.id, None)
        log.info("proc %d ended: %s", proc.id, proc.status)
        await self._emit(proc, "exit", {"proc": proc.id, **proc.status,
                                        "stderr_tail": list(proc.stderr_tail)})

    async def _pump(self, proc: Proc, stream: str, pipe: trio.abc.ReceiveStream) -> None:
        """Forward complete lines, a batch per read, so chatty processes cost few frames."""
        pending = b""
        async with pipe:
            while True:
                data = await pipe.receive_some(65536)
                if not data:
                    break
                *lines, pending = (pending + data).split(b"\n")
                if len(pending) > _MAX_LINE:  # a line with no end in sight goes out in pieces
                    lines.append(pending)
                    pending = b""
                await self._lines(proc, stream, lines)
        if pending:
            await self._lines(proc, stream, [pending])

    async def _lines(self, proc: Proc, stream: str, raw: list[bytes]) -> None:
        if not raw:
            return
        lines = [line.decode("utf-8", "replace") for line in raw]
        if stream == "stderr":
            proc.stderr_tail.extend(lines)
        await self._emit(proc, "output", {"proc": proc.id, "stream": stream, "lines": lines})

    async def _emit(self, proc: Proc, kind: str, data: dict) -> None:
        try:
            await proc.emit(kind, data)
        except Exception:
            pass  # the owner is gone; kill_owned_by() stops its processes

    def kill(self, owner: object, proc_id: int, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.get(proc_id)
        if proc is None or proc.owner is not owner:
            raise SpawnError(f"no process {proc_id} of this connection is running")
        proc.signal_group(sig)

    async def stop(self, procs: list[Proc]) -> None:
        """SIGTERM each process group, SIGKILL what is still running after STOP_GRACE.
        Safe to call while being cancelled (it shields itself): it is how the daemon exits."""
        with trio.CancelScope(shield=True):
            for proc in procs:
                proc.signal_group(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE):
                for proc in procs:
                    await proc.process.wait()
            for proc in procs:
                proc.signal_group(signal.SIGKILL)
                await proc.process.wait()

    async def kill_owned_by(self, owner: object) -> None:
        await self.stop([p for p in self.procs.values() if p.owner is owner])

    async def stop_all(self) -> None:
        await self.stop(list(self.procs.values()))
