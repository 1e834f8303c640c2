"""`make bench`'s report of the data path (issue 34): each figure beside its limit from the
same run, the ratio and the target, and the README's figures rewritten from that run and
nothing else of the README. Rendered from a small results dict, as bench/run_all.py renders a
saved run (`--render`)."""

from __future__ import annotations

import copy

from bench import datapath_report, run_all
from bench.report import summary_tables

INGEST = {"content_mib": 1024.0, "push_s": 2.0, "MB_per_s": 1000.0,
          "pipeline_cpu_s_per_gb": {"sender": 0.5, "receiver": 1.0},
          "daemon_cpu_s_per_gb_push": 0.3, "daemon_cpu_s_per_gb_incl_backing": 0.35,
          "node_floor_cpu_s_per_gb": 0.25,
          "disk_per_content_byte": 1.001}
RESULTS = {
    "datapath": {
        "ingest": {"auto": INGEST, "on": {**INGEST, "MB_per_s": 600.0, "push_s": 1.8}},
        "relay": {"nodes": 3, "per_node_cpu_s_per_gb": [0.45, 0.7, 0.4],
                  "hop_floor_cpu_s_per_gb": 0.2},
        "large_env": {"gib": 8.0, "one_mib": 1024, "venv_files": 22554,
                      "env": {"big_files": 40}, "one_gib_MB_per_s": [1000.0, 1000.0],
                      "env_MB_per_s": 950.0, "rate_ratio": 0.95,
                      "rate_ratio_range": [0.94, 0.96], "daemon_peak_rss_mb": 300.0,
                      "disk_per_content_byte": 1.06},
        "loopback_samples_MB_per_s": [3000.0, 2500.0, 2800.0], "loopback_MB_per_s": 3000.0},
    "coldstart": {"module": "torch", "disk": {"content_bytes": 10**9, "ratio": 1.0},
                  "sides": {"default": {"median": 3.0, "min": 2.9, "max": 3.3},
                            "early": {"median": 2.2, "min": 2.1, "max": 2.4},
                            "local": {"median": 2.0, "min": 1.9, "max": 2.1}}},
}
REPORT = {"date": "2026-12-06T07:40:00", "load": [0.5, 1.0], "quick": False,
          "results": RESULTS}


def _row(lines: list[str], start: str) -> list[str]:
    hit = [ln for ln in lines if ln.startswith("| " + start)]
    assert len(hit) == 1, (start, lines)
    return [cell.strip() for cell in hit[0].strip("|").split("|")]


def test_each_figure_stands_beside_its_limit_from_the_same_run_and_its_target():
    lines = datapath_report.table(RESULTS)
    assert lines[0] == datapath_report.HEADING
    # against the best loopback sample of the run, not the push's own
    assert _row(lines, "node ingest, 1 GiB incompressible, 1 fresh node, `--encrypt auto`") \
        [1:] == ["1000 MB/s (2.00 s)", "raw loopback stream 3000 MB/s", "0.33x", ">= 0.5x",
                 "**not met**"]
    assert _row(lines, "node ingest, 1 GiB incompressible, 1 fresh node, `--encrypt on`")[3:] \
        == ["0.20x", ">= 0.35x", "**not met**"]
    # the CPU rows beside a node's and a hop's work in a plain Python loop, same run
    assert _row(lines, "daemon CPU per GB")[1:] == [
        "0.35 s (0.30 s during the push)",
        "a node's floor (recv_into, GMAC check, xxh3, O_DIRECT write) 0.25 s",
        "1.40x (floor 0.25 s)", "<= 0.4 s", "**met**"]
    # every hop but the last node is judged, and the worst of them
    assert _row(lines, "CPU per GB per relay hop")[1:] == [
        "0.45, 0.70 s (hop 1, 2)", "a hop's floor (a node's, and sendall to the next) 0.20 s",
        "3.50x (floor 0.20 s)", "<= 0.5 s", "**not met**"]
    assert _row(lines, "fresh node: push + first `import torch`")[1:] == [
        "3.00 s (2.90-3.30)", "local cold import 2.00 s", "1.50x", "<= 1.5x", "**met**"]
    assert _row(lines, "the same, `push --early`")[3:] == ["1.10x", "<= 1.2x", "**met**"]
    assert _row(lines, "8 GiB env to a fresh node")[1:] == [
        "950 MB/s", "the 1 GiB rate 1000 MB/s (1000, 1000)", "0.95x (0.94-0.96)", ">= 0.9x",
        "**met**"]
    assert _row(lines, "... the daemon's peak RSS")[-2:] == ["<= 250 MB", "**not met**"]
    assert _row(lines, "node disk per content byte")[3:] == ["1.060x", "<= 1.05x",
                                                           "**not met**"]
    assert any("8 GiB (40 random .so-sized files and the torch venv, 22,554 files)" in ln
               for ln in lines)


def test_a_run_that_measured_the_disk_and_the_mount_shows_the_floors_they_set():
    # the disk a fresh node writes every byte to, and the mount's own cold import: a target
    # below them cannot be met on this machine, and the row says so with figures of its run
    res = copy.deepcopy(RESULTS)
    res["datapath"]["ingest"]["auto"].update(disk_direct_MB_per_s=1500.0)
    res["coldstart"].update(mount_import_s={"median": 2.5, "min": 2.4, "max": 2.6},
                            disk_floor={"seconds": 0.5})
    lines = datapath_report.table(res)
    assert _row(lines, "node ingest, 1 GiB incompressible, 1 fresh node, `--encrypt auto`") \
        [2:4] == ["raw loopback stream 3000 MB/s; the node's disk (O_DIRECT) 1500 MB/s = "
                  "0.50x of it", "0.33x (of the disk 0.67x)"]
    assert _row(lines, "fresh node: push + first `import torch`")[2:4] == [
        "local cold import 2.00 s; the mount's cold import, the version there: 2.50 s; "
        "the disk's write of the venv: 0.50 s", "1.50x (floor 1.50x)"]
    assert _row(lines, "the same, `push --early`")[2:4] == [
        "local cold import 2.00 s; the mount's cold import, the version there: 2.50 s",
        "1.10x (floor 1.25x)"]


def test_a_run_without_the_cold_starts_or_the_data_path_says_so():
    alone = {"datapath": RESULTS["datapath"]}
    assert _row(datapath_report.table(alone), "the same, `push --early`")[1:] == [
        "not in this run (the coldstart workload: not run)", "", "", "<= 1.2x", "n/a"]
    failed = {**alone, "coldstart": {"error": "BenchError: push exited 1\nmore"}}
    assert "BenchError: push exited 1)" in _row(datapath_report.table(failed),
                                                "fresh node: push")[1]
    assert datapath_report.table({"coldstart": RESULTS["coldstart"]}) == []
    assert datapath_report.table({"datapath": {"error": "OSError: no space"}}) == []
    # the run's report (and the docs' latest run) carries the section after the goals
    goal = {"goal": "g", "target": "t", "shown": "s", "met": True}
    md = summary_tables({"goals": [goal], "results": alone})
    assert md.index(datapath_report.HEADING) > md.index("| g | t | s | **met** |")


def test_a_full_run_rewrites_the_readme_figures_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# title\n\nintro\n\n## How fast\n\n", "\nmore text\n"
    readme.write_text(before + run_all.FIGURES_BEGIN + "\n\nold figures\n\n"
                      + run_all.FIGURES_END + after)
    md = tmp_path / "bench" / "results" / "bench-20261206-074000.md"
    assert run_all.update_readme_figures(REPORT, md, readme)
    text = readme.read_text()
    assert text.startswith(before + run_all.FIGURES_BEGIN) and text.endswith(
        run_all.FIGURES_END + after)
    assert "old figures" not in text
    assert "`make bench` of 2026-12-06T07:40:00 (load 0.5, [full report]" \
           "(bench/results/bench-20261206-074000.md))" in text
    lines = text.splitlines()
    assert _row(lines, "push to a fresh node (`--encrypt auto`) / raw loopback stream") == [
        "push to a fresh node (`--encrypt auto`) / raw loopback stream", "0.33x (1000 MB/s)",
        ">= 0.5x", "**not met**"]
    assert _row(lines, "push + first `import torch` / local cold import")[1:] == [
        "1.50x (3.00 s)", "<= 1.5x", "**met**"]
    assert _row(lines, "daemon peak RSS, 8 GiB env")[1:] == ["300 MB", "<= 250 MB",
                                                            "**not met**"]
    # a run that measured the floors shows them beside the ratio
    floors = copy.deepcopy(REPORT)
    floors["results"]["datapath"]["ingest"]["auto"]["disk_direct_MB_per_s"] = 1500.0
    floors["results"]["coldstart"]["mount_import_s"] = {"median": 2.5}
    assert run_all.update_readme_figures(floors, md, readme)
    lines = readme.read_text().splitlines()
    assert _row(lines, "push to a fresh node (`--encrypt auto`)")[1] == \
        "0.33x (1000 MB/s; of the disk 0.67x)"
    assert _row(lines, "the same, `push --early`")[1] == "1.10x (2.20 s; floor 1.25x)"
    assert _row(lines, "daemon peak RSS, 8 GiB env")[1] == "300 MB"
    # rendered again from the same run: the same page
    assert run_all.update_readme_figures(REPORT, md, readme) and readme.read_text() == text


def test_a_readme_without_markers_or_a_run_without_the_data_path_is_left_alone(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# title\n")
    md = tmp_path / "bench-x.md"
    assert not run_all.update_readme_figures(REPORT, md, readme)
    assert readme.read_text() == "# title\n"
    marked = f"{run_all.FIGURES_BEGIN}\nkept\n{run_all.FIGURES_END}\n"
    readme.write_text(marked)
    no_datapath = copy.deepcopy(REPORT)
    del no_datapath["results"]["datapath"]
    assert not run_all.update_readme_figures(no_datapath, md, readme)
    assert readme.read_text() == marked


def test_the_readme_has_the_place_a_full_run_fills():
    text = (run_all.REPO / "README.md").read_text()
    assert text.count(run_all.FIGURES_BEGIN) == 1
    assert text.index(run_all.FIGURES_BEGIN) < text.index(run_all.FIGURES_END)
