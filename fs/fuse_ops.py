"""The read-only FUSE filesystem over published snapshots.

Layout of the mount:

    MOUNT/NAME/...                    the current version of workspace NAME
    MOUNT/.versions/NAME/VERSION/...  every retained version, immutable

Snapshots never change, so entries and attributes are cached by the kernel for a long time and
file pages are kept across opens (`keep_cache`). When a workspace switches version, exactly the
kernel entries that changed are invalidated before `set_workspace` returns, so nobody reads stale
content after a push has succeeded.

A handle is the inode number. With the patched pyfuse3 the Makefile builds (`fs/pyfuse3.patch`,
against the system's libfuse 3), files are served one of two ways, decided once FUSE INIT is
answered (check_passthrough):

- passthrough (root, Linux 6.9+, and a backing id from the kernel): a file of
  backing.MIN_SIZE or more is bound at open to its backing file on local disk (fs/backing.py),
  and the kernel reads and maps it directly, at local-disk speed and in large folios. Every
  open is then a round trip (the kernel has no passthrough without open), so smaller files
  are opened with `keep_cache` and read through here.
- no-open (otherwise): `open` answers ENOSYS, so the kernel stops sending open and release at
  all and keeps file pages in its own cache; reads come with handle 0, which the patch turns
  into the inode.

Either way `opendir` answers ENOSYS (no-opendir): the kernel keeps directory listings itself, and
warm `find` costs no round trip. With a stock pyfuse3 every open is a round trip.

Inode numbers: a directory of the current view keeps its inode across versions (keyed by its
path), and a file or symlink is keyed by its path and content, so an unchanged file keeps its
inode and page cache across versions, while a changed file gets a new inode (a reader holding the
old one open keeps reading the old content).
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import stat
import struct
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio
import xxhash

from ..settings import settings
from . import passthrough
from .backing import BackingFiles
from .backing import wanted as backing_wanted
from .chunk_cache import ChunkCache
from .manifest import Entry, Kind, Manifest

log = logging.getLogger(__name__)

VERSIONS = b".versions"
PREFETCH_CHUNKS = 2
CHUNK_CACHE_BYTES = 128 << 20  # decoded chunks kept for the read path
LISTING_CACHE_ENTRIES = 10_000
# No-open needs the patched pyfuse3 (this), and a kernel that supports it (checked at INIT, see
# init()); settings.no_open (MONARCH_FS_NO_OPEN=0) keeps the open round trips, to compare or debug.
NO_OPEN_BUILT = bool(getattr(pyfuse3, "FH_ZERO_IS_INODE", False))
TIMEOUT = 24 * 3600.0  # entries are invalidated explicitly; the timeout is only a backstop
# Enum members as plain names: `Kind.DIR` is a descriptor lookup, and listings test it per entry.
DIR, FILE, SYMLINK = Kind.DIR, Kind.FILE, Kind.SYMLINK
_TYPE = {DIR: stat.S_IFDIR, FILE: stat.S_IFREG, SYMLINK: stat.S_IFLNK}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT


@dataclass(slots=True)
class Staged:
    """A workspace switch prepared by SnapshotFS.stage, applied by SnapshotFS.switch."""

    name: bytes
    old: list[Tree]  # what was served when it was staged
    trees: list[Tree]
    changed: list[tuple[Entry | None, Entry | None]]


class Tree:
    """A snapshot indexed for lookups: entries by path and sorted child names by directory."""

    def __init__(self, version: bytes, manifest: Manifest):
        self.version = version
        self.manifest = manifest
        self.entries: dict[bytes, Entry] = {}
        self.children: dict[bytes, list[Entry]] = {}  # in name order
        self.total_bytes = manifest.total_bytes  # for statfs, which `find` and `df` call
        for e in manifest.entries:  # sorted: parents first, names in order within a directory
            self.entries[e.path] = e
            if e.kind == DIR:
                self.children[e.path] = []
            if e.path:
                self.children[e.parent].append(e)

    @property
    def hex(self) -> str:
        return self.version.hex()


@dataclass(eq=False, slots=True)
class Node:
    """What one inode is. `view` is None for the current view of `ws`, else a version id."""

    key: bytes  # what it is (a digest, see _dir_key and _obj_key): equal keys, same inode
    entry: Entry
    ws: bytes | None = None
    view: bytes | None = None
    special: str | None = None  # "root", "versions" or "wsv" for the synthetic directories
    lookups: int = 0  # how many times the kernel was handed this inode and has not forgotten
    chunk_size: int = 0  # files: how the content is cut (from its snapshot's manifest)
    opens: int = 0  # open files on this inode (when opens are not no-open)
    backing_id: int = 0  # while open through passthrough: the kernel's id of its backing file


def _changes(before: Tree, after: Tree) -> list[tuple[Entry | None, Entry | None]]:
    """(old, new) for every path whose entry differs between two snapshots."""
    if before.version == after.version:
        return []
    a, b = before.entries, after.entries
    return [(a.get(path), b.get(path)) for path in a.keys() | b.keys()
            if path not in a or path not in b or not a[path].same_content(b[path])]


def _child(path: bytes, name: bytes) -> bytes:
    return path + b"/" + name if path else name


# Inode keys are the xxh3_128 digest of what an entry is, built without a repr (listing a large
# directory computes one per entry) and 16 bytes whatever the path (the daemon holds one per
# inode the kernel knows: 100k of them after a `find`).
_OBJ = struct.Struct("<BIQqII")  # kind, mode, size, mtime_ns, chunk size, path length


def _dir_key(ws: bytes, view: bytes | None, path: bytes) -> bytes:
    """A directory keeps its inode across versions of the current view (keyed by path)."""
    return xxhash.xxh3_128_digest(b"".join((b"D", ws, b"\0", view or b"", b"\0", path)))


def _obj_key(ws: bytes, e: Entry, chunk_size: int) -> bytes:
    """A file or symlink is keyed by everything a reader sees of it."""
    head = _OBJ.pack(e.kind, e.mode, e.size, e.mtime_ns, chunk_size, len(e.path))
    return xxhash.xxh3_128_digest(b"".join((b"O", ws, b"\0", head, e.path, e.target,
                                            *e.chunks)))


# The request handlers pyfuse3 may call: the coroutines of its Operations class.
_HANDLERS = frozenset(name for name, fn in vars(pyfuse3.Operations).items()
                      if inspect.iscoroutinefunction(fn))


def _guarded(op: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`fn`, answering EIO instead of raising anything but FUSEError.

    pyfuse3 lets any other exception out of a handler end `pyfuse3.main()`, and with it the
    daemon and every workspace it serves. One line is logged per failure, with the operation
    and the inode (the traceback only at debug level): a bad entry that every `ls` trips over
    must not flood the log. A forget gets no reply, so there is nothing to answer: its error is
    only logged. It costs one coroutine frame per request: 0.26 us on a 2.0 us `read` handler
    called in-process, lost in the 45-65 us of a FUSE round trip (O_DIRECT 4 KiB reads through
    a mount: fastest of 9 runs 45.6 us guarded, 45.5 us not; medians within the noise)."""
    no_reply = op == "forget"

    @functools.wraps(fn)
    async def handler(self: SnapshotFS, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            if no_reply:
                return None
            raise
        except Exception as e:
            self.ops["failed"] += 1
            ino = args[0] if args and isinstance(args[0], int) else "-"
            log.error("FUSE %s on inode %s failed (answered EIO): %s: %s", op, ino,
                      type(e).__name__, e)
            log.debug("FUSE %s on inode %s", op, ino, exc_info=True)
            if no_reply:
                return None
            raise pyfuse3.FUSEError(errno.EIO) from None

    return handler


def _guard_handlers(cls: type[pyfuse3.Operations]) -> type[pyfuse3.Operations]:
    """Wrap every request handler `cls` defines with _guarded: the one place where no FUSE
    request can take the daemon down."""
    for name in sorted(_HANDLERS & vars(cls).keys()):
        setattr(cls, name, _guarded(name, vars(cls)[name]))
    return cls


@_guard_handlers
class SnapshotFS(pyfuse3.Operations):
    """The read-only filesystem over published snapshots: the handlers pyfuse3 calls, the
    inode table, and the switch of a workspace to a new version with exact invalidation."""

    def __init__(self, load_chunk: Callable[[bytes], bytes | memoryview],
                 backing: BackingFiles | None = None,
                 load_cached: Callable[[bytes], bytes | memoryview | None] | None = None):
        super().__init__()
        self.backing = backing
        self.chunks = ChunkCache(load_chunk, CHUNK_CACHE_BYTES, load_cached)
        # name -> [current, older...]. Names are bytes, as every name the kernel hands over or
        # is handed: no FUSE request ever encodes or decodes one (which could fail).
        self.workspaces: dict[bytes, list[Tree]] = {}
        self.mtime_ns = 0
        self._nodes: dict[int, Node] = {}
        self._inos: dict[bytes, int] = {}
        self.nursery: trio.Nursery | None = None  # for prefetches, set while serving
        self.ops: Counter[str] = Counter()  # requests served, by operation (user.monarch.ops)
        self._listings: OrderedDict[tuple, list[tuple[bytes, Node]]] = OrderedDict()
        self._listed = 0  # entries held in self._listings
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.mounted = False
        # Called when the kernel forgets a file that no served version has any more (removed
        # or dropped while a reader held it): held_chunks() no longer counts its chunks.
        self.on_orphan_forgotten: Callable[[], None] | None = None
        self.no_open = False  # files: decided at FUSE INIT
        self.no_opendir = False
        self.passthrough = False
        self.passthrough_opens = 0  # opens bound to a backing file (user.monarch.passthrough_opens)
        self._binding: dict[int, trio.Event] = {}  # inodes whose backing file is being opened
        self.open_mode = "not mounted"  # what `monarch-fs status` shows: no-open, or why not
        self._checked = trio.Event()  # check_passthrough() has decided
        root = Node(b"root", self._synthetic(), special="root")
        self._nodes[pyfuse3.ROOT_INODE] = root
        self._inos[root.key] = pyfuse3.ROOT_INODE

    # ---- the inode table ------------------------------------------------------------------

    def _synthetic(self) -> Entry:
        return Entry(b"", DIR, 0o755, 0, self.mtime_ns)

    def _ino(self, node: Node) -> tuple[int, Node]:
        """(inode number, live node): the live node is the one already in the table under
        `node`'s key, else `node` itself, now added. A node's inode number is a hash of what it
        is, so an unchanged file keeps its number across versions, after the kernel forgot it,
        and across daemon restarts."""
        ino = self._inos.get(node.key)
        if ino is not None:
            return ino, self._nodes[ino]
        ino = max(2, xxhash.xxh3_64_intdigest(node.key) >> 1)
        while ino in self._nodes:  # another live node hashed here: probe on
            ino = ino + 1 if ino + 1 < 1 << 63 else 2
        self._inos[node.key] = ino
        self._nodes[ino] = node
        return ino, node

    def _remember(self, node: Node) -> pyfuse3.EntryAttributes:
        """Hand an inode to the kernel (lookup or readdirplus): it now counts one more lookup."""
        ino, live = self._ino(node)
        live.lookups += 1
        return self._attr(ino, live)

    def _entry_node(self, ws: bytes, view: bytes | None, entry: Entry, chunk_size: int) -> Node:
        if entry.kind == DIR:
            return Node(_dir_key(ws, view, entry.path), entry, ws, view)
        return Node(_obj_key(ws, entry, chunk_size), entry, ws, view, chunk_size=chunk_size)

    def _tree(self, node: Node) -> Tree | None:
        trees = self.workspaces.get(node.ws or b"")
        if not trees:
            return None
        if node.view is None:
            return trees[0]
        return next((t for t in trees if t.version == node.view), None)

    def _attr(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        return self._set_attr(self._blank_attr(), ino, node)

    def _blank_attr(self) -> pyfuse3.EntryAttributes:
        """Attributes with the fields every entry shares already set."""
        a = pyfuse3.EntryAttributes()
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_blksize = 128 * 1024
        return a

    @staticmethod
    def _set_attr(a: pyfuse3.EntryAttributes, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        """The fields that are the entry's own."""
        e = node.entry
        a.st_ino = ino
        a.st_mode = _TYPE[e.kind] | e.mode
        a.st_nlink = 2 if e.kind is DIR else 1
        a.st_size = e.size
        a.st_blocks = (e.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = e.mtime_ns
        return a

    def held_chunks(self) -> list[bytes]:
        """The chunks of every file the kernel still holds: a job may have one of a version
        no longer retained open, and keeps reading it through here. (A list: references to
        ids the entries already hold, not a set's table.)"""
        return [c for node in self._nodes.values() for c in node.entry.chunks]

    def _node(self, ino: int) -> Node:
        try:
            return self._nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _children(self, node: Node) -> list[tuple[bytes, Node]]:
        """The entries of a directory node, in a stable order."""
        if node.special == "root":
            names = sorted(self.workspaces)
            out = [(VERSIONS, Node(b"versions", self._synthetic(), special="versions"))]
            for ws in names:
                tree = self.workspaces[ws][0]
                out.append((ws, self._entry_node(ws, None, tree.entries[b""], 0)))
            return out
        if node.special == "versions":
            return [(ws, Node(b"wsv\0" + ws, self._synthetic(), ws=ws, special="wsv"))
                    for ws in sorted(self.workspaces)]
        if node.special == "wsv":
            return [(t.hex.encode(), self._entry_node(node.ws, t.version, t.entries[b""], 0))
                    for t in self.workspaces.get(node.ws, [])]
        tree = self._tree(node)
        if tree is None or node.entry.path not in tree.children:
            return []
        ws, view, size = node.ws, node.view, tree.manifest.chunk_size
        return [(e.name, self._entry_node(ws, view, e, size))
                for e in tree.children[node.entry.path]]

    def _lookup_child(self, node: Node, name: bytes) -> Node | None:
        if node.special is not None:
            return next((n for nm, n in self._children(node) if nm == name), None)
        tree = self._tree(node)
        if tree is None:
            return None
        e = tree.entries.get(_child(node.entry.path, name))
        if e is None:
            return None
        return self._entry_node(node.ws, node.view, e, tree.manifest.chunk_size)

    # ---- publishing -----------------------------------------------------------------------

    async def stage(self, name: bytes, versions: list[tuple[bytes, Manifest]]) -> Staged:
        """Index `versions` (current first) for workspace `name` and find what changed: all
        the work of a switch that can fail, done before the switch is decided (a commit saves
        its refs in between). Nothing is served from it until `switch`."""
        old = self.workspaces.get(name, [])
        known = {t.version: t for t in old}
        trees = [known.get(v) or await trio.to_thread.run_sync(Tree, v, m) for v, m in versions]
        changed = await trio.to_thread.run_sync(_changes, old[0], trees[0]) if old else []
        return Staged(name, old, trees, changed)

    async def set_workspace(self, name: bytes, versions: list[tuple[bytes, Manifest]]) -> None:
        """Serve `versions` (current first) for workspace `name`, invalidating what changed."""
        await self.switch(await self.stage(name, versions))

    async def switch(self, staged: Staged) -> None:
        """Serve what `stage` prepared, then drop the kernel entries that changed. The switch
        itself is plain assignments, so it cannot fail half-way; a failed invalidation is logged
        (it would only keep a stale cache entry)."""
        name, old, trees, changed = staged.name, staged.old, staged.trees, staged.changed
        self.workspaces[name] = trees  # callers serialize stage..switch (the publish lock)
        self.mtime_ns = max(self.mtime_ns, trees[0].entries[b""].mtime_ns)
        if not self.mounted:
            return
        inval_entries: list[tuple[int, bytes]] = []
        # Directories whose listing or attributes changed: the kernel drops both (it caches
        # listings itself under no-open).
        inval_dirs: set[int] = {pyfuse3.ROOT_INODE}

        # Names that appear or go away: a new workspace (the kernel may hold a negative entry
        # for it), and retained versions added or dropped.
        if not old:
            entries, dirs = self._naming(name)
            inval_entries += entries
            inval_dirs |= dirs
        wsv = self._known_ino(b"wsv\0" + name)
        if wsv is not None:
            inval_dirs.add(wsv)
            before, after = {t.version for t in old}, {t.version for t in trees}
            inval_entries += [(wsv, v.hex().encode()) for v in before ^ after]

        # The current view: names whose entry changed (and so their parent's listing), and
        # directories whose attributes did (a directory keeps its inode across versions).
        for a, b in changed:
            if a is not None and b is not None and a.kind == b.kind == DIR:
                dir_ino = self._known_ino(_dir_key(name, None, b.path))
                if dir_ino is not None:
                    self._nodes[dir_ino].entry = b
                    inval_dirs.add(dir_ino)
            elif (a or b).path:
                parent = self._known_ino(_dir_key(name, None, (a or b).parent))
                if parent is not None:
                    inval_entries.append((parent, (a or b).name))
                    inval_dirs.add(parent)
        await trio.to_thread.run_sync(self._invalidate, inval_entries, sorted(inval_dirs))

    def _naming(self, name: bytes) -> tuple[list[tuple[int, bytes]], set[int]]:
        """The kernel entries that name workspace `name` (MOUNT/NAME, .versions/NAME) and the
        folders listing them: what a workspace that appears or goes away invalidates."""
        entries, dirs = [(pyfuse3.ROOT_INODE, name)], {pyfuse3.ROOT_INODE}
        versions_dir = self._known_ino(b"versions")
        if versions_dir is not None:
            entries.append((versions_dir, name))
            dirs.add(versions_dir)
        return entries, dirs

    def _known_ino(self, key: bytes) -> int | None:
        """The inode for key, if the kernel knows it (else it has nothing cached to drop)."""
        ino = self._inos.get(key)
        return ino if ino is not None and self._nodes[ino].lookups else None

    async def remove_workspace(self, name: bytes) -> None:
        """Stop serving workspace `name`: MOUNT/NAME and .versions/NAME leave the mount at
        once (the kernel drops its entries for them, and with them the names below). A file a
        reader holds open keeps its node, and reads, until the kernel forgets it."""
        if self.workspaces.pop(name, None) is None:
            return
        for key in [k for k in self._listings if k[0] == name]:
            self._listed -= len(self._listings.pop(key))
        if not self.mounted:
            return
        entries, dirs = self._naming(name)
        wsv = self._known_ino(b"wsv\0" + name)
        if wsv is not None:
            dirs.add(wsv)
        await trio.to_thread.run_sync(self._invalidate, entries, sorted(dirs))

    @staticmethod
    def _invalidate(entries: list[tuple[int, bytes]], dirs: list[int]) -> None:
        # Runs in a worker thread: the synchronous calls return once the kernel has dropped the
        # entries, while the trio thread keeps answering the requests they may wait for.
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

    # ---- FUSE operations ------------------------------------------------------------------

    def passthrough_unavailable(self) -> str | None:
        """Why passthrough will not be asked for at INIT, or None if it will be."""
        if self.backing is None:
            return "no backing files"
        if not passthrough.built_in():
            return "pyfuse3 without fs/pyfuse3.patch"
        if not settings.passthrough:
            return "MONARCH_FS_PASSTHROUGH=0"
        if os.geteuid() != 0:
            return "passthrough needs root"
        return None

    def init(self) -> None:
        """FUSE INIT: answer open/opendir with ENOSYS only where the kernel understands it
        (Linux 5.1+); an older kernel would fail every `ls` with ENOSYS. Passthrough is asked
        for here, and confirmed by check_passthrough() once INIT is answered."""
        self.passthrough = passthrough.asked()
        self.no_opendir = (NO_OPEN_BUILT and settings.no_open
                           and getattr(pyfuse3, "NO_OPEN_SUPPORTED", False))
        self._set_open_mode(self.passthrough_unavailable() or passthrough.negotiated()[1])

    def _set_open_mode(self, why_not: str) -> None:
        self.no_open = self.no_opendir and not self.passthrough
        if self.passthrough:
            self.open_mode = "passthrough"
        elif self.no_open:
            self.open_mode = f"no-open (no passthrough: {why_not})"
        elif not NO_OPEN_BUILT:
            self.open_mode = "open per file (pyfuse3 without fs/pyfuse3.patch)"
        elif not settings.no_open:
            self.open_mode = "open per file (MONARCH_FS_NO_OPEN=0)"
        else:
            self.open_mode = "open per file (the kernel has no FUSE no-open support)"
        if not self.passthrough and not self.no_open:
            log.info("FUSE: %s: every open is a round trip", self.open_mode)

    async def check_passthrough(self) -> None:
        """Once INIT is answered (a stat of the mount from another thread has returned): keep
        passthrough only if the INIT reply took it and the kernel gives a backing id for a file
        of the backing folder; else serve files with no-open. Opens wait for the answer."""
        try:
            if not self.passthrough:
                return
            ok, why_not = passthrough.negotiated()
            if ok and self.backing is not None:
                try:
                    backing_id = await trio.to_thread.run_sync(passthrough.probe,
                                                               self.backing.root)
                    if backing_id <= 0:
                        ok, why_not = False, f"the kernel gave backing id {backing_id}"
                except OSError as e:
                    ok, why_not = False, f"the kernel refused a backing file: {e.strerror or e}"
            if not ok:
                self.passthrough = False
                self._set_open_mode(why_not)
                log.warning("FUSE %s", self.open_mode)
        finally:
            self._checked.set()

    async def lookup(self, parent_inode, name, ctx=None):
        self.ops["lookup"] += 1
        node = self._node(parent_inode)
        if node.entry.kind != DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name == b".":
            return self._remember(node)
        if name == b"..":
            raise pyfuse3.FUSEError(errno.ENOENT)  # the kernel resolves '..' itself
        child = self._lookup_child(node, name)
        if child is None:
            # A negative entry: the kernel remembers the name is absent (Python's import
            # system probes many), until a publish adds it and invalidates it.
            absent = pyfuse3.EntryAttributes()
            absent.st_ino = 0
            absent.entry_timeout = TIMEOUT
            return absent
        return self._remember(child)

    async def forget(self, inode_list):
        self.ops["forget"] += 1
        orphans = False
        for ino, n in inode_list:
            node = self._nodes.get(ino)
            if node is None:
                continue
            node.lookups = max(0, node.lookups - n)
            if node.lookups or ino == pyfuse3.ROOT_INODE:
                continue
            del self._nodes[ino]
            if self._inos.get(node.key) == ino:
                del self._inos[node.key]
            orphans = orphans or bool(node.entry.chunks) and self._tree(node) is None
        if orphans and self.on_orphan_forgotten is not None:
            self.on_orphan_forgotten()

    async def getattr(self, inode, ctx=None):
        self.ops["getattr"] += 1
        return self._attr(inode, self._node(inode))

    async def readlink(self, inode, ctx):
        self.ops["readlink"] += 1
        node = self._node(inode)
        if node.entry.kind != SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.entry.target

    async def opendir(self, inode, ctx):
        self.ops["opendir"] += 1
        node = self._node(inode)
        if node.entry.kind != DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if self.no_opendir:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-opendir: the kernel caches listings
        return inode

    def _listing(self, node: Node) -> list[tuple[bytes, Node]]:
        """A directory's entries. Snapshot directories never change, and every `ls`, `find`
        or Python import lists them again, so listings are kept (LRU, bounded in entries)."""
        tree = self._tree(node) if node.special is None else None
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

    async def readdir(self, fh, start_id, token):
        self.ops["readdir"] += 1
        node = self._node(fh)  # a handle is the directory's inode
        listing = self._listing(node)
        attr = self._blank_attr()  # one object for every entry: readdir_reply copies it out
        # "." and "..", as a local disk lists them. They also keep the kernel's cached copy of
        # a listing from being empty: the kernel answers an empty cached listing without looking
        # for its pages, so invalidating them (set_workspace) would not drop it, and a folder
        # listed while empty stayed empty after a publish added names to it (unless its mtime
        # changed). The kernel takes no lookup for these two.
        for i in range(start_id, 2):
            ino = fh if i == 0 else self._parent_ino(node, fh)
            if not pyfuse3.readdir_reply(token, b"." if i == 0 else b"..",
                                         self._set_attr(attr, ino, node), i + 1):
                return
        for i in range(max(start_id - 2, 0), len(listing)):
            name, child = listing[i]
            ino, live = self._ino(child)
            if not pyfuse3.readdir_reply(token, name, self._set_attr(attr, ino, live), i + 3):
                return
            live.lookups += 1

    def _parent_ino(self, node: Node, ino: int) -> int:
        """The inode of a directory's parent, for its ".." entry (its own, `ino`, if the parent
        is not in the table: the kernel holds a directory's parent while it holds the
        directory, so that is only the root)."""
        if node.special in ("root", "versions") or (node.view is None and not node.entry.path):
            return pyfuse3.ROOT_INODE  # the mount root, and the current view of a workspace
        if node.special == "wsv":
            key = b"versions"
        elif not node.entry.path:  # MOUNT/.versions/NAME/VERSION
            key = b"wsv\0" + node.ws
        else:
            key = _dir_key(node.ws, node.view, node.entry.parent)
        return self._inos.get(key, ino)

    async def releasedir(self, fh):
        self.ops["releasedir"] += 1

    async def open(self, inode, flags, ctx):
        self.ops["open"] += 1
        node = self._node(inode)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.kind != FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if node.entry.kind == DIR else errno.EINVAL)
        if self.passthrough and not self._checked.is_set():
            await self._checked.wait()  # the first opens, while check_passthrough() runs
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-open: reads come with the inode
        backing_id = await self._backing_id(inode, node) if self.passthrough else 0
        node.opens += 1
        if backing_id:
            self.passthrough_opens += 1
            return pyfuse3.FileInfo(fh=inode, keep_cache=False, backing_id=backing_id)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def _backing_id(self, inode: int, node: Node) -> int:
        """The backing id to open `node` with, or 0 to read it through the daemon."""
        while (busy := self._binding.get(inode)) is not None:
            await busy.wait()  # another open of this inode is binding it: use its answer
        if node.backing_id or node.opens:
            # Every open file of an inode must use the same mode and backing (the kernel fails
            # the open otherwise): the first open decides, until the last one is released.
            return node.backing_id
        if self.backing is None or not backing_wanted(node.entry):
            return 0
        backing = self.backing
        done = self._binding[inode] = trio.Event()
        try:
            await backing.wait(node.entry)  # its copy is queued or running: that one first
            node.backing_id = await trio.to_thread.run_sync(self._bind, backing, node.entry)
        except OSError as e:
            # The kernel refuses this folder's files (a filesystem that cannot back FUSE
            # passthrough): say so once, and serve every file through the daemon.
            self.open_mode = f"passthrough refused for {backing.root}: {e.strerror or e}"
            self.backing = None
            log.warning("FUSE %s; files are read through the daemon", self.open_mode)
        finally:
            del self._binding[inode]
            done.set()
        return node.backing_id

    @staticmethod
    def _bind(backing: BackingFiles, entry: Entry) -> int:
        """A backing id for `entry`'s backing file, 0 if there is none (yet). Blocking (a stat,
        an open, an ioctl): runs in a worker thread."""
        path = backing.ready(entry)
        if path is None:  # not written (yet): the chunk store serves it
            return 0
        try:
            return passthrough.open_backing(path)
        except FileNotFoundError:  # pruned meanwhile
            return 0

    async def read(self, fh, off, size):
        self.ops["read"] += 1
        # A handle is the file's inode. The kernel holds the inode while the file is open, so
        # the node (and the content it was opened with) outlives any publish.
        node = self._node(fh)
        entry, chunk_size = node.entry, node.chunk_size
        end = min(off + size, entry.size)
        parts = []
        chunks = entry.chunks
        last = (end - 1) // chunk_size
        if self.nursery is not None and end > off:
            # Sequential readers come back for the next chunks: load (and decompress, on both
            # cores) a few ahead while they use this one.
            for cid in chunks[last + 1:last + 1 + PREFETCH_CHUNKS]:
                self.chunks.prefetch(self.nursery, cid)
        while off < end:
            i, within = divmod(off, chunk_size)
            try:
                data = await self.chunks.get(chunks[i])
            except Exception as e:  # missing or corrupt object: an I/O error, never wrong bytes
                log.error("reading %r: %s", entry.path, e)
                raise pyfuse3.FUSEError(errno.EIO) from None
            if len(data) != min(chunk_size, entry.size - i * chunk_size):
                # A manifest whose size disagrees with its chunks (only a hand-made one can):
                # an error, never a short file that the kernel would take for a truncation.
                log.error("reading %r: chunk %d holds %d bytes, the manifest says otherwise",
                          entry.path, i, len(data))
                raise pyfuse3.FUSEError(errno.EIO)
            piece = memoryview(data)[within:within + end - off]
            parts.append(piece)
            off += len(piece)
            if not piece:
                break
        # One piece (the usual case) goes out as a view of the cached chunk: pyfuse3 takes any
        # buffer, and slicing bytes would copy it.
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def release(self, fh):
        self.ops["release"] += 1
        node = self._nodes.get(fh)
        if node is None:
            return
        node.opens = max(0, node.opens - 1)
        if not node.opens and node.backing_id:
            backing_id, node.backing_id = node.backing_id, 0
            try:
                passthrough.close_backing(backing_id)
            except OSError as e:
                log.warning("closing backing id %d: %s", backing_id, e)
        if not node.opens and self._tree(node) is None:
            # The last open of a file no served version has (removed, or dropped while it was
            # open): drop the kernel's entry, else it stays cached, the kernel never forgets
            # the file, and its chunks are kept until memory runs short.
            parent = self._known_ino(_dir_key(node.ws, node.view, node.entry.parent))
            if parent is not None:
                pyfuse3.invalidate_entry_async(parent, node.entry.name, ignore_enoent=True)

    async def statfs(self, ctx):
        self.ops["statfs"] += 1
        s = pyfuse3.StatvfsData()
        total = sum(t[0].total_bytes for t in self.workspaces.values())
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(len(t[0].entries) for t in self.workspaces.values())
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def _xattrs(self, node: Node) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        if node.special == "root":
            out[b"user.monarch.workspaces"] = b" ".join(
                ws + b"=" + t[0].hex.encode() for ws, t in sorted(self.workspaces.items()))
            out[b"user.monarch.cache_hits"] = str(self.chunks.hits).encode()
            out[b"user.monarch.cache_misses"] = str(self.chunks.misses).encode()
            out[b"user.monarch.cache_nowait"] = str(self.chunks.nowait).encode()
            out[b"user.monarch.passthrough_opens"] = str(self.passthrough_opens).encode()
            ops = self.ops.copy()
            if hasattr(pyfuse3, "ioctls"):  # refused inside the patched pyfuse3, never seen here
                ops["ioctl"] = pyfuse3.ioctls()
            out[b"user.monarch.ops"] = " ".join(
                f"{k}={v}" for k, v in sorted(ops.items()) if v).encode()
            return out
        tree = self._tree(node) if node.ws else None
        if tree is not None:
            out[b"user.monarch.workspace"] = node.ws
            out[b"user.monarch.version"] = tree.hex.encode()
        if node.entry.kind == FILE:
            out[b"user.monarch.chunks"] = " ".join(c.hex() for c in node.entry.chunks).encode()
            backing = self.backing if self.passthrough and backing_wanted(node.entry) else None
            path = backing and await trio.to_thread.run_sync(backing.ready, node.entry)
            if path is not None:  # opens of this file read it from there
                out[b"user.monarch.backing"] = os.fsencode(path)
        return out

    async def getxattr(self, inode, name, ctx):
        self.ops["getxattr"] += 1
        value = (await self._xattrs(self._node(inode))).get(name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode, ctx):
        self.ops["listxattr"] += 1
        return list(await self._xattrs(self._node(inode)))


def set_readahead(mountpoint: str, kb: int = 4096) -> bool:
    """Widen the kernel's readahead window for the mount (root only).

    With the default 128 KiB window a sequential reader costs one FUSE request, and a trip
    through Python, per 128 KiB; a wider window lets the kernel send 1 MiB requests.
    """
    target = os.fsencode(os.path.abspath(mountpoint))
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            dev = next(line.split()[2] for line in f if line.split()[4] == target)
        with open(f"/sys/class/bdi/{dev.decode()}/read_ahead_kb", "w") as f:
            f.write(str(kb))
        return True
    except (OSError, StopIteration) as e:
        log.debug("cannot set readahead for %s: %s", mountpoint, e)
        return False


def mount_options() -> set[str]:
    opts = set(pyfuse3.default_options)
    # default_permissions (pyfuse3's default, kept explicit): the kernel applies each file's
    # own mode and owner, so a file pushed 0600 is only for the daemon's user.
    opts |= {"default_permissions", "ro", "fsname=monarch-fs", "subtype=monarch-fs", "nosuid",
             "nodev"}
    if os.getuid() == 0:
        opts.add("allow_other")  # every user on the node reads the snapshot
    return opts
