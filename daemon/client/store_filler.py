"""The dev box store's background filler: after a push returned, it compresses into the store
the chunks of the snapshot the store lacks (store_keep.py says why the push does not wait for
them), so that the next push to fresh nodes sends everything from the store.

`python -m monarch_fs.daemon.client.store_filler SPEC` (filler_control.start, with SPEC the
JSON of what the push was: home, store, bound, src, excludes, cache, version, name):

- It lowers its CPU priority first (SCHED_IDLE, else nice 19): it runs only on cores nothing
  else wants, and a push or a job on the dev box does not share them with it.
- It takes the store's lock without waiting: busy, it exits (a push holds the store, and
  fills it itself). It records its pid in the store's folder while it holds the lock.
- It finds the chunks as the push did: it scans the folder again with the same excludes,
  through the push's scan cache (one walk when warm), which it reads and never writes (a
  later push may be writing it). A folder changed since the push is filled as it is now:
  that is what the next push needs. Each chunk is read and checked against its id by
  ControllerStore.fill, which asks between chunks whether to stop.
- A push that wants the store asks it to stop (filler_control.py): it stops within a chunk
  (its check runs every CHECK_EVERY at most), makes durable what it wrote, closes the store
  and exits. What it wrote is flushed every FLUSH_EVERY meanwhile, so that the push finds
  little to flush or check. What it left is recorded as pending, and that push's own filler
  fills it after its own folder (the same folder's, as it is now, once).
- It writes one line per run to HOME/store-fill.log: what it kept and in how long, or why it
  stopped. A home removed under it stops it, quietly (a line, if it can).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import trio

from ... import collector
from ...fs.private_files import replace_file
from ...fs.scan import ScanStopped, scan
from ...fs.scan_cache import ScanCache, file_key
from ...fs.snapshot import Snapshot, SourceChanged
from ...fs.store import Store, StoreBusy
from ...settings import settings
from . import filler_control
from .controller_store import ControllerStore

CHECK_EVERY = 0.005  # seconds: at most this often, a look for a request to stop
FLUSH_EVERY = 1.0  # seconds between flushes of what it wrote
LOG_MAX = 1 << 20  # the log is cut to its last half past this size


class ReadOnlyCache(ScanCache):
    """The push's scan cache, read and never written (not even its use time): a later push
    may be saving it now. What a scan here would record is simply not kept."""

    def save(self) -> bool:
        return False

    def save_facts(self) -> None:
        pass

    def discard(self) -> None:  # a stale entry: the next push finds it so, and clears it
        self._old, self._new, self._file = {}, {}, None

    @staticmethod
    def _touch(path: str) -> tuple[int, int, int, int] | None:
        return file_key(path)


class Stop:
    """Asked before each chunk, by both fill threads: whether to stop, and why."""

    def __init__(self, store: Path, pid: int) -> None:
        self.store, self.flag = store, filler_control.stop_path(store, pid)
        self.why: str | None = None
        self._next = 0.0

    def __call__(self) -> bool:
        if self.why is not None:
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + CHECK_EVERY
        if self.flag.exists():
            self.why = "a push asked for the store"
        elif not self.store.is_dir():
            self.why = "the store's folder was removed"
        return self.why is not None


def lower_priority() -> str:
    """The lowest CPU priority this process may take (threads started later inherit it)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        try:
            os.nice(19 - os.nice(0))
        except OSError:
            return "normal"
        return "nice 19"


def log(home: Path, line: str) -> None:
    """One line in HOME/store-fill.log, if the home is still there."""
    path = filler_control.log_path(home)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        if path.stat().st_size > LOG_MAX:  # keep the last half
            data = path.read_bytes()
            replace_file(path, data[len(data) // 2:], f"{path}.{os.getpid()}.tmp")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:  # the home is gone: nobody is left to read it
        return
    try:
        os.write(fd, f"{stamp} filler {os.getpid()}: {line}\n".encode())
    finally:
        os.close(fd)


async def fill(spec: dict, started: float) -> str:
    """The filler's run (see the module docstring); the line to log."""
    store_dir = Path(spec["store"])
    what = f"{spec['name']} {spec['version'][:12]}"
    if not store_dir.is_dir():  # removed with its home: make nothing again there
        return f"{what}: the store {store_dir} is gone; nothing filled"
    try:
        raw = await trio.to_thread.run_sync(Store, store_dir, settings.pack_limit)
    except StoreBusy:
        return f"{what}: the store is in use (a push holds it, and fills it); nothing filled"
    except OSError as e:
        return f"{what}: the store {store_dir} cannot be opened ({e}); nothing filled"
    store = ControllerStore(raw, int(spec["bound"]))
    pid = os.getpid()
    stop = Stop(store_dir, pid)
    pidfile = filler_control.pid_path(store_dir)
    try:
        replace_file(pidfile, str(pid).encode(), f"{pidfile}.{pid}.tmp")
        filler_control.drop_stale_requests(store_dir)
        line, unfinished = await _fill(spec, store, stop, started)
        return f"{what}: {line}{await _fill_pending(spec, unfinished, store, stop)}"
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_release, store, pidfile, stop)


async def _fill_pending(spec: dict, unfinished: bool, store: ControllerStore,
                       stop: Stop) -> str:
    """Then what fillers stopped by a push left of other snapshots (filler_control.py:
    pending), until asked to stop too; this one's spec pending in turn if it was stopped.
    What to add to the log line."""
    root = store.root
    pending = [p for p in filler_control.read_pending(root) if not _same(p, spec)]
    done: list[str] = []
    for other in list(pending):
        if stop.why is not None:
            break
        line, left = await _fill(other, store, stop, time.monotonic())
        done.append(f"; then {other['name']} {other['version'][:12]}, left by a filler "
                    f"stopped before: {line}")
        if not left:
            pending.remove(other)
    try:
        filler_control.write_pending(root, pending + ([spec] if unfinished else []))
    except OSError:  # the store's folder removed under it
        pass
    return "".join(done)


def _same(a: dict, b: dict) -> bool:
    """The same folder pushed as the same workspace (a later version replaces an earlier)."""
    return (a["src"], a["name"]) == (b["src"], b["name"])


def _release(store: ControllerStore, pidfile: Path, stop: Stop) -> None:
    """The pid file goes while the lock is held, then the lock, then this run's request."""
    _unlink(pidfile)
    store.close()
    _unlink(stop.flag)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


async def _fill(spec: dict, store: ControllerStore, stop: Stop,
                started: float) -> tuple[str, bool]:
    """Fill what the folder of `spec` holds now: the line to log, and whether some is left
    because a request stopped it."""
    src = spec["src"]
    cache = ReadOnlyCache.for_folder(spec["cache"], src) if spec["cache"] else None
    stopped = threading.Event()  # the walk looks between folders: a request during the scan
    snap: Snapshot | None = None
    failed = ""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch, stop, stopped)
        try:
            with collector.paused(freeze=True):
                snap = await scan(src, spec["excludes"], cache=cache, stop=stopped)
        except ScanStopped:
            failed = f"stopped while scanning ({stop.why}); nothing filled"
        except OSError as e:
            failed = f"the folder {src} cannot be scanned ({e}); nothing filled"
        nursery.cancel_scope.cancel()
    if snap is None:
        return failed, stop.why is not None
    now = snap.manifest.id.hex()
    changed = ("" if now == spec["version"] else
               f" (the folder changed since the push: filled it as it is now, {now[:12]})")
    objects = snap.manifest.objects()
    ids = [*snap.manifest.chunk_ids(), *objects]

    def read(cid: bytes) -> bytes | bytearray | memoryview:
        obj = objects.get(cid)
        return obj if obj is not None else snap.read_chunk(cid)

    kept, failed = 0, ""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flush_every, store)
        try:
            kept = await store.fill(ids, read, objects, stop=stop)
        except (SourceChanged, OSError) as e:  # an edit during the fill, a full disk
            failed = f" ({e})"
        nursery.cancel_scope.cancel()
    if not store.root.is_dir():  # its home removed under it: nothing to record there
        return "stopped (the store's folder was removed); nothing recorded", False
    # Not the bound's collect when a push waits for the store: that push applies it.
    whole = stop.why is None and not failed
    await trio.to_thread.run_sync(store.settle, bytes.fromhex(spec["version"]), whole)
    left = await trio.to_thread.run_sync(store.lacks, ids)
    seconds = time.monotonic() - started
    if stop.why is not None:
        return (f"stopped after {seconds:.2f} s ({stop.why}): kept {kept} chunks, {left} left "
                f"to the next filler{changed}"), left > 0
    if failed:
        return (f"stopped after {seconds:.2f} s{failed}: kept {kept} chunks, {left} left"
                f"{changed}"), False
    return f"kept {kept} chunks in {seconds:.2f} s; {left} lacking{changed}", False


async def _watch(stop: Stop, stopped: threading.Event) -> None:
    while not stop():
        await trio.sleep(CHECK_EVERY)
    stopped.set()


async def _flush_every(store: ControllerStore) -> None:
    while True:
        await trio.sleep(FLUSH_EVERY)
        if store.wrote:
            try:
                await trio.to_thread.run_sync(store.store.flush)
            except OSError:  # the fill meets it too, and says so
                return


def main(argv: list[str]) -> int:
    started = time.monotonic()
    priority = lower_priority()
    spec = json.loads(argv[0])
    home = Path(spec["home"])
    try:
        line = trio.run(fill, spec, started)
    except OSError as e:  # its store removed under it, say: nothing to leave whole
        line = f"{spec['name']} {spec['version'][:12]}: stopped ({e})"
    log(home, f"{line} [{priority}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
