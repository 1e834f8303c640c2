"""Flushing the store to disk after a publish, off the push's critical path (--durable background).

A node's store is a cache of content whose truth is the dev box: every chunk is verified
against its id when it arrives and when it is read. So a version is published once its chunks
are written (in the page cache) and settled (Store.settle), and the flush to disk follows here,
$MONARCH_FS_FLUSH_SECONDS after the last publish (an edit loop's publishes share one flush).
Each flush records the open pack's durable point; after a crash the node verifies what lies past it
before serving (fs/durable.py) and serves the last whole version (recovery.py, lost.py).
`--durable sync` flushes before every publish instead, as before (publisher.py).
"""

from __future__ import annotations

import logging

import trio

from ...fs.store import Store

log = logging.getLogger("monarch_fs.daemon")



class Flusher:
    """Flushes the store in the background once publishes pause (see the module docstring)."""

    def __init__(self, store: Store, delay: float) -> None:
        self.store = store
        self.delay = delay
        self.flushes = 0
        self._due = trio.Event()

    def published(self) -> None:
        """A version was published from settled, unflushed chunks: flush them soon."""
        self._due.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Flush after each publish (the delay later, once publishes pause), until cancelled;
        then once more, so that a clean stop leaves nothing to check at the next start."""
        task_status.started()
        try:
            while True:
                await self._due.wait()
                while self._due.is_set():  # another publish meanwhile: wait for a pause
                    self._due = trio.Event()
                    await trio.sleep(self.delay)
                await self._flush()
        finally:
            with trio.CancelScope(shield=True):
                await self._flush()

    async def _flush(self) -> None:
        try:
            await trio.to_thread.run_sync(self.store.flush)
            self.flushes += 1
        except OSError as e:  # the data stays settled: the next flush, or a crash's check
            log.warning("flushing the store: %s", e)
