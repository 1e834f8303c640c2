"""A dict made from the one before it at the cost of the changes: the index of a new version.

A node indexes each version it serves by path (fs/inodes.py's Tree). An edit changes a few
paths of 100k, and copying the whole dict for it cost 4 ms a version on a node. A `Layered`
shares the previous version's dict (its `base`, never changed once shared) and holds only this
version's differences on top; when those grow past a sixteenth of the base, one copy folds them
in. A lookup is two dict lookups at most, whatever the history.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

_GONE = object()  # in `_top`: a key of the base that this version no longer has
FOLD_MIN = 1024  # differences kept on top before a fold is considered at all


class Layered(MutableMapping[K, V]):
    """A mapping: `base` (shared, read-only from here on) with this one's changes on top.
    Iterating it (or its keys, items, values) makes a flat copy first: O(size)."""

    __slots__ = ("_base", "_top", "_len")

    def __init__(self, base: dict[K, V] | None = None) -> None:
        self._base: dict[K, V] = base if base is not None else {}
        self._top: dict[K, object] = {}
        self._len = len(self._base)

    def derive(self) -> Layered[K, V]:
        """A new mapping equal to this one, to change without changing this one: it copies
        only the differences (and folds them into a new base once they are many)."""
        new: Layered[K, V] = Layered.__new__(Layered)
        new._len = self._len
        if len(self._top) > max(FOLD_MIN, len(self._base) // 16):
            new._base, new._top = self.flat(), {}
        else:
            new._base, new._top = self._base, self._top.copy()
        return new

    def flat(self) -> dict[K, V]:
        """A plain dict of the same items (a copy: O(size))."""
        out = self._base.copy()
        for k, v in self._top.items():
            if v is _GONE:
                del out[k]
            else:
                out[k] = v  # type: ignore[assignment]  # (not _GONE: a V)
        return out

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key, default=None):
        top = self._top
        if key in top:
            v = top[key]
            return default if v is _GONE else v
        return self._base.get(key, default)

    def __getitem__(self, key: K) -> V:
        v = self.get(key, _GONE)
        if v is _GONE:
            raise KeyError(key)
        return v  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        if key in self._top:
            return self._top[key] is not _GONE
        return key in self._base

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self:
            self._len += 1
        self._top[key] = value

    def __delitem__(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        self._len -= 1
        if key in self._base:
            self._top[key] = _GONE
        else:
            del self._top[key]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        return iter(self.flat())


def derived(m: Mapping[K, V]) -> Layered[K, V]:
    """A mapping equal to `m`, to change without changing `m` (a plain dict is shared, not
    copied: it must not change afterwards)."""
    return m.derive() if isinstance(m, Layered) else Layered(m if isinstance(m, dict) else dict(m))
