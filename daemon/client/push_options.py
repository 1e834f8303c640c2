"""What a push is asked to do: one value (PushOptions) that `monarch-fs push` fills from its
flags, and the checks of what names it (the workspace, the source path) that fail before
anything is scanned or sent."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..wire import bulk
from ..wire.requests import check_source_path, check_workspace_name
from ..wire.topology import CONTROL_FANOUT, KINDS
from . import link_codec
from .links import STALL_TIMEOUT


@dataclass(frozen=True)
class PushOptions:
    """How to push. The defaults are `monarch-fs push`'s without flags, but for the dev box's
    caches (the command line passes its folders): a push made with PushOptions() keeps no
    scan cache, no dev box store and no first-read lists."""

    name: str | None = None
    """The workspace (default: the source folder's name)."""
    excludes: Sequence[str] = ()
    """Glob patterns of paths not pushed (--exclude)."""
    topology: str = "auto"
    """How chunks fan out: auto, star, chain or tree (topology.KINDS)."""
    fanout: int = 2
    """Children per node of a tree."""
    allow_partial: bool = False
    """Publish on the healthy nodes when some fail, and report the others; without it a
    failed node fails the push and no node switches."""
    timeout: float = STALL_TIMEOUT
    """Seconds a node may stall before it is failed."""
    cache_dir: str | os.PathLike[str] | None = None
    """Where the scan cache is kept, so unchanged files are not read again."""
    transport: str | bulk.LocalTransport = "auto"
    """auto, tcp or rdma, or a transport resolved already (bulk.resolve_local)."""
    encrypt: str = "auto"
    """The sessions' encryption policy (addresses.encrypts): auto, on or off."""
    at_source: bool | None = None
    """Also expose the workspace at the source folder's absolute path on every node (a link
    to MOUNT/NAME), so a venv's scripts, which name that path, run there. None: where the
    path allows it, else push without it and warn."""
    store_dir: str | os.PathLike[str] | None = None
    """The dev box store (controller_store.py): chunks are sent from it and kept in it."""
    store_bound: int = 0
    """The store's size bound in bytes (0 keeps only the snapshot just pushed)."""
    compress: str = "auto"
    """zstd on each link: auto, on or off (link_codec.py)."""
    early: bool = False
    """push --early: publish once every node holds the manifest and the chunks the first
    reads need; the rest streams after."""
    first_reads_dir: str | os.PathLike[str] | None = None
    """Where the dev box keeps the nodes' first reads (push --early; first_reads.py)."""
    bwlimit: float = 0
    """Bytes a second the dev box streams at most (0: no limit; stream.Pacer)."""
    helpers: int | None = None
    """Processes that share the sending of small files (send_helpers.py); None: one per core
    beyond the first, up to 3."""
    control: str = "auto"
    """How requests reach the nodes: auto, star or tree (topology.control)."""
    control_fanout: int = CONTROL_FANOUT
    """Children per node of a control tree."""
    freeze_scan: bool = False
    """The process ends with the push (the command line): what its scan made is frozen out
    of the collector's passes (collector.paused)."""

    def check(self) -> None:
        """ValueError for a value no push takes, before anything is scanned."""
        if self.compress not in link_codec.POLICIES:
            raise ValueError(f"unknown compression {self.compress!r}: use one of "
                             f"{link_codec.POLICIES}")
        if self.topology not in KINDS:
            raise ValueError(f"unknown topology {self.topology!r}: use one of {KINDS}")


def workspace_name(src: str | os.PathLike[str], name: str | None) -> str:
    """The workspace `src` is pushed as: `name`, else the folder's own name. ValueError, naming
    the folder and pointing at --name, when that cannot be a workspace name (check_workspace_name
    says why; a folder named in Latin-1 once took down every node it reached)."""
    if name:
        check_workspace_name(name)
        return name
    folder = os.path.abspath(src)
    try:
        check_workspace_name(os.path.basename(folder))
    except ValueError as e:
        shown = os.fsencode(folder).decode("utf-8", "backslashreplace")
        raise ValueError(f"the folder {shown} cannot name a workspace ({e}); pass --name NAME "
                         "to push it under another name") from None
    return os.path.basename(folder)


def source_args(src: str | os.PathLike[str]) -> dict[str, str]:
    """What prepare and commit carry for push --at-source: the folder's absolute path (as
    typed, links in it kept: a venv's scripts name the path it was made at, which is the path
    its user types) and its "DEV:INO". ValueError saying why a node could not expose it."""
    path = os.path.abspath(src)
    try:
        check_source_path(path)
    except ValueError as e:
        raise ValueError(f"{e}; push with --no-at-source, or from another folder") from None
    st = os.stat(path)
    return {"source": path, "source_id": f"{st.st_dev}:{st.st_ino}"}


