"""Where things are in a mesh: named dimensions (hosts first, then the per-host ones), sliced by
coordinates, and the values a call returns, one per rank.

    procs = hosts.spawn_procs(per_host={"gpus": 4})    # dims hosts x gpus
    procs.slice(gpus=0)                                 # gpu 0 of every host
    procs.slice(hosts=1, gpus=slice(0, 2))

A proc's rank is its position in the whole proc mesh (row-major over the dimensions: rank =
host * procs_per_host + its index on its host), and stays the same in every slice, so results
and errors always name the same rank. `per_host=N` names its dimension "procs"; "host" and
"proc" are accepted for "hosts" and a mesh's only per-host dimension.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

Selector = int | slice | Iterable[int] | None
HOSTS = "hosts"


def per_host_dims(per_host: int | Mapping[str, int]) -> dict[str, int]:
    """The per-host dimensions of `spawn_procs(per_host=...)`, checked."""
    dims = {"procs": per_host} if isinstance(per_host, int) else dict(per_host)
    if not dims:
        raise ValueError("per_host needs at least one dimension, e.g. {'gpus': 2}")
    for name, size in dims.items():
        if not isinstance(name, str) or not name.isidentifier() or name in (HOSTS, "host"):
            raise ValueError(f"per_host dimension {name!r}: expected a name other than "
                             "'hosts', usable as a keyword")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"per_host dimension {name!r} must be at least 1, not {size!r}")
    return dims


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


class Point(dict):
    """Coordinates by dimension name (a dict, so `slice(**point)` works) and the linear rank."""

    def __init__(self, coords: Mapping[str, int], rank: int, extent: Mapping[str, int]) -> None:
        super().__init__(coords)
        self.rank = rank
        self.extent = dict(extent)

    def __repr__(self) -> str:
        return f"Point({dict(self)!r}, rank={self.rank})"


class Shaped:
    """A rectangular view of a proc mesh: some coordinates of each named dimension."""

    _dims: tuple[str, ...]  # e.g. ("hosts", "gpus")
    _extent: tuple[int, ...]  # the whole proc mesh's size in each
    _coords: tuple[tuple[int, ...], ...]  # the positions this view keeps, per dimension

    def _init_shape(self, dims: tuple[str, ...], extent: tuple[int, ...],
                    coords: tuple[tuple[int, ...], ...] | None = None) -> None:
        self._dims, self._extent = dims, extent
        self._coords = coords or tuple(tuple(range(n)) for n in extent)

    @property
    def ranks(self) -> list[int]:
        strides = [math.prod(self._extent[i + 1:]) for i in range(len(self._extent))]
        return [sum(c * s for c, s in zip(point, strides))
                for point in itertools.product(*self._coords)]

    @property
    def sizes(self) -> dict[str, int]:
        return {d: len(c) for d, c in zip(self._dims, self._coords)}

    @property
    def extent(self) -> dict[str, int]:
        """Monarch's name for sizes."""
        return self.sizes

    def __len__(self) -> int:
        return math.prod(len(c) for c in self._coords)

    def _dim(self, key: str) -> int:
        names = {d: i for i, d in enumerate(self._dims)}
        if key == "host":
            key = HOSTS
        elif key == "proc" and len(self._dims) == 2:
            key = self._dims[1]
        if key not in names:
            raise ValueError(f"no dimension {key!r} in this mesh (dimensions: "
                             f"{', '.join(self._dims)})")
        return names[key]

    def _sliced(self, selectors: Mapping[str, Selector]) -> tuple[tuple[int, ...], ...]:
        coords = list(self._coords)
        for key, sel in selectors.items():
            i = self._dim(key)
            coords[i] = select(coords[i], sel, self._dims[i])
        return tuple(coords)

    def point_of(self, rank: int) -> Point:
        """The coordinates of `rank` in the whole mesh."""
        coords, rest = {}, rank
        for d, n in zip(reversed(self._dims), reversed(self._extent)):
            rest, coords[d] = divmod(rest, n)
        return Point({d: coords[d] for d in self._dims}, rank, dict(zip(self._dims, self._extent)))


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
