#!/usr/bin/env python3
"""Push benchmark: how long `monarch-fs push` takes to put a Python-environment-like tree on N
nodes, next to what people do today (rsync, tar | zstd | tar), in the same run on the same disk.

    .venv/bin/python -m bench.push_bench [--size-mb 1024] [--nodes 3] [--out bench/results]
    .venv/bin/python -m bench.push_bench --clean      # remove the cached generated trees

`make bench` runs it through bench/run_all.py (`measure()`, 512 MB by default there).

Three cases, because they are what a researcher lives through: the first push of an environment
(cold), pushing again when nothing changed, and pushing after editing one small source file.

Fairness rules, and why:

- Everything goes through the real command line (`monarch-fs push --json` in a child process),
  timed by wall clock, so the figure includes interpreter start-up: that is what a user waits for.
- rsync and tar copy to N local folders one after another, as a user looping over hosts from a
  head node would; monarch-fs pushes to N local daemons (loopback TCP, FUSE mounts) at once. Both
  share the same two cores, so neither gets free parallelism from the machine.
- Every run pushes with a fresh $MONARCH_FS_HOME, so the push's scan cache (what each file
  hashed to) starts empty for the cold case, as on a first push, and the re-pushes use what the
  cold push left there, as a user's would.
- The page cache is dropped before every cold run when we are root (the tree fits in RAM, so a
  warm cache would hide the disk); warm cases run with whatever the previous case left behind.
- `sync` runs (untimed) before every measured run, so one tool's dirty pages are never flushed on
  another tool's clock: monarch-fs flushes its chunk store (fdatasync) before it publishes,
  rsync and tar never flush. The time a `sync` takes right after each rsync/tar run is recorded
  too, as the price of the durability monarch-fs pays and they do not.

The tree is generated once, deterministically (random.Random(0)), into a cache folder and reused:
~25% of the bytes are thousands of small pseudo-source files (compress like code, ~2.7x with
zstd -1), the rest a few 50-200 MB binaries, half low-entropy like shared libraries (~2x), half
random like weights. The edit case appends one line to one small file and truncates it back
afterwards (and at the next start, should a run be interrupted), so the cache stays pristine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from monarch_fs.daemon.client import cluster

from .common import (
    DEFAULT_CACHE,
    BenchError,
    MiB,
    PageCache,
    fmt_bytes,
    last_json,
    mfs_cli,
    remove_work,
    run,
    sync,
)
from .machine import machine_facts

GENERATOR_VERSION = 1
SMALL_FRACTION = 0.25
SMALL_SIZES = (1024, 40 * 1024)  # bytes, uniform
LARGE_SIZES = (50 * MiB, 200 * MiB)  # bytes, uniform
LINE_POOL = 5000  # distinct pseudo-source lines: sets how well the small files compress
VERIFY_SAMPLE = 200  # files compared byte for byte after the cold push
EDIT_LINE = b"# edited by push_bench\n"

WORDS = (
    "self def return import from class if else elif for in while try except finally with as None "
    "True False and or not is lambda yield async await raise pass break continue global torch "
    "tensor numpy array dtype shape device cuda float32 int64 size dim index value key items "
    "config model layer weight bias grad optimizer step loss batch input output hidden state "
    "cache module name path os sys logging logger warn error result args kwargs options data "
    "buffer stream offset length count total start end first last next prev parent child node "
    "graph edge list dict set tuple str int float bool bytes len range enumerate zip map filter "
    "sorted isinstance getattr setattr hasattr super init forward backward apply reduce scatter "
    "gather rank world group process"
).split()
SEPARATORS = (" ", " ", " ", ".", ", ", "(", ")", " = ", "_", " + ", ": ", "[")

# Low-entropy bytes for library-like binaries: half zeros, a few common values, some spread.
LOW_ENTROPY = bytes(0 if b < 128 else (b & 0x0F) if b < 224 else b for b in range(256))
LARGE_NAMES = (
    ("torch/lib/libtorch_cpu.so", True),
    ("safetensors_cache/model-00001-of-00004.safetensors", False),
    ("torch/lib/libtorch_cuda.so", True),
    ("safetensors_cache/model-00002-of-00004.safetensors", False),
    ("nvidia/cublas/lib/libcublasLt.so.12", True),
    ("safetensors_cache/model-00003-of-00004.safetensors", False),
    ("triton/_C/libtriton.so", True),
    ("safetensors_cache/model-00004-of-00004.safetensors", False),
)
SITE = "lib/python3.11/site-packages"


# ---- the generated tree -------------------------------------------------------------------

@dataclass
class TreeInfo:
    """What was generated, stored next to the tree so a rerun can reuse (and repair) it."""

    generator: int
    size_mb: int
    small_files: int
    small_bytes: int
    large_files: list[list]  # [relative path, bytes, compressible]
    edit_path: str  # the small file the edit case appends to
    edit_size: int  # its pristine size and mtime, to undo an interrupted edit
    edit_mtime_ns: int

    @property
    def total_bytes(self) -> int:
        return self.small_bytes + sum(size for _, size, _ in self.large_files)


def _pseudo_source(rng: random.Random, pool: list[str], size: int) -> bytes:
    """`size` bytes of code-like text: lines drawn from a fixed pool, as real modules repeat
    idioms (this compresses ~2.7x per file with zstd -1, close to real site-packages)."""
    return "".join(rng.choices(pool, k=size // 30 + 4)).encode()[:size]


def _line_pool(rng: random.Random) -> list[str]:
    def line() -> str:
        k = rng.randint(2, 9)
        words = rng.choices(WORDS, k=k)
        seps = rng.choices(SEPARATORS, k=k - 1) + [""]
        indent = "    " * rng.choice((0, 1, 1, 2, 2, 2, 3))
        return indent + "".join(map(str.__add__, words, seps)) + "\n"

    return [line() for _ in range(LINE_POOL)]


def _write_binary(rng: random.Random, path: Path, size: int, compressible: bool) -> None:
    """Every 1 MiB block is fresh random bytes (no two chunks alike, so deduplication gets no
    unfair help); library-like files map 3 of 4 blocks to low-entropy bytes (~2x with zstd)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            block = rng.randbytes(min(MiB, left))
            if compressible and rng.random() < 0.75:
                block = block.translate(LOW_ENTROPY)
            f.write(block)
            left -= len(block)


def _small_file_paths(rng: random.Random, count: int) -> list[str]:
    """Package folders a few levels deep, mostly .py, like an unpacked site-packages."""
    packages = [f"{a}_{b}" for a, b in (rng.sample(WORDS, 2) for _ in range(max(1, count // 200)))]
    packages = list(dict.fromkeys(packages))
    subdirs = ["", "", "utils", "nn", "ops", "_internal", "tests", "backends/cpu"]
    exts = [".py"] * 17 + [".pyi", ".txt", ".json"]
    paths = []
    for i in range(count):
        sub = rng.choice(subdirs)
        name = f"{rng.choice(WORDS)}_{i:05d}{rng.choice(exts)}"
        paths.append("/".join(p for p in (SITE, rng.choice(packages), sub, name) if p))
    return paths


def generate_tree(dest: Path, size_mb: int) -> TreeInfo:
    """Write the tree into `dest` (which must not exist) and describe it."""
    rng = random.Random(0)
    total = size_mb * MiB
    small_budget = int(total * SMALL_FRACTION)
    pool = _line_pool(rng)

    sizes: list[int] = []
    while sum(sizes) < small_budget:
        sizes.append(min(rng.randint(*SMALL_SIZES), small_budget - sum(sizes)))
    paths = _small_file_paths(rng, len(sizes))
    for n, (rel, size) in enumerate(zip(paths, sizes), 1):
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_pseudo_source(rng, pool, size))
        if n % 500 == 0 or n == len(paths):
            print(f"\rgenerating small files: {n}/{len(paths)}", end="", file=sys.stderr)

    large: list[list] = []
    left = total - small_budget
    i = 0
    while left > 0:
        size = min(rng.randint(*LARGE_SIZES), left)
        if left - size < LARGE_SIZES[0]:
            size = left  # no runt at the end
        name, compressible = LARGE_NAMES[i % len(LARGE_NAMES)]
        if i >= len(LARGE_NAMES):
            name += f".{i // len(LARGE_NAMES)}"
        rel = f"{SITE}/{name}"
        print(f"\rgenerating {rel} ({size // MiB} MiB)" + " " * 20, end="", file=sys.stderr)
        _write_binary(rng, dest / rel, size, compressible)
        large.append([rel, size, compressible])
        left -= size
        i += 1
    print(file=sys.stderr)

    # What a venv has besides site-packages: a config, scripts, and symlinks.
    (dest / "bin").mkdir(exist_ok=True)
    (dest / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n"
                                     "version = 3.11.7\n")
    (dest / "bin/torchrun").write_text("#!/usr/bin/env python\nimport sys\n")
    os.chmod(dest / "bin/torchrun", 0o755)
    os.symlink("/usr/bin/python3.11", dest / "bin/python3")
    os.symlink("python3", dest / "bin/python")
    os.symlink("lib", dest / "lib64")

    edit = dest / paths[len(paths) // 2]
    st = edit.stat()
    return TreeInfo(GENERATOR_VERSION, size_mb, len(sizes), sum(sizes), large,
                    paths[len(paths) // 2], st.st_size, st.st_mtime_ns)


def _info_path(cache: Path, size_mb: int) -> Path:
    return cache / f"tree-{size_mb}.json"


def ensure_tree(cache: Path, size_mb: int) -> tuple[Path, TreeInfo, bool]:
    """The cached tree for `size_mb` (generated on first use), its description, and whether it
    was generated now. A tree left edited by an interrupted run is truncated back first."""
    tree = cache / f"tree-{size_mb}"
    info_file = _info_path(cache, size_mb)
    if tree.is_dir() and info_file.exists():
        info = TreeInfo(**json.loads(info_file.read_text()))
        if info.generator == GENERATOR_VERSION:
            undo_edit(tree, info)
            return tree, info, False
    print(f"generating a {size_mb} MB tree in {tree} (once; later runs reuse it)", file=sys.stderr)
    cache.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tree, ignore_errors=True)
    partial = cache / f"tree-{size_mb}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    info = generate_tree(partial, size_mb)
    os.rename(partial, tree)
    info_file.write_text(json.dumps(asdict(info), indent=1))
    return tree, info, True


def edit_file(tree: Path, info: TreeInfo) -> Path:
    """Append one line to one small source file, as a researcher's edit would."""
    path = tree / info.edit_path
    with open(path, "ab") as f:
        f.write(EDIT_LINE)
    return path


def undo_edit(tree: Path, info: TreeInfo) -> None:
    """The edit only appends, so truncating to the recorded size restores the pristine file."""
    path = tree / info.edit_path
    if path.stat().st_size != info.edit_size:
        os.truncate(path, info.edit_size)
    os.utime(path, ns=(info.edit_mtime_ns, info.edit_mtime_ns))


def clean_cache(cache: Path) -> None:
    """--clean: remove every cached tree (and its description) under the cache folder."""
    removed = 0
    for p in sorted(cache.glob("tree-*")):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed += 1
    print(f"removed {removed} cached entries from {cache}")


# ---- measuring ----------------------------------------------------------------------------

@dataclass
class Measurement:
    tool: str
    case: str
    seconds: float  # wall clock, every node
    cache_dropped: bool = False
    per_node: list[float] = field(default_factory=list)  # rsync/tar: each destination in turn
    flush_seconds: float | None = None  # rsync/tar: a `sync` right after, not in `seconds`
    push: dict | None = None  # monarch-fs: the CLI's JSON result


class MonarchFS:
    """`monarch-fs push` through the real CLI, against a local cluster."""

    def __init__(self, cli: str, cluster_dir: Path, home: Path):
        self.cli = cli
        self.dir = cluster_dir
        self.env = {**os.environ, "MONARCH_FS_HOME": str(home)}  # the scan cache lives here

    def push(self, tree: Path, case: str, cache_dropped: bool = False) -> Measurement:
        sync()
        seconds, proc = run([self.cli, "push", str(tree), "--hosts", f"@{self.dir / 'hosts'}",
                             "--token-file", str(self.dir / "token"), "--json"], env=self.env,
                            timeout=None)
        return Measurement("monarch-fs", case, seconds, cache_dropped, push=last_json(proc.stdout))

    def mount(self, node: int, name: str) -> Path:
        return self.dir / f"node-{node}" / "mnt" / name


class Copier:
    """A copy a user would run once per node, one node after another (rsync, tar | zstd)."""

    def __init__(self, tool: str, command, dests: list[Path]):
        self.tool = tool
        self.command = command  # (tree, dest) -> argv
        self.dests = dests

    def copy(self, tree: Path, case: str, cache_dropped: bool = False) -> Measurement:
        sync()
        per_node = []
        for dest in self.dests:
            dest.mkdir(parents=True, exist_ok=True)
            seconds, _ = run(self.command(tree, dest), timeout=None)
            per_node.append(seconds)
        return Measurement(self.tool, case, sum(per_node), cache_dropped, per_node,
                           flush_seconds=sync())


def rsync_cmd(tree: Path, dest: Path) -> list[str]:
    return ["rsync", "-a", f"{tree}/", f"{dest}/"]


def tar_zstd_cmd(tree: Path, dest: Path) -> list[str]:
    """tar | zstd -1 | (the network) | zstd -d | tar: the receiving side must decompress, and
    tar -x refuses a compressed stream without being told, so the decompression is explicit."""
    pipeline = (f"tar -C {shlex.quote(str(tree))} -cf - . | zstd -1 -q | zstd -d -q | "
                f"tar -C {shlex.quote(str(dest))} -xf -")
    return ["bash", "-c", "set -o pipefail; " + pipeline]


# ---- correctness --------------------------------------------------------------------------

def _listing(root: Path) -> dict[str, tuple]:
    """Every entry below root: files by size, symlinks by target, directories as such."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("symlink", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.stat().st_size)
    return out


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(MiB), fb.read(MiB)
            if x != y:
                return False
            if not x:
                return True


def verify_copy(tree: Path, mount: Path, info: TreeInfo) -> str:
    """Compare the whole listing (names, types, sizes, link targets) and the bytes of a sample
    (random small files, every large file's kind, the file the edit case touches)."""
    src, dst = _listing(tree), _listing(mount)
    if src != dst:
        only_src = sorted(set(src) - set(dst))[:5]
        only_dst = sorted(set(dst) - set(src))[:5]
        differ = sorted(k for k in set(src) & set(dst) if src[k] != dst[k])[:5]
        raise BenchError(f"{mount} does not match {tree}: {len(src)} vs {len(dst)} entries; "
                         f"missing {only_src}, extra {only_dst}, different {differ}")
    files = sorted(k for k, v in src.items() if v[0] == "file")
    rng = random.Random(1)
    sample = set(rng.sample(files, min(VERIFY_SAMPLE, len(files))))
    sample.add(info.edit_path)
    for kind in (True, False):
        sample.update([rel for rel, _, c in info.large_files if c == kind][:1])
    for rel in sorted(sample):
        if not same_bytes(tree / rel, mount / rel):
            raise BenchError(f"{mount / rel} differs from {tree / rel}")
    return (f"{len(src)} entries ({len(files)} files) match by name/type/size; "
            f"{len(sample)} files match byte for byte")


def verify_edit(tree: Path, info: TreeInfo, mounts: list[Path]) -> str:
    """After the edit push, every node must serve the edited bytes (no stale reads)."""
    for m in mounts:
        if not same_bytes(tree / info.edit_path, m / info.edit_path):
            raise BenchError(f"{m / info.edit_path} is stale after the edit push")
    return f"edited file correct on all {len(mounts)} nodes"


# ---- report -------------------------------------------------------------------------------

CASES = (("cold", "cold"), ("nochange", "re-push, no change"),
         ("edit", "re-push, 1 small file edited"))


def markdown(report: dict) -> str:
    by = {(m["tool"], m["case"]): m for m in report["measurements"]}
    t, m = report["tree"], report["machine"]
    lines = [
        f"## monarch-fs push benchmark, {report['date']}",
        "",
        f"- tree: {t['entries']} entries, {fmt_bytes(t['bytes'])}: {t['small_files']} small "
        f"text files ({fmt_bytes(t['small_bytes'])}), {len(t['large_files'])} binaries "
        f"({fmt_bytes(t['bytes'] - t['small_bytes'])}); {t['path']}",
        f"- {report['nodes']} nodes: monarch-fs to a local cluster (loopback TCP, FUSE), "
        f"rsync and tar|zstd to {report['nodes']} local folders one after another",
        f"- machine: {m['nproc']} cores, kernel {m['kernel']}, Python {m['python']}, "
        f"{m['mem_gib']} GiB RAM; {m['rsync']}; zstd {m['zstd'].split(' v')[-1].split(',')[0]}; "
        f"monarch-fs {m['monarch_fs_commit']}",
        f"- page cache: {report['page_cache']}",
        "",
        "| case | monarch-fs s | rsync s | rsync / monarch-fs | tar\\|zstd s | tar / monarch-fs "
        "| monarch-fs bytes_sent | chunks_sent |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case, label in CASES:
        mfs = by[("monarch-fs", case)]
        row = [label, f"{mfs['seconds']:.2f}"]
        for tool in ("rsync", "tar|zstd"):
            other = by.get((tool, case))
            if other is None:
                row += ["n/a", "n/a"]
            else:
                row += [f"{other['seconds']:.2f}", f"{other['seconds'] / mfs['seconds']:.2f}x"]
        row += [f"{mfs['push']['bytes_sent']:,} ({fmt_bytes(mfs['push']['bytes_sent'])})",
                f"{mfs['push']['chunks_sent']:,} (snapshot: {mfs['push']['chunks_total']:,})"]
        lines.append("| " + " | ".join(row) + " |")
    flush = ", ".join(f"{tool} {case} {by[(tool, case)]['flush_seconds']:.2f}s"
                      for tool in ("rsync", "tar|zstd") for case, _ in CASES
                      if (tool, case) in by)
    internal = ", ".join(f"{case} {by[('monarch-fs', case)]['push']['seconds']:.2f}s"
                         for case, _ in CASES)
    lines += [
        "",
        f"bytes_sent and chunks_sent are what left the dev box (`push --json`; fan-out "
        f"{by[('monarch-fs', 'cold')]['push'].get('topology', 'star')}), summed over nodes. "
        "Ratios above 1 mean monarch-fs is faster. tar re-sends everything, so it has no "
        "no-change case. monarch-fs seconds are wall clock around the CLI (interpreter start-up "
        f"included); the push itself reported {internal}.",
        f"monarch-fs makes the stores durable (syncfs) before publishing; rsync and tar do not. "
        f"A `sync` right after each of their runs (not counted above) took: {flush}.",
        f"Correctness: cold push: {report['verify']['cold']}; "
        f"edit push: {report['verify']['edit']}.",
    ]
    return "\n".join(lines) + "\n"


# ---- the run ------------------------------------------------------------------------------

def benchmark(tree: Path, info: TreeInfo, nodes: int, work: Path
              ) -> tuple[list[Measurement], dict, PageCache]:
    """Every tool, every case, in an order that gives each cold run a dropped cache."""
    cli = mfs_cli()
    cache = PageCache()
    cluster_dir = work / "cluster"
    rsync = Copier("rsync", rsync_cmd, [work / f"rsync-{i}" for i in range(nodes)])
    tar = Copier("tar|zstd", tar_zstd_cmd, [work / f"tar-{i}" for i in range(nodes)])
    results: list[Measurement] = []
    verify: dict = {}

    def step(what: str, fn, *args) -> Measurement:
        print(f"  {what} ...", end="", flush=True, file=sys.stderr)
        m = fn(*args)
        print(f" {m.seconds:.2f}s", file=sys.stderr)
        results.append(m)
        return m

    print(f"starting {nodes} daemons in {cluster_dir}", file=sys.stderr)
    cluster.up(nodes, cluster_dir)
    try:
        home = work / "home"
        home.mkdir(exist_ok=True)
        mfs = MonarchFS(cli, cluster_dir, home)
        step("monarch-fs cold", mfs.push, tree, "cold", cache.drop())
        verify["cold"] = verify_copy(tree, mfs.mount(0, tree.name), info)
        step("monarch-fs no change", mfs.push, tree, "nochange")
        step("rsync cold", rsync.copy, tree, "cold", cache.drop())
        step("rsync no change", rsync.copy, tree, "nochange")
        step("tar|zstd cold", tar.copy, tree, "cold", cache.drop())
        edit_file(tree, info)
        try:
            step("monarch-fs edit", mfs.push, tree, "edit")
            mounts = [mfs.mount(i, tree.name) for i in range(nodes)]
            verify["edit"] = verify_edit(tree, info, mounts)
            step("rsync edit", rsync.copy, tree, "edit")
            step("tar|zstd edit", tar.copy, tree, "edit")
        finally:
            undo_edit(tree, info)
    finally:
        cluster.down(cluster_dir)
    return results, verify, cache


def measure(size_mb: int, nodes: int, cache_dir: Path = DEFAULT_CACHE) -> dict:
    """Generate (or reuse) the tree, run every tool and case, and return the report (what
    main() writes as JSON). Raises BenchError when a tool fails or a copy is wrong."""
    tree, info, generated = ensure_tree(cache_dir, size_mb)
    print(f"tree {tree}: {info.small_files} small files, {len(info.large_files)} binaries, "
          f"{fmt_bytes(info.total_bytes)}" + (" (generated now)" if generated else " (cached)"),
          file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=cache_dir))
    try:
        results, verify, cache = benchmark(tree, info, nodes, work)
    finally:
        remove_work(work)

    now = datetime.datetime.now()
    report = {
        "date": now.isoformat(timespec="seconds"),
        "nodes": nodes,
        "machine": machine_facts(),
        "page_cache": cache.describe(),
        "tree": {**asdict(info), "path": str(tree), "bytes": info.total_bytes,
                 "entries": len(_listing(tree))},
        "measurements": [asdict(m) for m in results],
        "verify": verify,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024, help="tree size (default 1024)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes / destinations (default 3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="where push-<date>.json and .md go (default bench/results)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"where generated trees are kept (default {DEFAULT_CACHE})")
    parser.add_argument("--clean", action="store_true",
                        help="remove the cached generated trees and exit")
    args = parser.parse_args(argv)
    if args.clean:
        clean_cache(args.cache)
        return 0
    if args.size_mb < 4 or args.nodes < 1:
        parser.error("--size-mb must be at least 4 and --nodes at least 1")

    try:
        report = measure(args.size_mb, args.nodes, args.cache)
    except BenchError as e:
        print(f"push_bench: FAILED: {e}", file=sys.stderr)
        return 1
    now = datetime.datetime.fromisoformat(report["date"])
    md = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"push-{now:%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
