"""An actor's own thread for its sync endpoints, with a fast hand-back for short calls.

Why: a sync endpoint runs on its actor's thread, so it may block, keep per-thread state (the
CUDA device) and use the synchronous mesh API. A call's own path does not come back at all:
it is `submit`ted, and the thread answers its caller itself (actor_slot.py). What the loop
must wait for (a constructor, `__supervise__`, `__cleanup__`, the calls queued before an async
endpoint) goes through `run`: the loop first waits for the answer on a lock for up to GRACE
seconds (one futex wake each way, no trip through trio's wakeup socket); only a call still
running then is awaited through trio, and the loop goes on meanwhile. Nothing the function
does can deadlock on that wait: the loop is back within GRACE whatever it does.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")
GRACE = 0.0005  # seconds the loop waits for a sync endpoint before going on with other work


class _Job(Generic[T]):
    """One call: who finished first (the call, or the loop's patience) is settled under
    `mutex`, so the answer comes back exactly one way."""

    def __init__(self, fn: Callable[[], T], token: trio.lowlevel.TrioToken) -> None:
        self.fn = fn
        self.token = token
        self.result: outcome.Outcome | None = None
        self.ready = threading.Lock()
        self.ready.acquire()  # released when the call is done
        self.mutex = threading.Lock()
        self.finished = False
        self.detached = False  # the loop stopped waiting on `ready`: wake it through trio
        self.done = trio.Event()

    def __call__(self) -> None:
        self.result = outcome.capture(self.fn)
        with self.mutex:
            self.finished = True
            detached = self.detached
        self.ready.release()
        if detached:
            try:
                self.token.run_sync_soon(self.done.set)
            except trio.RunFinishedError:
                pass

    def detach(self) -> bool:
        """Stop waiting on `ready`; False if the call finished first (its result is here)."""
        with self.mutex:
            if self.finished:
                return False
            self.detached = True
            return True


class ActorThread:
    """Runs an actor's sync calls one at a time, in order, on one thread of its own (started
    through trio.lowlevel.start_thread_soon and kept for the proc's life)."""

    def __init__(self, name: str, grace: float = GRACE) -> None:
        self.name = name
        self.grace = grace
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._running = False

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException:  # a submitted job reports its own errors; this is a bug
                traceback.print_exc()
            del job  # its arguments and result (tensors on a message's buffer) are not held

    def _start(self) -> None:
        if not self._running:
            trio.lowlevel.start_thread_soon(self._serve, lambda _: None, name=self.name)
            self._running = True

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue `fn()` after the calls already queued, without waiting for it: it answers
        its caller itself (actor_slot.py)."""
        self._start()
        self._jobs.put(fn)

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the thread, after the calls already queued. Cancelling stops the wait,
        not the call."""
        self._start()
        job: _Job[T] = _Job(fn, trio.lowlevel.current_trio_token())
        self._jobs.put(job)
        if not job.ready.acquire(timeout=self.grace) and job.detach():
            await job.done.wait()
        # else no checkpoint: the caller's next step (posting the answer) is one, and another
        # here would cost the proc one more round of its loop (an epoll_wait) per call.
        assert job.result is not None
        return job.result.unwrap()

    def close(self) -> None:
        if self._running:
            self._jobs.put(None)
            self._running = False
