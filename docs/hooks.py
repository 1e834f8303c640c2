"""MkDocs hooks (mkdocs.yml `hooks:`): the pages made from the code, made at every build.

A page asks for a generated part with a marker on a line of its own, `<!-- gen:NAME -->`, which
the build replaces by GENERATORS[NAME](); an unknown name fails the build. So the CLI, settings
and telemetry references are never kept by hand, and never stale:

- `cli`: every command and option, from the argparse parser itself (monarch_fs.options.
  build_parser), not from its source text, so it survives code moves;
- `settings`: every MONARCH_FS_* variable, from the properties of monarch_fs.settings.Settings;
- `schema`: the telemetry tables and their columns, from the SQL the nodes create them with
  (what `monarch-fs query --schema` prints).

The Python API pages use mkdocstrings, which reads modules by their import names: the install
maps folders to names (fs/ is monarch_fs.fs), so `on_startup` lays a tree of symlinks that
spells them (build/api-src, as `make typecheck` does for mypy).

A link from a page to a file of the repository outside docs/ (`../bench/results/X.md`, a test,
the systemd unit) is checked like any link: the file is published with the site under
`repo/`, and the link rewritten to it; a link to a file that does not exist is left as it is,
so a strict build fails on it.
"""

from __future__ import annotations

import argparse
import ast
import html
import inspect
import io
import os
import posixpath
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
API_SRC = REPO / "build" / "api-src"
MARKER = re.compile(r"^<!-- gen:([\w-]+) -->$", re.M)
# [text](target) links whose target is relative; images too.
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?(\))")
REPO_PREFIX = "repo"


# ---- the Python API: a tree of the import names ------------------------------------------------

def api_source_tree(root: Path = API_SRC) -> Path:
    """`root`/monarch_fs/... as installed: monarch_fs/*.py, and fs/, daemon/, mesh/ inside it."""
    pkg = root / "monarch_fs"
    pkg.mkdir(parents=True, exist_ok=True)
    for old in pkg.iterdir():
        if old.is_symlink():
            old.unlink()
    for f in sorted((REPO / "monarch_fs").glob("*.py")):
        (pkg / f.name).symlink_to(f)
    for layer in ("fs", "daemon", "mesh"):
        (pkg / layer).symlink_to(REPO / layer)
    return root


# ---- escaping --------------------------------------------------------------------------------

def md_text(text: str) -> str:
    """Plain text (an argparse help, a docstring) as Markdown inside a table cell: code spans
    kept, everything else escaped so `__pycache__` or `a|b` stay what they are."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:
            out.append(part.replace("|", "\\|"))
        else:
            part = html.escape(part, quote=False)
            out.append(re.sub(r"([\\*_\[\]|])", r"\\\1", part))
    return " ".join("".join(out).split())


# ---- the CLI ---------------------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser
                 ) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) for each subcommand, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _option_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.metavar is not None:
        metavar = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper()
    return f"{names} {metavar}"


def _option_help(action: argparse.Action) -> str:
    text = (action.help or "") % {"default": action.default, "prog": "monarch-fs"}
    default = action.default
    if action.option_strings and action.nargs != 0 and default not in (None, [], "") \
            and default is not argparse.SUPPRESS and "default" not in text:
        text = f"{text} (default {default:g})" if isinstance(default, float) else \
            f"{text} (default {default})"
    if action.choices is not None and not action.option_strings:
        text = f"one of {', '.join(map(str, action.choices))}. {text}"
    if getattr(action, "required", False) and action.option_strings:
        text = f"required. {text}"
    return md_text(text.strip())


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line, at a fixed width (not the terminal's), so builds are reproducible."""
    formatter = argparse.HelpFormatter(parser.prog, width=96)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def cli_reference() -> str:
    from monarch_fs.options import build_parser

    parser = build_parser()
    parser.prog = "monarch-fs"
    lines = [md_text(parser.description or ""), "", "```text", _usage(parser), "```", ""]
    lines += ["| command | what it does |", "| --- | --- |"]
    commands = _subcommands(parser)
    for name, help_text, _ in commands:
        lines.append(f"| [`{name}`](#monarch-fs-{name}) | {md_text(help_text)} |")
    lines += ["", "Every command also takes the global options, before the command's name:", ""]
    lines += _options_table([a for a in parser._actions
                             if not isinstance(a, (argparse._SubParsersAction,
                                                   argparse._HelpAction))])
    for name, help_text, sub in commands:
        sub.prog = f"monarch-fs {name}"
        lines += ["", f"## monarch-fs {name}", "", md_text(help_text) + ".", ""]
        if sub.description:
            lines += [md_text(sub.description), ""]
        lines += ["```text", _usage(sub), "```", ""]
        lines += _options_table([a for a in sub._actions
                                 if not isinstance(a, argparse._HelpAction)])
    return "\n".join(lines) + "\n"


def _options_table(actions: list[argparse.Action]) -> list[str]:
    if not actions:
        return []
    rows = ["| option | what it does |", "| --- | --- |"]
    for a in actions:
        rows.append(f"| `{_option_name(a).replace('|', '/')}` | {_option_help(a) or ' '} |")
    return rows


# ---- settings --------------------------------------------------------------------------------

# "MONARCH_FS_NAME (default)[, UNIT]: what it does". A unit "in bytes" or "in seconds" is the
# property's, converted, not the variable's: only an "(at least ...)" of it is kept.
_SETTING_DOC = re.compile(r"^(MONARCH_FS_\w+)(?: \(([^)]*)\))?(,[^:]*)?: (.*)$", re.S)


def settings_reference() -> str:
    """A table row per property of Settings, in the order settings.py declares them, under the
    heading of its section (its `# ---- who reads it ----` comment)."""
    from monarch_fs.settings import Settings

    section = ""
    sections: dict[str, str] = {}
    for line in inspect.getsource(Settings).splitlines():
        if m := re.match(r"\s*# ---- (.*?) -+$", line):
            section = m[1]
        elif m := re.match(r"\s*def (\w+)\(self\)", line):
            sections[m[1]] = section
    lines = ["| variable | default | read by | what it does |", "| --- | --- | --- | --- |"]
    for name, member in vars(Settings).items():
        if not isinstance(member, property) or not member.__doc__:
            continue
        doc = " ".join(inspect.cleandoc(member.__doc__).split())
        m = _SETTING_DOC.match(doc)
        if not m:
            raise ValueError(f"Settings.{name}: its docstring does not start with "
                             f"'MONARCH_FS_NAME (default): ...': {doc[:60]!r}")
        variable, default, text = m[1], m[2] or "unset", m[4]
        if m[3] and not m[3].startswith(", in "):
            default = f"{default} {m[3][1:].strip()}"  # the variable's own unit: "2 seconds"
        elif m[3] and (least := re.search(r"\(at least [^)]*\)", m[3])):
            default = f"{default} {least[0]}"
        lines.append(f"| `{variable}` | {md_text(default)} | {md_text(sections.get(name, ''))} "
                     f"| {md_text(text)} |")
    return "\n".join(lines) + "\n"


# ---- the telemetry schema --------------------------------------------------------------------

def schema_reference() -> str:
    """Each table the nodes create, and its columns with their type and comment: the SQL is
    run in an in-memory database and read back, so the page shows what a node makes."""
    from monarch_fs.daemon.client.query import schema_text

    sql = schema_text()
    db = sqlite3.connect(":memory:")
    db.executescript(sql)
    tables = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' "
                        "ORDER BY rowid").fetchall()
    out: list[str] = []
    for table, create in tables:
        comments = _column_comments(create)
        out += [f"### `{table}`", "", "| column | type | what it holds |", "| --- | --- | --- |"]
        for _, column, kind, notnull, _, pk in db.execute(f"PRAGMA table_info({table})"):
            what = comments.get(column, "")
            if pk:
                what = what or "row id, in the order rows were written"
            out.append(f"| `{column}` | {kind}{' NOT NULL' if notnull and not pk else ''} "
                       f"| {md_text(what)} |")
        out.append("")
    out += ["The SQL itself, as `monarch-fs query --schema` prints it:", "", "```sql",
            sql.strip(), "```"]
    return "\n".join(out) + "\n"


def _column_comments(create: str) -> dict[str, str]:
    """column -> the `-- comment` on its line of a CREATE TABLE (a comment on a line that
    declares several columns belongs to all of them)."""
    found: dict[str, str] = {}
    for line in create.splitlines():
        code, _, comment = line.partition("--")
        if not comment.strip():
            continue
        for decl in code.split(","):
            words = decl.replace("(", " ").split()
            if len(words) >= 2 and words[0].upper() not in ("CREATE", "PRIMARY", "UNIQUE"):
                found[words[0]] = comment.strip()
    return found


# ---- the module map -----------------------------------------------------------------------------

LAYERS = (("monarch_fs", "monarch_fs"), ("fs", "monarch_fs.fs"), ("daemon", "monarch_fs.daemon"),
          ("mesh", "monarch_fs.mesh"))


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(?:\s+[A-Z(`]|$)", para)
    return m[1] if m else para


def modules_reference() -> str:
    """A table per package: each module, and the first sentence of its docstring."""
    out: list[str] = []
    for folder, name in LAYERS:
        for pkg in sorted({p.parent for p in (REPO / folder).rglob("*.py")}):
            rel = pkg.relative_to(REPO).as_posix()
            import_name = name + rel[len(folder):].replace("/", ".")
            rows = []
            for f in sorted(pkg.glob("*.py")):
                doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
                if doc is None and f.name == "__init__.py":
                    continue
                rows.append(f"| `{f.name}` | {md_text(_first_sentence(doc or ''))} |")
            if rows:
                out += [f"### `{rel}/` (`{import_name}`)", "", "| module | what it is |",
                        "| --- | --- |", *rows, ""]
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "modules": modules_reference,
    "settings": settings_reference,
    "schema": schema_reference,
}


def expand(markdown: str) -> str:
    """`markdown` with every generated part in place; an unknown marker is an error."""
    def one(m: re.Match[str]) -> str:
        if m[1] not in GENERATORS:
            raise ValueError(f"unknown generated part <!-- gen:{m[1]} --> "
                             f"(known: {', '.join(GENERATORS)})")
        return GENERATORS[m[1]]().rstrip("\n")
    return MARKER.sub(one, markdown)


# ---- links to the repository's files -----------------------------------------------------------

def repo_target(page_src: str, target: str, docs_dir: Path) -> str | None:
    """The repository path (posix) a relative link of page `page_src` points to, when it leaves
    docs/ and names a file that exists; else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    page_dir = (docs_dir / page_src).parent
    path = Path(os.path.normpath(page_dir / target))
    try:
        path.relative_to(docs_dir)
        return None  # inside docs/: mkdocs checks it
    except ValueError:
        pass
    try:
        rel = path.relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if path.is_file() else None


def repo_links(markdown: str, page_src: str, docs_dir: Path) -> tuple[str, set[str]]:
    """`markdown` with links to repository files outside docs/ pointed at their copies under
    repo/, and the set of those files."""
    used: set[str] = set()

    def one(m: re.Match[str]) -> str:
        rel = repo_target(page_src, m[2], docs_dir)
        if rel is None:
            return m[0]
        used.add(rel)
        new = posixpath.relpath(f"{REPO_PREFIX}/{rel}", posixpath.dirname(page_src) or ".")
        return f"{m[1]}{new}{m[3] or ''}{m[4]}"

    return LINK.sub(one, markdown), used


# ---- the hooks -------------------------------------------------------------------------------

def on_startup(command: str, dirty: bool) -> None:
    # Before any plugin's on_config: mkdocstrings takes its search paths as they are then.
    api_source_tree()


def on_files(files: Any, config: Any) -> Any:
    """Publish the repository files that pages link to (found by reading every page now)."""
    from mkdocs.structure.files import File

    docs_dir = Path(config["docs_dir"])
    wanted: set[str] = set()
    for f in files.documentation_pages():
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        wanted |= repo_links(text, f.src_uri, docs_dir)[1]
    for rel in sorted(wanted):  # a .md (a bench report) becomes a page of the site
        files.append(File.generated(config, f"{REPO_PREFIX}/{rel}",
                                    abs_src_path=str(REPO / rel)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        text = expand(markdown)
    except ValueError as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from None
    if page.file.src_uri.startswith(f"{REPO_PREFIX}/"):
        return text  # a repository file shown as it is
    return repo_links(text, page.file.src_uri, Path(config["docs_dir"]))[0]


if __name__ == "__main__":  # python docs/hooks.py NAME: print a generated part
    import sys

    buf = io.StringIO()
    for name in sys.argv[1:] or list(GENERATORS):
        buf.write(GENERATORS[name]())
    sys.stdout.write(buf.getvalue())
