"""What a node records of each process it starts, so that `monarch-fs repro` can start the same
one elsewhere: the command and working folder as asked (before `{workspace}` and `{mount}`
expand to this node's paths), the environment the request set (RANK and the torchrun
variables, `run --env`) without what looks like a secret, the job, and the workspace version
the process was pinned to. It goes into the `detail` of the `proc.started` event."""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from ..wire.jobs import job_of

# Names whose values are not written down: a credential passed by --env stays on its node.
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|COOKIE",
                         re.IGNORECASE)


def launch_record(args: dict[str, Any], pin: str | None,
                  source: str | None = None) -> dict[str, Any]:
    """The repro record of a spawn request's `args` (argv, cwd, env) pinned to the version
    folder `pin` (MOUNT/.versions/NAME/VERSION) of a workspace pushed from `source` (the dev
    box's folder, when the node was told it)."""
    env = {str(k): str(v) for k, v in (args.get("env") or {}).items()}
    kept = {k: v for k, v in env.items() if not SECRET_NAME.search(k)}
    record: dict[str, Any] = {"argv": list(args.get("argv") or []), "cwd": args.get("cwd"),
                              "env": kept, "job": job_of(env),
                              "version": PurePath(pin).name if pin else None, "pinned": pin,
                              "source": source}
    if len(kept) < len(env):
        record["withheld"] = sorted(set(env) - set(kept))
    return record
