"""One long-lived thread for sync calls that must all run on the same thread.

It serves both layers above fs/: daemon/node/procs.py forks every process from one (PR_SET_PDEATHSIG
fires when the thread that forked a child exits, so it must outlive the children) and
mesh/runtime.py runs each actor's sync endpoints on one. So it lives in daemon/, the lower of
the two: in mesh/ the daemon would import upward."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")


class DedicatedThread:
    """Runs sync calls one at a time on one thread of its own, kept for good (started through
    trio.lowlevel.start_thread_soon). An actor's sync endpoints all run on its thread, so
    per-thread state (torch.cuda.set_device, thread-locals) persists from call to call, as in a
    plain script; trio's worker threads would hand each call to whichever thread is idle."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running = False

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, deliver = job
            deliver(outcome.capture(fn))

    async def run(self, fn: Callable[[], T], *, shield: bool = False) -> T:
        """`fn()` on the thread. Cancelling stops the wait, not the call; with `shield` the wait
        is not cancellable either (the caller must learn what a started call did)."""
        if not self._running:
            trio.lowlevel.start_thread_soon(self._serve, lambda _: None, name=self.name)
            self._running = True
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put((fn, deliver))
        with trio.CancelScope(shield=shield):
            await done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        if self._running:
            self._jobs.put(None)
            self._running = False
