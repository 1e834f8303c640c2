"""cold_start_bench's report: issue 19's targets next to a run's figures (markdown lines), and
the one figure quoted rather than measured (Monarch's remotemount)."""

from __future__ import annotations

import os

from .common import fmt_bytes

MONARCH_REMOTEMOUNT_S = 9.6  # Monarch 0.7 remotemount, push/open + first import (issue 19)
TARGETS = {"push_s": 1.5, "cold_s": 5.0, "early_s": 3.5, "disk_ratio": 1.1, "cpu_per_gb": 1.0,
           "hosts_ratio": 1.3}


def _met(value: float, target: float) -> str:
    return "**met**" if value <= target else "**not met**"


def table(res: dict) -> list[str]:
    """The issue's targets next to this run's figures (markdown lines)."""
    s, t = res["sides"], TARGETS
    cold, local, rsync = s["default"]["median"], s["local"]["median"], s["rsync"]["median"]
    push = res["push_s"]["median"]
    floor = res["disk_floor"]
    mod = res["module"]
    lines = ["| what (issue 19) | target | this run | |", "| --- | --- | --- | --- |",
             f"| push of the venv ({fmt_bytes(res['disk']['content_bytes'])}) to a fresh node, "
             f"dev box pushed it before | <= {t['push_s']} s | {push:.2f} s "
             f"({len(res['push_s']['runs'])} runs, "
             f"{res['push_s']['min']:.2f}-{res['push_s']['max']:.2f}) | "
             f"{_met(push, t['push_s'])} |",
             f"| ... the node's disk writing that content once, O_DIRECT + fsync (a floor for "
             f"any push) | | {floor['seconds']:.2f} s ({floor['mb_s']} MB/s); the push is "
             f"{push / floor['seconds']:.2f}x it | |",
             f"| cold start to the first `import {mod}` done, default mode | <= {t['cold_s']} s "
             f"(Monarch {MONARCH_REMOTEMOUNT_S} s) | {cold:.2f} s "
             f"({s['default']['min']:.2f}-{s['default']['max']:.2f}); "
             f"{cold / MONARCH_REMOTEMOUNT_S:.2f}x Monarch, {cold / local:.2f}x local import, "
             f"{cold / rsync:.2f}x rsync + import | {_met(cold, t['cold_s'])} |"]
    if isinstance(res["early"], dict):
        e = res["early"]
        v = e["import_done_s"]["median"]
        lines.append(f"| the same, usable-early mode | <= {t['early_s']} s | {v:.2f} s (usable "
                     f"{e['usable_s']['median']:.2f} s, complete {e['complete_s']['median']:.2f}"
                     f" s); {v / local:.2f}x local import | {_met(v, t['early_s'])} |")
    else:
        lines.append(f"| the same, usable-early mode | <= {t['early_s']} s | not available "
                     "(push has no --early) | n/a |")
    d = res["disk"]
    lines.append(f"| node disk per pushed content byte | <= {t['disk_ratio']}x | "
                 f"{d['ratio']:.2f}x ({fmt_bytes(d['node_disk_bytes'])} for "
                 f"{fmt_bytes(d['content_bytes'])}) | {_met(d['ratio'], t['disk_ratio'])} |")
    for r in res["ingest"]:
        target = f"<= {t['cpu_per_gb']} s" if r["nodes"] == 1 else "(reported)"
        verdict = _met(r["cpu_s_per_gb"], t["cpu_per_gb"]) if r["nodes"] == 1 else ""
        lines.append(f"| daemon CPU per GB ingested, incompressible, {r['nodes']} node"
                     f"{'s' * (r['nodes'] > 1)} | {target} | {r['cpu_s_per_gb']:.2f} s/GB; "
                     f"{r['mb_s_per_node']:.0f} MB/s of content per node "
                     f"({fmt_bytes(r['bytes'])} in {r['push_s']:.2f} s) | {verdict} |")
    h = res["hosts"]
    if isinstance(h, list):
        one, many = h[0], h[-1]
        lines.append(f"| cold start on {many['hosts']} netns hosts behind {res['rate']} links, "
                     f"against 1 host | <= {t['hosts_ratio']}x | {res['hosts_ratio']:.2f}x "
                     f"({many['all_imported_s']:.2f} s vs {one['all_imported_s']:.2f} s; "
                     f"stores on {many['stores_on']}) | "
                     f"{_met(res['hosts_ratio'], t['hosts_ratio'])} |")
        cpu_floor = res["hosts_cpu_floor_s"]
        lines.append(f"| ... the {many['hosts']} hosts' daemons and imports on this machine's "
                     f"{os.cpu_count()} cores (a floor here) | | {many['hosts_cpu_s']:.1f} CPU-s"
                     f" = {cpu_floor:.2f} s, {cpu_floor / one['all_imported_s']:.2f}x the 1-host "
                     f"run (1 host: {one['hosts_cpu_s']:.1f} CPU-s) | |")
    else:
        lines.append(f"| cold start on netns hosts, against 1 host | <= {t['hosts_ratio']}x | "
                     f"skipped ({h['skipped']}) | n/a |")
    c = res.get("cpu_s", {}).get("default")
    if c:
        lines += ["", f"CPU of a default-mode cold start (median): daemon "
                  f"{c['daemon']['median']:.2f} s, push and import processes "
                  f"{c['push_and_import']['median']:.2f} s (the wall clock moves with the "
                  "machine's load; these far less)."]
    if "machine_load" in res:
        m = res["machine_load"]
        lines += ["", f"The machine's load average went {m['loadavg'][0]:.1f} -> "
                  f"{m['loadavg'][1]:.1f}; its CPUs were {m['cpu_busy_pct']:.0f}% busy over the "
                  "workload (every process, not only ours)."]
    lines += ["", f"Sides (median seconds until `import {mod}` is done): monarch-fs push + "
              f"import {cold:.2f} s; local disk, import only (page cache dropped) {local:.2f} s;"
              f" `rsync -a` to a fresh local folder + import {rsync:.2f} s; Monarch 0.7 "
              f"remotemount {MONARCH_REMOTEMOUNT_S} s (quoted from the issue, not measured)."]
    return lines
