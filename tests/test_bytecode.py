"""Modules pushed without bytecode (daemon/client/bytecode.py): the mount is read-only, so a node
compiles them again on every import. `push` says so in one warning line; `push --compile`
byte-compiles SRC first, with the venv's own interpreter, and the nodes then import from the
pushed .pyc files (Python's `-v` says the .pyc "matches" its source).

A real venv (`python -m venv --without-pip`, a package of ours in its site-packages) and a plain
tree of modules, pushed through the real command line to a real 2-node cluster."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import Cluster

pytestmark = pytest.mark.mount

SITE = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
TAG = sys.implementation.cache_tag


def make_venv(root: Path) -> Path:
    """A venv with package `mypkg` (two modules) in its site-packages, and no bytecode."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True, timeout=120)
    pkg = root / SITE / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "mod.py").write_text("def answer():\n    return 42\n")
    return root


def bytecode_warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "no bytecode" in ln]


def import_verbose(python: Path, module: str) -> subprocess.CompletedProcess:
    """Import `module` with `python -v`: its stderr says where each module's code came from."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONNOUSERSITE": "1"}
    return subprocess.run([str(python), "-v", "-c", f"import {module}; print({module}.__file__)"],
                          capture_output=True, text=True, env=env, timeout=60, check=True)


def test_venv_without_bytecode_warns_and_compile_makes_nodes_import_pyc(
        tmp_path: Path, cluster2: Cluster) -> None:
    venv = make_venv(tmp_path / "venv")

    first = cluster2.push(venv, "--name", "bcvenv", "--no-at-source")
    lines = bytecode_warnings(first.stderr)
    assert len(lines) == 1, first.stderr
    assert f"2 Python modules have no bytecode (e.g. {SITE}/mypkg/__init__.py" in lines[0]
    assert "--compile" in lines[0] and TAG in lines[0]
    node_venv = cluster2.mnt(1) / "bcvenv"
    cold = import_verbose(node_venv / "bin" / "python", "mypkg.mod")
    assert not [ln for ln in cold.stderr.splitlines() if "mypkg" in ln and "matches" in ln]

    second = cluster2.push(venv, "--name", "bcvenv", "--no-at-source", "--compile")
    assert bytecode_warnings(second.stderr) == [], second.stderr
    for name in ("__init__", "mod"):
        src = venv / SITE / "mypkg" / f"{name}.py"
        cached = Path(importlib.util.cache_from_source(str(src)))
        assert cached.is_file(), "--compile writes __pycache__ into SRC"
        on_node = node_venv / cached.relative_to(venv)
        assert on_node.read_bytes() == cached.read_bytes()
    out = import_verbose(node_venv / "bin" / "python", "mypkg.mod")
    mod_py = node_venv / SITE / "mypkg" / "mod.py"
    assert out.stdout.strip() == str(mod_py)
    said = [ln for ln in out.stderr.splitlines() if "mypkg" in ln]
    pyc = importlib.util.cache_from_source(str(mod_py))
    assert f"# {pyc} matches {mod_py}" in said, said  # importlib checked it and took it
    assert f"# code object from '{pyc}'" in said, said

    third = cluster2.push(venv, "--name", "bcvenv", "--no-at-source")
    assert bytecode_warnings(third.stderr) == [], "the pushed tree now carries its bytecode"


def test_plain_tree_compiles_and_skips_what_cannot_compile(
        tmp_path: Path, cluster2: Cluster) -> None:
    """A tree that is not a venv is compiled with the Python running push; a file compileall
    cannot compile (syntax of another Python) is reported by --compile, then not warned about
    again: no node could compile it either."""
    src = tmp_path / "code"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "train.py").write_text("EPOCHS = 3\n")
    (src / "pkg" / "py2only.py").write_text("print 'hello'\n")

    first = cluster2.push(src, "--exclude", "*.pyc")
    lines = bytecode_warnings(first.stderr)
    assert len(lines) == 1 and lines[0].startswith("warning: 3 Python modules"), first.stderr

    compiled = cluster2.push(src, "--compile")
    assert bytecode_warnings(compiled.stderr) == [], compiled.stderr
    assert "1 files under" in compiled.stderr and "did not compile" in compiled.stderr
    assert (src / "pkg" / "__pycache__" / f"train.{TAG}.pyc").is_file()

    excluded = cluster2.push(src, "--exclude", "*.pyc")
    assert len(bytecode_warnings(excluded.stderr)) == 1, "excluding *.pyc leaves them out again"


def test_what_is_known_of_unchanged_folders_gives_the_same_answer():
    """missing_bytecode with the facts of an earlier version (push keeps them in the scan
    cache) answers as it does without them, after edits that change what is missing: a module
    added to an uncompiled folder, a compiled folder's bytecode deleted, a folder renamed under
    lib/pythonX.Y (whose modules another Python imports)."""
    from monarch_fs.daemon.client.bytecode import missing_bytecode
    from monarch_fs.fs.manifest import Entry, Kind, Manifest

    def tree(paths: list[str]) -> Manifest:
        dirs = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
        return Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0)]
                        + [Entry(d.encode(), Kind.DIR, 0o755, 0, 0) for d in dirs]
                        + [Entry(p.encode(), Kind.FILE, 0o644, 0, 0) for p in paths])

    lib = SITE.rpartition("/")[0]  # lib/pythonX.Y: this Python's, whose bytecode m.py has
    first = ["a/x.py", "a/y.py", "b/z.py", f"b/__pycache__/z.{TAG}.pyc", "c/w.py",
             "c/q.py", f"{lib}/m.py", f"{lib}/__pycache__/m.{TAG}.pyc"]
    edits = [first + ["a/new.py"],
             [p for p in first if not p.startswith("b/__pycache__")],
             [p.replace(lib, "lib/python3.98") for p in first],
             [p for p in first if not p.startswith("c/")]]
    _, memo = missing_bytecode(tree(first), TAG)
    for paths in edits:
        fresh, _ = missing_bytecode(tree(paths), TAG)
        known, _ = missing_bytecode(tree(paths), TAG, memo)
        assert known == fresh
    counts = [missing_bytecode(tree(p), TAG)[0] for p in [first, *edits]]
    assert [m.count for m in counts] == [4, 5, 5, 5, 2]
    assert counts[0].example == "a/x.py" and counts[4].example == "a/x.py"
    assert missing_bytecode(tree(edits[2]), TAG)[0].count == 5  # m.py is for 3.98 now
