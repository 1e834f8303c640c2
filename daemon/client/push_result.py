"""What a push reports: what it did (PushResult, printed by `push` and given by `--json`), or
which nodes failed it and at which step (PushError)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


class PushError(Exception):
    """Some nodes failed; nothing was published (unless `published` names nodes)."""

    def __init__(self, stage: str, failures: dict[str, str], nodes: int,
                 published: Sequence[str] = ()):
        self.stage = stage
        self.failures = failures
        self.published = list(published)
        if published and stage != "committing":  # push --early: after its early publish
            head = (f"push failed on {len(failures)} of {nodes} nodes while {stage}, after "
                    f"{len(published)} served the version published early: they lack what did "
                    "not arrive until a push of it completes it")
        elif published:
            head = (f"commit failed on {len(failures)} of {nodes} nodes "
                    f"({len(published)} switched to the new version)")
        else:
            head = (f"push failed on {len(failures)} of {nodes} nodes while {stage}; "
                    "nothing was published, every node keeps its last good version")
        lines = [head] + [f"  {host}: {cause}" for host, cause in sorted(failures.items())]
        super().__init__("\n".join(lines))


@dataclass
class PushResult:
    """What a push did, as `push` prints it (and `--json` gives it)."""

    version: str
    name: str
    files: int
    bytes: int
    chunks_total: int
    chunks_sent: int  # chunk copies that left the dev box (relays forward the rest)
    bytes_sent: int  # bytes that left the dev box
    nodes: int  # nodes now serving the version
    seconds: float
    topology: str = "star"
    transport: str = "tcp"  # how chunk payloads left the dev box: tcp, rdma-rc or rdma-srd
    failed: dict[str, str] = field(default_factory=dict)  # --allow-partial: nodes left behind
    links: list[dict] = field(default_factory=list)  # per root: link_codec.LinkChoice
    # Send helpers (send_helpers.py): processes started, and what they sent (chunks, bytes)
    helpers: dict = field(default_factory=dict)
    store: dict = field(default_factory=dict)  # the dev box store: used, sent_from, added
    warnings: list[str] = field(default_factory=list)
    # push --early: seconds from the start until every node served the version (usable) and
    # until every node held all of it (complete); None (and left out of --json) otherwise.
    usable_seconds: float | None = None
    complete_seconds: float | None = None
    first_reads: int | None = None  # push --early: files sent first (the nodes' first reads)
    first_read_bytes: int | None = None  # push --early: what of them went first, in bytes
    chunks_wanted: int | None = None  # push --early: sent ahead of the stream, for a reader
    # Seconds each step took, in order (scan, connect, current, negotiate, send, publish, keep):
    # where a slow push spent its time.
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if v is not None or k not in ("usable_seconds", "complete_seconds",
                                              "first_reads", "first_read_bytes",
                                              "chunks_wanted")}

    def left_behind(self) -> list[str]:
        """The warning lines for the nodes an --allow-partial push left behind."""
        return [f"warning: {host} left behind (--allow-partial): {cause}"
                for host, cause in sorted(self.failed.items())]


class Clock:
    """The seconds each step of a push took (PushResult.phases)."""

    def __init__(self, t0: float) -> None:
        self.last = t0
        self.phases: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.phases[step] = round(self.phases.get(step, 0.0) + now - self.last, 3)
        self.last = now
