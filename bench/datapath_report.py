"""Issue 34's table from one run: each figure of the data path beside its limit measured in
the same run (the raw loopback stream, the node's disk, a node's and a relay hop's work at its
plainest, the local cold import, the 1 GiB rate),
the ratio and the target. A limit from last week means nothing on a shared VM, so every ratio
here has both sides from the same `make bench`.

`rows` judges the figures, `table` prints them for the run's report and docs/benchmarks.md,
`readme_section` the short table the README quotes (bench/run_all.py rewrites both)."""

from __future__ import annotations

from .common import fmt_bytes

# issue 34's Done-when table
TARGETS = {"ingest_auto": 0.5, "ingest_on": 0.35, "daemon_cpu_s_per_gb": 0.4,
           "hop_cpu_s_per_gb": 0.5, "cold": 1.5, "early": 1.2, "env_rate": 0.9,
           "env_rss_mb": 250.0, "disk": 1.05}
HEADING = "**The data path (issue 34)**"


def _size(mib: float) -> str:
    return f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib:g} MiB"


def _row(what: str, short: str, shown: str, limit: str, ratio: str, target: str,
         met: bool | None, floor: str = "") -> dict:
    """`floor`: the figure against what this machine allows, measured in the same run
    ("floor 1.50x"), shown beside the ratio in the table and in the README."""
    return {"what": what, "short": short, "shown": shown, "limit": limit, "ratio": ratio,
            "target": target, "met": met, "floor": floor}


def _missing(what: str, short: str, target: str, why: str) -> dict:
    return _row(what, short, why, "", "", target, None)


def _ingest_rows(dp: dict) -> list[dict]:
    t, out = TARGETS, []
    loop = dp["loopback_MB_per_s"]
    for mode in ("auto", "on"):
        r = dp["ingest"][mode]
        x = r["MB_per_s"] / loop
        limit, floor = f"raw loopback stream {loop:.0f} MB/s", ""
        if "disk_direct_MB_per_s" in r:  # the node's disk, which every byte goes to
            disk = r["disk_direct_MB_per_s"]
            limit += f"; the node's disk (O_DIRECT) {disk:.0f} MB/s = {disk / loop:.2f}x of it"
            floor = f"of the disk {r['MB_per_s'] / disk:.2f}x"
        out.append(_row(
            f"node ingest, {_size(r['content_mib'])} incompressible, 1 fresh node, "
            f"`--encrypt {mode}`, whole push process",
            f"push to a fresh node (`--encrypt {mode}`) / raw loopback stream",
            f"{r['MB_per_s']:.0f} MB/s ({r['push_s']:.2f} s)", limit, f"{x:.2f}x",
            f">= {t[f'ingest_{mode}']}x", x >= t[f"ingest_{mode}"], floor))
    # The CPU rows beside a node's work at its plainest, same run (bench/limits.node_floor):
    # what the same calls cost in a plain Python loop, on this machine, now.
    r = dp["ingest"]["auto"]
    cpu, floor = r["daemon_cpu_s_per_gb_incl_backing"], r["node_floor_cpu_s_per_gb"]
    out.append(_row(
        "daemon CPU per GB ingested (the push and its backing copies)",
        "daemon CPU per GB ingested",
        f"{cpu:.2f} s ({r['daemon_cpu_s_per_gb_push']:.2f} s during the push)",
        f"a node's floor (recv_into, GMAC check, xxh3, O_DIRECT write) {floor:.2f} s",
        f"{cpu / floor:.2f}x", f"<= {t['daemon_cpu_s_per_gb']} s",
        cpu <= t["daemon_cpu_s_per_gb"], f"floor {floor:.2f} s"))
    rl = dp["relay"]
    hops = rl["per_node_cpu_s_per_gb"][:-1]
    worst, floor = max(hops), rl["hop_floor_cpu_s_per_gb"]
    out.append(_row(
        f"CPU per GB per relay hop (chain of {rl['nodes']} local nodes)",
        f"CPU per GB per relay hop (chain of {rl['nodes']})",
        ", ".join(f"{h:.2f}" for h in hops) + " s (hop " + ", ".join(
            str(i + 1) for i in range(len(hops))) + ")",
        f"a hop's floor (a node's, and sendall to the next) {floor:.2f} s",
        f"{worst / floor:.2f}x", f"<= {t['hop_cpu_s_per_gb']} s",
        worst <= t["hop_cpu_s_per_gb"], f"floor {floor:.2f} s"))
    return out


def _cold_rows(cs: dict | None) -> list[dict]:
    """The coldstart workload's medians over its local cold import (page cache dropped)."""
    mod = cs.get("module", "torch") if cs else "torch"
    labels = (("default", "cold", f"fresh node: push + first `import {mod}`, / local cold "
               "import, default mode", f"push + first `import {mod}` / local cold import"),
              ("early", "early", "the same, `push --early`", "the same, `push --early`"))
    sides = cs.get("sides", {}) if cs else {}
    if "error" in (cs or {}):
        why = f"not in this run (the coldstart workload: {cs['error'].splitlines()[0]})"
    else:
        why = "not in this run (the coldstart workload: not run)"
    out = []
    for side, key, what, short in labels:
        target = f"<= {TARGETS[key]}x"
        if "local" not in sides:
            out.append(_missing(what, short, target, why))
        elif side not in sides:
            out.append(_missing(what, short, target, "not available (push has no --early)"))
        else:
            s, local = sides[side], sides["local"]["median"]
            x = s["median"] / local
            limit, floor = _cold_floor(cs, side, local)
            out.append(_row(what, short, f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})",
                            f"local cold import {local:.2f} s" + limit, f"{x:.2f}x",
                            target, x <= TARGETS[key], floor))
    return out


def _cold_floor(cs: dict, side: str, local: float) -> tuple[str, str]:
    """What no cold start on this machine beats, from the same run, when it was measured: the
    mount's own cold import (the version whole on the node), and before a default push's import
    the disk's write of the venv's bytes: (what the limit cell adds, the row's floor), or
    ("", "")."""
    mount = cs.get("mount_import_s", {}).get("median")
    if not mount:
        return "", ""
    limit = f"; the mount's cold import, the version there: {mount:.2f} s"
    floor = mount
    disk = cs.get("disk_floor", {}).get("seconds")
    if side == "default" and disk:
        limit += f"; the disk's write of the venv: {disk:.2f} s"
        floor += disk
    return limit, f"floor {floor / local:.2f}x"


def _env_rows(dp: dict, cs: dict | None) -> list[dict]:
    t, le = TARGETS, dp["large_env"]
    one = le["one_gib_MB_per_s"]
    base = sum(one) / len(one)
    size = f"{le['gib']:g} GiB env" + ("" if le.get("venv_files") else " (no venv)")
    lo, hi = le["rate_ratio_range"]
    rss = le["daemon_peak_rss_mb"]
    one_size = _size(le.get("one_mib", 1024))
    out = [_row(f"{size} to a fresh node: rate / the {one_size} rate",
                f"{size} to a fresh node: rate / the {one_size} rate",
                f"{le['env_MB_per_s']:.0f} MB/s",
                f"the {one_size} rate {base:.0f} MB/s ("
                + ", ".join(f"{v:.0f}" for v in one) + ")",
                f"{le['rate_ratio']:.2f}x ({lo:.2f}-{hi:.2f})", f">= {t['env_rate']}x",
                le["rate_ratio"] >= t["env_rate"]),
           _row(f"... the daemon's peak RSS ingesting the {size}",
                f"daemon peak RSS, {size}", f"{rss:.0f} MB", "", "",
                f"<= {t['env_rss_mb']:g} MB", rss <= t["env_rss_mb"])]
    disks = {f"{_size(dp['ingest']['auto']['content_mib'])} file":
             dp["ingest"]["auto"]["disk_per_content_byte"], size: le["disk_per_content_byte"]}
    if cs and "disk" in cs:
        disks[f"the venv, {fmt_bytes(cs['disk']['content_bytes'])}"] = cs["disk"]["ratio"]
    worst = max(disks.values())
    out.append(_row("node disk per content byte (the largest of: "
                    + ", ".join(disks) + ")", "node disk per content byte",
                    ", ".join(f"{v:.3f}x" for v in disks.values()), "the content's bytes",
                    f"{worst:.3f}x", f"<= {t['disk']}x", worst <= t["disk"]))
    return out


def rows(res: dict) -> list[dict]:
    """Issue 34's figures from a run's results (the datapath workload's, and the coldstart
    workload's cold starts): none if the datapath workload did not run."""
    dp = res.get("datapath")
    if not dp or "ingest" not in dp:
        return []
    cs = res.get("coldstart")
    out = _ingest_rows(dp)
    return out + _cold_rows(cs) + _env_rows(dp, cs)


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("**met**" if met else "**not met**")


def table(res: dict) -> list[str]:
    """The section of the run's report: one table, what ran beneath it (markdown lines)."""
    figures = rows(res)
    if not figures:
        return []
    dp = res["datapath"]
    le = dp["large_env"]
    lines = [HEADING, "",
             "| what (ratios in one run) | this run | limit, same run | ratio | target | |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['shown']} | {r['limit']} | {r['ratio']}"
              + (f" ({r['floor']})" if r["floor"] else "")
              + f" | {r['target']} | {verdict(r['met'])} |" for r in figures]
    samples = ", ".join(f"{v:.0f}" for v in dp["loopback_samples_MB_per_s"])
    lines += ["", f"Sizes that ran: {_size(dp['ingest']['auto']['content_mib'])} to 1 node "
              f"(each `--encrypt`) and to a chain of {dp['relay']['nodes']}; an env of "
              f"{le['gib']:g} GiB ({le['env']['big_files']} random .so-sized files"
              + (f" and the torch venv, {le['venv_files']:,} files" if le.get("venv_files")
                 else ", no venv") + f"). The raw loopback stream is the best of the "
              f"workload's samples ({samples} MB/s; each push's own is in the results). One "
              "run of each; the cold starts are the coldstart workload's medians."]
    auto, on = dp["ingest"]["auto"], dp["ingest"]["on"]
    if "push_cpu_s_per_gb" in auto:
        lines += ["", f"The dev box's half: the push process's CPU per GB "
                  f"{auto['push_cpu_s_per_gb']:.2f} s (`--encrypt on`: "
                  f"{on['push_cpu_s_per_gb']:.2f} s), a plain-Python sender's (read, hash, send) "
                  f"{auto['pipeline_cpu_s_per_gb']['sender']:.2f} s."]
    if le.get("venv_alone_MB_per_s") and le.get("big_files_MB_per_s"):
        lines += ["", f"The env's parts: the venv alone {le['venv_alone_MB_per_s']:.0f} MB/s, "
                  f"the .so-sized files (the env's push less the venv's) "
                  f"{le['big_files_MB_per_s']:.0f} MB/s."]
    return lines


def readme_section(report: dict, report_link: str) -> list[str]:
    """The README's short table of the data path's figures from a run (markdown lines), with
    the run's date, load and full report; [] without the datapath workload."""
    figures = rows(report["results"])
    if not figures:
        return []
    return [f"The data path on a shared 2-core VM, from `make bench` of {report['date']} "
            f"(load {report['load'][0]:.1f}, [full report]({report_link})): each figure over "
            "its limit measured in the same run.", "",
            "| what | this run | target | |", "| --- | --- | --- | --- |",
            *(f"| {r['short']} | {_brief(r)} | {r['target']} | {verdict(r['met'])} |"
              for r in figures)]


def _brief(r: dict) -> str:
    """A row's figure for the README: the ratio where the target is one, else the value; with
    the floor the same run measured, where it did."""
    shown, floor = r["shown"].split(" (")[0], r["floor"]
    if not r["target"].endswith("x") or not r["ratio"]:
        return f"{shown} ({floor})" if floor else r["shown"]
    return f"{r['ratio'].split(' (')[0]} ({shown}" + (f"; {floor}" if floor else "") + ")"
