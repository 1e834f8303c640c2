"""The tail of a push --early gives way to the job reading the version it published.

Once a push --early has published its version, the job started on it reads the mount while
the rest of the push (its tail) still streams in, on the same node: the tail's receive,
verification and writes take the cores and the daemon's loop (which answers every FUSE request)
from the job, and the dev box's push process takes a core too. Paced at the dev box (half the
head's rate), the first `import torch` after the usable line still took 1.9-2.5 s against
1.2-1.3 s after a whole push, on the 2-core machine the benchmarks run on; held here, 1.6 s
(at 16 MiB/s; 1.7 at 64 MiB/s, 1.6 at 4 MB/s, 3.0-3.1 not held at all), and the push
completes sooner (4.5-4.7 s against 5.5-6.4).

So the node takes the tail slowly while its mount's readers are busy (a FUSE request in the
last QUIET seconds): BUSY_RATE bytes a second, which its socket's window passes back to the
sender, so the dev box waits rather than spends a core; at full speed once they are quiet.
A reader waiting for a chunk that has not arrived is never held back: the tail is taken at
full speed while any does (fetch.Fetcher), since that chunk is on the same connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

QUIET = 0.2  # seconds without a FUSE request: the readers are idle
BUSY_RATE = 16 << 20  # bytes a second of a tail taken while they are busy


class TailPace:
    """What a session receiving a push --early waits after each chunk frame of its tail."""

    def __init__(self, last_request: Callable[[], int], early: Callable[[bytes], bool],
                 waiting: Callable[[], bool], counters: dict[str, int]) -> None:
        self.last_request = last_request  # when the mount's last request came (perf_counter_ns)
        self.early = early  # whether a version is published early and not yet complete
        self.waiting = waiting  # whether a reader waits for a chunk not here yet
        self.counters = counters  # the node's (`status`): tail_held_ms

    async def taken(self, version: bytes, size: int) -> None:
        """`size` bytes of the push of `version` arrived: wait as the module docstring says."""
        if self.early(version) and not self.waiting() and self.busy():
            pause = size / BUSY_RATE
            self.counters["tail_held_ms"] += round(pause * 1000)
            await trio.sleep(pause)

    def busy(self) -> bool:
        """Whether the mount's readers are busy: a request in the last QUIET seconds."""
        return time.perf_counter_ns() - self.last_request() < QUIET * 1e9
