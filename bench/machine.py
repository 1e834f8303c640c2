"""The machine a benchmark ran on: its facts (CPU, memory, kernel, versions, the commit) and how
busy it was meanwhile, which figures from a shared machine need beside them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from .common import REPO, MiB


class CpuMeter:
    """How busy the whole machine was (every process, not only ours) between two points:
    the figures of a run on a shared machine need this next to them."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]), idle

    def busy(self) -> float:
        total, idle = self._read()
        dt, di = total - self.start[0], idle - self.start[1]
        return round(100.0 * (dt - di) / dt, 1) if dt else 0.0


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def machine_facts() -> dict:
    def first_line(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            return "?"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True).stdout.strip()

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")),
                 platform.processor() or "?")
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), "0")
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=normal", "--", "fs", "daemon"):
        commit += "+uncommitted changes"  # the figures are for the working tree, not the commit
    try:
        import pyfuse3
        pyfuse3_version = pyfuse3.__version__
    except Exception:
        pyfuse3_version = "?"
    root_dev = next((ln.split()[0] for ln in Path("/proc/mounts").read_text().splitlines()
                     if ln.split()[1] == "/"), "?")
    return {
        "nproc": os.cpu_count() or 0,
        "cpu": model,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "mem_gib": round(int(mem) / MiB, 1),
        "disk": root_dev,
        "pyfuse3": pyfuse3_version,
        "rsync": " ".join(first_line(["rsync", "--version"]).split()[:3]),
        "zstd": first_line(["zstd", "--version"]),
        "monarch_fs_commit": commit or "?",
    }
