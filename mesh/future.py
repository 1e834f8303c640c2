"""What a call returns at once: a `Future` for its answer, as in Monarch.

    fut = trainers.step.call(batch)     # posted now; nothing waits yet
    values = fut.get(timeout=30)        # a script blocks here (at most 30 s)
    values = await fut                  # trio code awaits it

Why futures: a rank that is alive but stuck (a deadlocked collective) must not hang the
controller. `get(timeout=)` raises `CallTimeout` (a `TimeoutError`) naming the ranks that have
not answered and what each is running, and the call stays in flight: a later `get()` still
returns its answer. Without a timeout, the mesh's default (`spawn_procs(call_timeout=)`) applies.

The call is posted to the mesh's loop when `call()` returns (through the loop's FIFO, so calls
and broadcasts from one thread keep their order) and the answer is read without another thread
hop once it has arrived.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from .asyncio_loop import in_asyncio
from .errors import MeshError
from .loop import _current_token, _in_loop, run_async_api

if TYPE_CHECKING:
    from .calls import CallTarget, PendingCall

T = TypeVar("T")


class CallTimeout(MeshError, TimeoutError):
    """A call's answer did not come within its timeout; the call is still in flight."""


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
        raise ValueError(f"invalid timeout {timeout}: expected a non-negative number of seconds")


class Future(Generic[T]):
    """The answer of a call, once it comes: `get(timeout=)` / `result(timeout=)` from plain
    code, `await` from trio code, `exception(timeout=)` for what it raised (or None)."""

    def __init__(self, state: CallTarget, finish: Callable[[dict[int, Any]], T]) -> None:
        self._state = state
        self._finish = finish
        self._pending: PendingCall | None = None
        self._post_error: BaseException | None = None
        self._settled = threading.Event()  # what get() waits on: no task, one wakeup

    # ---- the mesh's loop side -----------------------------------------------------------

    def _set_posted(self, pending: PendingCall | None, error: BaseException | None) -> None:
        """The post ran in the loop: the call in flight, or why it could not be made."""
        self._pending, self._post_error = pending, error
        if pending is None or pending.settled:
            self._settled.set()
        else:
            pending.watchers.append(self._settled.set)

    async def _wait(self, timeout: float | None) -> T:
        if self._post_error is not None:
            raise self._post_error
        pending = self._pending
        assert pending is not None, "a future is posted before anyone waits for it"
        if timeout is None:
            timeout = self._state.call_timeout
        if timeout is None:
            return self._finish(await pending.result())
        with trio.move_on_after(timeout):
            return self._finish(await pending.result())
        raise CallTimeout(self._state.describe_waiting(pending, timeout))

    # ---- any side -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the answer (or the error) is here: get() then returns at once."""
        return self._post_error is not None or (
            self._pending is not None and self._pending.settled)

    def get(self, timeout: float | None = None) -> T:
        """Block until the answer is here, at most `timeout` seconds (default: the mesh's
        call_timeout, None: no limit), and return it or raise what the call raised."""
        _check_timeout(timeout)
        token = self._state.trio_token
        if _current_token() is token:
            raise RuntimeError("Future.get() blocks; inside trio code use `await future`")
        if self.done:  # no thread hop for an answer that is already here
            return self._ready()
        limit = self._state.call_timeout if timeout is None else timeout
        if not self._settled.wait(limit):
            raise CallTimeout(_in_loop(trio.from_thread.run_sync, token, self._describe, limit))
        return self._ready()

    def _describe(self, timeout: float) -> str:
        if self._pending is None:
            return f"the call was not even posted within {timeout:g}s (is the mesh's loop busy?)"
        return self._state.describe_waiting(self._pending, timeout)

    def _ready(self) -> T:
        if self._post_error is not None:
            raise self._post_error.with_traceback(None)
        assert self._pending is not None
        pending = self._pending
        if pending._error is not None:
            raise pending._error.with_traceback(None)
        return self._finish(pending._value or {})

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What the call raised, or None if it answered (a timeout is raised, not returned)."""
        try:
            self.get(timeout)
        except CallTimeout:
            raise
        except Exception as e:
            return e
        return None

    async def _await(self) -> T:
        if _current_token() is None and in_asyncio():
            return await self._await_on_asyncio()
        return await run_async_api(self._state.trio_token, self._wait, None)

    async def _await_on_asyncio(self) -> T:
        """Awaited in an asyncio task (an async endpoint): wait in the mesh's loop, and hand
        the outcome to an asyncio future."""
        import asyncio  # an asyncio task is running: it is imported

        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()

        def give(value: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if answer.done():
                    return
                if error is not None:
                    answer.set_exception(error)
                else:
                    answer.set_result(value)
            loop.call_soon_threadsafe(settle)

        async def waiter() -> None:
            try:
                value = await self._wait(None)
            except Exception as e:
                give(None, e)
            except BaseException:
                give(None, MeshError("the mesh's loop ended before the call's answer came"))
                raise
            else:
                give(value, None)

        self._state.trio_token.run_sync_soon(trio.lowlevel.spawn_system_task, waiter)
        return await answer

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    def __repr__(self) -> str:
        what = "done" if self.done else "pending"
        call = f" {self._pending.actor}.{self._pending.method}" if self._pending else ""
        return f"<Future{call} {what}>"


class Done(Generic[T]):
    """What a blocking method that Monarch makes return a future returns here: the work is done
    when it returns, and `get()`, `result()` and `await` give its value at once."""

    def __init__(self, value: T) -> None:
        self._value = value

    def get(self, timeout: float | None = None) -> T:
        return self._value

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None

    def __await__(self) -> Generator[Any, None, T]:
        yield from ()
        return self._value


class Arrival(Future[T]):
    """The n-th answer of a call to many ranks, whichever rank gives it (stream())."""

    def __init__(self, state: CallTarget, n: int) -> None:
        super().__init__(state, lambda _: None)  # type: ignore[arg-type, return-value]
        self._n = n

    def _take(self) -> T | None:
        """The answer if it is here (or raise what it is); None if it is not yet."""
        pending = self._pending
        assert pending is not None
        if len(pending.arrivals) > self._n:
            rank = pending.arrivals[self._n]
            if rank in pending.errors:
                raise pending.errors[rank].with_traceback(None)
            return pending.results[rank]
        if pending.settled and pending._error is not None:  # a rank died: no more answers
            raise pending._error.with_traceback(None)
        return None

    @property
    def done(self) -> bool:
        if self._post_error is not None:
            return True
        pending = self._pending
        return pending is not None and (len(pending.arrivals) > self._n or (
            pending.settled and pending._error is not None))

    def _ready(self) -> T:
        if self._post_error is not None:
            raise self._post_error.with_traceback(None)
        return self._take()  # type: ignore[return-value]

    def get(self, timeout: float | None = None) -> T:
        """Block until this answer is here (see Future.get)."""
        _check_timeout(timeout)
        token = self._state.trio_token
        if _current_token() is token:
            raise RuntimeError("Future.get() blocks; inside trio code use `await future`")
        if self.done:
            return self._ready()
        return _in_loop(trio.from_thread.run, token, self._wait, timeout)

    result = get

    async def _wait(self, timeout: float | None) -> T:
        if self._post_error is not None:
            raise self._post_error
        pending = self._pending
        assert pending is not None
        if timeout is None:
            timeout = self._state.call_timeout
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while not self.done:
                await pending.arrived.wait()
            return self._ready()
        raise CallTimeout(self._state.describe_waiting(pending, timeout or 0.0))
