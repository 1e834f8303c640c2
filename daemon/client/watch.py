"""`monarch-fs push --watch`: push a folder again every time it changes, for edit-run loops.

The folder is watched with inotify, through the Rust `notify` backend of watchfiles, and the
watch is in place before the first push starts, so an edit made while a push runs is not lost:
it starts the next push as soon as that one ends. A burst of changes (an editor saving, a `git
checkout`) is pushed once, when nothing has changed for `quiet_ms` or at most `debounce_ms` after
its first change. Changes below excluded paths are ignored.

The tree is scanned whole once; after that, a change costs a look at the folders that hold the
changed paths (fs.rescan), and the nodes are asked only about chunks the last push did not
give them all. Should the watcher miss a change (inotify can drop events under a flood), the
whole scan that runs once things are quiet after a push finds it and pushes it. That scan
(about a second at 100k files) gives way to an edit that comes in while it runs: the edit is
pushed at once, and the check runs again once things are quiet.

Python's cyclic garbage collector is paused while a change is rescanned and pushed: the snapshot
of a large tree holds dicts of 100k items, and a collection that traverses them would add its
15 ms or more to the edit it lands in (measured at 100k files); it runs between pushes instead.

With --on-demand (what `push --keep-warm` leaves in the background) the watch pushes first, then
only what a one-shot `monarch-fs push` hands over (handoff.py): changes are still rescanned as
they come, so the one-shot command costs its start and the push of what changed, as git's
fsmonitor spares `git status` its walk. With an idle time it stops after that long without a push.

One line per push goes to stdout (a JSON object per line with --json); a failed push is reported
on stderr and watching goes on. SIGINT (Ctrl-C) or SIGTERM stops watching: exit status 0, or 130
when a push had to be cancelled mid-way (publishing is two-phase, so unless that push was already
committing, every node keeps its previous version).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TextIO

import trio
from watchfiles._rust_notify import RustNotify  # documented: watchfiles' "Rust backend" API

from ...fs.private_files import private_dir
from ...fs.rescan import rescan
from ...fs.scan import ScanStopped, is_excluded, scan
from ...fs.scan_cache import ScanCache
from ...fs.snapshot import Snapshot
from . import handoff
from .handoff_answer import Asked, Judge, serve_handoffs
from .progress import fmt_bytes
from .push_result import PushResult

QUIET_MS = 5  # an editor's save is a few events within a millisecond or two
DEBOUNCE_MS = 1000
CHECK_MS = 2000  # quiet for this long after a push: scan the whole tree, in case of a miss
CHECK_POLL_MS = 20  # during that scan, how often the watcher is asked whether an edit came

# push_once(snapshot, held): push `snapshot` of the folder; `held`, the snapshot every node took
# last (None: not known)
PushOnce = Callable[[Snapshot, Snapshot | None], Awaitable[PushResult]]


def summary(result: PushResult, changes: int) -> str:
    """The one line printed for a push."""
    why = "first push" if changes == 0 else f"{changes} change{'s' * (changes != 1)}"
    return (f"{time.strftime('%H:%M:%S')} pushed {result.name} {result.version[:12]} to "
            f"{result.nodes} nodes in {result.seconds:.2f}s ({why}): sent "
            f"{fmt_bytes(result.bytes_sent)} in {result.chunks_sent} chunks; {result.files} files, "
            f"{fmt_bytes(result.bytes)}")


class _Filter:
    """Which reported paths count as changes: inside the folder, not excluded, not ignored."""

    def __init__(self, root: str, excludes: Sequence[str],
                 ignore: Sequence[str | os.PathLike[str]]):
        self.root = root
        self.excludes = tuple(excludes)
        self.ignore = [os.path.abspath(p) for p in ignore]

    def __call__(self, path: str) -> bytes | None:
        """The path relative to the root ("" for the root itself) if it counts, else None."""
        if any(path == p or path.startswith(p + os.sep) for p in self.ignore):
            return None
        rel = os.path.relpath(path, self.root)
        if rel == ".":
            return b""
        if rel.startswith(".." + os.sep) or rel == "..":
            return None
        brel = os.fsencode(rel)
        return None if is_excluded(brel, self.excludes) else brel


# A hand-off wakes the wait for changes by touching a file in a folder of its own that the
# watcher also watches (HOME/watch/PID.wake, private): the watcher returns what it holds, the
# wake's path among it, which counts for nothing. (Not through the watcher's stop event:
# RustNotify drops the changes it holds when that is set.) The wait had looked for hand-offs
# every 25 ms, which was most of a hand-off's time; it still looks every POLL_MS, should a
# wake be lost.
WAKE = "wake"  # the file touched
POLL_MS = 1000
FLUSH_STEP_MS = 1  # asking the watcher what it holds up to a hand-off: not a whole quiet_ms


async def watch(
    src: str | os.PathLike[str],
    push_once: PushOnce,
    *,
    cache: ScanCache | None = None,
    excludes: Sequence[str] = (),
    ignore: Sequence[str | os.PathLike[str]] = (),
    json_lines: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    quiet_ms: int = QUIET_MS,
    debounce_ms: int = DEBOUNCE_MS,
    judge: Judge | None = None,
    on_demand: bool = False,
    idle_s: float | None = None,
) -> int:
    """Push now, then after every change of `src` (see the module docstring), until SIGINT or
    SIGTERM. `push_once` does one push; `cache` is the folder's scan cache, for the whole
    scans; `ignore` lists paths whose changes never count (the scan cache, should it live
    inside the folder). With `judge`, one-shot pushes of this folder are taken over a socket
    in handoff.sockets() (see handoff.py). `on_demand`: after the first push, push only what
    is handed over (changes are still rescanned as they come, so a hand-off costs the push
    alone). `idle_s`: stop after that many seconds without a push. Returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    root = os.path.abspath(src)
    if not os.path.isdir(root):
        raise NotADirectoryError(f"{root} is not a directory")
    wake = handoff.sockets() / f"{os.getpid()}.wake" if judge is not None else None
    # (the hand-offs' folder never counts, should it lie inside the one watched)
    counts = _Filter(root, excludes, [*ignore, *([handoff.sockets()] if wake else [])])
    stop = threading.Event()  # checked by the watcher thread every quiet_ms
    pushing = False
    interrupted = False
    last_warnings: list[str] = []
    outcome: PushResult | BaseException | None = None  # of the last push
    waiting: list[Asked] = []  # hand-offs that arrived since the last push started

    def say(line: str, stream: TextIO) -> None:
        print(line, file=stream, flush=True)

    async def push_and_report(snap: Snapshot, held: Snapshot | None,
                              changes: int) -> Snapshot | None:
        """Push `snap`; what every node holds after it: `snap`, or None if it failed."""
        nonlocal pushing, last_warnings, outcome
        pushing = True
        try:
            result = outcome = await push_once(snap, held)
        except Exception as e:  # noqa: BLE001 -- any failure is reported, and watching goes on
            outcome = e
            say(f"{time.strftime('%H:%M:%S')} push failed: {e}", err)
            return None
        finally:
            pushing = False
        for w in result.warnings:
            if w not in last_warnings:
                say(f"warning: {w}", err)
        last_warnings = result.warnings
        for line in result.left_behind():
            say(line, err)
        if json_lines:
            obj = result.to_json()
            obj.pop("warnings")
            obj["changes"] = changes
            say(json.dumps(obj), out)
        else:
            say(summary(result, changes), out)
        return None if result.failed else snap

    async def scanned(snap: Snapshot | None, changed: set[bytes]) -> Snapshot:
        """The tree now: `snap` rescanned at the `changed` paths, or scanned whole."""
        if snap is not None and changed:
            try:
                return await rescan(snap, changed, excludes)
            except OSError:  # a folder went away while it was listed: look at everything
                pass
        return await scan(root, excludes, cache=cache)

    async def check(snap: Snapshot | None, notify: RustNotify) -> Snapshot | set[bytes] | str:
        """The whole scan after a quiet spell. It finds the tree `snap` has and returns `snap`
        (whose folder objects are built; a whole scan's are not, 0.8 s at 100k files on the
        next edit), or the tree that differs, validated. It gives way to what the watcher
        reports meanwhile (changed paths, or "stop"), which it returns instead, and to a
        hand-off ("handoff"): at 100k files the scan takes about a second, and neither an edit
        nor a push typed by hand must wait for it."""
        given_up = threading.Event()
        done = False
        got: set[bytes] | str = set()

        async def watch_meanwhile() -> None:
            nonlocal got
            while not done:  # (polled, not cancelled: what the watcher returns is kept)
                news = await changes(notify, CHECK_POLL_MS)
                if news == "stop" or (isinstance(news, set) and news):
                    got = news
                elif waiting:
                    got = "handoff"
                else:
                    continue
                given_up.set()
                return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_meanwhile)
            try:
                fresh = await scan(root, excludes, cache=cache, validate=False, stop=given_up)
            except ScanStopped as e:  # what the walk found is dropped after the push that
                leftovers.append(e.found)  # stopped it (30 ms at 100k files), not before
                e.found = None
            finally:
                done = True
        if got:
            return got
        if snap is not None and fresh.manifest.entries == list(snap.manifest):  # (no list kept)
            return snap
        await trio.to_thread.run_sync(fresh.manifest.validate,
                                      cache.checked if cache is not None else ())
        return fresh

    check_at: float | None = None  # when the whole scan after a quiet spell is due
    leftovers: list[object] = []  # what a check that gave way had found, to drop later

    async def changes(notify: RustNotify, timeout: int, step: int = 0) -> set[bytes] | str:
        """What changed (relative paths that count), waiting up to `timeout` ms (0: for
        ever) for a change, looking every `step` ms (quiet_ms: a change is over once quiet
        that long); or "stop", or "timeout"."""
        nonlocal check_at
        raw = await trio.to_thread.run_sync(notify.watch, debounce_ms, step or quiet_ms, timeout,
                                            stop)
        if isinstance(raw, set):
            if check_at is not None:  # not quiet yet, even if nothing that counts changed
                check_at = time.monotonic() + CHECK_MS / 1e3
            return {rel for _, path in raw if (rel := counts(path)) is not None}
        return raw

    async def held_changes(notify: RustNotify) -> set[bytes] | None:
        """What the watcher holds now (a hand-off's push asks what changed up to it), asked
        in FLUSH_STEP_MS steps; None for "stop"."""
        got = await changes(notify, 1, FLUSH_STEP_MS)
        return None if got == "stop" else got if isinstance(got, set) else set()

    async def loop(notify: RustNotify) -> None:
        nonlocal outcome, check_at
        snap: Snapshot | None = None  # the tree as last scanned (None: scan it whole)
        tracked: Snapshot | None = None  # what a whole-scan check checked
        pushed = b""  # the version last pushed
        held: Snapshot | None = None  # what every node took last
        changed: set[bytes] = set()
        checking = False  # a whole scan after a quiet spell: did the watcher miss anything?
        asked: list[Asked] = []  # the hand-offs this push answers
        last_push = time.monotonic()
        while True:
            gc.disable()  # until the push is done (see the module docstring)
            pushed_now = False
            try:
                if checking:
                    tracked = snap
                    found = await check(snap, notify)
                    if found == "stop":
                        return
                    if isinstance(found, (set, str)):  # an edit or a hand-off came in: it goes
                        # first, in this turn (what the check's walk found is dropped, and the
                        # collector runs, after its push), and the check later
                        checking, check_at = False, time.monotonic() + CHECK_MS / 1e3
                        changed = found if isinstance(found, set) else set()
                        if found == "handoff":
                            asked, waiting[:] = list(waiting), []
                            held_now = await held_changes(notify)
                            if held_now is None:
                                return
                            changed = held_now
                        if changed or snap is None:
                            snap = await scanned(snap, changed)
                    else:
                        snap = found
                elif snap is None or changed:
                    snap = await scanned(snap, changed)
            except (OSError, ValueError) as e:  # the folder went away, an unsafe name...
                say(f"{time.strftime('%H:%M:%S')} push failed: {e}", err)
                snap, outcome = None, e
            else:
                # (on demand, the tree may hold changes taken in but not pushed: a miss is a
                # tree the check found that differs from the one it checked)
                missed = checking and snap.manifest.id != pushed and (
                    not on_demand or snap is not tracked)
                if missed:
                    say(f"{time.strftime('%H:%M:%S')} the watcher missed a change; a whole "
                        "scan found it", err)
                if asked or (not on_demand and (missed or not checking)):
                    held = await push_and_report(snap, held, len(changed) or int(missed))
                    pushed_now = True
                    pushed, check_at = snap.manifest.id, time.monotonic() + CHECK_MS / 1e3
                    last_push = time.monotonic()
                elif on_demand and not checking:  # changes taken in, for the next hand-off
                    check_at = time.monotonic() + CHECK_MS / 1e3
            finally:
                for a in asked:
                    a.answer(outcome)
                if asked:  # their replies go out before the collector runs again (after a
                    await trio.sleep(0)  # check, 0.1 s for the cache it loaded, at 100k files)
                leftovers.clear()
                gc.enable()
            changed, checking, asked = set(), False, []
            if pushed_now and waiting and held is snap:
                # Hand-offs that came while that push ran: it scanned the tree before they
                # came, so unless the watcher has seen a change since, it was their push too
                # (an edit saved and then pushed by hand is pushed once, not twice).
                held_now = await held_changes(notify)
                if held_now is None:
                    return
                if held_now:
                    changed = held_now
                else:
                    for a in waiting:
                        a.answer(outcome)
                    waiting[:] = []
            while not (changed or checking or asked):
                if idle_s is not None and not waiting and time.monotonic() - last_push > idle_s:
                    say(f"{time.strftime('%H:%M:%S')} no push for {idle_s / 60:g} min", err)
                    return
                left = 0 if check_at is None else max(1, int(1e3 * (check_at - time.monotonic())))
                if not waiting:  # (a hand-off that came meanwhile is taken at once)
                    polls = judge is not None or idle_s is not None
                    got = await changes(notify, min(left or POLL_MS, POLL_MS) if polls else left)
                else:
                    got = "timeout"
                if got == "stop":
                    return
                if isinstance(got, set):
                    changed = got
                elif check_at is not None and time.monotonic() >= check_at:
                    checking, check_at = True, None
                asked, waiting[:] = list(waiting), []
                if asked and not changed and not checking:  # what changed up to the request
                    held_now = await held_changes(notify)
                    if held_now is None:
                        return
                    changed = held_now

    async def on_signal(signals, cancel: trio.CancelScope) -> None:
        nonlocal interrupted
        async for _ in signals:
            interrupted = pushing
            stop.set()
            cancel.cancel()
            return

    if wake is not None:
        handoff.own_sockets()  # this user's alone, or refused
        private_dir(wake)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            # The watch starts here, before the first push.
            watched = [root] + ([str(wake)] if wake is not None else [])
            with RustNotify(watched, False, False, 300, True, False) as notify:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(on_signal, signals, nursery.cancel_scope)
                    if judge is not None and wake is not None:
                        await nursery.start(serve_handoffs, judge, waiting, wake / WAKE)
                    say(f"watching {root} (Ctrl-C to stop)", err)
                    await loop(notify)
                    nursery.cancel_scope.cancel()
    finally:
        if wake is not None:
            shutil.rmtree(wake, ignore_errors=True)
    say("stopped watching" + (" (a push in progress was cancelled)" if interrupted else ""), err)
    return 130 if interrupted else 0
