"""The dev box store's fillers a benchmark's pushes started (daemon/client/filler_control.py),
settled when its cluster goes: stopped when the home is the cluster's own (removed with it),
waited for when the home is kept across clusters, so that the next cluster's push finds the
store whole, as a dev box does once its filler ran."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from monarch_fs.daemon.client import filler_control

FILL_TIMEOUT = 600.0  # seconds a kept home's fillers are waited for, before they are stopped


def settle(home: Path, kept: bool, timeout: float = FILL_TIMEOUT) -> None:
    if kept and filler_control.running(home):
        t = time.monotonic()
        if filler_control.wait_all(home, timeout):
            print(f"  the dev box store's filler finished {time.monotonic() - t:.1f} s after "
                  "the cluster's last push", file=sys.stderr, flush=True)
            return
        print(f"warning: the dev box store's filler still ran after {timeout:g} s: stopped",
              file=sys.stderr, flush=True)
    filler_control.stop_all(home)
