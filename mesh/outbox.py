"""The messages a proc sends its owner, in order: queued for one writer task, or sent at once by
whoever posts when nothing is queued or being sent.

Why the shortcut: an endpoint's answer handed to the writer cost the proc one more task switch
and one more round of its loop (an epoll_wait) per call, on the path of every `call()`. Order
is kept: the poster sends only when no message posted before is still unsent (a large one goes
as several frames, wire.send, and nothing may come between them), and takes the channel's send
lock before anyone else can run.
"""

from __future__ import annotations

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.transport import Channel, ConnectionLost
from . import wire

SIZE = 16  # messages queued before those who post wait for the link
_GONE = (ConnectionLost, trio.ClosedResourceError, trio.BrokenResourceError)


class Outbox:
    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[p.Data](SIZE)
        self._chan: Channel | None = None  # set while the writer runs
        self._pending = 0  # messages posted and not yet sent (queued, or on their way)
        self.flushed = trio.Event()  # the writer is done: everything queued went, or the link

    async def post(self, msg: p.Data) -> None:
        """Send `msg` after everything posted before it; dropped once the link is going away."""
        chan = self._chan
        if chan is not None and not self._pending and wire.one_frame(msg):
            self._pending += 1
            try:
                await chan.send(msg)  # takes the send lock before anything else runs
            except _GONE:
                pass  # the writer finds out too, and ends
            finally:
                self._pending -= 1
            return
        self._pending += 1  # counted from now: a message handed to a waiting writer is in
        try:                # no queue, but still ahead of whatever is posted next
            await self._send.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._pending -= 1

    def close(self) -> None:
        """No more messages: the writer sends what is queued and ends."""
        self._chan = None
        self._send.close()

    async def writer(self, chan: Channel) -> None:
        """Send what is posted, in order, until close() (or the link ends)."""
        self._chan = chan
        try:
            async for msg in self._receive:
                try:
                    await wire.send(chan, msg)
                finally:
                    self._pending -= 1
        except _GONE:
            pass
        finally:
            self._chan = None
            self._receive.close()  # whoever still posts is not left waiting for space
            self.flushed.set()
