"""The inode table of the mounted snapshots: which inode number is which entry of which version,
how many times the kernel holds each, and the listings of their folders.

Kept apart from the pyfuse3 handlers (fs/fuse_ops.py) because it is the state they share, and
the one part a version switch changes: a handler reads it, a switch decides from it which kernel
entries to drop (fs/invalidation.py).

Inode numbers: a directory of the current view keeps its inode across versions (keyed by its
path), and a file or symlink is keyed by its path and content, so an unchanged file keeps its
inode and page cache across versions, while a changed file gets a new inode (a reader holding the
old one open keeps reading the old content).
"""

from __future__ import annotations

import errno
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import pyfuse3
import xxhash

from .layered import Layered
from .manifest import Entry, Kind, Manifest

VERSIONS = b".versions"
LISTING_CACHE_ENTRIES = 10_000
# Enum members as plain names: `Kind.DIR` is a descriptor lookup, and listings test it per entry.
DIR, FILE, SYMLINK = Kind.DIR, Kind.FILE, Kind.SYMLINK


class Tree:
    """A snapshot indexed for lookups: entries by path and sorted child names by directory.

    Given the tree of the version `manifest` was loaded knowing (Manifest.base), it is that
    index with the folders the load read listed again: the cost of the change, not of the
    tree (its dicts are fs/layered.py's: that index shared, with the changes on top). It also
    keeps what differs from that version (`changed`, for `changes`)."""

    def __init__(self, version: bytes, manifest: Manifest, prev: Tree | None = None):
        self.version = version
        self.manifest = manifest
        self.prev_version: bytes | None = None
        self.changed: list[tuple[Entry | None, Entry | None]] = []
        base = manifest.base() if manifest.base is not None else None
        if prev is not None and base is not None and base is prev.manifest:
            self._update(prev)
            return
        entries: dict[bytes, Entry] = {}
        children: dict[bytes, Sequence[Entry]] = {}  # in name order (the Folders' own)
        self.total_bytes = manifest.total_bytes  # for statfs, which `find` and `df` call
        for f in manifest.folders():
            entries[f.entry.path] = f.entry
            children[f.entry.path] = f.kids
            for e in f.kids:
                entries[e.path] = e
        self.entries, self.children = Layered(entries), Layered(children)

    def _update(self, prev: Tree) -> None:
        """`prev`'s index, with each folder the load read listed again (see the class)."""
        entries, children = prev.entries.derive(), prev.children.derive()
        changed = self.changed
        total = prev.total_bytes

        def size(e: Entry) -> int:
            return e.size if e.kind == FILE else 0

        def drop(gone: Entry) -> None:  # a path gone, and everything below it
            # (a loop: a closure that called itself would be a reference cycle, and hold
            # these dicts of the whole tree until a collection, 50 ms at 100k files)
            nonlocal total
            stack = [gone]
            while stack:
                e = stack.pop()
                entries.pop(e.path, None)
                changed.append((e, None))
                total -= size(e)
                if e.kind == DIR:
                    stack.extend(reversed(children.pop(e.path, ())))

        m = self.manifest
        for f in m.read_folders:
            folder = f.entry
            was = entries.get(folder.path)
            if was is not None and was.kind != DIR:  # a file or link became a folder
                drop(was)
                was = None
            if was is not folder and (was is None or not was.same_content(folder)):
                changed.append((was, folder))
            entries[folder.path] = folder
            old = {e.name: e for e in children.get(folder.path, ())} if was is not None else {}
            kids = f.kids
            for e in kids:
                before = old.pop(e.name, None)
                if before is e or e.kind == DIR:
                    continue  # the same, or a folder: one that is new or changed was read
                if before is not None and before.kind == DIR:
                    drop(before)  # a folder became a file or link
                    before = None
                if before is not None:
                    total -= size(before)
                entries[e.path] = e
                total += size(e)
                if before is None or not before.same_content(e):
                    changed.append((before, e))
            for gone in old.values():
                drop(gone)
            children[folder.path] = kids
        self.entries, self.children, self.total_bytes = entries, children, total
        self.prev_version = prev.version

    @property
    def hex(self) -> str:
        return self.version.hex()


@dataclass(eq=False, slots=True)
class Node:
    """What one inode is. `view` is None for the current view of `ws`, else a version id."""

    key: bytes  # what it is (a digest, see dir_key and obj_key): equal keys, same inode
    entry: Entry
    ws: bytes = b""  # b"" only for the root and .versions, which belong to no workspace
    view: bytes | None = None
    special: str | None = None  # "root", "versions" or "wsv" for the synthetic directories
    lookups: int = 0  # how many times the kernel was handed this inode and has not forgotten
    chunk_size: int = 0  # files: how the content is cut (from its snapshot's manifest)
    opens: int = 0  # open files on this inode (when opens are not no-open)
    backing_id: int = 0  # while open through passthrough: the kernel's id of its backing file


def changes(before: Tree, after: Tree) -> list[tuple[Entry | None, Entry | None]]:
    """(old, new) for every path whose entry differs between two snapshots."""
    if before.version == after.version:
        return []
    if after.prev_version == before.version:  # found while indexing it (Tree._update)
        return after.changed
    a, b = before.entries, after.entries
    # An entry a version shares with the one decoded before it is the same object
    # (Manifest.load's `known`): most of a tree after an edit.
    return [(a.get(path), b.get(path)) for path in a.keys() | b.keys()
            if path not in a or path not in b
            or (a[path] is not b[path] and not a[path].same_content(b[path]))]


def _home(key: bytes) -> int:
    """The inode number a node with `key` gets, unless another live node holds it."""
    return max(2, xxhash.xxh3_64_intdigest(key) >> 1)


def _child(path: bytes, name: bytes) -> bytes:
    return path + b"/" + name if path else name


# Inode keys are the xxh3_128 digest of what an entry is, built without a repr (listing a large
# directory computes one per entry) and 16 bytes whatever the path (the daemon holds one per
# inode the kernel knows: 100k of them after a `find`).
_OBJ = struct.Struct("<BIQqII")  # kind, mode, size, mtime_ns, chunk size, path length


def dir_key(ws: bytes, view: bytes | None, path: bytes) -> bytes:
    """A directory keeps its inode across versions of the current view (keyed by path)."""
    return xxhash.xxh3_128_digest(b"".join((b"D", ws, b"\0", view or b"", b"\0", path)))


def obj_key(ws: bytes, e: Entry, chunk_size: int) -> bytes:
    """A file or symlink is keyed by everything a reader sees of it."""
    head = _OBJ.pack(e.kind, e.mode, e.size, e.mtime_ns, chunk_size, len(e.path))
    return xxhash.xxh3_128_digest(b"".join((b"O", ws, b"\0", head, e.path, e.target,
                                            *e.chunks)))


def wsv_key(ws: bytes) -> bytes:
    """The key of MOUNT/.versions/NAME."""
    return b"wsv\0" + ws


class InodeTable:
    """The served workspaces and the inodes the kernel was handed for them."""

    def __init__(self) -> None:
        # name -> [current, older...]. Names are bytes, as every name the kernel hands over or
        # is handed: no FUSE request ever encodes or decodes one (which could fail).
        self.workspaces: dict[bytes, list[Tree]] = {}
        self.mtime_ns = 0  # of the synthetic folders: the newest workspace root's
        self.nodes: dict[int, Node] = {}
        # A node's inode number is its key's hash (_home); the few that are not (the root, and a
        # node whose home number was taken: 63-bit hashes, so all but never) are listed here.
        # No map of every key to its number: serving 100k files, that took 5 MB (151 -> 146 MB).
        self._moved: dict[bytes, int] = {}
        self._listings: OrderedDict[tuple[bytes, bytes | None, bytes, bytes],
                                    list[tuple[bytes, Node]]] = OrderedDict()
        self._listed = 0  # entries held in self._listings
        root = Node(b"root", self.synthetic(), special="root")
        self.nodes[pyfuse3.ROOT_INODE] = root
        self._moved[root.key] = pyfuse3.ROOT_INODE

    def synthetic(self) -> Entry:
        return Entry(b"", DIR, 0o755, 0, self.mtime_ns)

    def ino(self, node: Node) -> tuple[int, Node]:
        """(inode number, live node): the live node is the one already in the table under
        `node`'s key, else `node` itself, now added. A node's inode number is a hash of what it
        is, so an unchanged file keeps its number across versions, after the kernel forgot it,
        and across daemon restarts."""
        ino = self._find(node.key)
        if ino is not None:
            return ino, self.nodes[ino]
        home = ino = _home(node.key)
        while ino in self.nodes:  # another live node hashed here: probe on
            ino = ino + 1 if ino + 1 < 1 << 63 else 2
        if ino != home:
            self._moved[node.key] = ino
        self.nodes[ino] = node
        return ino, node

    def _find(self, key: bytes) -> int | None:
        """The inode number of the live node with `key`, if any."""
        ino = _home(key)
        node = self.nodes.get(ino)
        if node is not None and node.key == key:
            return ino
        return self._moved.get(key)

    def node(self, ino: int) -> Node:
        """The node of an inode the kernel holds; ENOENT for any other."""
        try:
            return self.nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def known_ino(self, key: bytes) -> int | None:
        """The inode for key, if the kernel knows it (else it has nothing cached to drop)."""
        ino = self._find(key)
        return ino if ino is not None and self.nodes[ino].lookups else None

    def forget(self, inode_list: list[tuple[int, int]]) -> bool:
        """Count down the kernel's lookups; drop the inodes it no longer holds. True if one of
        them was a file that no served version has any more (its chunks are no longer held)."""
        orphans = False
        for ino, n in inode_list:
            node = self.nodes.get(ino)
            if node is None:
                continue
            node.lookups = max(0, node.lookups - n)
            if node.lookups or ino == pyfuse3.ROOT_INODE:
                continue
            del self.nodes[ino]
            if self._moved.get(node.key) == ino:
                del self._moved[node.key]
            orphans = orphans or bool(node.entry.chunks) and self.tree(node) is None
        return orphans

    def held_chunks(self) -> list[bytes]:
        """The chunks of every file the kernel still holds: a job may have one of a version
        no longer retained open, and keeps reading it through here. (A list: references to
        ids the entries already hold, not a set's table.)"""
        return [c for node in self.nodes.values() for c in node.entry.chunks]

    def tree(self, node: Node) -> Tree | None:
        """The snapshot `node` belongs to, if it is still served."""
        trees = self.workspaces.get(node.ws)
        if not trees:
            return None
        if node.view is None:
            return trees[0]
        return next((t for t in trees if t.version == node.view), None)

    @staticmethod
    def entry_node(ws: bytes, view: bytes | None, entry: Entry, chunk_size: int) -> Node:
        if entry.kind == DIR:
            return Node(dir_key(ws, view, entry.path), entry, ws, view)
        return Node(obj_key(ws, entry, chunk_size), entry, ws, view, chunk_size=chunk_size)

    def _children(self, node: Node) -> list[tuple[bytes, Node]]:
        """The entries of a directory node, in a stable order."""
        if node.special == "root":
            out = [(VERSIONS, Node(b"versions", self.synthetic(), special="versions"))]
            for ws in sorted(self.workspaces):
                current = self.workspaces[ws][0]
                out.append((ws, self.entry_node(ws, None, current.entries[b""], 0)))
            return out
        if node.special == "versions":
            return [(ws, Node(wsv_key(ws), self.synthetic(), ws=ws, special="wsv"))
                    for ws in sorted(self.workspaces)]
        if node.special == "wsv":
            return [(t.hex.encode(), self.entry_node(node.ws, t.version, t.entries[b""], 0))
                    for t in self.workspaces.get(node.ws, [])]
        tree = self.tree(node)
        if tree is None or node.entry.path not in tree.children:
            return []
        ws, view, size = node.ws, node.view, tree.manifest.chunk_size
        return [(e.name, self.entry_node(ws, view, e, size))
                for e in tree.children[node.entry.path]]

    def lookup_child(self, node: Node, name: bytes) -> Node | None:
        if node.special is not None:
            return next((n for nm, n in self._children(node) if nm == name), None)
        tree = self.tree(node)
        if tree is None:
            return None
        e = tree.entries.get(_child(node.entry.path, name))
        if e is None:
            return None
        return self.entry_node(node.ws, node.view, e, tree.manifest.chunk_size)

    def listing(self, node: Node) -> list[tuple[bytes, Node]]:
        """A directory's entries. Snapshot directories never change, and every `ls`, `find`
        or Python import lists them again, so listings are kept (LRU, bounded in entries)."""
        tree = self.tree(node) if node.special is None else None
        if tree is None:
            return self._children(node)
        key = (node.ws, node.view, tree.version, node.entry.path)
        listing = self._listings.get(key)
        if listing is None:
            listing = self._listings[key] = self._children(node)
            self._listed += len(listing)
            while self._listed > LISTING_CACHE_ENTRIES and len(self._listings) > 1:
                self._listed -= len(self._listings.popitem(last=False)[1])
        else:
            self._listings.move_to_end(key)
        return listing

    def drop_listings(self, ws: bytes) -> None:
        """Forget the kept listings of a workspace that is no longer served."""
        for key in [k for k in self._listings if k[0] == ws]:
            self._listed -= len(self._listings.pop(key))

    def parent_ino(self, node: Node, ino: int) -> int:
        """The inode of a directory's parent, for its ".." entry (its own, `ino`, if the parent
        is not in the table: the kernel holds a directory's parent while it holds the
        directory, so that is only the root)."""
        if node.special in ("root", "versions") or (node.view is None and not node.entry.path):
            return pyfuse3.ROOT_INODE  # the mount root, and the current view of a workspace
        if node.special == "wsv":
            key = b"versions"
        elif not node.entry.path:  # MOUNT/.versions/NAME/VERSION
            key = wsv_key(node.ws)
        else:
            key = dir_key(node.ws, node.view, node.entry.parent)
        found = self._find(key)
        return ino if found is None else found
