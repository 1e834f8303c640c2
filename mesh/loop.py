"""One mesh API for plain scripts and for trio code.

Every mesh object belongs to the trio loop it was created in, because its connections are read
by tasks of that loop. Trio code awaits the `*_async` methods in that loop. A plain script has
no loop, so `HostMesh.connect()`/`HostMesh.local()` start one on a background thread and the
synchronous methods hand their work to it through `trio.from_thread` and wait.

Why a thread at all: the mesh must keep reading every connection while the script runs its own
code (a proc may die at any time, and output streams in). The project allows no bare threads
except through trio, so the loop's thread comes from trio.lowlevel.start_thread_soon, and all
talk with it goes through trio.from_thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import outcome
import trio

from .errors import MeshError

T = TypeVar("T")


def _current_token() -> trio.lowlevel.TrioToken | None:
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


def run_sync_api(token: trio.lowlevel.TrioToken, name: str,
                 afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run `await afn(*args)` in the mesh's loop from a thread that has no loop of its own."""
    current = _current_token()
    if current is token:
        raise RuntimeError(f"{name}() blocks; inside trio code use `await {name}_async(...)`")
    if current is not None:
        raise RuntimeError(f"{name}() called from inside another trio loop; use "
                           f"`await {name}_async(...)`")
    return _in_loop(trio.from_thread.run, token, afn, *args)


def post_sync_api(token: trio.lowlevel.TrioToken, fn: Callable[..., T], *args: Any) -> T:
    """Run the non-blocking `fn(*args)` in the mesh's loop, from its own thread or any other."""
    if _current_token() is token:
        return fn(*args)
    return _in_loop(trio.from_thread.run_sync, token, fn, *args)


def _in_loop(via: Callable[..., T], token: trio.lowlevel.TrioToken, fn: Callable[..., Any],
             *args: Any) -> T:
    """`via(fn, *args)` in the mesh's loop (via is trio.from_thread.run or run_sync), with its
    errors as a script should see them."""
    try:
        return via(fn, *args, trio_token=token)
    except MeshError as e:  # the frames of the loop thread say nothing to the script's author
        raise e.with_traceback(None) from None
    except trio.RunFinishedError:
        raise MeshError("its host mesh has been closed") from None


async def run_async_api(token: trio.lowlevel.TrioToken, afn: Callable[..., Awaitable[T]],
                        *args: Any) -> T:
    """`await afn(*args)` in the mesh's loop: directly when we are in it, else (a mesh made by a
    script's background loop, awaited from some other trio program) through a worker thread."""
    if _current_token() is token:
        return await afn(*args)
    call = functools.partial(trio.from_thread.run, afn, *args, trio_token=token)
    return await trio.to_thread.run_sync(call)


@asynccontextmanager
async def service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for background tasks around a `yield`: the tasks are cancelled when the body
    ends, and an exception from the body comes out as itself, not wrapped in an ExceptionGroup
    (so `except ActorError` works around `async with HostMesh.open()`)."""
    body_exc: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except BaseException as e:  # re-raised below, once the tasks are gone
            body_exc = e
        nursery.cancel_scope.cancel()
    if body_exc is not None:
        raise body_exc


class BackgroundLoop:
    """A trio loop on a trio-managed thread, holding one async context open for a script.

    `start(main)` runs `await main(task_status)` in the new loop and returns the value `main`
    passes to task_status.started(); `stop()` makes main return and waits for the loop to end.
    """

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._finished = threading.Event()
        self._value: outcome.Outcome | None = None
        self._result: outcome.Outcome | None = None
        self._stop: trio.Event | None = None

    def start(self, main: Callable[..., Awaitable[None]]) -> Any:
        trio.lowlevel.start_thread_soon(lambda: trio.run(self._main, main), self._deliver,
                                        name="monarch-fs mesh loop")
        self._started.wait()
        if self._value is None:  # the loop ended before main started: raise why
            self._finished.wait()
            assert self._result is not None
            self._result.unwrap()
            raise RuntimeError("the mesh loop ended before it started")
        return self._value.unwrap()

    async def _main(self, main: Callable[..., Awaitable[None]]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            value = await nursery.start(main, self._stop)
            self._value = outcome.Value(value)
            self._started.set()

    def _deliver(self, result: outcome.Outcome) -> None:
        self._result = result
        self._started.set()
        self._finished.set()

    def stop(self, timeout: float | None = None) -> None:
        """Let main return, wait for the loop to end, and raise what it raised (if anything)."""
        stop = self._stop  # None only if the loop never got as far as main
        if not self._finished.is_set() and stop is not None:
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        if not self._finished.wait(timeout):
            raise TimeoutError("the mesh loop did not stop")
        result, self._result = self._result, outcome.Value(None)
        assert result is not None
        result.unwrap()

    @property
    def running(self) -> bool:
        return not self._finished.is_set()
