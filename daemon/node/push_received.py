"""What one session received of a push, for the `push.received` event its flush records
(docs/reference/events.md): apart from the session (session.py), which only counts into it."""

from __future__ import annotations

import time

from .events import EventLog


def hex_or_none(version: bytes | None) -> str | None:
    return version.hex() if version is not None else None


class PushReceived:
    """What one session received of a push between two flushes (chunks, bytes, from the
    first chunk to the flush), what it was asked and lacked, and its place in the broadcast:
    the `push.received` row a flush records."""

    def __init__(self) -> None:
        self.version: bytes | None = None  # the push's manifest, when the client said
        self.topology = "leaf"
        self._reset()

    def _reset(self) -> None:
        self.chunks = self.bytes = self.asked = self.lacking = 0
        self.started: float | None = None

    def arrived(self, count: int, size: int) -> None:
        """`count` chunks of `size` bytes in all arrived."""
        self.chunks += count
        self.bytes += size
        if self.started is None:
            self.started = time.monotonic()

    def opened(self, version: bytes | None, children: list[dict]) -> None:
        """A relay session: this node forwards to `children` (each with its own subtree)."""
        self.version = version
        self.topology = (f"relay to {len(children)} ({_below(children)} below)" if children
                         else "leaf")

    def flushed(self, events: EventLog, peer: str, failed: dict[str, str],
                transport: str) -> None:
        if self.chunks or self.asked:
            seconds = time.monotonic() - self.started if self.started is not None else 0.0
            events.record("push.received", version=hex_or_none(self.version), peer=peer,
                          count=self.chunks, bytes=self.bytes, seconds=round(seconds, 6),
                          topology=self.topology, transport=transport,
                          text="; ".join(f"{a or 'here'}: {w}" for a, w in failed.items())
                          or None,
                          detail={"asked": self.asked, "lacking": self.lacking})
        self._reset()


def _below(kids: list[dict]) -> int:
    """The nodes in a relay plan's subtrees."""
    return sum(1 + _below(k.get("children", [])) for k in kids)
