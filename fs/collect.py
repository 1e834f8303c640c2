"""Freeing the store's space: sealed packs that hold no live object are deleted, and those mostly
dead are compacted (their live objects copied to the open pack, then deleted).

Apart from the Store's write and read paths (fs/store.py) because it is the one part that
removes anything, with its own crash reasoning (see `collect`). It sees the store through
`Packs`, the few members it needs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from . import pack
from .chunk import CorruptChunk, decode
from .durable import Seals
from .pack import PACK_SHIFT, RECORD, unloc
from .private_files import fsync_dir

# A sealed pack whose live records fill less than this is compacted (see collect), copying
# at most COMPACT_MAX_BYTES per collect.
COMPACT_BELOW = 0.5
COMPACT_MAX_BYTES = 256 * 1024 * 1024

Live = Callable[[], Iterable[Iterable[bytes]]]


class Packs(Protocol):
    """What a collect uses of the Store: its packs, its index, and its append and read paths."""

    packs: Path
    _index: dict[bytes, int]  # id -> pack.loc(pack, offset, length)
    _lock: threading.Lock
    _cur: int  # the open pack, never collected
    seals: Seals  # nor full packs not sealed yet
    _unreadable: set[int]
    _readers: dict[int, int]
    _retired: list[int]

    def get_blob(self, cid: bytes) -> bytes: ...

    def _append(self, cid: bytes, parts: list[bytes | memoryview]) -> None: ...

    def sync(self) -> None: ...


def collect(store: Packs, live: Live) -> tuple[int, int]:
    """Free the space of objects outside `live()`; (packs deleted, bytes freed).

    A sealed pack holding no live object is deleted. A sealed pack whose live records fill
    less than COMPACT_BELOW of it is compacted: its live objects are read, verified and
    appended to the open pack, which is made durable, and then it is deleted too. Without
    that, a node pushed small edits for months would keep whole packs for the odd live
    file in each. At most COMPACT_MAX_BYTES are copied per collect (a push waits for it).

    `live()` gives the live ids in groups (one per retained version, say), and may be
    called twice. Its ids are looked up, never all kept: on a daemon holding 100k files a
    set of them would be its largest allocation. A first pass finds the packs no group
    fills to COMPACT_BELOW; only for those does a second pass collect the live ids, which
    tell exactly which to compact and what to copy. Deleted packs' objects leave the index
    first, so from then on `missing` reports them and a push sends them again; the open
    pack is never touched. A pack's index goes before the pack: a crash in between leaves
    a pack that the next start scans and the next collect deletes. A crash after the
    copies leaves those objects twice; the newer pack wins at start, and the next collect
    deletes the older. Blocking: run it in a worker thread."""
    for fd in store._retired:  # any read that used them finished long ago
        os.close(fd)
    store._retired.clear()
    most: dict[int, int] = {}  # pack -> the most bytes of live records one group has there
    with store._lock:
        sizes = {int(p.stem): p.stat().st_size for p in store.packs.glob("*.pack")
                 if p.stem.isdigit()}
        for group in live():
            for n, used in _bytes_by_pack(store, group).items():
                most[n] = max(most.get(n, 0), used)
        sealed = set(sizes) - {store._cur} - store._unreadable - set(store.seals.pending)
    doomed = sealed - set(most)
    maybe = {n for n in sealed & set(most) if most[n] < COMPACT_BELOW * sizes[n]}
    freed = _delete(store, doomed, sizes)
    compacted = 0
    if maybe:
        compacted, more = _compact(store, maybe, sizes, live)
        freed += more
    return len(doomed) + compacted, freed


def _bytes_by_pack(store: Packs, ids: Iterable[bytes]) -> dict[int, int]:
    """Bytes of the records of `ids`, per pack."""
    index = store._index
    out: dict[int, int] = {}
    for cid in ids:
        if (location := index.get(cid)) is not None:
            n, _, length = unloc(location)
            out[n] = out.get(n, 0) + RECORD.size + length
    return out


def _compact(store: Packs, maybe: set[int], sizes: dict[int, int], live: Live
             ) -> tuple[int, int]:
    """Compact those of `maybe` that are less than COMPACT_BELOW live, within the budget:
    copy their live objects to the open pack, then delete them. (packs, bytes freed)."""
    index = store._index
    ids = {cid for group in live() for cid in group
           if (location := index.get(cid)) is not None and location >> PACK_SHIFT in maybe}
    used = _bytes_by_pack(store, ids)
    packs: set[int] = set()
    budget = COMPACT_MAX_BYTES
    for n in sorted(maybe, key=lambda n: used.get(n, 0)):
        live_bytes = used.get(n, 0)
        if live_bytes < COMPACT_BELOW * sizes[n] and (not packs or live_bytes <= budget):
            packs.add(n)
            budget -= live_bytes
    copied = 0
    for cid in sorted(ids, key=lambda c: index.get(c, 0)):  # in pack order
        if index.get(cid, 0) >> PACK_SHIFT not in packs:
            continue
        blob: bytes | None
        try:
            blob = store.get_blob(cid)
            decode(cid, blob)
        except KeyError:
            continue
        except CorruptChunk:
            blob = None  # damaged: not copied, so missing from now on; a push resends it
        with store._lock:
            location = index.get(cid)
            if location is None or location >> PACK_SHIFT not in packs:
                continue
            if blob is None:
                del index[cid]
                continue
            store._append(cid, [blob])
            copied += RECORD.size + len(blob)
    if packs:
        store.sync()  # the copies are durable before the originals go
    return len(packs), _delete(store, packs, sizes) - copied


def _delete(store: Packs, packs: set[int], sizes: dict[int, int]) -> int:
    """Delete sealed packs, their objects leaving the index first; the bytes freed (their
    `sizes`: sealed packs do not change)."""
    if not packs:
        return 0
    with store._lock:
        for cid in [c for c, location in store._index.items()
                    if location >> PACK_SHIFT in packs]:
            del store._index[cid]
        _retire(store, packs)
    for n in sorted(packs):
        pack.idx_path(store.packs, n).unlink(missing_ok=True)
        pack.pack_path(store.packs, n).unlink(missing_ok=True)
    with store._lock:
        _retire(store, packs)  # a read may have opened one of them in the meantime
    fsync_dir(store.packs)
    return sum(sizes[n] for n in packs)


def _retire(store: Packs, packs: set[int]) -> None:
    """Hand the read descriptors of deleted packs to the next collect. Holds store._lock."""
    for n in packs:
        fd = store._readers.pop(n, None)
        if fd is not None:
            store._retired.append(fd)
