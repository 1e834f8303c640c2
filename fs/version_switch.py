"""Switching a workspace to a new version, and dropping exactly the kernel entries that changed.

Snapshots never change, so the kernel caches entries, attributes, listings and pages for a long
time; correctness after a push rests on this module: every name and folder a switch changes is
invalidated before the switch returns, so nobody reads stale content after a push has succeeded.
Kept apart from the handlers because it is the one writer of the inode table (fs/inodes.py) and
the only caller of the kernel's invalidation API.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import pyfuse3
import trio

from .inodes import DIR, InodeTable, Tree, changes, dir_key, wsv_key
from .manifest import Entry, Manifest

log = logging.getLogger(__name__)

Invalidations = tuple[list[tuple[int, bytes]], list[int]]  # (parent, name) entries; inodes


@dataclass(slots=True)
class Staged:
    """A workspace switch prepared by `stage`, applied by `serve`."""

    name: bytes
    old: list[Tree]  # what was served when it was staged
    trees: list[Tree]
    changed: list[tuple[Entry | None, Entry | None]]


async def stage(table: InodeTable, name: bytes, versions: list[tuple[bytes, Manifest]]
                ) -> Staged:
    """Index `versions` (current first) for workspace `name` and find what changed, in worker
    threads: all the work of a switch that can fail. Nothing is served from it until `serve`."""
    old = table.workspaces.get(name, [])
    known = {t.version: t for t in old}
    trees = []
    for v, m in versions:
        tree = known.get(v)
        trees.append(tree if tree is not None else await trio.to_thread.run_sync(
            Tree, v, m, old[0] if old else None))
    changed = await trio.to_thread.run_sync(changes, old[0], trees[0]) if old else []
    return Staged(name, old, trees, changed)


def serve(table: InodeTable, staged: Staged) -> None:
    """Serve what `stage` prepared: plain assignments, so it cannot fail half-way."""
    table.workspaces[staged.name] = staged.trees  # callers serialize stage..serve (publish lock)
    table.mtime_ns = max(table.mtime_ns, staged.trees[0].entries[b""].mtime_ns)


def switched(table: InodeTable, staged: Staged) -> Invalidations:
    """The kernel entries and inodes that changed with a `serve` of `staged` (a folder the
    kernel holds takes its new attributes here)."""
    name, old, trees = staged.name, staged.old, staged.trees
    entries: list[tuple[int, bytes]] = []
    # Directories whose listing or attributes changed: the kernel drops both (it caches
    # listings itself under no-open).
    dirs: set[int] = {pyfuse3.ROOT_INODE}

    # Names that appear or go away: a new workspace (the kernel may hold a negative entry
    # for it), and retained versions added or dropped.
    if not old:
        naming, naming_dirs = _naming(table, name)
        entries += naming
        dirs |= naming_dirs
    wsv = table.known_ino(wsv_key(name))
    if wsv is not None:
        dirs.add(wsv)
        before, after = {t.version for t in old}, {t.version for t in trees}
        entries += [(wsv, v.hex().encode()) for v in before ^ after]

    # The current view: names whose entry changed (and so their parent's listing), and
    # directories whose attributes did (a directory keeps its inode across versions).
    for a, b in staged.changed:
        if a is not None and b is not None and a.kind == b.kind == DIR:
            dir_ino = table.known_ino(dir_key(name, None, b.path))
            if dir_ino is not None:
                table.nodes[dir_ino].entry = b
                dirs.add(dir_ino)
            continue
        e = a or b
        if e is not None and e.path:
            parent = table.known_ino(dir_key(name, None, e.parent))
            if parent is not None:
                entries.append((parent, e.name))
                dirs.add(parent)
    return entries, sorted(dirs)


def remove(table: InodeTable, name: bytes) -> Invalidations | None:
    """Stop serving workspace `name`; None if it was not served, else the kernel entries that
    named it (dropping them drops the names below too)."""
    if table.workspaces.pop(name, None) is None:
        return None
    table.drop_listings(name)
    entries, dirs = _naming(table, name)
    wsv = table.known_ino(wsv_key(name))
    if wsv is not None:
        dirs.add(wsv)
    return entries, sorted(dirs)


def _naming(table: InodeTable, name: bytes) -> tuple[list[tuple[int, bytes]], set[int]]:
    """The kernel entries that name workspace `name` (MOUNT/NAME, .versions/NAME) and the
    folders listing them: what a workspace that appears or goes away invalidates."""
    entries, dirs = [(pyfuse3.ROOT_INODE, name)], {pyfuse3.ROOT_INODE}
    versions_dir = table.known_ino(b"versions")
    if versions_dir is not None:
        entries.append((versions_dir, name))
        dirs.add(versions_dir)
    return entries, dirs


async def invalidate(dropped: Invalidations) -> None:
    """Drop the kernel's entries and cached inodes, in a worker thread: the synchronous calls
    return once the kernel has dropped them, while the trio thread keeps answering the requests
    they may wait for. A failure is logged (it would only keep a stale cache entry)."""
    await trio.to_thread.run_sync(_invalidate, *dropped)


def _invalidate(entries: list[tuple[int, bytes]], dirs: list[int]) -> None:
    for parent, name in entries:
        try:
            pyfuse3.invalidate_entry(parent, name)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("invalidating entry %r: %s", name, e)
    for ino in dirs:
        try:
            pyfuse3.invalidate_inode(ino)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("invalidating inode %d: %s", ino, e)
