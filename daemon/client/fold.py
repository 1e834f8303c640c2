"""Output of many ranks, folded: identical lines that ranks print within a short window are
printed once, `[ranks 0-63] epoch 3 done`, and what differs stays a line per rank. `run`
folds its live output (mesh/spmd.py) and `logs` the lines it reads back; `--no-fold` prints
every line, `[rank R] ...`, as it comes.

A line is held for WINDOW seconds from the first rank that printed it, gathering the ranks
that print the same text on the same stream meanwhile; lines go out in the order they were
first printed. A rank's own lines keep their order: a line joins a held group only if that
rank has nothing held after the group, or if the group can move behind what it has (none of
the group's ranks has anything held after it); else it starts a new group. So no rank's line
is ever printed before one it printed earlier. At most MAX_HELD groups wait: past it, the
oldest go.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

WINDOW = 0.5  # seconds a line waits for the same line from other ranks
MAX_HELD = 10_000


def rank_ranges(ranks: Iterable[int]) -> str:
    """`0-2,4,6-7` for ranks 0, 1, 2, 4, 6, 7."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def prefix(ranks: list[int]) -> str:
    return f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {rank_ranges(ranks)}]"


@dataclass
class _Group:
    seq: int
    first: float
    stream: str
    text: str
    ranks: list[int] = field(default_factory=list)


class FoldedOutput:
    """Where ranks' lines go: `lines(rank, stream, texts)` as they come, `due()` now and
    then (lines whose window passed go out), `flush()` before anything else is said."""

    def __init__(self, out: TextIO, err: TextIO, *, fold: bool = True, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.err = out, err
        self.fold = fold
        self.window = window
        self.clock = clock
        # By seq, oldest first (taking the oldest is O(1) whatever was deleted before it).
        self._held: OrderedDict[int, _Group] = OrderedDict()
        self._latest: dict[tuple[str, str], _Group] = {}  # (stream, text) -> newest group
        self._last_of: dict[int, int] = {}  # rank -> seq of its newest held group
        self._seq = 0
        self._written = False

    def lines(self, rank: int, stream: str, texts: Iterable[str],
              at: float | None = None) -> None:
        """Lines rank `rank` printed on `stream` (stdout or stderr), at `at` (default now)."""
        if not self.fold:
            self._write(stream, "".join(f"[rank {rank}] {t}\n" for t in texts))
            self._flush_streams()
            return
        now = self.clock() if at is None else at
        for text in texts:
            key = (stream, text)
            g = self._latest.get(key)
            if g is None or g.seq not in self._held or rank in g.ranks:
                g = self._new(_Group(0, now, stream, text))
            elif self._last_of.get(rank, -1) > g.seq:
                # This rank printed something held after g: g can move behind that only if
                # none of its ranks did too.
                if any(self._last_of[r] != g.seq for r in g.ranks):
                    g = self._new(_Group(0, now, stream, text))
                else:
                    del self._held[g.seq]
                    g = self._new(g)
                    for r in g.ranks:
                        self._last_of[r] = g.seq
            g.ranks.append(rank)
            self._last_of[rank] = g.seq
        while len(self._held) > MAX_HELD:
            self._emit(next(iter(self._held.values())))
        self.due(now)

    def _new(self, g: _Group) -> _Group:
        """`g`, held as the newest group."""
        self._seq += 1
        g.seq = self._seq
        self._held[g.seq] = g
        self._latest[(g.stream, g.text)] = g
        return g

    def due(self, now: float | None = None) -> None:
        """Print the held lines whose window has passed."""
        now = self.clock() if now is None else now
        while self._held:
            g = next(iter(self._held.values()))
            if now - g.first < self.window:
                break
            self._emit(g)
        self._flush_streams()

    def flush(self) -> None:
        """Print every held line."""
        while self._held:
            self._emit(next(iter(self._held.values())))
        self._flush_streams()

    def _emit(self, g: _Group) -> None:
        del self._held[g.seq]
        if self._latest.get((g.stream, g.text)) is g:
            del self._latest[(g.stream, g.text)]
        self._write(g.stream, f"{prefix(g.ranks)} {g.text}\n")

    def _write(self, stream: str, text: str) -> None:
        (self.err if stream == "stderr" else self.out).write(text)
        self._written = True

    def _flush_streams(self) -> None:
        """Flush once per call, not per line: `logs` prints a million lines."""
        if self._written:
            self._written = False
            self.out.flush()
            self.err.flush()
