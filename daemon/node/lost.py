"""Versions a crash took chunks from: not served; the last whole version is, until a push.

With `--durable background` a version is published before its chunks are flushed, so a power
cut can take some of them (or its manifest's folder objects) with the page cache. At start the
store verifies what lies past each durable point and drops what does not verify (fs/durable.py);
then every retained version that is not early (incomplete.py: those may lack chunks by design)
is checked against the store. One that lacks an object is not served: the workspace serves the
newest retained version that is whole, and `status` (`lost`, and a line under `problems`) and
the event log (`version.lost`) say which version was lost and how many of its chunks. A push
of it asks what the node lacks (the node no longer says it serves it), sends that, and its
commit clears the loss. A workspace with no whole version is not served at all (Refs.hold).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("monarch_fs.daemon")


@dataclass(frozen=True)
class LostVersion:
    """A workspace's current version that a crash took chunks from."""

    version: bytes
    chunks: int | None  # distinct chunks of it the store lacks; None: its manifest was lost
    serving: bytes | None  # the whole version served instead; None: the workspace is not

    def describe(self, name: str) -> str:
        """One line for `status` and the log: what was lost, what is served, what repairs it."""
        what = (f"lost {self.chunks} chunks" if self.chunks is not None
                else "lost folder objects of its manifest")
        instead = (f"serving {self.serving.hex()[:12]}, the last whole version"
                   if self.serving is not None else "no whole version left to serve")
        return (f"workspace {name!r}: version {self.version.hex()[:12]} {what} in an unclean "
                f"stop (not flushed to disk yet); {instead}; a push of it repairs it")

    def to_wire(self) -> dict[str, object]:
        return {"version": self.version.hex(), "chunks": self.chunks,
                "serving": self.serving.hex() if self.serving is not None else None}


class Losses:
    """The workspaces whose current version was lost at start, until each is published again."""

    def __init__(self) -> None:
        self.by_name: dict[str, LostVersion] = {}

    def note(self, name: str, lost: LostVersion) -> None:
        self.by_name[name] = lost
        log.error("%s", lost.describe(name))

    def published(self, name: str) -> None:
        """`name` was published again: whatever it serves now is whole."""
        self.by_name.pop(name, None)

    def problems(self) -> list[str]:
        return [lost.describe(name) for name, lost in sorted(self.by_name.items())]

    def to_wire(self) -> dict[str, dict[str, object]]:
        return {name: lost.to_wire() for name, lost in sorted(self.by_name.items())}
