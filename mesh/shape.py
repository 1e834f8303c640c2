"""Where things are in a mesh: hosts x procs per host, sliced by coordinates, and the values a
call returns, one per rank.

A proc's rank is its position in the whole proc mesh (host-major: rank = host * per_host + proc),
and stays the same in every slice, so results and errors always name the same rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

Selector = int | slice | Iterable[int] | None


def select(coords: tuple[int, ...], sel: Selector, dim: str) -> tuple[int, ...]:
    """Pick coordinates of this view by position: an int, a slice, or a list of positions."""
    if sel is None:
        return coords
    if isinstance(sel, int):
        if not -len(coords) <= sel < len(coords):
            raise IndexError(f"{dim}={sel} is outside this mesh ({dim} size {len(coords)})")
        return (coords[sel],)
    picked = coords[sel] if isinstance(sel, slice) else tuple(coords[i] for i in sel)
    if not picked:
        raise ValueError(f"{dim}={sel!r} selects nothing")
    return picked


class Shaped:
    """A rectangular view of a proc mesh: some hosts x some procs of each."""

    _host_coords: tuple[int, ...]
    _proc_coords: tuple[int, ...]
    _per_host: int

    @property
    def ranks(self) -> list[int]:
        return [h * self._per_host + p for h in self._host_coords for p in self._proc_coords]

    @property
    def sizes(self) -> dict[str, int]:
        return {"host": len(self._host_coords), "proc": len(self._proc_coords)}

    def __len__(self) -> int:
        return len(self._host_coords) * len(self._proc_coords)

    def _sliced(self, host: Selector, proc: Selector) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return select(self._host_coords, host, "host"), select(self._proc_coords, proc, "proc")


class ValueMesh:
    """What a call returned, one value per rank: `vm[rank]` (the rank in the whole proc mesh),
    iteration and `list(vm)` in rank order, `vm.items()` for (rank, value) pairs."""

    def __init__(self, ranks: list[int], values: list[Any]) -> None:
        self._values = dict(zip(ranks, values))

    @property
    def ranks(self) -> list[int]:
        return list(self._values)

    def __getitem__(self, rank: int) -> Any:
        try:
            return self._values[rank]
        except KeyError:
            raise IndexError(f"rank {rank} is not in this mesh (ranks {self.ranks})") from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values.values())

    def __len__(self) -> int:
        return len(self._values)

    def items(self) -> list[tuple[int, Any]]:
        return list(self._values.items())

    def values(self) -> list[Any]:
        return list(self._values.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ValueMesh):
            return self._values == other._values
        if isinstance(other, (list, tuple)):
            return self.values() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"ValueMesh({self._values!r})"
