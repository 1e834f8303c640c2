"""The code blocks of the README and the docs site that are meant to run, as the pages print
them.

A page marks such a block with an HTML comment on the line before its fence (invisible on the
page):

    <!-- run -->                  the block runs on its own (its own HOME, its own cluster)
    <!-- run: NAME -->            the page's blocks of that NAME run as one script, in order
    <!-- run: elsewhere FILE -->  a test in FILE runs it (it reads the block from the page)

tests/test_docs.py runs the first two kinds and checks that each "elsewhere" test exists and
reads its page; a marker of any other form is an error there, so a typo cannot hide a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^(?P<indent>[ \t]*)<!-- run(?P<rest>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: Path  # relative to the repository
    line: int  # of the fence's first line, 1-based
    mark: str  # "" for a plain <!-- run -->, else what follows the colon
    lang: str
    code: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def marked_blocks(page: Path) -> list[Block]:
    """The marked blocks of one page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if not m:
            i += 1
            continue
        rest = m["rest"].strip()
        if rest and not rest.startswith(":"):
            raise ValueError(f"{page}:{i + 1}: a run marker is <!-- run --> or "
                             f"<!-- run: NAME -->, not {lines[i].strip()!r}")
        mark = rest[1:].strip()
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        f = FENCE.match(lines[j]) if j < len(lines) else None
        if not f:
            raise ValueError(f"{page}:{i + 1}: a run marker must stand right before a fenced "
                             "code block")
        indent, fence = f["indent"], f["fence"]
        body: list[str] = []
        k = j + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k][len(indent):] if lines[k].startswith(indent) else lines[k])
            k += 1
        if k == len(lines):
            raise ValueError(f"{page}:{j + 1}: the code block never ends")
        found.append(Block(page.relative_to(REPO), j + 1, mark, f["lang"],
                           "\n".join(body) + "\n"))
        i = k + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in marked_blocks(page)]


def block_run_elsewhere(page: str, test_file: str) -> str:
    """The one block of `page` (relative to the repository) marked as run by `test_file`."""
    found = [b for b in marked_blocks(REPO / page) if b.mark == f"elsewhere {test_file}"]
    assert len(found) == 1, (f"{page} has {len(found)} blocks marked "
                             f"<!-- run: elsewhere {test_file} -->, not one")
    return found[0].code
