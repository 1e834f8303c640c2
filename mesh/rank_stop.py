"""Stopping the ranks of a `monarch-fs run` attempt, in bounded time whatever the daemons do.

The ranks still running get SIGTERM, what is left STOP_GRACE seconds later SIGKILL, and their
exits are awaited as long again. Each signal goes to every rank of every host at once, and a
host's daemon has KILL_TIMEOUT seconds to answer (hosts.KILL_TIMEOUT): a daemon that is stopped
or wedged answers nothing and reports no exit, so a host that did not answer is neither asked
again nor waited for. Without that bound one silent daemon held `run` up forever (seen in
tests/test_repro.py: a daemon's trio thread stuck reading /dev/fuse, fs/pyfuse3.patch). The
stop ends with a line per such host naming the ranks and PIDs that may still run there; its
daemon kills them once it notices the run's connection is gone.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from .hosts import KILL_TIMEOUT, Launcher

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL, and after SIGKILL, for the exits

Wait = Callable[[Callable[[], bool]], Awaitable[None]]  # returns once the condition holds


@dataclass(frozen=True)
class Started:
    """Where a rank runs: its host's index, the daemon's id for its proc, and its PID there."""

    host: int
    proc: int
    pid: int | None = None


async def signal_all(launcher: Launcher, procs: list[Started], sig: int,
                     timeout: float = KILL_TIMEOUT) -> set[int]:
    """Send `sig` to every proc at once; the hosts that did not answer within `timeout`."""
    silent: set[int] = set()

    async def one(started: Started) -> None:
        if not await launcher.kill(started.host, started.proc, sig, timeout):
            silent.add(started.host)

    async with trio.open_nursery() as nursery:
        for started in procs:
            nursery.start_soon(one, started)
    return silent


async def stop_ranks(launcher: Launcher, ranks: dict[int, Started], exited: set[int],
                     wait: Wait, grace: float = STOP_GRACE,
                     timeout: float = KILL_TIMEOUT) -> list[str]:
    """SIGTERM the `ranks` not in `exited` (which the caller's event handler fills), SIGKILL
    those left after `grace` seconds, and wait as long again for their exits (`wait(done)`
    returns once done() holds). A line per host that did not answer within `timeout`."""
    silent: set[int] = set()

    def running() -> list[int]:
        return [r for r, s in ranks.items() if r not in exited and s.host not in silent]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not (left := running()):
            break
        silent |= await signal_all(launcher, [ranks[r] for r in left], sig, timeout)
        with trio.move_on_after(grace):
            await wait(lambda: not running())
    lines = []
    for host in sorted(silent):
        stuck = [(r, s.pid) for r, s in sorted(ranks.items()) if s.host == host
                 and r not in exited]
        if stuck:
            what = ", ".join(f"rank {r}" + ("" if pid is None else f" (pid {pid})")
                             for r, pid in stuck)
            lines.append(f"{launcher.hosts[host]} did not answer the stop within {timeout:g} s "
                         f"(its daemon is stopped or stuck); may still be running there: {what}")
    return lines
