"""The code stays in its rooms (issue 37): no module over 450 lines, no import circle (imports
inside functions count), and no client module importing a node module or the reverse: what both
need lives in daemon/wire/. Read from the source, as a newcomer reads it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"monarch_fs": "monarch_fs", "fs": "monarch_fs.fs", "daemon": "monarch_fs.daemon",
            "mesh": "monarch_fs.mesh"}  # folder -> installed name (pyproject's mapping)
MAX_LINES = 450


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    assert len(found) > 100, f"no sources under {ROOT}?"
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The monarch_fs modules `name` imports, at any depth of its code."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                target = ".".join(anchor + ([target] if target else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name and known[m].name != "__init__.py"}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by what a reader looks for: {long}"


def test_no_import_circle():
    edges = graph()
    circles = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circles.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        for other in sorted(edges[name]):
            visit(other, path + [name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_client_and_node_do_not_import_each_other():
    sides = ("monarch_fs.daemon.client", "monarch_fs.daemon.node")
    crossing = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
                for here, there in (sides, sides[::-1])
                if a.startswith(here) and b.startswith(there)]
    assert not crossing, "what both need lives in daemon/wire/:\n" + "\n".join(crossing)
