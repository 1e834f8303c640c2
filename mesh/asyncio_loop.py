"""Async endpoints run on asyncio, so that asyncio libraries (async inference engines,
`asyncio.Queue`, aiohttp) work inside actors, as they do in Monarch's.

Why a loop on a thread of its own, rather than trio as a guest of asyncio or asyncio as a guest
of trio: the runtime's I/O (the owner's connection, direct calls, big frames) stays on plain
trio, at full speed and with its structured cancellation, and a proc that has no async
endpoint pays nothing. In guest mode every trio wakeup would go through the other loop's queue,
and every I/O wait through a helper thread. The cost here is two thread hops per async call
(tens of microseconds), only for async endpoints.

One loop per proc, started (through trio) when the first async endpoint runs (and asyncio is
imported then too: a proc's start does not pay for it); an actor's async
messages still run one at a time, in order, because the runtime awaits each before the next.
Inside such an endpoint, `await future` of a mesh call works: future.py waits in the mesh's
loop and resolves an asyncio future.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    import asyncio


class AsyncioLoop:
    """An asyncio event loop on a trio-started thread, for one proc's async endpoints."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                import asyncio

                loop = asyncio.new_event_loop()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.run_forever()

                trio.lowlevel.start_thread_soon(run, lambda _: None, name="asyncio endpoints")
                self._loop = loop
            return self._loop

    async def run(self, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """`await fn()` on the asyncio loop; its result here, or what it raised. Cancelling
        this cancels the asyncio task."""
        import asyncio

        loop = self._started()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        task = asyncio.run_coroutine_threadsafe(fn(), loop)
        task.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            task.cancel()
            raise
        return task.result()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


def in_asyncio() -> bool:
    """True in a task of a running asyncio loop (never before asyncio is imported)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
