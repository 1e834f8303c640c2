"""push --early: once every node serves the version, the rest of the stream (the tail) goes at
most at TAIL_SHARE of the rate the head went at (the manifest and the first reads' chunks).

The job started on the early version reads it while the tail streams, on the same nodes: the
tail's receive, verification and writes took the node's cores and the daemon's loop (which
also answers every FUSE request) from it. Measured on the 2-core machine the benchmarks run on,
the torch venv (bench/results/venvpush-20261206.md): unpaced, the first `import torch` after
the usable line took 3.8-4.8 s; with the tail at 150 MB/s (the head went at ~280) 2.1-2.2 s,
and the push completed 1-3 s later. Chunks a reader wants are never paced (stream.Pacer), so a
read of what has not arrived waits no longer; a lower --bwlimit stays.
"""

from __future__ import annotations

import time

from .stream import Pacer, Stream

TAIL_SHARE = 0.5
TAIL_PACED_FROM = 32 << 20  # a head smaller than this says nothing of the link: no pacing


def pace(pacer: Pacer, stream: Stream | None, started: float) -> float:
    """Pace the rest of `stream` (streaming since `started`, time.monotonic()) as the module
    docstring says; the rate set, in bytes a second (0: none)."""
    if stream is None or stream.bytes_sent < TAIL_PACED_FROM:
        return 0.0
    rate = TAIL_SHARE * stream.bytes_sent / max(time.monotonic() - started, 1e-3)
    pacer.rate = min(rate, pacer.rate) if pacer.rate > 0 else rate
    return pacer.rate
