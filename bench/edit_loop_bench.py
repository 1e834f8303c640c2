#!/usr/bin/env python3
"""The edit-run loop (issue 20): a tree of small source files on 4 nodes, pushed again with no
change, and after one edited file until every node shows the edit; `monarch-fs push` (its
interpreter start included: what a user waits for) next to `rsync -a` into 4 local folders one
after another, and `push --watch` from the moment the file is saved until every node shows it.
The one-shot push is measured three ways: as a new process on its own; handed to a `push
--watch` of the tree that runs (daemon/client/handoff.py); and as `push --keep-warm`, typed the
same every time, whose first run leaves a `push --watch --on-demand` behind that takes the
later ones.

    .venv/bin/python -m bench.edit_loop_bench [--files 15000,100000] [--nodes 4] [--rounds 5]

Rules:
- The trees are tree_bench's generated small files (cached in --cache), the same for both
  sides; the edit appends a line to one file, and the file's bytes and mtime are put back at
  the end, so the cached tree stays as generated.
- Each side first copies the tree once (untimed); its scan cache (monarch-fs) and its
  destinations (rsync) are then warm, as in a researcher's loop.
- The sides alternate round by round (bench.common.rounds), so a drift in the machine's load
  falls on both alike.
- "shows the edit": every node's mount (every rsync folder) holds the edited bytes, read back
  after the timed command (the push returns once every node serves it; rsync once it copied).
  In --watch, the mounts are read in a loop from the moment the file is written: 20 edits one
  right after the other's push; 5 each IN_CHECK_S after the last push, while the watch's
  whole-scan check runs (it starts once quiet for 2 s, and gives way to an edit); and 5 each
  PAUSE_S after the last push, past the check, as a person's edits come.
- Monarch 0.7's `refresh` figures (1 host) are quoted from the issue, not measured here.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .common import (
    DEFAULT_CACHE,
    BenchError,
    LocalCluster,
    interrupt,
    log,
    rounds,
    run,
    summary,
    workload_main,
)
from .tree_bench import ensure_files

TARGETS = {"nochange_s": 0.3, "edit_s": 0.35, "watch_s": 0.1, "scale": 1.2}
MONARCH_REFRESH = {"nochange_s": 0.27, "edit_s": 1.0}  # Monarch 0.7, 1 host (the issue's)
WATCH_TIMEOUT = 30.0  # seconds an edit may take to show everywhere in --watch
# `push --watch` also measured with each edit this long after the last push, as a person
# edits: past the whole-scan check the watch runs once quiet for CHECK_MS (2 s), and the scan
# itself (about 1 s at 100k files).
PAUSE_S = 4.0
PAUSED_EDITS = 5
IN_CHECK_S = 2.05  # an edit this long after a push lands in the watch's whole-scan check


class Edit:
    """One file of the tree, edited in place and put back as it was (bytes and mtime)."""

    def __init__(self, tree: Path) -> None:
        self.rel = min(p for p in tree.rglob("*.py")).relative_to(tree)
        self.path = tree / self.rel
        self.pristine = self.path.read_bytes()
        st = self.path.stat()
        self.times = (st.st_atime_ns, st.st_mtime_ns)
        self.count = 0

    def next(self) -> bytes:
        """Write the next edit; its bytes. Each is one byte longer than the last: rsync's quick
        check (size and mtime, to the second) would miss a same-size edit in the same second."""
        self.count += 1
        data = self.pristine + b"#" * self.count + b"\n"
        self.path.write_bytes(data)
        return data

    def restore(self) -> None:
        self.path.write_bytes(self.pristine)
        os.utime(self.path, ns=self.times)


def shows(roots: list[Path], rel: Path, data: bytes) -> bool:
    try:
        return all((r / rel).read_bytes() == data for r in roots)
    except OSError:
        return False


def check_shows(roots: list[Path], rel: Path, data: bytes, who: str) -> None:
    if not shows(roots, rel, data):
        raise BenchError(f"{who}: the edit of {rel} is not on every node after it returned")


def rsync_to_all(tree: Path, dests: list[Path]) -> float:
    t0 = time.perf_counter()
    for d in dests:
        run(["rsync", "-a", "--delete", f"{tree}/", f"{d}/"])
    return time.perf_counter() - t0


def watch_latencies(cl: LocalCluster, tree: Path, edit: Edit, roots: list[Path],
                    edits: int, pause: float = 0.0) -> list[float]:
    """`push --watch`: seconds from each edit written until every node shows it; each edit
    `pause` seconds after the last push (as a person edits: after a pause past CHECK_MS the
    watch has run its whole-scan check)."""
    cmd, env = cl.push_args(tree, "--watch", "--json", "--name", tree.name)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    stdout = proc.stdout

    def pushed() -> None:
        """Wait for the line of the push under way (one per push, flushed)."""
        if not select.select([stdout], [], [], WATCH_TIMEOUT)[0] or \
                not stdout.readline().startswith("{"):
            raise BenchError("push --watch printed no push line in time")

    out: list[float] = []
    try:
        pushed()  # the first push, of the tree as it is
        for _ in range(edits):
            time.sleep(pause)
            data = edit.next()
            t0 = time.perf_counter()
            while not shows(roots, edit.rel, data):
                if time.perf_counter() - t0 > WATCH_TIMEOUT:
                    raise BenchError(f"push --watch: the edit not on every node after "
                                     f"{WATCH_TIMEOUT:.0f} s")
                time.sleep(0.001)
            out.append(time.perf_counter() - t0)
            pushed()  # so that the next edit starts a push of its own
    finally:
        interrupt(proc)
    return out


def handed_off(cl: LocalCluster, tree: Path, edit: Edit, roots: list[Path],
               n: int) -> dict[str, list[float]]:
    """`monarch-fs push` (CLI start included) while a `push --watch` of the tree runs, which
    takes the push over (daemon/client/handoff.py): `n` no-change pushes and `n` edits."""
    cmd, env = cl.push_args(tree, "--watch", "--name", tree.name)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        return handed_rounds(cl, tree, edit, roots, n, proc.pid, (), "monarch-fs push",
                             alive=lambda: proc.poll() is None)
    finally:
        interrupt(proc)


def kept_warm(cl: LocalCluster, tree: Path, edit: Edit, roots: list[Path],
              n: int) -> dict[str, list[float]]:
    """`monarch-fs push --keep-warm`, the same command every time: the first (untimed) pushes
    and leaves a `push --watch --on-demand` of the tree in the background, which every later
    one is handed to: `n` no-change pushes and `n` edits. That watch is stopped at the end, by
    its pid."""
    cmd, env = cl.push_args(tree, "--json", "--name", tree.name, "--keep-warm")
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in first.stderr.splitlines() if ln.startswith("keeping ")), None)
    if first.returncode or line is None:
        raise BenchError(f"push --keep-warm left no watch behind: {first.stderr.strip()}")
    pid = int(line.split(" pid ")[1].split(",")[0])
    sock = cl.home / "watch" / f"{pid}.sock"
    try:
        return handed_rounds(cl, tree, edit, roots, n, pid, ("--keep-warm",),
                             "monarch-fs push --keep-warm")
    finally:
        if sock.exists():  # (not our child: its socket goes when it stops)
            os.kill(pid, signal.SIGINT)
            t0 = time.perf_counter()
            while sock.exists() and time.perf_counter() - t0 < WATCH_TIMEOUT:
                time.sleep(0.05)


def handed_rounds(cl: LocalCluster, tree: Path, edit: Edit, roots: list[Path], n: int,
                  pid: int, args: tuple[str, ...], who: str,
                  alive: Callable[[], bool] = lambda: True) -> dict[str, list[float]]:
    """Once the watch `pid` listens for pushes: `n` no-change pushes and `n` edits, each a
    `monarch-fs push ARGS` that must be handed to it (seconds, CLI start included)."""
    sock = cl.home / "watch" / f"{pid}.sock"
    t0 = time.perf_counter()
    while not sock.exists():
        if not alive() or time.perf_counter() - t0 > WATCH_TIMEOUT:
            raise BenchError(f"{who}: the watch did not start listening for pushes")
        time.sleep(0.05)

    def push() -> float:
        seconds, result = cl.push(tree, tree.name, args=args)
        if result.get("watch") != pid:
            raise BenchError(f"{who} was not handed to the running watch")
        return seconds

    out: dict[str, list[float]] = {"nochange": [], "edit": []}
    push()  # untimed: the watch's own first push is done
    for _ in range(n):
        out["nochange"].append(push())
        data = edit.next()
        out["edit"].append(push())
        check_shows(roots, edit.rel, data, f"{who} (handed off)")
    return out


def one_tree(work: Path, cache: Path, files: int, nodes: int, n: int, watch_edits: int) -> dict:
    """Both sides on one tree of `files` files: medians of `n` rounds, and the watch."""
    tree = ensure_files(cache, files)
    edit = Edit(tree)
    d = work / f"edit-loop-{files}"
    dests = [d / f"rsync-{i}" for i in range(nodes)]
    try:
        with LocalCluster(d / "cluster", nodes) as cl:
            mounts = [cl.mount(i) / tree.name for i in range(nodes)]
            edit_phases: dict = {}  # of the last edit's push: where its time went

            def mfs_push(phases: dict | None = None) -> float:
                seconds, pushed = cl.push(tree, tree.name)
                if phases is not None:
                    phases.update(pushed.get("phases", {}))
                return seconds

            def up_to_date(side: str) -> None:
                """Before a no-change run, untimed: that side has the tree as it is now (the
                other side's edit may have changed it)."""
                if side == "mfs_nochange":
                    mfs_push()
                elif side == "rsync_nochange":
                    rsync_to_all(tree, dests)

            def edited(side: Callable[[], float], roots: list[Path], who: str
                       ) -> Callable[[], float]:
                def once() -> float:
                    data = edit.next()
                    seconds = side()
                    check_shows(roots, edit.rel, data, who)
                    return seconds
                return once

            try:
                got = rounds(n, {
                    "mfs_nochange": mfs_push,
                    "rsync_nochange": lambda: rsync_to_all(tree, dests),
                    "mfs_edit": edited(lambda: mfs_push(edit_phases), mounts, "monarch-fs push"),
                    "rsync_edit": edited(lambda: rsync_to_all(tree, dests), dests, "rsync"),
                }, before=up_to_date)
                watch = watch_latencies(cl, tree, edit, mounts, watch_edits)
                in_check = watch_latencies(cl, tree, edit, mounts, PAUSED_EDITS, IN_CHECK_S)
                paused = watch_latencies(cl, tree, edit, mounts, PAUSED_EDITS, PAUSE_S)
                handed = handed_off(cl, tree, edit, mounts, n)
                warm = kept_warm(cl, tree, edit, mounts, n)
            finally:
                edit.restore()
    finally:
        for dest in dests:
            shutil.rmtree(dest, ignore_errors=True)
    res = {"files": files, "nodes": nodes,
           **{k: summary([round(s, 4) for s in v]) for k, v in got.items()},
           "watch": summary([round(s, 4) for s in watch]), "edit_phases": edit_phases,
           "watch_paused": summary([round(s, 4) for s in paused]),
           "watch_in_check": summary([round(s, 4) for s in in_check]),
           **{f"handoff_{k}": summary([round(s, 4) for s in v]) for k, v in handed.items()},
           **{f"warm_{k}": summary([round(s, 4) for s in v]) for k, v in warm.items()}}
    log(f"  {files:,} files: no change {res['mfs_nochange']['median']:.3f}s (rsync "
        f"{res['rsync_nochange']['median']:.3f}s), edit {res['mfs_edit']['median']:.3f}s "
        f"(rsync {res['rsync_edit']['median']:.3f}s), --watch {res['watch']['median']:.3f}s "
        f"({res['watch_in_check']['median']:.3f}s during the whole-scan check, "
        f"{res['watch_paused']['median']:.3f}s after it), "
        f"handed to --watch: no change {res['handoff_nochange']['median']:.3f}s, edit "
        f"{res['handoff_edit']['median']:.3f}s, --keep-warm: no change "
        f"{res['warm_nochange']['median']:.3f}s, edit {res['warm_edit']['median']:.3f}s")
    return res


def measure(work: Path, cache: Path = DEFAULT_CACHE, files: tuple[int, ...] = (15_000, 100_000),
            nodes: int = 4, n: int = 5, watch_edits: int = 20) -> dict:
    return {"trees": [one_tree(work, cache, f, nodes, n, watch_edits) for f in files]}


# ---- the report ---------------------------------------------------------------------------

def _met(value: float, target: float) -> str:
    return "**met**" if value <= target else "**not met**"


def table(res: dict) -> list[str]:
    """The issue's targets next to this run's figures, and the sides (markdown lines)."""
    t = TARGETS
    trees = res["trees"]
    base = trees[0]
    lines = ["| what (issue 20) | target | this run | |", "| --- | --- | --- | --- |"]
    for key, label, target in (("nochange", "no-change push", t["nochange_s"]),
                               ("edit", "one edit visible on every node", t["edit_s"])):
        r = base[f"rsync_{key}"]["median"]
        for side, how in (("mfs", "a new process"), ("handoff", "handed to a running --watch"),
                          ("warm", "a new process, kept warm by the last: --keep-warm")):
            if f"{side}_{key}" not in base:
                continue
            m = base[f"{side}_{key}"]["median"]
            lines.append(f"| {label}, {base['files']:,} files, {base['nodes']} nodes, CLI "
                         f"start included ({how}) | <= {target} s | {m:.3f} s; rsync {r:.3f} s "
                         f"({r / m:.2f}x); Monarch refresh {MONARCH_REFRESH[f'{key}_s']} s "
                         f"(1 host) | {_met(m, target)} |")
    w = base["watch"]
    lines.append(f"| one edit in `--watch`, saved to shown on every node | <= {t['watch_s']} s "
                 f"(median of {len(w['runs'])}) | {w['median']:.3f} s ({w['min']:.3f}-"
                 f"{w['max']:.3f}) | {_met(w['median'], t['watch_s'])} |")
    for big in trees[1:]:
        for key, label in (("nochange", "no-change push"), ("edit", "one edit"),
                           ("watch", "--watch edit")):
            for side, how in (("mfs", "new process"), ("handoff", "handed to --watch"),
                              ("warm", "new process, --keep-warm")):
                if key == "watch" and side != "mfs":
                    continue
                k = "watch" if key == "watch" else f"{side}_{key}"
                if k not in big or k not in base:
                    continue
                x = big[k]["median"] / base[k]["median"]
                lines.append(f"| {label}{'' if key == 'watch' else f' ({how})'}, "
                             f"{big['files']:,} files against {base['files']:,} | <= "
                             f"{t['scale']}x | {x:.2f}x ({big[k]['median']:.3f} s) | "
                             f"{_met(x, t['scale'])} |")
    lines += ["", "| files | no change | handed off | --keep-warm | rsync | edit | handed off | "
              f"--keep-warm | rsync | --watch edit | {IN_CHECK_S:g} s after the last (in the "
              f"check) | {PAUSE_S:g} s after the last |",
              "| ---: " * 12 + "|"]
    for tr in trees:
        lines.append(f"| {tr['files']:,} | " + " ".join(
            f"{tr[k]['median']:.3f} s |" if k in tr else "|"
            for k in ("mfs_nochange", "handoff_nochange", "warm_nochange", "rsync_nochange",
                      "mfs_edit", "handoff_edit", "warm_edit", "rsync_edit", "watch",
                      "watch_in_check", "watch_paused")))
    phases = ", ".join(f"{k} {v:.3f} s" for k, v in base["edit_phases"].items())
    lines += ["", f"A push of {base['files']:,} files with an edit, step by step (`push --json`'s "
              f"phases, the CLI's start not included): {phases}."]
    return lines


OPTIONS = [
    ("--files", {"default": "15000,100000", "help": "tree sizes, comma-separated"}),
    ("--nodes", {"type": int, "default": 4}),
    ("--rounds", {"type": int, "default": 5}),
    ("--watch-edits", {"type": int, "default": 20}),
]


def main(argv: list[str] | None = None) -> int:
    def run_it(work: Path, a) -> dict:
        res = measure(work, a.cache, tuple(int(f) for f in a.files.split(",")), a.nodes,
                      a.rounds, a.watch_edits)
        print("\n".join(table(res)), file=sys.stderr)
        return res

    return workload_main(argv, __doc__, OPTIONS, run_it)


if __name__ == "__main__":
    sys.exit(main())
