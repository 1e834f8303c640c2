"""The messages a proc sends its owner, in order: written at once by whoever posts (the loop, or
an actor's thread with its answer) when nothing is queued ahead, else queued for one writer task.

Why the shortcut: an endpoint's answer handed to the writer cost the proc one more task switch
and one more round of its loop (an epoll_wait) per call, and one from an actor's thread a wakeup
of the loop too, on the path of every `call()`. link_writer.py keeps the order: a message is
written at once only when nothing posted before it is still unsent (a large one goes as several
frames, wire.send, and nothing may come between them).
"""

from __future__ import annotations

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.transport import Channel
from .link_writer import LinkWriter

SIZE = 16  # messages queued before those who post wait for the link


class Outbox:
    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[p.Data | None](SIZE)
        self._link: LinkWriter | None = None  # set while the writer runs
        self._early = 0  # posted before the writer started
        self._closed = False
        self.flushed = trio.Event()  # the writer is done: everything queued went, or the link

    async def post(self, msg: p.Data) -> None:
        """Send `msg` after everything posted before it; dropped once the link is going away."""
        link = self._link
        if self._closed or (link is not None and link.send_now(msg, wait=False)):
            return
        if link is not None:
            link.pending += 1  # counted from now: a message handed to a waiting writer is in
        else:                  # no queue, but still ahead of whatever is posted next
            self._early += 1
        try:
            await self._send.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def send_now(self, msg: p.Data) -> bool:
        """From a thread that is not the loop: write `msg` now, in this thread, if nothing is
        queued ahead of it (waiting for the link if another thread writes); False if it must
        be posted through the loop instead."""
        link = self._link
        return link is not None and not self._closed and link.send_now(msg, wait=True)

    def close(self) -> None:
        """No more messages: the writer sends what is queued and ends."""
        self._closed = True
        self._send.close()

    async def writer(self, chan: Channel) -> None:
        """Send what is posted, in order, until close() (or the link ends)."""
        link = self._link = LinkWriter(chan, self._send.send_nowait)
        link.pending, self._early = self._early, 0
        try:
            async for msg in self._receive:
                await link.write(msg)
        finally:
            self._link = None
            self._receive.close()  # whoever still posts is not left waiting for space
            self.flushed.set()
