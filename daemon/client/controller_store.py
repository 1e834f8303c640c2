"""The dev box's own content-addressed store: every chunk a push sent, in the form it goes on the
wire, so a later push of unchanged content to fresh nodes sends it again without re-reading,
re-hashing or re-compressing it.

It is a node's Store (fs/store.py, the same pack format) at $MONARCH_FS_HOME/store, plus a small
record, `snapshots.json`, of the snapshots pushed (version, workspace, when, bytes) and the
store's size as of the last push, which `status` reads without taking the store's lock. The scan
cache still says which files are unchanged (their chunk ids, unread); this is where their chunks
are found. After a push, when the packs exceed the bound (MONARCH_FS_STORE_MIB, default 20
GiB), the least recently pushed snapshots are forgotten, never the one just pushed, and a
collect frees what only they used.

A push that sends nothing, or little to nodes that serve a version of the workspace (an edit:
less than SMALL_PUSH), does not open the store when it holds this snapshot, or one of the same
workspace: it only records that snapshot as pushed now (ControllerStore.mark_pushed), since an
open reads every pack's index.

What a push sent zstd-compressed is written beside the send (keeper.py). What it sent raw (a
loopback or fast link) and compresses is not compressed there, on the cores the send and the
nodes need, but after the publish (ControllerStore.fill, with whatever else the store lacks):
a first push of the torch venv from a fresh dev box home compresses ~1 GB, 2.7 s of its 6.5 s.
By default (MONARCH_FS_STORE_FILL=background, store_keep.py) the push keeps only what no file
can give again (folder objects), records the snapshot and returns; a filler process of lowest
CPU priority reads the rest again from the folder and fills it (store_filler.py). The store
is whole for the next push to fresh nodes once it is done, which is seconds after the push on
an idle dev box, and a push to fresh nodes before then reads what it lacks from the source.

A chunk that does not compress is not copied into the store: its wire form is the file it was
read from, which a later push reads either way (encoding.py). The store only records its id,
in `sourced.ids` (SOURCED), so that it is not tried again; a push that finds the file changed
reads it as any changed file.

A Store is owned by one process at a time (an exclusive lock): a push that finds it busy asks
a filler holding it to stop (filler_control.py: it stops between two chunks and closes the
store), and takes it as soon as it is free; one that is still busy after BUSY_WAIT (another
push, a `push --watch` pushing right now) is pushed without it, and the push says so.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ...fs.chunk import ID_SIZE, RAW, CorruptChunk, compressible, decode, encode
from ...fs.manifest import Manifest
from ...fs.private_files import replace_file
from ...fs.snapshot import SourceChanged
from ...fs.store_lock import StoreBusy, lock
from ...settings import settings
from . import filler_control

if TYPE_CHECKING:
    from ...fs.store import Store

# A node's answer to a chunk whose bytes are not its id's (daemon/node/writes.py).
REJECTED = re.compile(r"rejected chunk ([0-9a-f]{32}): ")
RECORD = "snapshots.json"
SOURCED = "sourced.ids"  # ids of chunks whose wire form is their source file, 16 bytes each
BUSY_WAIT = 2.0  # seconds a push waits for a store another push (or a filler) holds
BUSY_RETRY = 0.02  # seconds between its tries: a filler asked to stop frees it in tens of ms
SEAL_RECORDS = 2048  # an open pack with this many records is sealed after a push (finish)
SMALL_PUSH = 4 << 20  # a push that sends less goes without the store (mark_pushed)
FILL_WORKERS = 2  # threads compressing what the store lacks after the publish


@dataclass
class Held:
    """One snapshot the store holds: what `status` lists, and what GC drops first (oldest)."""

    version: str  # hex
    workspace: str
    pushed: float  # time.time() of its last push
    bytes: int  # content bytes of its files


@dataclass
class Summary:
    """The record as `status` reports it (read without opening the store)."""

    path: str
    objects: int
    bytes: int
    bound: int
    snapshots: list[Held]
    filling: int | None = None  # the pid of a filler filling it now (store_filler.py)

    def to_json(self) -> dict:
        return asdict(self)


def read_summary(root: Path, bound: int, filler: bool = False) -> Summary:
    """What the store held after its last push (or its filler's last run), and (`filler`:
    for `status`, not a push's every look) which filler fills it now; an absent or damaged
    record is an empty one."""
    try:
        data = json.loads((root / RECORD).read_text())
        held = [Held(**h) for h in data["snapshots"]]
        objects, size = int(data["objects"]), int(data["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        held, objects, size = [], 0, 0
    pid = filler_control.holder(root) if filler else None
    filling = pid if pid is not None and filler_control.is_filler(pid) else None
    return Summary(str(root), objects, size, bound, held, filling)


class ControllerStore:
    """The dev box's store, open for one push (see the module docstring)."""

    def __init__(self, store: Store, bound: int):
        self.store = store
        self.root = store.root
        self.bound = bound
        self.hits = 0  # blobs (chunks, manifest) this push sent from the store
        self.added = 0  # chunks added after publishing (the nodes had them already)
        self.sourced = _read_ids(self.root / SOURCED)  # see the module docstring
        self._sourced_changed = False
        self._healed: set[bytes] = set()  # damaged copies replaced (heal): once each
        self.wrote = False  # whether this push appended to the packs (finish flushes them)

    @classmethod
    async def open(cls, root: Path, bound: int,
                   wait: float = BUSY_WAIT) -> tuple[ControllerStore | None, str | None]:
        """The store, or (None, the one-line reason the push goes on without it)."""
        from ...fs.store import Store  # (not for a push that sends little: mark_pushed)

        deadline = trio.current_time() + wait
        while True:
            try:
                store = await trio.to_thread.run_sync(Store, root, settings.pack_limit)
                return cls(store, bound), None
            except StoreBusy:
                if trio.current_time() >= deadline:
                    return None, (f"the dev box store {root} is in use by another push; "
                                  "pushed without it (every chunk read and compressed)")
                await trio.to_thread.run_sync(filler_control.ask_to_stop, root)
                await trio.sleep(BUSY_RETRY)
            except OSError as e:
                return None, f"the dev box store {root} cannot be opened ({e}); pushed without it"

    @staticmethod
    def mark_pushed(root: Path, version: bytes, workspace: str) -> bool:
        """After a push that sent nothing, or little (push.py: _Push.small_update): record, without
        opening the store (its open reads every pack's index: 50 ms at 100k chunks, more with
        every snapshot it holds), that what it holds of this push was pushed now. That is
        `version`, or else the last snapshot of `workspace` it holds, most of this one (a
        later push that needs the few chunks the edits since then sent reads them from the
        source, and keeps them). False when it holds neither, or another push holds the
        store: the push then opens it and fills it. Blocking."""
        try:
            fd = lock(root)
        except (StoreBusy, OSError):
            return False
        try:
            summary = read_summary(root, 0)
            mine = [h for h in summary.snapshots if h.version == version.hex()] or [
                h for h in summary.snapshots if h.workspace == workspace]
            if not mine:
                return False
            last = max(mine, key=lambda h: h.pushed)
            last.pushed, last.workspace = time.time(), workspace
            _write_record(root, summary.objects, summary.bytes, summary.snapshots)
            return True
        finally:
            os.close(fd)

    # ---- the blobs a push sends (worker threads) ---------------------------------------------

    def get(self, cid: bytes) -> bytes | None:
        """A chunk's wire form, if the store holds it."""
        if not self.store.has(cid):
            return None
        self.hits += 1
        return self.store.get_blob(cid)

    def add(self, cid: bytes, blob: bytes | memoryview) -> None:
        """Keep a blob just encoded from bytes checked against `cid` (not decoded again)."""
        self.wrote = True
        self.store.put_blob(cid, blob, verified=True)

    def holds(self, cid: bytes) -> bool:
        """Whether the store has the chunk, or knows that its source is its wire form."""
        return cid in self.sourced or self.store.has(cid)

    def is_sourced(self, cid: bytes) -> bool:
        return cid in self.sourced

    def add_sourced(self, cid: bytes) -> None:
        """Record that the chunk `cid`, read from a file, does not compress (thread-safe: a
        set's add is atomic)."""
        if cid not in self.sourced:
            self.sourced.add(cid)
            self._sourced_changed = True

    async def fill(self, ids: Iterable[bytes],
                   read: Callable[[bytes], bytes | bytearray | memoryview],
                   objects: Iterable[bytes] = (), workers: int = FILL_WORKERS,
                   seconds: float | None = None,
                   stop: Callable[[], bool] | None = None) -> int:
        """After the publish: add the chunks of `ids` the store lacks (those the nodes already
        had, those that went raw and compress, those the keeper had no room for: keeper.py),
        so that the next push to fresh nodes finds the store whole; how many. `objects`: those
        of `ids` that are folder objects (no file to read them from again: always kept). zstd
        releases the GIL: `workers` threads compress side by side (a first push of the torch
        venv from a fresh dev box home compresses ~1 GB here). After `seconds`, what is left
        but folder objects is left to the next push's fill, so a push's command does not wait
        for its store far longer than for its nodes."""
        todo = [cid for cid in await trio.to_thread.run_sync(self.store.missing, ids)
                if cid not in self.sourced]
        folders = set(objects)
        todo.sort(key=lambda cid: cid not in folders)  # what must be kept first
        deadline = None if seconds is None else time.monotonic() + seconds
        counts: list[int] = []
        failed: list[SourceChanged | OSError] = []

        async def worker(part: list[bytes]) -> None:
            try:
                counts.append(await trio.to_thread.run_sync(self._fill, part, read, folders,
                                                             deadline, stop))
            except (SourceChanged, OSError) as e:  # raised as itself, not in a group
                failed.append(e)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i in range(workers):
                nursery.start_soon(worker, todo[i::workers])
        if failed:
            raise failed[0]
        return sum(counts)

    def _fill(self, ids: list[bytes], read: Callable[[bytes], bytes | bytearray | memoryview],
              folders: set[bytes], deadline: float | None = None,
              stop: Callable[[], bool] | None = None) -> int:
        """fill's part on one thread; how many it kept. Blocking."""
        done = 0
        for cid in ids:
            if stop is not None and stop():
                break
            if deadline is not None and cid not in folders and time.monotonic() > deadline:
                break
            done += 1
            data = read(cid)
            blob = encode(data) if compressible(data) else None
            self.wrote = True
            if blob is not None and blob[0] != RAW:
                self.store.put_blob(cid, blob, verified=True)
            elif cid in folders:
                self.store.put_blob(cid, blob or bytes([RAW]) + data, verified=True)
            else:
                self.add_sourced(cid)
        return done

    def heal(self, failures: dict[str, str],
             read: Callable[[bytes], bytes | bytearray | memoryview]) -> dict[str, str]:
        """`failures` (node: error), each rejection of a chunk this store sent checked against
        its copy here: a damaged copy is dropped and, when the source still has the chunk,
        replaced from it (its new record, later in the packs, is the one the next open
        indexes), and the error says so and what to do (issue 33, finding 7: every push to a
        fresh node failed the same way, naming neither the store nor a way out). Blocking."""
        out = dict(failures)
        for addr, error in failures.items():
            found = REJECTED.search(error)
            cid = bytes.fromhex(found[1]) if found else b""
            if not cid or not self.store.has(cid) or cid in self._healed:
                continue
            try:
                decode(cid, self.store.get_blob(cid))
                continue  # whole here: damaged on the way, not in this store
            except (CorruptChunk, KeyError, OSError):
                pass
            self._healed.add(cid)
            self.store.forget(cid)
            self.wrote = True
            try:
                data = read(cid)
                blob = encode(data)
                self.store.put_blob(cid, blob)  # verified against the id, unlike add()
                done = "replaced it from the source; push again"
            except (CorruptChunk, OSError, ValueError, SourceChanged) as e:
                done = (f"dropped it, but the source no longer has it ({e}); push with "
                        "--no-store")
            out[addr] = f"{error}: the dev box store {self.root} held a damaged copy; {done}"
        return out

    # ---- after a push --------------------------------------------------------------------------

    def finish(self, version: bytes, workspace: str, content_bytes: int) -> list[str]:
        """Record the snapshot just pushed, then drop the least recently pushed others while
        the packs exceed the bound; returns a line per snapshot dropped. Blocking.

        The open pack is sealed once it holds SEAL_RECORDS records: an open pack has no index,
        so the next push's open would read every record's header (7 ms for 15k small files'
        chunks, at every push). A push that appended nothing flushes nothing: a cold push from
        a whole store waited here for the disk the nodes were flushing to (0.01-0.14 s, more
        under load), with nothing of its own to flush."""
        summary = read_summary(self.root, self.bound)
        held = [h for h in summary.snapshots if h.version != version.hex()]
        held.append(Held(version.hex(), workspace, time.time(), content_bytes))
        return self._settle(held)

    def settle(self, version: bytes, bound: bool = True) -> list[str]:
        """After a background fill of `version`: as finish, but the snapshots recorded stay
        as they are (when each was pushed); without `bound`, none is dropped (a push waits
        for the store). Blocking."""
        held = read_summary(self.root, self.bound).snapshots
        held.sort(key=lambda h: h.version == version.hex())  # the one never dropped: last
        return self._settle(held, bound)

    def lacks(self, ids: Iterable[bytes]) -> int:
        """How many of `ids` the store neither holds nor knows to be their own source."""
        return sum(1 for cid in self.store.missing(ids) if cid not in self.sourced)

    def _settle(self, held: list[Held], bound: bool = True) -> list[str]:
        if self.wrote:
            self.store.sync()
        if self.store.unsealed >= SEAL_RECORDS:
            self.store.seal()
        dropped: list[str] = []
        while bound and self.store.usage()[1] > self.bound and len(held) > 1:
            oldest = min(held[:-1], key=lambda h: h.pushed)
            held.remove(oldest)
            dropped.append(f"dev box store over its bound: dropped {oldest.workspace} "
                           f"{oldest.version[:12]}")
            # Read before collecting: collect holds the store's lock while it asks for them.
            live = list(self._live(held))
            self.store.seal()
            self.store.collect(live.copy)
            self.sourced = {cid for group in live for cid in group if cid in self.sourced}
            self._sourced_changed = True
        if self._sourced_changed:
            replace_file(self.root / SOURCED, b"".join(sorted(self.sourced)),
                         self.root / f"{SOURCED}.{os.getpid()}.tmp")
            self._sourced_changed = False
        self._write(held)
        return dropped

    def _live(self, held: list[Held]) -> Iterable[Iterable[bytes]]:
        """The chunk ids of each held snapshot, and its manifest's objects."""
        for h in held:
            version = bytes.fromhex(h.version)
            yield [version]
            try:
                manifest = Manifest.load(
                    version, lambda oid: decode(oid, self.store.get_blob(oid)))
            except (KeyError, ValueError, CorruptChunk):
                continue  # not held (the nodes had it): its chunks are not kept live
            yield manifest.object_ids()
            yield manifest.chunk_ids()

    def _write(self, held: list[Held]) -> None:
        _write_record(self.root, *self.store.usage(), held)

    def close(self) -> None:
        self.store.close()


def _write_record(root: Path, objects: int, size: int, held: list[Held]) -> None:
    data = {"objects": objects, "bytes": size, "snapshots": [asdict(h) for h in held]}
    replace_file(root / RECORD, json.dumps(data).encode(), root / f"{RECORD}.{os.getpid()}.tmp")


def _read_ids(path: Path) -> set[bytes]:
    """The ids in a file of ids back to back; an absent or torn file holds what it holds."""
    try:
        data = path.read_bytes()
    except OSError:
        return set()
    return {data[i : i + ID_SIZE] for i in range(0, len(data) - len(data) % ID_SIZE, ID_SIZE)}


def as_raw(cid: bytes, blob: bytes) -> bytes:
    """The same chunk in raw form, for a link faster than the codec: decompressed (and checked
    against its id) here, once, rather than on every node behind the link."""
    if blob[0] == RAW:
        return blob
    return bytes([RAW]) + bytes(decode(cid, blob))
