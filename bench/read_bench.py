#!/usr/bin/env python3
"""Sequential read of one large file: the mount of a 1-node local cluster vs the same file on
local disk, with the page cache dropped (cold) and warm.

    .venv/bin/python -m bench.read_bench [--size-mb 1024] [--cold-runs 3] [--warm-runs 5]

The file stands for a large shared library (libtorch_cpu.so is ~400 MB): every 1 MiB block is
fresh seeded random bytes (random.Random(0), so no two chunks deduplicate), three blocks in four
mapped to low-entropy bytes, so zstd -1 halves it and the mount has to decompress what it serves,
as it would for a real .so. It is generated once into the cache folder and reused.

Reads are dd-like: one 1 MiB `readinto` after another into the same buffer, unbuffered, from
this process (the daemon serving the mount is another process). Cold runs drop the page cache
(and dentries, inodes) before each read; warm runs read once untimed, then take the median.
Mount and local runs alternate; a warm run during which the machine read from disk (someone else
dropped the page cache) is run again (common.rounds). Before every cold mount run but the first
(which comes right after the publish) the daemon is restarted on its store, else its
decoded-chunk cache would serve what the previous run read. The daemon's counters (FUSE
requests by type, chunk-cache hits and misses) and its CPU time are recorded for the cold and
the warm mount runs, and the bytes read through the mount are checked against the local file.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import xxhash

from .common import (
    DEFAULT_CACHE,
    BenchError,
    LocalCluster,
    MiB,
    Observed,
    PageCache,
    log,
    own_disk_kib,
    rounds,
    summary,
    workload_main,
)

GENERATOR_VERSION = 1
BLOCK = MiB
LOW_ENTROPY = bytes(0 if b < 128 else (b & 0x0F) if b < 224 else b for b in range(256))
NAME = "readbench"


def ensure_file(cache: Path, size_mb: int) -> Path:
    """The cached folder holding `data.bin` of `size_mb` MiB (generated on first use)."""
    folder = cache / f"read-{size_mb}"
    marker = cache / f"read-{size_mb}.json"
    want = {"generator": GENERATOR_VERSION, "size": size_mb * MiB}
    if folder.is_dir() and marker.exists() and json.loads(marker.read_text()) == want:
        if (folder / "data.bin").stat().st_size == want["size"]:
            return folder
    log(f"generating a {size_mb} MiB file in {folder} (once; later runs reuse it)")
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    tmp = folder / "data.bin.partial"
    with open(tmp, "wb") as f:
        for _ in range(size_mb):
            block = rng.randbytes(BLOCK)
            if rng.random() < 0.75:
                block = block.translate(LOW_ENTROPY)
            f.write(block)
    os.rename(tmp, folder / "data.bin")
    marker.write_text(json.dumps(want))
    return folder


def read_seconds(path: Path, expect: int) -> float:
    """dd if=path of=/dev/null bs=1M, timed."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    total = 0
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [view]):
            total += n
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    if total != expect:
        raise BenchError(f"read {total} bytes from {path}, expected {expect}")
    return seconds


def digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


def measure(work: Path, cache: Path = DEFAULT_CACHE, size_mb: int = 1024, cold_runs: int = 3,
            warm_runs: int = 5, page_cache: PageCache | None = None) -> dict:
    page_cache = page_cache or PageCache()
    folder = ensure_file(cache, size_mb)
    local = folder / "data.bin"
    size = local.stat().st_size
    mib = size / MiB
    with LocalCluster(work / "cl-read", 1) as cl:
        push_s, pushed = cl.push(folder, name=NAME)
        log(f"  pushed {mib:.0f} MiB to 1 node in {push_s:.2f}s")
        mounted = cl.mount() / NAME / "data.bin"
        counters: dict[str, dict] = {}

        def phase(label: str, n: int, cold: bool) -> dict:
            mount = Observed(cl, lambda: read_seconds(mounted, size))

            def before(side: str) -> None:
                if cold and side == "mount" and mount.runs:
                    cl.restart()  # the daemon's chunk cache would otherwise hold the file
                if cold:
                    page_cache.drop()

            log(f"  {label}: ", end="")
            out = rounds(n, {"mount": mount, "local": lambda: read_seconds(local, size)},
                         before,
                         None if cold else {"mount": cl.disk_probe(), "local": own_disk_kib})
            counters[label] = mount.report()
            res = {side: {**summary(secs), "discarded": out.discarded[side]}
                   for side, secs in out.items()}
            log("  ".join(f"{side} {mib / r['median']:.0f} MiB/s" for side, r in res.items()))
            return res

        cold = phase("cold", cold_runs, cold=True)
        read_seconds(mounted, size)  # warm-up: the page cache now holds both files
        read_seconds(local, size)
        warm = phase("warm", warm_runs, cold=False)
        if digest(mounted) != digest(local):
            raise BenchError(f"{mounted} does not hold the bytes of {local}")
        daemon = cl.proc()

    def throughput(res: dict) -> dict:
        return {side: {"mib_s": round(mib / r["median"], 1), "seconds": r}
                for side, r in res.items()}

    result = {
        "file": {"path": str(local), "bytes": size, "kind": "library-like, ~2x with zstd -1"},
        "read_size": BLOCK,
        "push_seconds": round(push_s, 2),
        "push": pushed,
        "cold": throughput(cold),
        "warm": throughput(warm),
        "counters": counters,
        "daemon": daemon,
        "page_cache": page_cache.describe(),
        "verified": "mount bytes == local bytes (xxh3_128)",
    }
    for case in ("cold", "warm"):
        r = result[case]
        r["ratio"] = round(r["mount"]["mib_s"] / r["local"]["mib_s"], 3)  # >1: mount faster
    return result


def main(argv: list[str] | None = None) -> int:
    return workload_main(argv, __doc__, [("--size-mb", {"type": int, "default": 1024})],
                         lambda work, a: measure(work, a.cache, a.size_mb, a.cold_runs,
                                                 a.warm_runs))


if __name__ == "__main__":
    sys.exit(main())
