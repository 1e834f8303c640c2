"""The examples run: the RL loop of examples/rl/train.py, with a generator killed and
replaced mid-run, on a local cluster of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.mount
def test_rl_example_survives_a_killed_generator():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "rl" / "train.py"), "--steps", "4",
                           "--kill-at", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "step 1: generator rank 1 died; replacing it" in out
    assert "generators at versions [4, 4]" in out  # weights reached both, the new one too
    assert "done: 4 steps, 1 generator replaced" in out
    assert "killed by SIGKILL" in proc.stderr  # the failure, reported once
