"""The suite's report: issue 5's goals (and 19's, 20's, 21's) judged from a run's figures, and
the run as Markdown: the goals, issue 34's data path (datapath_report.py), a table per
workload, and where the mount's time goes.
run_all.py measures and writes it."""

from __future__ import annotations

from collections.abc import Callable

from . import (
    cold_start_bench,
    datapath_report,
    edit_loop_bench,
    fanout_model,
    network_push_bench,
    push_bench,
    telemetry_bench,
)
from .common import fmt_bytes

# ---- goals --------------------------------------------------------------------------------

def _x(ratio: float, limit: float) -> str:
    """A ratio with enough digits that it visibly sits on the side of the limit it is on."""
    return f"{ratio:.3f}x" if abs(ratio - limit) < 0.01 else f"{ratio:.2f}x"


def goals(res: dict) -> list[dict]:
    """Issue 5's goals, each with the figure of this run and whether it is met."""
    out = []

    def goal(what: str, target: str, value: float | None, ok, shown: str) -> None:
        out.append({"goal": what, "target": target, "value": value, "shown": shown,
                    "met": None if value is None else bool(ok(value))})

    imp = res.get("import", {})
    if "cold" in imp:
        mod = imp["module"]
        for case, limit in (("cold", 1.3), ("warm", 1.05)):
            r = imp[case]
            goal(f"`import {mod}`, {case}" + (" (first import after publish)" if case == "cold"
                                               else ""),
                 f"mount <= {limit}x local", r["ratio"], lambda v, lim=limit: v <= lim,
                 f"{_x(r['ratio'], limit)} ({r['mount']['wall_s']['median']:.2f} s vs "
                 f"{r['local']['wall_s']['median']:.2f} s)")
    rd = res.get("read", {})
    if "cold" in rd:
        size = fmt_bytes(rd["file"]["bytes"])
        for case, limit in (("cold", 0.7), ("warm", 0.95)):
            r = rd[case]
            goal(f"sequential read of {size}, {case}", f"mount >= {limit}x local", r["ratio"],
                 lambda v, lim=limit: v >= lim,
                 f"{_x(r['ratio'], limit)} ({r['mount']['mib_s']:.0f} vs "
                 f"{r['local']['mib_s']:.0f} MiB/s)")
    tr = res.get("tree", {})
    if "find" in tr:
        n = f"{tr['tree']['files']:,}"
        # The issue asks for `find` + `stat`: both the bare `find` (names and types only; on
        # local disk that never touches an inode) and the walk that stats every entry.
        for tool, label in (("find", "`find`"), ("walk", "`find` + `stat` (os.walk + lstat)")):
            for case in ("cold", "warm"):
                r = tr[tool][case]
                goal(f"{label} over {n} files, {case}", "mount <= 2x local", r["ratio"],
                     lambda v: v <= 2.0,
                     f"{_x(r['ratio'], 2.0)} ({r['mount']['median']:.2f} s vs "
                     f"{r['local']['median']:.2f} s)")
        mb = tr["daemon"]["peak_rss_mb"]
        goal(f"daemon peak RSS serving {n} files", "<= 150 MB", mb, lambda v: v <= 150,
             f"{mb:.0f} MB (VmHWM; {tr['daemon']['push_peak_rss_mb']:.0f} MB while receiving "
             "the push)")
    pu = res.get("push", {})
    if "measurements" in pu:
        by = {(m["tool"], m["case"]): m for m in pu["measurements"]}
        mfs, rs = by[("monarch-fs", "cold")]["seconds"], by[("rsync", "cold")]["seconds"]
        speedup = rs / mfs
        goal(f"cold push, {fmt_bytes(pu['tree']['bytes'])} to {pu['nodes']} nodes on this "
             "machine (rsync into local folders: no network)",
             "monarch-fs >= 3x faster than `rsync -a`", speedup, lambda v: v >= 3.0,
             f"{_x(speedup, 3.0)} ({mfs:.2f} s vs rsync {rs:.2f} s)")
    net = res.get("netpush", {})
    for r in net.get("runs", []):
        if r["nodes"] < 2:
            continue  # one host: no fan-out, and nothing for relaying to win
        x = r["vs_rsync_one_by_one"]
        goal(f"cold push, {fmt_bytes(net['config']['bytes'])} to {r['nodes']} hosts over "
             f"{net['config']['rate']} links (rsync daemon on each host)",
             "monarch-fs >= 3x faster than `rsync -a`", x, lambda v: v >= 3.0,
             f"{_x(x, 3.0)} ({r['monarch_fs_s']:.2f} s vs rsync {r['rsync_one_by_one_s']:.2f} s"
             " one host after another)")
    cs = res.get("coldstart", {})
    if "sides" in cs:
        t, mod = cold_start_bench.TARGETS, cs["module"]
        push, cold = cs["push_s"]["median"], cs["sides"]["default"]["median"]
        goal("push of the venv to a fresh node, dev box pushed it before (issue 19)",
             f"<= {t['push_s']} s", push, lambda v: v <= t["push_s"], f"{push:.2f} s")
        goal(f"cold start to the first `import {mod}` done on a fresh node (issue 19)",
             f"<= {t['cold_s']} s", cold, lambda v: v <= t["cold_s"],
             f"{cold:.2f} s ({cold / cold_start_bench.MONARCH_REMOTEMOUNT_S:.2f}x Monarch "
             f"remotemount's {cold_start_bench.MONARCH_REMOTEMOUNT_S} s)")
        if isinstance(cs["early"], dict):
            v = cs["early"]["import_done_s"]["median"]
            goal("the same, usable-early mode (issue 19)", f"<= {t['early_s']} s", v,
                 lambda v: v <= t["early_s"], f"{v:.2f} s")
        else:
            goal("the same, usable-early mode (issue 19)", f"<= {t['early_s']} s", None,
                 bool, "not available")
        d = cs["disk"]["ratio"]
        goal("node disk per pushed content byte (issue 19)", f"<= {t['disk_ratio']}x", d,
             lambda v: v <= t["disk_ratio"], f"{d:.2f}x")
        one = next(r for r in cs["ingest"] if r["nodes"] == 1)
        goal("daemon CPU per GB ingested, incompressible, 1 node (issue 19)",
             f"<= {t['cpu_per_gb']} s", one["cpu_s_per_gb"], lambda v: v <= t["cpu_per_gb"],
             f"{one['cpu_s_per_gb']:.2f} s/GB ({one['mb_s_per_node']:.0f} MB/s)")
        if "hosts_ratio" in cs:
            x = cs["hosts_ratio"]
            goal(f"cold start on {cs['hosts'][-1]['hosts']} netns hosts vs 1 (issue 19)",
                 f"<= {t['hosts_ratio']}x", x, lambda v: v <= t["hosts_ratio"], f"{x:.2f}x")
    el = res.get("editloop", {})
    if "trees" in el:
        t, base = edit_loop_bench.TARGETS, el["trees"][0]
        where = f"{base['files']:,} files, {base['nodes']} nodes (issue 20)"
        for key, label in (("nochange", "no-change push"), ("edit", "one edit shown")):
            for side, how in (("mfs", "new process"), ("handoff", "handed to --watch"),
                              ("warm", "new process, --keep-warm")):
                if f"{side}_{key}" not in base:
                    continue
                v, r = base[f"{side}_{key}"]["median"], base[f"rsync_{key}"]["median"]
                goal(f"{label} ({how}), {where}", f"<= {t[f'{key}_s']} s", v,
                     lambda v, lim=t[f"{key}_s"]: v <= lim, f"{v:.3f} s (rsync {r:.3f} s)")
        w = base["watch"]["median"]
        goal(f"one edit in --watch, {where}", f"<= {t['watch_s']} s", w,
             lambda v: v <= t["watch_s"], f"{w:.3f} s")
        for big in el["trees"][1:]:
            for key in ("handoff_edit", "warm_nochange", "warm_edit", "watch"):
                if key not in big or key not in base:
                    continue
                x = big[key]["median"] / base[key]["median"]
                goal(f"{key.replace('_', ' ')}, {big['files']:,} files against "
                     f"{base['files']:,} (issue 20)", f"<= {t['scale']}x", x,
                     lambda v: v <= t["scale"], f"{x:.2f}x ({big[key]['median']:.3f} s)")
    te = res.get("telemetry", {})
    if "reads" in te:
        for case, r in te["reads"].items():
            if isinstance(r, dict) and "ratio" in r:
                goal(f"{case}, recording events against not (issue 21)", "<= 1.05x",
                     r["ratio"], lambda v: v <= 1.05,
                     f"{_x(r['ratio'], 1.05)} ({r['on']['median']:.3f} s vs "
                     f"{r['off']['median']:.3f} s)")
        q = te["query"]
        for label, r in q["queries"].items():
            v = r["seconds"]["median"]
            goal(f"query over {q['nodes']} nodes of {q['events_per_node']:,} events: {label} "
                 "(issue 21)", f"< {telemetry_bench.TARGET_QUERY_S:g} s", v,
                 lambda v: v < telemetry_bench.TARGET_QUERY_S,
                 f"{v:.3f} s ({r['cli_seconds']['median']:.2f} s with the command's start)")
    ef = res.get("editfanout", {})
    if "fit" in ef:
        v = ef["projected_1024_s"]
        tree = (f", control tree {ef['error_tree_at_max']:+.0%}"
                if "error_tree_at_max" in ef else "")
        goal("one edit on 1024 nodes, projected (issue 20)", "<= 1 s", v, lambda v: v <= 1,
             f"{v:.2f} s down the control tree (star: {ef['projected_1024_star_s']:.2f} s; "
             f"model error at {ef['per_n'][-1]['nodes']} netns nodes: star "
             f"{ef['error_at_max']:+.0%}{tree})")
    return out


# ---- the report ---------------------------------------------------------------------------

def _ops_line(c: dict) -> str:
    runs = max(1, c.get("mount_runs", 1))
    ops = sorted(c.get("ops", {}).items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {v / runs:,.0f}" if v >= runs else f"{k} {v / runs:.2f}"
                     for k, v in ops) or "none"
    cache = ""
    if "cache_misses" in c:
        cache = f"{c.get('cache_hits', 0) / runs:,.0f} / {c['cache_misses'] / runs:,.0f}"
        if c.get("cache_nowait"):
            cache += f" ({c['cache_nowait'] / runs:,.0f} from memory)"
    return f"{text} | {cache} | {c['daemon_cpu_s'] / runs:.2f}"


def _spread(s: dict) -> str:
    """A median with its range: on a shared machine one run can move more than a goal's
    margin."""
    return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"


def _mount_table(heading: str, labels: list[str], groups: list[tuple[str, dict]],
                 figures: list[str], sides: Callable[[dict], tuple[dict, dict, dict]],
                 cells: Callable[[dict], str]) -> list[str]:
    """`heading`, then a table of the mount against local disk: the `labels` columns, then the
    `figures` columns. For each (label, results by case) of `groups`, a row per case, cold then
    warm: the label, the case and its runs, then `cells(its result)`. `sides(result)`: where
    the mount's run times are, and where each side counts the runs it discarded (the workloads
    keep them at different depths)."""
    lines = [heading, "", "| " + " | ".join(labels + figures) + " |",
             "|" + " --- |" * len(labels) + " ---: |" * len(figures)]
    for label, by_case in groups:
        for case in ("cold", "warm"):
            times, mount, local = sides(by_case[case])
            rerun = (mount.get("discarded") or 0) + (local.get("discarded") or 0)
            runs = f"{len(times['runs'])} runs" + (
                f", {rerun} rerun: cache dropped by another job" if rerun else "")
            lines.append(f"| {label}{case} ({runs}) | {cells(by_case[case])} |")
    return lines


def machine_line(report: dict) -> str:
    m = report["machine"]
    return (f"{m['nproc']} cores ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}, "
            f"Python {m['python']}, pyfuse3 {m['pyfuse3']}, {m['rsync']}, zstd "
            f"{m['zstd'].split(' v')[-1].split(',')[0]}; monarch-fs {m['monarch_fs_commit']}")


def _netpush_heading(r: dict) -> str:
    c = r["config"]
    return (f"**push over a network**: the same tree to N hosts, each in its own network "
            f"namespace, every link {c['rate']} each way; `rsync -a` to an rsync daemon on each "
            f"host; stores and destinations on {c['store_dir']}; x: how many times faster "
            "monarch-fs is")


# The workloads whose module makes its own table: (result key, the heading, the table's rows;
# none for a result without the figures, as one that failed or was skipped).
_OWN_TABLES: list[tuple[str, Callable[[dict], str], Callable[[dict], list[str]]]] = [
    ("netpush", _netpush_heading,
     lambda r: network_push_bench.table(r["runs"]) if "runs" in r else []),
    ("coldstart", lambda r: "**cold start on a fresh allocation** (issue 19)",
     lambda r: cold_start_bench.table(r) if "sides" in r else []),
    ("editloop", lambda r: "**the edit-run loop** (issue 20)",
     lambda r: edit_loop_bench.table(r) if "trees" in r else []),
    ("editfanout", lambda r: "**one edit to N netns nodes** (issue 20)",
     lambda r: fanout_model.small_change_report(r)[2:] if "fit" in r else []),
]


def summary_tables(report: dict) -> list[str]:
    """The goals and one table per workload: what the README shows."""
    res = report["results"]
    lines = (["| goal (issue 5, 19, 20, 21) | target | this run | |", "| --- | --- | --- | --- |"]
             if report["goals"] else [])  # none: a run of workloads without goals (--only)
    for g in report["goals"]:
        verdict = "n/a" if g["met"] is None else ("**met**" if g["met"] else "**not met**")
        lines.append(f"| {g['goal']} | {g['target']} | {g['shown']} | {verdict} |")
    for name, r in res.items():
        if "error" in r:
            lines += ["", f"**{name}: FAILED**: {r['error'].splitlines()[0]}"]
    lines.append("")
    if datapath := datapath_report.table(res):
        lines += [*datapath, ""]

    pu = res.get("push", {})
    if "measurements" in pu:
        by = {(m["tool"], m["case"]): m for m in pu["measurements"]}
        t = pu["tree"]
        lines += [f"**push**: {t['entries']:,} entries, {fmt_bytes(t['bytes'])} "
                  f"({t['small_files']:,} small text files, {len(t['large_files'])} binaries) to "
                  f"{pu['nodes']} nodes; rsync and tar to {pu['nodes']} local folders one after "
                  "another; seconds, and how many times faster monarch-fs is", "",
                  "| case | monarch-fs | `rsync -a` | `tar \\| zstd -1 \\| tar -x` | vs rsync | "
                  "vs tar | sent by monarch-fs |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for case, label in push_bench.CASES:
            m = by[("monarch-fs", case)]
            row = [label, f"{m['seconds']:.2f} s"]
            others = [by.get((tool, case)) for tool in ("rsync", "tar|zstd")]
            row += [f"{o['seconds']:.2f} s" if o else "n/a" for o in others]
            row += [f"{o['seconds'] / m['seconds']:.2f}x" if o else "n/a" for o in others]
            row.append(fmt_bytes(m["push"]["bytes_sent"]))
            lines.append("| " + " | ".join(row) + " |")
        flushes = [f"{tool} {by[(tool, 'cold')]['flush_seconds']:.2f} s" for tool in
                   ("rsync", "tar|zstd") if by.get((tool, "cold"), {}).get("flush_seconds")]
        if flushes:
            lines += ["", "monarch-fs flushes the chunk store before it publishes; rsync and tar "
                      "do not, and a `sync` right after their cold copies took "
                      + ", ".join(flushes) + " (not in their times above)."]
        lines.append("")

    if "skipped" in res.get("netpush", {}):
        lines += [f"**push over a network**: skipped ({res['netpush']['skipped']})", ""]
    for key, heading, table in _OWN_TABLES:
        if key in res and (rows := table(res[key])):
            lines += [heading(res[key]), "", *rows, ""]

    rd = res.get("read", {})
    if "cold" in rd:
        lines += _mount_table(
            f"**sequential read**: {fmt_bytes(rd['file']['bytes'])} library-like file (zstd -1 "
            "halves it), 1 MiB reads; median MiB/s", ["case"], [("", rd)],
            ["mount", "local disk", "mount / local"],
            lambda r: (r["mount"]["seconds"], r["mount"]["seconds"], r["local"]["seconds"]),
            lambda r: f"{r['mount']['mib_s']:.0f} | {r['local']['mib_s']:.0f} | "
                      f"{r['ratio']:.2f}x")
        lines.append("")

    imp = res.get("import", {})
    if "cold" in imp:
        v = imp["venv"]
        lines += _mount_table(
            f"**`import {imp['module']}`** ({imp['version']}) from a pushed venv "
            f"({imp['push']['files']:,} files, {fmt_bytes(imp['push']['bytes'])}); median "
            "seconds of a fresh interpreter (fastest-slowest run), and of the import statement "
            "alone", ["case"], [("", imp)],
            ["mount", "local disk", "mount / local", "import statement: mount / local"],
            lambda r: (r["mount"]["wall_s"], r["mount"], r["local"]),
            lambda r: f"{_spread(r['mount']['wall_s'])} | {_spread(r['local']['wall_s'])} | "
                      f"{r['ratio']:.2f}x | {r['mount']['import_s']['median']:.2f} s / "
                      f"{r['local']['import_s']['median']:.2f} s = {r['import_ratio']:.2f}x")
        if v.get("excludes"):
            lines.append(f"\n(pushed without {', '.join(v['excludes'])})")
        if "floor" in imp["warm"]:
            f = imp["warm"]["floor"]
            lines.append(f"\nA warm run waits for {f['requests']:,} requests (an open of each "
                         "file, and the ioctl with which Python's open() asks whether it is a "
                         "terminal, which the kernel forwards every time); at "
                         f"{imp['round_trip_us']:.0f} us per round trip on this machine that is "
                         f"{f['seconds']:.2f} s, so even a daemon that took no time at all "
                         f"would be {f['ratio']:.2f}x local here.")
        lines.append("")

    tr = res.get("tree", {})
    if "find" in tr:
        d = tr["daemon"]
        lines += _mount_table(
            f"**metadata**: {tr['tree']['files']:,} files ({tr['tree']['per_dir']} per folder); "
            "median seconds", ["listing", "case"],
            [("`find -type f \\| wc -l` | ", tr["find"]), ("os.walk + lstat | ", tr["walk"])],
            ["mount", "local disk", "mount / local"],
            lambda r: (r["mount"], r["mount"], r["local"]),
            lambda r: f"{r['mount']['median']:.2f} s | {r['local']['median']:.2f} s | "
                      f"{r['ratio']:.2f}x")
        lines += ["", f"**daemon memory** serving {tr['tree']['files']:,} files: peak "
                  f"{d['peak_rss_mb']:.0f} MB (VmHWM after the listings), "
                  f"{d['at_start']['VmRSS_kb'] / 1024:.0f} MB once started on the snapshot, "
                  f"{d['push_peak_rss_mb']:.0f} MB peak while receiving the push "
                  f"({tr['push_seconds']:.1f} s to push {tr['tree']['files']:,} files to 1 node)",
                  ""]
    return lines


def markdown(report: dict) -> str:
    res = report["results"]
    title = "monarch-fs benchmarks" + (" (QUICK smoke run: not the goals' workloads)"
                                       if report["quick"] else "")
    lines = [
        f"## {title}, {report['date']}", "",
        f"- machine: {machine_line(report)}",
        f"- shared machine: load average {report['load'][0]:.1f} at the start, "
        f"{report['load'][1]:.1f} at the end; all CPUs {report['cpu_busy_pct']:.0f}% busy "
        "over the run (every process on the machine, not only ours)",
        f"- page cache: {report['page_cache']}",
        f"- suite: {report['seconds']:.0f} s (" + ", ".join(
            f"{k} {v:.0f} s" for k, v in report["workload_seconds"].items()) + ")",
        "- ratios: times are mount / local (lower is better, 1.00x = local disk), throughput "
        "mount / local (higher is better); push: how many times faster monarch-fs is", "",
    ]
    lines += summary_tables(report)
    counters = []
    for name, key in (("read", "read"), ("import", "import"), ("tree", "tree")):
        r = res.get(key, {})
        for label, c in r.get("counters", {}).items():
            counters.append(f"| {name} {label} | {_ops_line(c)} |")
    if counters:
        lines += ["### Where the mount's time goes", "",
                  "Requests the daemon served per mount run (its `user.monarch.ops` counters, "
                  "read before and after each run), decoded-chunk cache hits / misses per run, "
                  "and the daemon's CPU seconds per run.", "",
                  "| workload | FUSE requests per run | chunk cache hits / misses | daemon CPU s |",
                  "| --- | --- | ---: | ---: |", *counters, ""]
    return "\n".join(lines) + "\n"
