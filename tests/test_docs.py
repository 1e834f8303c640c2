"""The documentation: the site builds strictly, its generated references say what the code
does, and the examples of the README and of the site run as printed (tests/doc_examples.py
finds them).

The strict build itself is in `make test` (and `make docs` without --strict); here it is
checked that a strict build fails on what would mislead a reader: a broken link or anchor, a
nav entry to a missing page, a reference to an API name that does not exist."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doc_examples import REPO, Block, all_blocks, marked_blocks
from helpers import mfs, start_cluster, stop_cluster
from monarch_fs.daemon.client.push_result import PushResult
from monarch_fs.daemon.client.query import schema_text
from monarch_fs.daemon.wire.replies import COUNTERS, TRANSPORT_KEYS, StatusReply
from monarch_fs.options import build_parser
from monarch_fs.push_command import push_report

BIN = Path(sys.executable).parent  # the venv's: monarch-fs, python


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


# ---- the strict build fails on what would mislead a reader -------------------------------------

def _site_copy(tmp_path: Path) -> Path:
    """The site's sources in `tmp_path`, the code beside them (linked): a build of the copy is
    a build of the real thing, and the copy can be broken on purpose."""
    site = tmp_path / "site-src"
    site.mkdir()
    shutil.copytree(REPO / "docs", site / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "mkdocs.yml", site)
    for name in ("monarch_fs", "fs", "daemon", "mesh", "bench", "tests"):
        (site / name).symlink_to(REPO / name)
    return site


def _build(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "mkdocs"), "build", "--strict", "-d",
                           str(site / "out")], cwd=site, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
def test_a_strict_build_of_the_site_as_it_is_passes(tmp_path):
    out = _build(_site_copy(tmp_path))
    assert out.returncode == 0, out.stderr
    built = tmp_path / "site-src" / "out"
    cli = (built / "reference" / "cli" / "index.html").read_text()
    assert "monarch-fs push" in cli and "--keep-warm" in cli  # generated, not a stub
    api = (built / "reference" / "api" / "index.html").read_text()
    assert "spawn_procs" in api and "read_secrets" in api  # mkdocstrings rendered the names


@pytest.mark.slow
def test_a_strict_build_fails_on_broken_links_anchors_nav_and_references(tmp_path):
    site = _site_copy(tmp_path)
    page = site / "docs" / "index.md"
    page.write_text(page.read_text() + "\n[a](no-such-page.md) [b](guides/slurm.md#no-such-"
                    "anchor) [c](../bench/results/no-such-report.md) "
                    "[d][monarch_fs.mesh.NoSuchName]\n")
    yml = site / "mkdocs.yml"
    yml.write_text(yml.read_text().replace("  - Benchmarks: benchmarks.md",
                                           "  - Benchmarks: benchmarks.md\n"
                                           "  - Gone: no-such-nav-page.md"))
    out = _build(site)
    assert out.returncode != 0
    for what in ("no-such-page.md", "#no-such-anchor", "no-such-report.md",
                 "monarch_fs.mesh.NoSuchName", "no-such-nav-page.md"):
        assert what in out.stderr, (what, out.stderr)


@pytest.mark.slow
def test_a_strict_build_fails_on_an_api_name_that_does_not_exist(tmp_path):
    site = _site_copy(tmp_path)
    page = site / "docs" / "reference" / "api.md"
    page.write_text(page.read_text() + "\n::: monarch_fs.mesh.NoSuchClass\n")
    out = _build(site)
    assert out.returncode != 0 and "monarch_fs.mesh.NoSuchClass" in out.stderr, out.stderr


def test_an_unknown_generated_part_is_an_error():
    with pytest.raises(ValueError, match="gen:nosuch"):
        hooks.expand("<!-- gen:nosuch -->\n")


# ---- the generated references say what the code does ------------------------------------------

def test_the_cli_reference_has_every_command_and_option():
    text = hooks.cli_reference()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert f"## monarch-fs {name}\n" in text, name
        section = text.split(f"## monarch-fs {name}\n", 1)[1].split("\n## ", 1)[0]
        section = section.replace("\\", "")  # the Markdown escapes
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # every command has -h
            for flag in action.option_strings:
                assert f"`{flag}" in section or f", {flag}" in section, (name, flag)
            if action.help and action.option_strings:
                words = re.sub(r"[^\w ]", " ", action.help).split()[:3]
                assert all(w in section for w in words), (name, action.option_strings)


def test_the_settings_reference_lists_every_variable():
    listed = set(re.findall(r"^\| `(MONARCH_FS_\w+)`", hooks.settings_reference(), re.M))
    source = (REPO / "monarch_fs" / "settings.py").read_text()
    assert listed == set(re.findall(r'"(MONARCH_FS_\w+)"', source))


def test_the_schema_reference_has_every_table_and_column():
    import sqlite3

    text = hooks.schema_reference()
    db = sqlite3.connect(":memory:")
    db.executescript(schema_text())
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert "events" in tables and "reads" in tables
    for table in tables:
        section = text.split(f"### `{table}`\n", 1)[1].split("\n### ", 1)[0]
        for column in (r[1] for r in db.execute(f"PRAGMA table_info({table})")):
            assert f"| `{column}` |" in section, (table, column)


def _recorded_kinds() -> set[str]:
    kinds: set[str] = set()
    for f in [*REPO.glob("monarch_fs/*.py"), *REPO.glob("fs/**/*.py"),
              *REPO.glob("daemon/**/*.py"), *REPO.glob("mesh/**/*.py")]:
        code = f.read_text()
        kinds |= set(re.findall(r"(?:\.|\b_)record\(\s*\"([\w.]+)\"", code))
        for a, b in re.findall(r"record\(\s*\"([\w.]+)\" if [^\n]* else \"([\w.]+)\"", code):
            kinds |= {a, b}
        kinds |= set(re.findall(r"\"kind\": \"([\w.]+)\"", code))
    return kinds


def test_the_event_kinds_table_is_the_code_s():
    page = (REPO / "docs" / "reference" / "events.md").read_text()
    table = page.split("## Kinds of event", 1)[1].split("\n## ", 1)[0]
    listed = {k for row in re.findall(r"^\| (`[^|]+`) \|", table, re.M)
              for k in re.findall(r"`([\w.]+)`", row)}
    assert listed == _recorded_kinds()


def test_the_json_reference_lists_every_field():
    page = (REPO / "docs" / "reference" / "json.md").read_text()
    push = page.split("## `monarch-fs push --json`", 1)[1].split("\n## ", 1)[0]
    # What the command prints for a push with every optional part (--early, a hand-off).
    result = PushResult(version="ab" * 16, name="env", files=1, bytes=1, chunks_total=1,
                        chunks_sent=1, bytes_sent=1, nodes=1, seconds=0.1,
                        usable_seconds=0.05, complete_seconds=0.1, first_reads=1,
                        first_read_bytes=1, chunks_wanted=0)
    printed = json.loads(push_report(result, True, watch=1234)[0])
    assert set(printed) >= {f.name for f in dataclasses.fields(PushResult)} - {"warnings"}
    for name in printed:
        assert f"`{name}`" in push, name
    status = page.split("## `monarch-fs status --json`", 1)[1].split("\n## ", 1)[0]
    spread = {"transport", "counters"}  # spread into the object: their keys are listed
    for name in [f.name for f in dataclasses.fields(StatusReply) if f.name not in spread]:
        assert f"`{name}`" in status, name
    for name in (*COUNTERS, *TRANSPORT_KEYS, "host", "reachable", "error"):
        assert f"`{name}`" in status, name


# ---- the examples run as printed ---------------------------------------------------------------

BLOCKS = all_blocks()
RUNNERS = ("sh", "bash", "python")


def _scripts() -> list[tuple[str, str, str]]:
    """(where, language, code): each block marked <!-- run -->, and each page's blocks of one
    <!-- run: NAME --> joined in order."""
    out: list[tuple[str, str, str]] = []
    named: dict[tuple[Path, str], list[Block]] = {}
    for b in BLOCKS:
        if b.lang not in RUNNERS or b.mark.startswith("elsewhere "):
            continue
        if b.mark:
            named.setdefault((b.page, b.mark), []).append(b)
        else:
            out.append((b.where(), b.lang, b.code))
    for (page, mark), blocks in named.items():
        langs = {"sh" if b.lang == "bash" else b.lang for b in blocks}
        assert len(langs) == 1, f"{page}: the blocks of run: {mark} mix {langs}"
        out.append((f"{page} (run: {mark})", blocks[0].lang, "".join(b.code for b in blocks)))
    return out


def test_every_marked_block_is_run_by_some_test():
    assert BLOCKS, "no marked block at all: the marker changed?"
    for b in BLOCKS:
        if b.mark.startswith("elsewhere "):
            test_file = REPO / b.mark.split(None, 1)[1]
            assert test_file.is_file(), b.where()
            assert str(b.page) in test_file.read_text(), (
                f"{b.where()}: {test_file.name} does not read {b.page}")
        else:
            assert b.lang in (*RUNNERS, "sql"), f"{b.where()}: no runner for {b.lang!r}"
            assert re.fullmatch(r"[\w-]*", b.mark), b.where()


def test_the_readme_has_its_tour_and_stays_short():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    tour = [b for b in marked_blocks(REPO / "README.md") if b.lang in RUNNERS]
    assert tour, "the README's tour is not marked to run"
    code = "".join(b.code for b in tour)
    for step in ("cluster up", "push", "run", "query", "cluster down"):
        assert f"monarch-fs {step}" in code, step


def _clean_env(home: Path) -> dict[str, str]:
    """A reader's shell: their own HOME, the venv first on PATH, no MONARCH_FS_* of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_FS_")}
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONDONTWRITEBYTECODE="1")
    return env


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("where,lang,code", _scripts(), ids=[s[0] for s in _scripts()])
def test_the_example_runs(where, lang, code, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = _clean_env(home)
    if lang == "python":
        script = tmp_path / "example.py"
        script.write_text(code)
        argv, cwd = [sys.executable, str(script)], tmp_path
    else:
        argv, cwd = ["bash", "-euo", "pipefail", "-c", code], REPO
    try:
        out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:  # a block that failed half way may have left its cluster up
        subprocess.run([str(BIN / "monarch-fs"), "cluster", "down"], env=env,
                       capture_output=True, timeout=120)
    assert out.returncode == 0, f"{where} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    if where.startswith("README.md"):  # the tour's query found the rank that died, as it says
        assert re.search(r"^127\.0\.0\.1:\d+ +3 +0 +1 +rank 3: simulated crash", out.stdout,
                         re.M), out.stdout


@pytest.fixture(scope="module")
def cluster_with_history(tmp_path_factory):
    """Two nodes that served two versions of a workspace and ran a job whose rank 1 failed:
    something for every query of the docs to find."""
    c = start_cluster(tmp_path_factory.mktemp("docs-cluster"), 2)
    try:
        src = tmp_path_factory.mktemp("src") / "job"
        src.mkdir()
        (src / "train.py").write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' "
                                      "else 0)\n")
        c.push(src)
        (src / "more.py").write_text("x = 1\n")
        c.push(src)
        run = mfs("run", "--hosts", c.hostfile, "--token-file", c.token_file, "--workspace",
                  "job", "--", sys.executable, "train.py", check=False)
        assert run.returncode == 3, run.stderr
        deadline = time.monotonic() + 30
        while not _query(c, "SELECT count(*) AS n FROM events WHERE kind = 'proc.exited' "
                            "AND code = 3")["rows"][0]["n"]:
            assert time.monotonic() < deadline, "no proc.exited event recorded"
            time.sleep(0.5)
        yield c
    finally:
        stop_cluster(c)


def _query(c, sql: str) -> dict:
    out = mfs("query", "--json", "--hosts", c.hostfile, "--token-file", c.token_file, sql,
              check=False)
    assert out.returncode == 0, f"{sql}\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout)


SQL = [b for b in BLOCKS if b.lang == "sql" and not b.mark]


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("block", SQL, ids=[b.where() for b in SQL])
def test_the_query_runs_on_every_node(block, cluster_with_history):
    result = _query(cluster_with_history, block.code)
    assert result["unreachable"] == [] and isinstance(result["rows"], list)
    if "code != 0" in block.code:  # the questions "which rank died": it did
        assert any(row.get("rank") == 1 for row in result["rows"]), result
