"""The dev box store's fillers that tests' pushes start (daemon/client/filler_control.py):
waiting for them when a test reads the store after a push, and stopping them before the homes
are removed (conftest.py's home fixture)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from monarch_fs.daemon.client import filler_control
from monarch_fs.settings import settings


def wait_fillers(home: Path | None = None, timeout: float = 60) -> None:
    """Wait until the store fillers the pushes with this $MONARCH_FS_HOME (default: the
    test's) started have finished (daemon/client/filler_control.py)."""
    home = settings.home if home is None else home
    assert filler_control.wait_all(home, timeout), \
        f"store fillers still running after {timeout}s: {filler_control.running(home)}"


def stop_fillers(root: Path, timeout: float = 10) -> list[int]:
    """Stop every store filler whose $MONARCH_FS_HOME lies under `root` (found by their command
    lines: a test may push with a home of its own), asked as a push asks and waited for by
    pid, killed past `timeout`; before the homes are removed. The pids found."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if filler_control.MODULE.encode() in argv and len(argv) >= 2:
            try:
                spec = json.loads(argv[-2] or argv[-1])
            except ValueError:
                continue
            if Path(spec["home"]).is_relative_to(root):
                found.append((int(name), Path(spec["store"])))
    filler_control.stop(found, timeout)  # fillers this test's pushes started
    return [pid for pid, _ in found]
