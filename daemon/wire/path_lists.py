"""Lists of paths in a workspace (bytes: names need not be UTF-8) as JSON: what the
`first_reads` reply carries, and the file each end keeps them in (a node its recordings,
the dev box what it learned from the nodes; daemon/node/first_reads.py, daemon/client/
first_reads.py). Surrogate escapes keep any name."""

from __future__ import annotations

import json
from pathlib import Path

from ...fs.private_files import private_dir, replace_file

MAX_PATHS = 4096  # paths in one list, at most


def encode_paths(paths: list[bytes]) -> list[str]:
    return [p.decode("utf-8", "surrogateescape") for p in paths]


def decode_paths(paths: list[str]) -> list[bytes]:
    return [p.encode("utf-8", "surrogateescape") for p in paths]


def load_paths(path: Path) -> list[bytes]:
    """The list kept at `path`; [] if there is none. ValueError etc. if it is damaged."""
    try:
        return decode_paths(json.loads(path.read_text())["paths"])
    except FileNotFoundError:
        return []


def save_paths(path: Path, paths: list[bytes]) -> None:
    """Replace the list at `path` (its folder made private first). OSError if it cannot."""
    private_dir(path.parent)
    replace_file(path, json.dumps({"paths": encode_paths(paths)}).encode(),
                 path.with_suffix(".tmp"))
