"""Hang detection for `monarch-fs run --hang-timeout S` and proc meshes
(`spawn_procs(hang_timeout=S)`).

`run`: when no rank has printed anything for S seconds, every rank's stacks are taken (each
node's daemon runs py-spy on its ranks: daemon/node/stacks.py), printed folded as `monarch-fs
stacks` prints them, and recorded on each node as a `job.hang` event and rows of its `stacks`
table. Then `--on-hang` decides:
`kill` fails the attempt (the ranks are stopped, and `--max-restarts` may start the group
again), `wait` lets it run on and reports again only after some rank has printed.

Silence is the signal because it is the one a launcher sees for every job without asking
anything of it; a job that legitimately computes for long without printing needs a larger S.

A proc mesh: when a call has waited S seconds for some rank's answer, the mesh's procs'
stacks are taken, printed and recorded the same way; `kill` then fails the mesh with that
rank's failure (the call raises SupervisionError saying it hung) and kills the rank, `wait`
lets the call go on. Each call is reported once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TextIO

import trio

from ..daemon.client.stacks import Ask, Report, collect, ranks_text, render
from ..daemon.wire import identity
from ..daemon.wire.stacks import StacksReply
from .hosts import Daemons, Launcher

if TYPE_CHECKING:
    from .mesh_state import MeshState

Fail = Callable[[int | None, str], None]  # (the rank to blame, why): ends the attempt


class HangWatch:
    """The silence of one attempt's ranks, and what to do when it lasts `timeout` seconds."""

    def __init__(self, job_name: str, timeout: float, on_hang: str, daemons: Daemons,
                 err: TextIO, fail: Fail) -> None:
        self.job_name = job_name
        self.timeout = timeout
        self.on_hang = on_hang
        self.daemons = daemons
        self.err = err
        self.fail = fail
        self.last = trio.current_time()
        self.reported = False

    def heard(self) -> None:
        """A rank printed something."""
        self.last = trio.current_time()
        self.reported = False

    async def run(self) -> None:
        while True:
            await trio.sleep_until(self.last + self.timeout)
            if self.reported or trio.current_time() < self.last + self.timeout:
                if self.reported:
                    await trio.sleep(self.timeout / 4)
                continue
            self.reported = True
            why = f"no rank printed anything for {self.timeout:g} s"
            report = await collect([str(h) for h in self.daemons.hosts],
                                   asking(self.daemons), self.job_name, hang=why)
            self._say(f"hang: {why}; the stacks of job {self.job_name}:")
            self.err.write(render(report))
            self.err.flush()
            if self.on_hang == "kill":
                rank, blame = _odd_one_out(report)
                self.fail(rank, f"hung: {why}{blame}")
                return
            self._say("--on-hang wait: letting it run")

    def _say(self, text: str) -> None:
        print(f"monarch-fs run: {text}", file=self.err, flush=True)


def asking(launcher: Launcher) -> Ask:
    """An Ask through `launcher`'s daemon links (signed where a node asks who is asking), or
    through its owner for a mesh an actor launched."""
    async def ask(i: int, args: dict[str, Any]) -> StacksReply:
        if isinstance(launcher, Daemons):
            link = launcher.links[i]
            signed = await identity.sign(link.chan, "stacks", args)  # if the node asks who
            return StacksReply.from_wire(await link.request("stacks", **signed))
        return StacksReply.from_wire(await launcher.request(i, "stacks", **args))
    return ask


class CallWatch:
    """A proc mesh's calls, and what to do with one that waits `timeout` seconds."""

    def __init__(self, state: MeshState, timeout: float, on_hang: str,
                 err: TextIO | None = None) -> None:
        self.state = state
        self.timeout = timeout
        self.on_hang = on_hang
        self.err = err
        self.seen: dict[int, float] = {}  # call id -> when first seen pending
        self.reported: set[int] = set()

    async def run(self) -> None:
        state = self.state
        while not (state.stopping or state.stopped or state.failure is not None):
            await trio.sleep(min(self.timeout / 4, 1.0))
            now = trio.current_time()
            pending = state.calls.pending()
            self.seen = {c.id: self.seen.get(c.id, now) for c in pending}
            stuck = [c for c in pending if now - self.seen[c.id] >= self.timeout
                     and c.id not in self.reported and c.remaining]
            if stuck:
                await self._hung(stuck[0])

    async def _hung(self, call: Any) -> None:
        state, err = self.state, self.err or sys.stderr
        self.reported.add(call.id)
        waiting = sorted(call.remaining)
        why = (f"call {call.actor}.{call.method} waited {self.timeout:g} s for "
               f"{ranks_text(waiting)}")
        report = await collect([str(h) for h in state.launcher.hosts],
                               asking(state.launcher), state.job, hang=why)
        print(f"monarch-fs mesh: hang: {why}; the stacks of proc mesh {state.name!r}:",
              file=err, flush=True)
        err.write(render(report))
        err.flush()
        if self.on_hang != "kill" or state.failure is not None or state.stopping:
            return
        rank, blame = _odd_one_out(report)
        proc = state.procs[rank if rank is not None and rank in waiting else waiting[0]]
        state.fail(proc, state.failure_of(proc, f"hung: {why}{blame}"))
        if proc.proc_id is not None:
            await state.launcher.kill(proc.host, proc.proc_id, signal.SIGKILL)


def _odd_one_out(report: Report) -> tuple[int | None, str]:
    """The rank whose stack differs from all others' (the likely culprit) and a note saying
    so; else the lowest rank and no note."""
    groups = report.groups
    if len(groups) > 1 and len(groups[-1].ranks) == 1:
        others = sum(len(g.ranks) for g in groups[:-1])
        return groups[-1].ranks[0], f"; its stack differs from the other {others} ranks'"
    ranks = [d.rank for _, d in report.dumps() if d.rank is not None]
    return (min(ranks) if ranks else None), ""


@asynccontextmanager
async def watching(watch: HangWatch | None) -> AsyncIterator[None]:
    """Watch for a hang while the body runs (nothing without a watch)."""
    if watch is None:
        yield
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()
