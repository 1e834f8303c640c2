"""What a proc mesh does with its procs' output: forward it to the controller or not, and fold
the identical lines many ranks print at once (a progress line from 64 ranks is one line).

    procs.logging_option(stream_to_client=True, aggregate_window_sec=3, level=logging.INFO)

Folding waits for the window to end, then prints each distinct line once, with the ranks that
printed it: `[procs ranks 0-3, 4 lines] loss 0.25`. A line one rank printed alone keeps its
usual prefix. The level is set on the procs' root logger (with a stderr handler if it has
none), so `logging.info` in an actor shows at INFO and not at WARNING.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import trio

Output = Callable[[str, int, str, list[str]], None]  # (mesh name, rank, stream, lines)


def _ranges(ranks: list[int]) -> str:
    """0-3,6 for [0, 1, 2, 3, 6]."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


class LogControl:
    """The output callback of one proc mesh, with its options."""

    def __init__(self, output: Output | None) -> None:
        self.output = output
        self.forward = output is not None
        self.window: float | None = None
        self._folding: dict[tuple[str, str], list[int]] = {}
        self._scope: trio.CancelScope | None = None
        self._mesh = ""

    def __call__(self, mesh: str, rank: int, stream: str, lines: list[str]) -> None:
        if not self.forward or self.output is None:
            return
        if self.window is None:
            self.output(mesh, rank, stream, lines)
            return
        self._mesh = mesh
        for line in lines:
            self._folding.setdefault((stream, line), []).append(rank)

    def configure(self, nursery: trio.Nursery | None, forward: bool,
                  window: float | None) -> None:
        """New options (in the mesh's loop): flush what was folded so far, then apply them."""
        if window is not None and not forward:
            raise ValueError("aggregate_window_sec folds lines forwarded to the controller: "
                             "it needs stream_to_client=True")
        if window is not None and window <= 0:
            raise ValueError(f"aggregate_window_sec must be positive, not {window!r}")
        self.flush()
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None
        self.forward, self.window = forward and self.output is not None, window
        if window is not None and nursery is not None:
            nursery.start_soon(self._flush_every, window)

    async def _flush_every(self, window: float) -> None:
        with trio.CancelScope() as self._scope:
            while True:
                await trio.sleep(window)
                self.flush()

    def flush(self) -> None:
        folding, self._folding = self._folding, {}
        if self.output is None:
            return
        for (stream, line), ranks in folding.items():
            if len(ranks) == 1:
                self.output(self._mesh, ranks[0], stream, [line])
                continue
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write(f"[{self._mesh} ranks {_ranges(ranks)}, {len(ranks)} lines] {line}\n")
            out.flush()
