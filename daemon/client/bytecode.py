"""Python bytecode in a pushed tree: say when modules have no `.pyc`, and compile them on request.

The mount is read-only, so a node cannot cache the bytecode it compiles: a module pushed without
its `__pycache__/NAME.TAG.pyc` is compiled again by every import, on every node (`import torch`
took 2.3 s instead of 0.8 s here). `push` checks the snapshot's manifest (no second walk of the
folder) and warns once; `push --compile` byte-compiles the folder first, with the interpreter that
will import it, as pip does at install time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ...fs.manifest import Kind, Manifest

PYCACHE = b"__pycache__"
_LIB_PYTHON = re.compile(rb"(?:^|/)lib/python(\d+)\.(\d+)/")
_VERSION = re.compile(r"^\s*version(?:_info)?\s*=\s*(\d+)\.(\d+)", re.MULTILINE)
COMPILE_TIMEOUT = 1800.0


def default_tag(src: str | os.PathLike[str]) -> str:
    """The cache tag (cpython-311) of the interpreter that will import `src`'s modules: the
    venv's, from its pyvenv.cfg, when `src` is a venv; else the running one's."""
    try:
        m = _VERSION.search((Path(src) / "pyvenv.cfg").read_text(errors="replace"))
    except OSError:
        m = None
    if m:
        return f"cpython-{m[1]}{m[2]}"
    return sys.implementation.cache_tag or "cpython"


def _tag_for(path: bytes, default: bytes) -> bytes:
    """A module under lib/pythonX.Y/ is imported by Python X.Y, whatever runs push."""
    m = _LIB_PYTHON.search(path)
    return b"cpython-" + m[1] + m[2] if m else default


@dataclass
class Missing:
    """Modules without bytecode: how many, one of them, and the tag looked for."""

    count: int
    example: str
    tag: str


def missing_bytecode(manifest: Manifest, tag: str) -> Missing | None:
    """The `.py` files of `manifest` that have no `__pycache__/NAME.TAG.pyc` next to them, in
    folders that hold no bytecode for TAG at all. A folder with bytecode for some of its modules
    was compiled; the modules left are the ones compileall could not compile (templates, syntax
    of another Python), which no node could compile either. None when there are none."""
    default = tag.encode()
    pycs: set[bytes] = set()
    compiled_dirs: set[tuple[bytes, bytes]] = set()  # (folder, tag) with any .pyc
    sources: list[bytes] = []
    for e in manifest:
        if e.kind != Kind.FILE:
            continue
        p = e.path
        if p.endswith(b".pyc"):
            head, _, name = p.rpartition(b"/")
            parent, _, cache = head.rpartition(b"/")
            if cache == PYCACHE or head == PYCACHE:
                pycs.add(p)
                parts = name.split(b".")
                if len(parts) == 3:  # NAME.TAG.pyc (not NAME.TAG.opt-1.pyc)
                    compiled_dirs.add((parent if cache == PYCACHE else b"", parts[1]))
        elif p.endswith(b".py"):
            sources.append(p)
    missing = []
    for p in sources:
        folder, _, name = p.rpartition(b"/")
        t = _tag_for(p, default)
        cache = (folder + b"/" if folder else b"") + PYCACHE
        if (cache + b"/" + name[:-3] + b"." + t + b".pyc" not in pycs
                and (folder, t) not in compiled_dirs):
            missing.append(p)
    if not missing:
        return None
    example = min(missing, key=lambda p: (p.count(b"/"), p))
    return Missing(len(missing), example.decode("utf-8", "backslashreplace"), tag)


def warnings(manifest: Manifest, src: str | os.PathLike[str]) -> list[str]:
    """The one warning line `push` prints for modules without bytecode (or none)."""
    m = missing_bytecode(manifest, default_tag(src))
    if m is None:
        return []
    what = "module has" if m.count == 1 else "modules have"
    return [f"{m.count:,} Python {what} no bytecode (e.g. {m.example}, no "
            f"__pycache__/*.{m.tag}.pyc): the mount is read-only, so every import on every node "
            "compiles them again; push --compile writes __pycache__ into SRC first (and do not "
            "--exclude '*.pyc')"]


def interpreter(src: str | os.PathLike[str]) -> str:
    """The Python that will import `src`: the venv's own bin/python when `src` is a venv (it
    has pyvenv.cfg), else the one running push."""
    if (Path(src) / "pyvenv.cfg").exists():
        return str(Path(src) / "bin" / "python")
    return sys.executable


@dataclass
class Compiled:
    """What `compile_tree` did: the interpreter it used, and the files it could not compile."""

    python: str
    failures: int


def compile_tree(src: str | os.PathLike[str]) -> Compiled:
    """Byte-compile every module under `src` into its __pycache__ (compileall, in parallel, as
    pip does at install time). Files that do not compile are counted, not fatal: pip goes on
    past them too. ValueError, naming the cause, when the interpreter cannot run."""
    python = interpreter(src)
    if not os.access(python, os.X_OK):
        raise ValueError(f"--compile: {src} has pyvenv.cfg but no runnable {python}")
    try:
        proc = subprocess.run([python, "-m", "compileall", "-q", "-j", "0", os.fspath(src)],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--compile: {python} -m compileall {src} failed: {e}") from None
    failures = proc.stdout.count("***")
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failures):
        cause = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise ValueError(f"--compile: {python} -m compileall {src} exited {proc.returncode}: "
                         f"{cause[-1] if cause else 'no output'}")
    return Compiled(python, failures)
