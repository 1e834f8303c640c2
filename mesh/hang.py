"""Hang detection for `monarch-fs run --hang-timeout S`: when no rank has printed anything for
S seconds, every rank's stacks are taken (each node's daemon runs py-spy on its ranks:
daemon/node/stacks.py), printed folded as `monarch-fs stacks` prints them, and recorded on
each node as a `job.hang` event and rows of its `stacks` table. Then `--on-hang` decides:
`kill` fails the attempt (the ranks are stopped, and `--max-restarts` may start the group
again), `wait` lets it run on and reports again only after some rank has printed.

Silence is the signal because it is the one a launcher sees for every job without asking
anything of it; a job that legitimately computes for long without printing needs a larger S.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TextIO

import trio

from ..daemon.client.stacks import Report, collect, render
from ..daemon.wire import identity
from ..daemon.wire.stacks import StacksReply
from .hosts import Daemons

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

    async def _ask(self, i: int, args: dict[str, Any]) -> StacksReply:
        link = self.daemons.links[i]
        signed = await identity.sign(link.chan, "stacks", args)  # if the node asks who
        return StacksReply.from_wire(await link.request("stacks", **signed))

    async def run(self) -> None:
        while True:
            await trio.sleep_until(self.last + self.timeout)
            if self.reported or trio.current_time() < self.last + self.timeout:
                if self.reported:
                    await trio.sleep(self.timeout / 4)
                continue
            self.reported = True
            why = f"no rank printed anything for {self.timeout:g} s"
            report = await collect([str(h) for h in self.daemons.hosts], self._ask,
                                   self.job_name, hang=why)
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
