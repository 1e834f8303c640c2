"""Node ingest: one large incompressible file pushed to N fresh local nodes over loopback.

Reports MB/s of content (wall time of the push), the daemons' CPU seconds per GB of content
(utime + stime from /proc/PID/stat around the push, summed over the nodes and divided by the
content each one ingested) and the node disk per content byte (store + backing files, once the
backing copies are done), beside the raw loopback stream measured in the same run
(bench/limits.py: one Python TCP stream, 4 MiB sendall/recv_into) and the push's rate over it,
and beside the node's disk (limits.direct_write: 4 MiB O_DIRECT writes and an fsync, the most
a fresh node can write).
Also the push process's own CPU per GB (the dev box's half of the path), and a floor measured on
the same file in the same run: a plain-Python push pipeline (limits.push_pipeline: read, hash
and send each 4 MiB piece; the receiver hashes it and writes it into the page cache), its rate
over the raw stream, the push's rate over it, and each side's CPU per GB.

Relays: `--nodes 3 --topology chain` streams to node 0, which forwards to node 1, which
forwards to node 2; `per_node_cpu_s_per_gb` is each daemon's CPU per GB it ingested, so the
first two are a relay hop each (receive, verify, write, forward) and the last a plain ingest.
Beside them, `node_floor_cpu_s_per_gb` and `hop_floor_cpu_s_per_gb` (bench/limits.node_floor,
same run): the CPU per GB of a plain Python loop doing a node's work on the same number of
bytes (recv_into, a GMAC check, xxh3, an O_DIRECT write; a hop also sends each piece on),
with no framing, store or Python per chunk.
On a machine whose cores the daemons share, CPU per GB per hop is the figure, not wall time.

    python -m bench.ingest_bench --mib 1024 --nodes 1 [--durable sync|background]
    python -m bench.ingest_bench --mib 1024 --nodes 3 --topology chain
    python -m bench.ingest_bench --mib 1024 --encrypt on
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import LocalCluster, disk_bytes, mfs_cli
from bench.limits import direct_write, loopback_stream, node_floor, push_pipeline
from bench.node_settled import flushed, settled


def cpu_seconds(pid: int, which: tuple[int, ...] = (11, 12)) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in which) / os.sysconf("SC_CLK_TCK")


def measure(src: Path, work: Path, nodes: int = 1, topology: str | None = None,
            encrypt: str | None = None, profile: str | None = None) -> dict:
    """Push the folder `src` (one large incompressible file) to a fresh cluster of `nodes` in
    `work`, beside the limits measured right before it; the figures the module's docstring
    names. The daemons' --durable is theirs, or $MONARCH_FS_DURABLE's."""
    content = sum(f.stat().st_size for f in src.iterdir())
    big = max(src.iterdir(), key=lambda f: f.stat().st_size)
    loopback = loopback_stream(content)  # bytes/s, this run
    floor = push_pipeline(big, work)
    # The node's disk, this run: a fresh node writes every byte, with O_DIRECT (a buffered write
    # into fresh page cache cost 1.8 CPU-s per GiB here against 0.2: fs/file_objects.py), so
    # no push to it outruns this.
    disk_rate = direct_write(work, content)
    # a node's and a relay hop's work at its plainest, this run (bench/limits.node_floor)
    piece = max(content // 2, 64 << 20)  # each of its 3 runs
    ingest_floor = node_floor(work, piece)
    hop_floor = node_floor(work, piece, forward=True) if nodes > 1 else None
    with LocalCluster(work / f"cluster-{nodes}-{topology or 'auto'}-{encrypt or 'auto'}",
                      nodes=nodes) as c:
        pids = [c.pid(i) for i in range(nodes)]
        spy = None
        if profile:  # a profiling aid only: py-spy, if installed
            cmd = (["perf", "record", "-g", "-p", str(pids[0]), "-o", profile]
                   if profile.endswith(".data") else
                   ["py-spy", "record", "-p", str(pids[0]), "-f", "raw",
                    "-o", profile, "-r", "250", "--threads"])
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        before = [cpu_seconds(p) for p in pids]
        user_before = [cpu_seconds(p, (11,)) for p in pids]
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        push_args = ["--topology", topology] if topology else []
        push_args += ["--encrypt", encrypt] if encrypt else []
        seconds, result = c.push(src, args=push_args)
        pushed = resource.getrusage(resource.RUSAGE_CHILDREN)
        push_cpu = pushed.ru_utime + pushed.ru_stime - children.ru_utime - children.ru_stime
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        after = [cpu_seconds(p) for p in pids]
        user = sum(cpu_seconds(p, (11,)) - b for p, b in zip(pids, user_before))
        settled(c)  # backing copies run after the commit
        settled_cpu = [cpu_seconds(p) for p in pids]
        for i in range(nodes):
            flushed(c.state(i))
        disk = [disk_bytes(c.state(i)) for i in range(nodes)]
    cpu = sum(a - b for a, b in zip(after, before))
    cpu_all = sum(a - b for a, b in zip(settled_cpu, before))
    gb = content * nodes / 1e9
    mib = content / (1 << 20)
    return {
        "nodes": nodes, "content_mib": int(mib) if mib.is_integer() else round(mib, 1),
        "push_s": round(seconds, 2),
        "MB_per_s": round(content / 1e6 / seconds, 1),
        "loopback_MB_per_s": round(loopback / 1e6, 1),
        "of_loopback": round(content / seconds / loopback, 3),
        "disk_direct_MB_per_s": round(disk_rate / 1e6, 1),
        "disk_of_loopback": round(disk_rate / loopback, 3),
        "of_disk": round(content / seconds / disk_rate, 3),
        "pipeline_MB_per_s": round(floor["bytes_per_s"] / 1e6, 1),
        "pipeline_of_loopback": round(floor["bytes_per_s"] / loopback, 3),
        "of_pipeline": round(content / seconds / floor["bytes_per_s"], 3),
        "pipeline_cpu_s_per_gb": {k.removesuffix("_cpu_s_per_gb"): round(v, 2)
                                  for k, v in floor.items() if k.endswith("_per_gb")},
        "durable": os.environ.get("MONARCH_FS_DURABLE", "background"),
        "daemon_cpu_s_per_gb_push": round(cpu / gb, 2),
        "of_which_user": round(user / gb, 2),
        "daemon_cpu_s_per_gb_incl_backing": round(cpu_all / gb, 2),
        "per_node_cpu_s_per_gb": [round((a - b) / (content / 1e9), 2)
                                  for a, b in zip(after, before)],
        "node_floor_cpu_s_per_gb": round(ingest_floor, 2),
        "hop_floor_cpu_s_per_gb": None if hop_floor is None else round(hop_floor, 2),
        "push_cpu_s_per_gb": round(push_cpu / (content / 1e9), 2),
        "phases": result.get("phases"),  # push --json's: scan, send, publish...
        "topology": topology or "auto", "encrypt": encrypt or "auto",
        "disk_per_content_byte": round(max(disk) / content, 3),
        "exit": result.get("ok", result.get("status")),
    }


def random_folder(folder: Path, mib: int) -> Path:
    """`folder` holding big.bin, `mib` MiB of random bytes (no compressor shrinks it)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "big.bin", "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--profile", help=("node 0's profile to this file: perf record if it "
                                       "ends in .data, else py-spy's collapsed stacks"))
    ap.add_argument("--durable", choices=["background", "sync"],
                    help="the daemons' --durable (default: theirs, background)")
    ap.add_argument("--topology", choices=["auto", "chain", "tree", "star"],
                    help="the push's --topology (chain: a relay hop per node but the last)")
    ap.add_argument("--encrypt", choices=["auto", "on"],
                    help="the push's --encrypt (auto: loopback is authenticated, not encrypted)")
    args = ap.parse_args()
    if args.durable:
        os.environ["MONARCH_FS_DURABLE"] = args.durable  # the cluster's daemons inherit it
    mfs_cli()
    with tempfile.TemporaryDirectory(dir="/work") as tmp:
        src = random_folder(Path(tmp) / "src", args.mib)
        print(json.dumps(measure(src, Path(tmp), args.nodes, args.topology, args.encrypt,
                                 args.profile)))


if __name__ == "__main__":
    main()
