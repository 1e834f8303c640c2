#!/usr/bin/env python3
"""How much disk a node's chunk store takes after many pushes of small edits, next to what the
versions it keeps need.

    .venv/bin/python -m bench.store_growth_bench [--pushes 16] [--files 256] [--edit 25]

A tree of `files` random 256 KiB files (incompressible, so stored bytes are file bytes) is pushed
to a 1-node local cluster `pushes` times, `edit` files rewritten before each push, with 16 MiB
packs (MONARCH_FS_PACK_MIB) so a small tree spans many. The node keeps 3 versions. The report
compares the store's size on disk (`monarch-fs status`) with the live bytes: the current tree
plus the files of the two older versions that differ from it. Not part of `make bench`: this
is about space, not speed, and nothing else here keeps versions to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from .common import LocalCluster, fmt_bytes, log, run

FILE_SIZE = 256 * 1024
KEEP = 3  # versions a node keeps (daemon default)


def measure(pushes: int, files: int, edit: int) -> dict:
    rnd = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="store-growth-") as tmp:
        src = Path(tmp) / "tree"
        src.mkdir()
        paths = [src / f"f{i:04d}.bin" for i in range(files)]
        for p in paths:
            p.write_bytes(rnd.randbytes(FILE_SIZE))
        os.environ["MONARCH_FS_PACK_MIB"] = "16"
        with LocalCluster(Path(tmp) / "cluster", 1) as cl:
            changed: list[set[Path]] = []
            for _ in range(pushes):
                edited = set(rnd.sample(paths, edit))
                for p in edited:
                    p.write_bytes(rnd.randbytes(FILE_SIZE))
                changed.append(edited)
                cl.push(src)
            time.sleep(2)  # the collect after the last commit runs in the background
            status = json.loads(run([cl.cli, "status", "--hosts", f"@{cl.dir / 'hosts'}",
                                     "--token-file", str(cl.dir / "token"), "--json"],
                                    env={**os.environ, "MONARCH_FS_HOME": str(cl.home)})[1].stdout)
    node = status[0]
    # Live: the current tree, and in each older kept version the files edited since.
    older = sum(len(set().union(*changed[len(changed) - k:])) for k in range(1, KEEP))
    live = (files + older) * FILE_SIZE
    return {"pushes": pushes, "files": files, "edited_per_push": edit, "file_bytes": FILE_SIZE,
            "store_bytes": node["store_bytes"], "live_bytes": live,
            "ratio": round(node["store_bytes"] / live, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=16)
    parser.add_argument("--files", type=int, default=256)
    parser.add_argument("--edit", type=int, default=25)
    args = parser.parse_args()
    r = measure(args.pushes, args.files, args.edit)
    log(f"{r['pushes']} pushes of {r['files']} files ({r['edited_per_push']} rewritten each "
        f"time): store {fmt_bytes(r['store_bytes'])} on disk for {fmt_bytes(r['live_bytes'])} "
        f"live ({r['ratio']}x)")
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
