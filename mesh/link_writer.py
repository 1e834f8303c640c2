"""The one way onto a mesh link's socket: a small message is written at once by whoever has it
(the loop, or an actor's own thread), the rest by a writer task, and order is kept.

Why: a call's message and its answer are one small frame each, and a hand-off to a writer task
(or, from an actor's thread, to the loop) cost each of them a task switch, trio's send
checkpoints and, from a thread, a wakeup of the loop and a wait for its answer: on `call()` to 4
actors that was most of the wall time a call spends outside Python's own work. Here the frame
is sealed and written with one `writev` on the (non-blocking) socket in the caller's thread,
under a lock that every sender of the link takes, so the session's sequence numbers (seal.py)
and the frames on the wire stay in one order.

Order: a message is written at once only when nothing is queued for the writer task; else it
is queued behind. The loop never blocks on the lock (the writer task holds it across awaits):
it queues instead. A thread may block on it. A write the socket takes only in part is finished
by the writer task when the loop wrote it (its rest goes first), or by the thread itself.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.protocol import ProtocolError
from ..daemon.wire.transport import Channel, ConnectionLost
from . import wire

SMALL = 64 * 1024  # larger messages always go through the writer task
_GONE = (ConnectionLost, ProtocolError, OSError, trio.ClosedResourceError,
         trio.BrokenResourceError)


def _size(msg: p.Data) -> int:
    return sum(memoryview(part).nbytes for part in msg.parts)


class LinkWriter:
    """Sends on one channel: `send_now` from any thread, `write` from the link's writer task.
    `queue` hands a message to that task (the caller's own queue; `pending` counts what is in
    it and not yet written, so nobody writes past it)."""

    def __init__(self, chan: Channel, queue: Callable[[p.Data | None], None]) -> None:
        self.chan = chan
        self._queue = queue
        sock = getattr(chan.stream, "socket", None)
        self._fd = sock.fileno() if sock is not None else -1
        self._lock = threading.Lock()
        self.pending = 0  # queued for the writer task and not yet written
        self._rest: list[memoryview] = []  # a frame the loop wrote in part: the writer ends it
        self.broken = False

    def post(self, msg: p.Data) -> None:
        """Send `msg` now if nothing is ahead of it and it is small, else queue it."""
        if not self.send_now(msg, wait=False):
            self.pending += 1
            self._queue(msg)

    def send_now(self, msg: p.Data, *, wait: bool) -> bool:
        """Write `msg` (one small frame) now, in this thread; False if it must be queued
        instead (something is queued, the link is busy and `wait` is False, or it is large).
        With `wait` (a thread that is not the loop) the lock is waited for and a write the
        socket takes in part is finished here."""
        if self.pending or self._fd < 0 or _size(msg) > SMALL:
            return False
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if self.pending:  # something was queued meanwhile: it goes first
                return False
            if self.broken:
                return True  # dropped: the reader finds out why the link ended
            try:
                rest = self._write_some(self.chan.conn.send_parts(msg))
                if rest and wait:
                    self._write_all(rest)
                elif rest:
                    self._rest = rest
                    self.pending += 1
                    self._queue(None)  # the writer task writes the rest first
            except _GONE:
                self.broken = True
            finally:
                self.chan.conn.sent()
            return True
        finally:
            self._lock.release()

    async def write(self, msg: p.Data | None) -> None:
        """In the writer task: write a queued message (None: the rest of a partial write).
        Once the link broke, messages are dropped: its reader finds out why it ended."""
        try:
            if not self._lock.acquire(blocking=False):  # a thread is writing: a few us
                await trio.to_thread.run_sync(self._lock.acquire)
            try:
                if self.broken:
                    return
                if msg is None:
                    rest, self._rest = self._rest, []
                    await self._write_async(rest)
                else:
                    await wire.send(self.chan, msg)
            except _GONE:
                self.broken = True
            finally:
                self._lock.release()
        finally:
            self.pending -= 1

    def _write_some(self, parts: list) -> list[memoryview]:
        """Write what the socket takes now; what it did not take."""
        views = [memoryview(b).cast("B") for b in parts if len(b)]
        try:
            sent = os.writev(self._fd, views)
        except BlockingIOError:
            sent = 0
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views and sent:
            views[0] = views[0][sent:]
        return views

    def _write_all(self, views: list[memoryview]) -> None:
        poll = select.poll()
        poll.register(self._fd, select.POLLOUT)
        while views:
            poll.poll()
            views = self._write_some(views)

    async def _write_async(self, views: list[memoryview]) -> None:
        while views:
            await trio.lowlevel.wait_writable(self._fd)
            views = self._write_some(views)
