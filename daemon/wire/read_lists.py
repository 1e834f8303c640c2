"""Lists of first reads in a workspace: what the `first_reads` reply carries, and the file each
end keeps them in (a node its recordings, the dev box what it learned from the nodes;
daemon/node/first_reads.py, daemon/client/first_reads.py).

A read is a path (bytes: names need not be UTF-8) and the index of the chunk of it that was
read, or None where only the file's opening is known (a small file, or a large one the kernel
read by passthrough with nothing known of its pages): then all of it. Read first, in order:
`import torch` reads part of libtorch_cpu.so, not all of it, and push --early sends those
chunks, not the file. As JSON: the distinct `paths` in order (what an older peer reads), and
`reads`, [path index, chunk index or -1] in order. Surrogate escapes keep any name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...fs.private_files import private_dir, replace_file

MAX_PATHS = 4096  # distinct paths in one list, at most
MAX_READS = 16384  # reads in one list, at most

Read = tuple[bytes, int | None]


def encode_reads(reads: Iterable[Read]) -> dict[str, list]:
    """{"paths": [...], "reads": [[i, k], ...]} (see the module docstring)."""
    index: dict[bytes, int] = {}
    pairs = []
    for path, k in reads:
        i = index.setdefault(path, len(index))
        pairs.append([i, -1 if k is None else k])
    return {"paths": [p.decode("utf-8", "surrogateescape") for p in index], "reads": pairs}


def decode_reads(value: Mapping[str, Any]) -> list[Read]:
    """The reads of an encoded list; of one with `paths` only (an older peer's), each file
    whole. ValueError (or TypeError, KeyError) if it is malformed."""
    paths = [p.encode("utf-8", "surrogateescape") for p in value["paths"]]
    pairs = value.get("reads")
    if pairs is None:
        return [(p, None) for p in paths]
    out: list[Read] = []
    for i, k in pairs:
        if not (isinstance(i, int) and isinstance(k, int) and 0 <= i < len(paths) and k >= -1):
            raise ValueError(f"not a read: {[i, k]!r}")
        out.append((paths[i], None if k < 0 else k))
    return out


def load_reads(path: Path) -> list[Read]:
    """The list kept at `path`; [] if there is none. ValueError etc. if it is damaged."""
    try:
        return decode_reads(json.loads(path.read_text()))
    except FileNotFoundError:
        return []


def save_reads(path: Path, reads: Iterable[Read]) -> None:
    """Replace the list at `path` (its folder made private first). OSError if it cannot."""
    private_dir(path.parent)
    replace_file(path, json.dumps(encode_reads(reads)).encode(), path.with_suffix(".tmp"))
