#!/usr/bin/env python3
"""How long a push takes to reach N nodes, from the link bandwidth, not from a run.

    .venv/bin/python -m bench.fanout_model                       # 1..1024 nodes, defaults
    .venv/bin/python -m bench.fanout_model --nodes 8,1024 --rate 10gbit --payload-mb 5000
    .venv/bin/python -m bench.fanout_model --check bench/results/fanout-DATE.json

The model
---------
Every host (the dev box and each node) has one full-duplex link of bandwidth B bytes/s in each
direction (what `tbf` enforces in the netns bench, and what a NIC gives on a real cluster); the
switch is not a bottleneck. B here is goodput: the link rate times the share of each frame that
is payload, 1448/1514 for TCP over Ethernet with timestamps (tbf counts whole frames; a real NIC
also sends a preamble and gap, 1448/1538). A push of P bytes that every node lacks, in chunks of
c bytes:

* A node forwards a chunk only once it has received the whole chunk (daemon/node/relay.py forwards a
  `PutChunk` frame after `chan.receive()` returned it: store-and-forward per chunk), and it
  forwards chunk j while it receives chunk j+1 (bounded queues), so levels overlap.
* A sender with m children pushes m copies of every chunk through its one uplink, so in steady
  state each child receives at B/m, and everything downstream is paced by the slowest sender:
  the stream runs at B/m where m is the largest number of copies any host sends.
* A chunk takes m·c/B to cross one hop at that pace, plus L, the per-hop latency (wire
  propagation + the relay's software delay between receiving a frame and starting to send it).

So the time to move the data is the time to stream P at B/m, plus the time the last chunk needs
to go down the remaining D hops after the first sender has sent it:

    T_net = m·P/B + D·(m·c/B + L) + L

    star            m = N (the dev box sends N copies), D = 0        -> N·P/B + L
    chain           m = 1, D = N-1                                   -> P/B + (N-1)(c/B + L) + L
    tree, fanout k  m = min(k, N-1) (1 for N = 1), D = the depth of the heap-ordered k-ary tree
                    (the smallest d with 1 + k + ... + k^d >= N)     -> m·P/B + D(m·c/B + L) + L

A tree is not "k·P/B per level": without pipelining every level would wait for the one above
(D·k·P/B), but relays forward as they receive, so the levels overlap and only the pipeline fill
(D hops of one chunk each) is paid per level. The chain's fill, (N-1)·c/B, grows linearly: with
4 MiB chunks at 400 Mbit/s it is 84 ms per hop, 86 s over 1023 hops (8x the transfer itself),
which is why a 1024-node chain wants small chunks or cut-through forwarding (forward each frame's
bytes as they arrive: the per-hop cost drops to L), and why a tree can beat it there.

The dev box's egress is (number of roots)·P·(1 + h): P for chain and tree, N·P for star; h is
the framing overhead the kernel counts (protocol frames, TCP/IP headers in GSO packets: ~0.1%).

The measured push time adds what is not data movement:

    T = T0 + max(T_net, T_cpu)

* T0: the CLI starting, scanning and hashing P on the dev box, connecting, publishing (two
  round trips and a syncfs on every node). It does not depend on N to first order; `--check`
  fits it from the N = 1 runs (median of measured - T_net), otherwise --t0 or a guess.
* T_cpu (one machine only): every node receives P once whatever the topology, so N·P bytes
  cross links in total, each costing kappa CPU-seconds (the kernel's send and receive, the
  daemon's receive, verify, store and forward), and the dev box's client spends kappa_c per
  byte it sends (roots·P). On one machine all of it shares the cores other users leave free:
  T_cpu = (N·P·kappa + roots·P·kappa_c) / free cores. `--check` fits kappa from the daemons'
  CPU-seconds plus the kernel's softirq time, and kappa_c from the client's, over all runs.
  T = T0 + max(T_net, T_cpu) is optimistic near the crossover, where both limits bite at once.
* On a real cluster each node has its own CPUs, but a relay daemon is one trio thread (plus
  store threads): it moves at most 1/kappa bytes/s, about 200 MB/s at the ~5 ns/byte measured
  here. `--relay-ns-per-byte` caps the link bandwidth at that, B_eff = min(B, 1/kappa): it
  changes nothing at 400 Mbit/s, and everything at 10 Gbit/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tests.netns import rate_bytes_per_second  # tc's rate units

MiB = 1024 * 1024
CHUNK = 4 * MiB  # fs/chunk.py CHUNK_SIZE
HEADER_OVERHEAD = 0.002  # dev-box tx_bytes / payload measured on veth (GSO packets)
WIRE_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame (MSS with timestamps / frame)
DEFAULT_LATENCY = 0.0005  # s per hop: a LAN hop plus a trio relay's wake-up and send
HASH_RATE = 1.5e9  # bytes/s the dev box reads + hashes a warm source at (a guess for T0)
STARTUP = 0.6  # s: interpreter start, connect, two-phase publish (a guess for T0)


def tree_depth(n: int, k: int) -> int:
    """Hops from the root to the deepest node of an n-node heap-ordered k-ary tree."""
    depth, level, covered = 0, 1, 1
    while covered < n:
        level *= k
        covered += level
        depth += 1
    return depth


def shape(topology: str, n: int, fanout: int = 2) -> tuple[int, int, int]:
    """(copies m the busiest sender makes, hops D below the first sender, roots)."""
    if topology == "star":
        return n, 0, n
    if topology == "chain":
        return 1, n - 1, 1
    if topology == "tree":
        return (min(fanout, n - 1) if n > 1 else 1), tree_depth(n, fanout), 1
    raise ValueError(f"unknown topology {topology!r}")


@dataclass
class Link:
    bandwidth: float  # goodput, bytes/s, each direction (the rate times WIRE_EFFICIENCY)
    latency: float = DEFAULT_LATENCY  # s per hop
    chunk: int = CHUNK


def goodput(rate: str) -> float:
    """Payload bytes/s through a link of `rate` (tc units)."""
    return rate_bytes_per_second(rate) * WIRE_EFFICIENCY


def transfer_seconds(payload: int, n: int, topology: str, link: Link, fanout: int = 2) -> float:
    """T_net: moving `payload` bytes to n nodes (see the module docstring)."""
    m, depth, _ = shape(topology, n, fanout)
    hop = m * min(link.chunk, payload) / link.bandwidth + link.latency
    return m * payload / link.bandwidth + depth * hop + link.latency


def devbox_egress(payload: int, n: int, topology: str, fanout: int = 2) -> float:
    """Bytes the dev box's interface sends."""
    return shape(topology, n, fanout)[2] * payload * (1 + HEADER_OVERHEAD)


def default_t0(payload: int) -> float:
    return STARTUP + payload / HASH_RATE


def predict(payload: int, n: int, topology: str, link: Link, fanout: int = 2,
            t0: float | None = None, kappa: float = 0.0, cores: float | None = None,
            kappa_client: float = 0.0) -> dict:
    """Predicted seconds and egress for one push. `cores` set: the dev box and the nodes share
    that many CPUs (one machine), so the CPU term can dominate (see the module docstring)."""
    t_net = transfer_seconds(payload, n, topology, link, fanout)
    roots = shape(topology, n, fanout)[2]
    t_cpu = ((n * payload * kappa + roots * payload * kappa_client) / cores) if cores else 0.0
    t0 = default_t0(payload) if t0 is None else t0
    return {"seconds": t0 + max(t_net, t_cpu), "t_net": t_net, "t_cpu": t_cpu, "t0": t0,
            "egress": devbox_egress(payload, n, topology, fanout),
            "bound": "cpu" if t_cpu > t_net else "network"}


# ---- projection ---------------------------------------------------------------------------

def project(args: argparse.Namespace) -> None:
    """Predicted time and egress per topology and N, plus a chain what-if on the chunk size."""
    bandwidth = goodput(args.rate)
    if args.relay_ns_per_byte:
        bandwidth = min(bandwidth, 1e9 / args.relay_ns_per_byte)
    link = Link(bandwidth, args.latency, int(args.chunk_mib * MiB))
    payload = int(args.payload_mb * 1e6)
    topologies = [("star", 0), ("chain", 0)] + [("tree", k) for k in args.fanouts]
    print(f"payload {payload / 1e6:.0f} MB, links {args.rate} (goodput "
          f"{link.bandwidth / 1e6:.1f} MB/s) "
          f"each way, chunk {link.chunk / MiB:g} MiB, {link.latency * 1e3:g} ms per hop, "
          f"T0 {args.t0 if args.t0 is not None else default_t0(payload):.2f} s; a real cluster "
          "(every node its own CPUs)")
    print("seconds, and (x) the dev box's egress over the payload:")
    head = [f"{t}{k if k else ''}" for t, k in topologies]
    print(f"{'N':>6}  " + "  ".join(f"{h:>14}" for h in head))
    for n in args.nodes:
        cells = []
        for topo, k in topologies:
            p = predict(payload, n, topo, link, k or 2, args.t0)
            cells.append(f"{p['seconds']:.1f} s x{p['egress'] / payload:.4g}")
        print(f"{n:>6}  " + "  ".join(f"{c:>14}" for c in cells))
    n = max(args.nodes)
    print(f"\nchain to {n} nodes by chunk size (the per-hop fill (N-1)·c/B is what grows):")
    for chunk in (64 * 1024, 256 * 1024, MiB, 4 * MiB, 16 * MiB):
        p = predict(payload, n, "chain", Link(link.bandwidth, link.latency, chunk), t0=args.t0)
        print(f"  {chunk / MiB:>7g} MiB  {p['seconds']:8.1f} s")
    cut = Link(link.bandwidth, link.latency, 0)
    p = predict(payload, n, "chain", cut, t0=args.t0)
    print(f"  cut-through {p['seconds']:6.1f} s (forward bytes as they arrive: per hop only L)")


# ---- check against measured runs ------------------------------------------------------------

def fit_t0(runs: list[dict], link: Link, fanout: int) -> float:
    """T0 = median over the N = 1 runs of measured - T_net (they have no relay and no
    contention, so what is left is the fixed cost)."""
    ones = [r["seconds"] - transfer_seconds(r["payload_bytes"], 1, r["topology"], link, fanout)
            for r in runs if r["nodes"] == 1]
    return statistics.median(ones) if ones else default_t0(runs[0]["payload_bytes"])


def fit_kappa(runs: list[dict]) -> tuple[float, float]:
    """(kappa, kappa_c): CPU-seconds per byte that crossed a link (the daemons' CPU plus the
    kernel's softirq time, over N·P) and per byte the client sent (its CPU over the egress);
    medians over the runs."""
    node = [(r["daemon_cpu_seconds"] + r.get("softirq_cpu_seconds", 0.0))
            / (r["nodes"] * r["payload_bytes"]) for r in runs if r.get("daemon_cpu_seconds")]
    client = [r["client_cpu_seconds"] / r["egress_bytes"] for r in runs
              if r.get("client_cpu_seconds") and r.get("egress_bytes")]
    return (statistics.median(node) if node else 0.0,
            statistics.median(client) if client else 0.0)


def check(results: dict, latency: float | None = None, out=sys.stdout) -> list[dict]:
    """Model vs measured for every run in a fanout bench result; returns the rows it printed.
    T0, kappa and kappa_c are fitted on the same runs (see fit_t0, fit_kappa). The free cores
    of a run are the machine's minus what other users took during it (the bench measures that:
    this machine is shared, and a load that comes and goes would otherwise look like error)."""
    cfg = results["config"]
    link = Link(goodput(cfg["rate"]),
                latency if latency is not None else cfg.get("hop_latency", DEFAULT_LATENCY),
                cfg.get("chunk_bytes", CHUNK))
    runs = [r for r in results["runs"] if r.get("ok", True)]
    fanout = cfg.get("fanout", 2)
    t0 = fit_t0(runs, link, fanout)
    kappa, kappa_c = fit_kappa(runs)
    cores = cfg.get("cores", 2)
    print(f"model: B = {link.bandwidth / 1e6:.1f} MB/s goodput, "
          f"L = {link.latency * 1e3:.1f} ms/hop, "
          f"c = {link.chunk / MiB:g} MiB, T0 = {t0:.2f} s (fitted on N=1); CPU: kappa = "
          f"{kappa * 1e9:.2f} ns per node-byte, kappa_c = {kappa_c * 1e9:.2f} ns per "
          f"dev-box byte, on {cores} cores less what others used", file=out)
    print(f"{'topology':>8} {'N':>3} {'measured s':>10} {'model s':>8} {'err':>7} "
          f"{'net-only s':>10} {'cpu s':>6} {'free':>5} {'bound':>7} {'egress/P':>8} "
          f"{'model':>6}", file=out)
    rows = []
    for r in runs:
        others = r.get("others_cpu_seconds",
                       cfg.get("background_load", 0.0) * cores * r["seconds"])
        free = max(0.25, cores - others / r["seconds"])
        p = predict(r["payload_bytes"], r["nodes"], r["topology"], link, fanout, t0, kappa,
                    free, kappa_c)
        err = (p["seconds"] - r["seconds"]) / r["seconds"]
        row = {"topology": r["topology"], "nodes": r["nodes"], "measured": r["seconds"],
               "predicted": p["seconds"], "error": err, "net_only": t0 + p["t_net"],
               "cpu": p["t_cpu"], "bound": p["bound"], "egress_ratio": r["egress_ratio"],
               "egress_ratio_model": p["egress"] / r["payload_bytes"]}
        rows.append(row)
        print(f"{row['topology']:>8} {row['nodes']:>3} {row['measured']:>10.2f} "
              f"{row['predicted']:>8.2f} {err:>+7.1%} {row['net_only']:>10.2f} "
              f"{row['cpu']:>6.2f} {free:>5.2f} {row['bound']:>7} {row['egress_ratio']:>8.3f} "
              f"{row['egress_ratio_model']:>6.3f}", file=out)
    if rows:
        mean_abs = statistics.mean(abs(r["error"]) for r in rows)
        print(f"mean |error| {mean_abs:.1%} over {len(rows)} runs", file=out)
    return rows


# ---- a small change (issue 20) ------------------------------------------------------------
#
# An edit moves kilobytes: its time is the control plane's, not the links'. For each edit the
# dev box sends every node a few small requests over the sessions push --watch keeps (current,
# what do you lack, relay, the chunk, flush, prepare, commit): b CPU-seconds per node, in its one
# trio thread. Each node works w CPU-seconds (load the changed folders, fsync, switch the
# version). F is what does not grow with N (the round trips, the dev box's own steps).
#
#   one machine (the netns check: N daemons and the dev box share the cores; the dev box's
#   requests are one thread's):
#       T(N) = F + N·max(b, (b + w) / cores)
#   a real cluster (each node its own CPUs; the dev box's requests go out one after another,
#   L the per-hop latency):
#       T(N) = F + N·b + w + L                       the star control plane (--control star)
#       T(N) = F + P(N)                              the control tree (--control tree, the
#       P(N) = min(k, N)·b + L + (D - 1)·(min(k, N)·r + L) + w
#                                                    default above 16 nodes): the dev box asks
#                                                    k roots, each node its k children, D hops
#                                                    deep; a node spends r CPU-seconds per child
#                                                    (fitted from the tree runs' daemon CPU
#                                                    beyond the star run's at the same N)
#   and the control tree on one machine, where the whole tree's CPU shares the cores:
#       T(N) = F + max(P(N), (k·b + (N - k)·r + N·w) / cores)

def fit_small_change(per_n: list[dict], cores: int,
                     trees: Sequence[tuple[int, int, float]] = ()) -> dict:
    """b, w and F from edit_fanout_bench's medians per N (least squares on the dev box's CPU
    against N for b; the daemons' CPU over N for w; F from the smallest N); r from `trees`,
    (N, k, the daemons' CPU down a control tree beyond the star's at that N): the N - k nodes
    a node asks instead of the dev box (b when there is no tree run)."""
    ns = [r["nodes"] for r in per_n]
    if len(ns) > 1:
        mean_n = statistics.mean(ns)
        mean_c = statistics.mean(r["client_cpu"] for r in per_n)
        b = (sum((r["nodes"] - mean_n) * (r["client_cpu"] - mean_c) for r in per_n)
             / sum((n - mean_n) ** 2 for n in ns))
    else:
        b = per_n[0]["client_cpu"] / ns[0]
    b = max(b, 0.0)
    w = statistics.median(r["daemon_cpu"] / r["nodes"] for r in per_n)
    low = min(per_n, key=lambda r: r["nodes"])
    f = max(0.0, low["seconds"] - low["nodes"] * max(b, (b + w) / cores))
    relayed = [max(0.0, extra) / (n - k) for n, k, extra in trees if n > k]
    r = statistics.median(relayed) if relayed else b
    return {"b": b, "w": w, "f": f, "r": r, "cores": cores, "fitted_on": ns}


def small_change_seconds(n: int, fit: dict, where: str = "cluster", fanout: int = 0) -> float:
    """Seconds for one edit to reach n nodes (see above): `where` "machine" (all on `cores`)
    or "cluster"; `fanout` k > 0: the control plane relayed down a k-ary tree."""
    b, w, f = fit["b"], fit["w"], fit["f"]
    r = fit.get("r", b)
    latency = fit.get("latency", DEFAULT_LATENCY)
    if fanout:
        k = min(fanout, n)
        path = k * b + latency + (tree_depth(n + 1, fanout) - 1) * (k * r + latency) + w
        if where == "machine":
            return f + max(path, (k * b + (n - k) * r + n * w) / fit["cores"])
        return f + path
    if where == "machine":
        return f + n * max(b, (b + w) / fit["cores"])
    return f + n * b + w + latency


def small_change_report(report: dict) -> list[str]:
    """The markdown of an edit_fanout_bench run: measured vs the model, and the projection."""
    fit = report["fit"]
    lines = [f"# One edit to N netns nodes ({report['date']}, links {report['rate']}, "
             f"{report['cores']} cores)", "",
             f"Model fitted on N = {', '.join(map(str, fit['fitted_on']))}: dev box "
             f"b = {fit['b'] * 1e3:.2f} ms CPU per node, node w = {fit['w'] * 1e3:.2f} ms CPU, "
             f"a node r = {fit.get('r', fit['b']) * 1e3:.2f} ms CPU per child down a control "
             f"tree, F = {fit['f'] * 1e3:.1f} ms (bench/fanout_model.py, `small_change`).", "",
             "| N | measured (median) | model, one machine | error |",
             "| ---: | ---: | ---: | ---: |"]
    rows = [(r, 0) for r in report["per_n"]]
    rows += [(t, t["fanout"]) for t in report.get("trees", [])]
    for r, k in rows:
        m = small_change_seconds(r["nodes"], fit, "machine", fanout=k)
        label = f"{r['nodes']}, control tree (k = {k})" if k else f"{r['nodes']}"
        lines.append(f"| {label} | {r['seconds']:.3f} s | {m:.3f} s | "
                     f"{(m - r['seconds']) / r['seconds']:+.0%} |")
    lines += ["", "Projected for a real cluster (each node its own CPUs):", "",
              "| N | star control plane (--control star) | control tree, k = 16 (auto above "
              "16 nodes) |", "| ---: | ---: | ---: |"]
    for n in (4, 64, 256, 1024):
        lines.append(f"| {n} | {small_change_seconds(n, fit):.3f} s | "
                     f"{small_change_seconds(n, fit, fanout=16):.3f} s |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="RESULTS_JSON",
                        help="compare the model with a fanout_bench.py result file")
    parser.add_argument("--nodes", default="1,2,4,8,16,64,128,256,1024",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--payload-mb", type=float, default=500)
    parser.add_argument("--rate", default="400mbit", help="link bandwidth, tc units")
    parser.add_argument("--latency", type=float, default=None, metavar="S",
                        help=f"per-hop latency in seconds (default {DEFAULT_LATENCY}, or the "
                             "bench's measured value with --check)")
    parser.add_argument("--chunk-mib", type=float, default=CHUNK / MiB)
    parser.add_argument("--fanouts", default="2,4", type=lambda s: [int(x) for x in s.split(",")],
                        help="tree fanouts to project (default 2,4)")
    parser.add_argument("--relay-ns-per-byte", type=float, default=0.0, metavar="NS",
                        help="CPU a relay daemon spends per byte; caps the link at 1/NS "
                             "(the netns bench measured ~5 ns here; default 0: no cap)")
    parser.add_argument("--t0", type=float, default=None,
                        help="fixed seconds per push (default: a guess from the payload size)")
    args = parser.parse_args(argv)
    if args.check:
        with open(args.check) as f:
            check(json.load(f), args.latency)
        return 0
    if args.latency is None:
        args.latency = DEFAULT_LATENCY
    project(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
