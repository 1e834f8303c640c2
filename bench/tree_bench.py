#!/usr/bin/env python3
"""Metadata at scale: `find` and a Python walk + lstat over 100,000 files, the mount of a
1-node local cluster vs the same tree on local disk, cold and warm; and the node daemon's peak
memory while it serves that snapshot.

    .venv/bin/python -m bench.tree_bench [--files 100000] [--cold-runs 3] [--warm-runs 5]

The tree is generated once into the cache folder, deterministically (random.Random(0)): 100
files per folder in folders three levels deep (10 x 10 x 10 for 100k files), like an unpacked
site-packages, sizes 0-4 KiB (most under 1 KiB), text-like content drawn from a seeded pool.

Two listings, each timed on the mount and on the local tree, alternating:
- `find DIR -type f | wc -l` (wall clock; the count must be the number of files);
- os.walk + os.lstat of every file in a fresh interpreter (time of the walk itself, measured
  in the child, so interpreter start-up is not in it).
Cold runs drop the page cache, dentries and inodes before each run (for the mount, the kernel
then forgets every inode and asks the daemon again); warm runs follow one untimed run of each.

Memory: after the push the daemon is restarted on its store, so the figure is that of a node
serving the 100k-file snapshot (loading it from the store included), not of receiving it; the
push's own peak is recorded too. VmHWM (peak resident set, /proc/PID/status) is read after all
the listings.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

from . import common

GENERATOR_VERSION = 1
PER_DIR = 100
NAME = "files"
WALK = """\
import json, os, sys, time
t = time.perf_counter()
n = 0
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        os.lstat(os.path.join(d, f))
        n += 1
print(json.dumps({"files": n, "seconds": time.perf_counter() - t}))
"""


def ensure_files(cache: Path, count: int) -> Path:
    """The cached tree of `count` small files (generated on first use)."""
    tree = cache / f"files-{count}"
    marker = cache / f"files-{count}.json"
    want = {"generator": GENERATOR_VERSION, "files": count}
    if tree.is_dir() and marker.exists() and json.loads(marker.read_text()) == want:
        return tree
    common.log(f"generating {count} files in {tree} (once; later runs reuse it)")
    partial = cache / f"files-{count}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(tree, ignore_errors=True)
    rng = random.Random(0)
    pool = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_ ().=:\n") for _ in range(1 << 16))
    pool_b = pool.encode()
    for i in range(count):
        d, k = divmod(i, PER_DIR)
        folder = partial / f"pkg{d // 100:02d}" / f"mod{d // 10 % 10}" / f"sub{d % 10}"
        if k == 0:
            folder.mkdir(parents=True)
        size = min(4096, int(rng.expovariate(1 / 700)))
        start = rng.randrange(len(pool_b) - 4096)
        (folder / f"f{k:03d}_{rng.randrange(1 << 20):05x}.py").write_bytes(
            pool_b[start:start + size])
        if (i + 1) % 10000 == 0:
            common.log(f"\r  {i + 1}/{count}", end="")
    common.log("")
    os.rename(partial, tree)
    marker.write_text(json.dumps(want))
    return tree


def find_seconds(root: Path, expect: int) -> float:
    seconds, proc = common.run(["bash", "-c", 'set -o pipefail; find "$1" -type f | wc -l',
                                "find", str(root)])
    if int(proc.stdout.strip()) != expect:
        raise common.BenchError(f"find found {proc.stdout.strip()} files under {root}, not "
                                f"{expect}")
    return seconds


def walk_seconds(root: Path, expect: int) -> float:
    _, proc = common.run([sys.executable, "-c", WALK, str(root)])
    out = json.loads(proc.stdout)
    if out["files"] != expect:
        raise common.BenchError(f"os.walk found {out['files']} files under {root}, not {expect}")
    return out["seconds"]


def measure(work: Path, cache: Path = common.DEFAULT_CACHE, files: int = 100_000,
            cold_runs: int = 3, warm_runs: int = 5,
            page_cache: common.PageCache | None = None) -> dict:
    page_cache = page_cache or common.PageCache()
    local = ensure_files(cache, files)
    with common.LocalCluster(work / "cl-tree", 1) as cl:
        push_s, pushed = cl.push(local, name=NAME)
        if pushed["files"] != files:
            raise common.BenchError(f"pushed {pushed['files']} files, not {files}")
        common.log(f"  pushed {files} files to 1 node in {push_s:.2f}s")
        after_push = cl.proc()
        cl.restart()  # a node serving the snapshot, not one that has just received it
        at_start = cl.proc()
        mounted = cl.mount() / NAME
        tools = {"find": find_seconds, "walk": walk_seconds}
        results: dict[str, dict] = {}
        counters: dict[str, dict] = {}
        for label, cold, n in (("cold", True, cold_runs), ("warm", False, warm_runs)):
            if not cold:
                for tool in tools.values():  # warm-up
                    tool(mounted, files)
                    tool(local, files)
            for tname, tool in tools.items():
                mount = common.Observed(cl, lambda tool=tool: tool(mounted, files))
                common.log(f"  {tname} {label}: ", end="")
                out = common.rounds(
                    n, {"mount": mount, "local": lambda tool=tool: tool(local, files)},
                    (lambda side: page_cache.drop()) if cold else None,
                    None if cold else {"mount": cl.disk_probe(), "local": common.own_disk_kib})
                res = {side: {**common.summary(secs), "discarded": out.discarded[side]}
                       for side, secs in out.items()}
                res["ratio"] = round(res["mount"]["median"] / res["local"]["median"], 3)
                results.setdefault(tname, {})[label] = res
                counters[f"{tname} {label}"] = mount.report()
                common.log(f"mount {res['mount']['median']:.2f}s  "
                           f"local {res['local']['median']:.2f}s")
        serving = cl.proc()

    return {
        "tree": {"path": str(local), "files": files, "per_dir": PER_DIR,
                 "bytes": pushed["bytes"]},
        "push_seconds": round(push_s, 2),
        "push": pushed,
        **results,
        "counters": counters,
        "daemon": {
            "after_push": after_push,  # VmHWM here includes receiving the push
            "at_start": at_start,  # restarted on its store, snapshot loaded, nothing read yet
            "serving": serving,  # after every listing above
            "peak_rss_mb": round(serving["VmHWM_kb"] / 1024, 1),
            "push_peak_rss_mb": round(after_push["VmHWM_kb"] / 1024, 1),
        },
        "page_cache": page_cache.describe(),
    }


def main(argv: list[str] | None = None) -> int:
    return common.workload_main(
        argv, __doc__, [("--files", {"type": int, "default": 100_000})],
        lambda work, a: measure(work, a.cache, a.files, a.cold_runs, a.warm_runs))


if __name__ == "__main__":
    sys.exit(main())
