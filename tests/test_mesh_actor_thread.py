"""An actor's own thread for its sync endpoints (mesh/actor_thread.py): short calls come back
without a trip through the loop's wakeup socket; long ones, and ones that need the loop, run
while the loop goes on; calls keep their thread and their order."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from monarch_fs.mesh.actor_thread import ActorThread


class _BlockedWaits(trio.abc.Instrument):
    """Counts the times the loop slept in its I/O wait (what a hand-back through the wakeup
    socket costs: the loop blocks in epoll until the thread writes to it)."""

    def __init__(self) -> None:
        self.count = 0

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.count += 1


def test_short_sync_calls_come_back_without_the_loop_sleeping_in_its_io_wait():
    waits = _BlockedWaits()

    async def main() -> list[int]:
        thread = ActorThread("actor t")
        await thread.run(lambda: None)  # the thread has started
        trio.lowlevel.add_instrument(waits)
        try:
            return [await thread.run(threading.get_ident) for _ in range(200)]
        finally:
            trio.lowlevel.remove_instrument(waits)
            thread.close()

    idents = trio.run(main)
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()  # one thread, its own
    assert waits.count < 50, f"the loop slept {waits.count} times for 200 short calls"


def test_long_and_loop_needing_calls_complete_while_the_loop_goes_on():
    async def main() -> None:
        thread = ActorThread("actor t")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0.001)

        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            assert await thread.run(lambda: time.sleep(0.2) or "slept") == "slept"
            assert ticks > 20  # the loop ran other tasks while the call blocked
            # A sync endpoint that waits on its own proc's loop (as the sync mesh API does).
            assert await thread.run(lambda: trio.from_thread.run_sync(
                lambda: "from the loop", trio_token=token)) == "from the loop"
            with pytest.raises(ZeroDivisionError):
                await thread.run(lambda: 1 / 0)
            order: list[int] = []
            async with trio.open_nursery() as calls:
                for i in range(5):
                    calls.start_soon(thread.run, lambda i=i: order.append(i))
                    await trio.sleep(0)
            assert order == [0, 1, 2, 3, 4]
            nursery.cancel_scope.cancel()
        thread.close()

    trio.run(main)
