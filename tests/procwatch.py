"""Check, not assume, that the processes a test started are gone: by pid and start time (read
from /proc), so a pid the kernel reused for someone else is not mistaken for ours."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Started:
    def __init__(self) -> None:
        self.pids: dict[int, int] = {}

    def add(self, *pids: int | None, tree: bool = False, match: str | None = None) -> None:
        """Remember processes (and with tree=True all their descendants now). A pid that is
        already gone needs no checking; with `match`, a live pid counts only if its command
        line contains that text (so a pid recorded late cannot be someone else's)."""
        for pid in pids:
            if pid is None:
                continue
            for p in [pid, *(descendants(pid) if tree else [])]:
                st = _stat(p)
                if st is not None and st[0] != "Z" and (match is None or match in _cmdline(p)):
                    self.pids[p] = st[2]

    def alive(self) -> list[int]:
        """Those still running (a zombie has ended: it only waits for its parent to reap it)."""
        out = []
        for pid, start in self.pids.items():
            st = _stat(pid)
            if st is not None and st[2] == start and st[0] != "Z":
                out.append(pid)
        return out

    def wait_gone(self, timeout: float = 15.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def assert_gone(self, timeout: float = 15.0) -> None:
        left = self.wait_gone(timeout)
        if left:
            raise AssertionError("processes left behind: " +
                                 "; ".join(f"{p}: {_cmdline(p)}" for p in left))
