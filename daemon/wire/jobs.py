"""What names a job on a node: every process of one `monarch-fs run` (all its restarts) or of
one proc mesh carries the same name in its environment, so that a later request (`monarch-fs
stacks JOB`) can find its ranks on every node without holding the connection that started
them."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping

JOB_ENV = "MONARCH_FS_JOB"  # set by `run` on every rank
MESH_ENV = "MONARCH_MESH_NAME"  # a proc mesh's name: its procs' job


def new_job_name(kind: str = "run") -> str:
    """A fresh job name: what started it (`run`, or a proc mesh's name), when (the newest sorts
    last), and enough randomness to tell two of the same second apart: `run-1206-013015-9f3a`."""
    return f"{kind}-{time.strftime('%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def job_of(env: Mapping[str, object]) -> str:
    """The job a process belongs to, from the environment its spawn request set ("" if
    none)."""
    name = env.get(JOB_ENV) or env.get(MESH_ENV) or ""
    return name if isinstance(name, str) else ""
