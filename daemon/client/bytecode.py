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

from ...fs.manifest import Folder, Kind, Manifest
from ...fs.scan_cache import ScanCache

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


def missing_bytecode(manifest: Manifest, tag: str,
                     memo: dict[bytes, tuple[int, bytes]] | None = None
                     ) -> tuple[Missing | None, dict[bytes, tuple[int, bytes]]]:
    """The `.py` files of `manifest` that have no `__pycache__/NAME.TAG.pyc` next to them, in
    folders that hold no bytecode for TAG at all (None when there are none), and what was found
    of each folder, for `memo` next time. A folder with bytecode for some of its modules was
    compiled; the modules left are the ones compileall could not compile (templates, syntax of
    another Python), which no node could compile either.

    What a folder lacks depends only on its object (its modules, and through its
    `__pycache__`'s id that folder's files) and the tag: `memo`, by object id and tag, answers
    for the folders an earlier scan found, so a one-file edit looks at the folders on its
    path."""
    default = tag.encode()
    facts: dict[bytes, tuple[int, bytes]] = {}
    count, example = 0, b""
    for f in manifest.folders():
        folder = f.entry.path
        t = _tag_for(folder + b"/", default)
        key = f.oid + t
        fact = (memo.get(key) if memo else None) or _folder_missing(f, t)
        facts[key] = fact
        if fact[0]:
            count += fact[0]
            path = folder + b"/" + fact[1] if folder else fact[1]
            if not example or (path.count(b"/"), path) < (example.count(b"/"), example):
                example = path
    if not count:
        return None, facts
    return Missing(count, example.decode("utf-8", "backslashreplace"), tag), facts


def _folder_missing(folder: Folder, tag: bytes) -> tuple[int, bytes]:
    """(modules without bytecode, the first one's name) of `folder`."""
    sources: list[bytes] = []
    pycs: set[bytes] = set()
    for e in folder.kids:
        if e.kind == Kind.FILE and e.name.endswith(b".py"):
            sources.append(e.name)
        elif e.kind == Kind.DIR and e.name == PYCACHE:
            pycs.update(c.name for c in folder.sub[e.name].kids
                        if c.kind == Kind.FILE and c.name.endswith(b".pyc"))
    # NAME.TAG.pyc (not NAME.TAG.opt-1.pyc) for any module: the folder was compiled
    if any(len(parts) == 3 and parts[1] == tag for parts in (p.split(b".") for p in pycs)):
        return 0, b""
    missing = [n for n in sources if n[:-3] + b"." + tag + b".pyc" not in pycs]
    return len(missing), min(missing, default=b"")


def warnings(manifest: Manifest, src: str | os.PathLike[str],
             cache: ScanCache | None = None) -> list[str]:
    """The one warning line `push` prints for modules without bytecode (or none). With the
    scan's `cache`, what it knows of the folders is used, and kept for the next push (the
    caller saves it)."""
    m, facts = missing_bytecode(manifest, default_tag(src),
                                cache.bytecode if cache is not None else None)
    if cache is not None:
        cache.keep_bytecode(facts)
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
