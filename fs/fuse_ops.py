"""The read-only FUSE filesystem over published snapshots: the handlers pyfuse3 calls.

Layout of the mount:

    MOUNT/NAME/...                    the current version of workspace NAME
    MOUNT/.versions/NAME/VERSION/...  every retained version, immutable

Snapshots never change, so entries and attributes are cached by the kernel for a long time and
file pages are kept across opens (`keep_cache`). When a workspace switches version, exactly the
kernel entries that changed are invalidated before `set_workspace` returns
(fs/version_switch.py), so nobody reads stale content after a push has succeeded.

A handle is the inode number (fs/inodes.py keeps the table). How files are opened (passthrough,
no-open, or an open per file) is decided at FUSE INIT: see fs/open_mode.py. Every handler here is
wrapped so that no request can take the daemon down (fs/handler_guard.py).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import Counter
from collections.abc import Awaitable, Callable

import pyfuse3
import trio

from . import passthrough, version_switch
from .backing import BackingFiles
from .backing import key as backing_key
from .backing import wanted as backing_wanted
from .chunk_cache import ChunkCache
from .handler_guard import guard_handlers
from .inodes import DIR, FILE, SYMLINK, InodeTable, Node, Tree, dir_key
from .manifest import Manifest
from .open_mode import OpenMode
from .residency import resident_chunks
from .version_switch import Staged

log = logging.getLogger(__name__)

PREFETCH_CHUNKS = 2
CHUNK_CACHE_BYTES = 128 << 20  # decoded chunks kept for the read path
TIMEOUT = 24 * 3600.0  # entries are invalidated explicitly; the timeout is only a backstop
_TYPE = {DIR: stat.S_IFDIR, FILE: stat.S_IFREG, SYMLINK: stat.S_IFLNK}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT


@guard_handlers
class SnapshotFS(OpenMode):
    """The read-only filesystem over published snapshots: the handlers pyfuse3 calls, over the
    inode table, and the switch of a workspace to a new version with exact invalidation."""

    def __init__(self, load_chunk: Callable[[bytes], bytes | memoryview],
                 backing: BackingFiles | None = None,
                 load_cached: Callable[[bytes], bytes | memoryview | None] | None = None,
                 fetch: Callable[[bytes], Awaitable[None]] | None = None):
        super().__init__(backing)
        self.chunks = ChunkCache(load_chunk, CHUNK_CACHE_BYTES, load_cached, fetch)
        self.table = InodeTable()
        self.nursery: trio.Nursery | None = None  # for prefetches, set while serving
        self.ops: Counter[str] = Counter()  # requests served, by operation (user.monarch.ops)
        self.busy_ns = 0  # time in handlers (handler_guard.py)
        self.last_request_ns = 0  # when the last request came (handler_guard.py)
        self.bytes_served = 0  # bytes the read handler returned
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.mounted = False
        # Called when the kernel forgets a file that no served version has any more (removed
        # or dropped while a reader held it): held_chunks() no longer counts its chunks.
        self.on_orphan_forgotten: Callable[[], None] | None = None
        # Told (workspace, path, chunk index) of each read, and (..., None) of each open: the
        # daemon records the first reads after a publish (push --early sends them first).
        # Must be cheap: it is on every read.
        self.on_read: Callable[[bytes, bytes, int | None], None] | None = None

    @property
    def workspaces(self) -> dict[bytes, list[Tree]]:
        """What is served: name -> [current version, older...]. Changed only through
        set_workspace, stage and switch, and remove_workspace."""
        return self.table.workspaces

    def read_counters(self) -> dict:
        """What the mount has served since it started, for telemetry: requests by operation,
        bytes read, decoded-chunk cache hits and misses, and nanoseconds spent in handlers and
        loading chunks (a node's `reads` rows are the differences, per interval)."""
        return {"ops": dict(self.ops), "bytes": self.bytes_served, "hits": self.chunks.hits,
                "misses": self.chunks.misses, "busy_ns": self.busy_ns,
                "disk_ns": self.chunks.load_ns}

    def resident_chunks(self, ws: bytes, path: bytes) -> list[int] | None:
        """The chunks of file `path` of workspace `ws` (its current version) in the page
        cache, if it is read by passthrough from its file object, which was written past the
        page cache: what was read of it since (fs/residency.py). None if that is not known
        (no passthrough, a small file, or a backing copy, written through the page cache).
        Blocking: a worker thread."""
        trees = self.table.workspaces.get(ws)
        backing = self.backing
        if not trees or not self.passthrough or backing is None or backing.store is None:
            return None
        entry = trees[0].entries.get(path)
        if entry is None or not backing_wanted(entry):
            return None
        obj = backing.store.file_object(backing_key(entry))
        return None if obj is None else resident_chunks(obj, trees[0].manifest.chunk_size)

    def held_chunks(self) -> list[bytes]:
        """The chunks of every file the kernel still holds (see InodeTable.held_chunks)."""
        return self.table.held_chunks()

    # ---- attributes -----------------------------------------------------------------------

    def _remember(self, node: Node) -> pyfuse3.EntryAttributes:
        """Hand an inode to the kernel (lookup or readdirplus): it now counts one more lookup."""
        ino, live = self.table.ino(node)
        live.lookups += 1
        return self._attr(ino, live)

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

    # ---- publishing -----------------------------------------------------------------------

    async def stage(self, name: bytes, versions: list[tuple[bytes, Manifest]]) -> Staged:
        """Index `versions` (current first) for workspace `name` and find what changed: all
        the work of a switch that can fail, done before the switch is decided (a commit saves
        its refs in between). Nothing is served from it until `switch`."""
        return await version_switch.stage(self.table, name, versions)

    async def set_workspace(self, name: bytes, versions: list[tuple[bytes, Manifest]]) -> None:
        """Serve `versions` (current first) for workspace `name`, invalidating what changed."""
        await self.switch(await self.stage(name, versions))

    async def switch(self, staged: Staged) -> None:
        """Serve what `stage` prepared, then drop the kernel entries that changed. The switch
        itself is plain assignments, so it cannot fail half-way; a failed invalidation is logged
        (it would only keep a stale cache entry)."""
        version_switch.serve(self.table, staged)
        if self.mounted:
            await version_switch.invalidate(version_switch.switched(self.table, staged))

    async def remove_workspace(self, name: bytes) -> None:
        """Stop serving workspace `name`: MOUNT/NAME and .versions/NAME leave the mount at
        once (the kernel drops its entries for them, and with them the names below). A file a
        reader holds open keeps its node, and reads, until the kernel forgets it."""
        dropped = version_switch.remove(self.table, name)
        if dropped is not None and self.mounted:
            await version_switch.invalidate(dropped)

    # ---- FUSE operations ------------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx=None):
        self.ops["lookup"] += 1
        node = self.table.node(parent_inode)
        if node.entry.kind != DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name == b".":
            return self._remember(node)
        if name == b"..":
            raise pyfuse3.FUSEError(errno.ENOENT)  # the kernel resolves '..' itself
        child = self.table.lookup_child(node, name)
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
        if self.table.forget(inode_list) and self.on_orphan_forgotten is not None:
            self.on_orphan_forgotten()

    async def getattr(self, inode, ctx=None):
        self.ops["getattr"] += 1
        return self._attr(inode, self.table.node(inode))

    async def readlink(self, inode, ctx):
        self.ops["readlink"] += 1
        node = self.table.node(inode)
        if node.entry.kind != SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.entry.target

    async def opendir(self, inode, ctx):
        self.ops["opendir"] += 1
        node = self.table.node(inode)
        if node.entry.kind != DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if self.no_opendir:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-opendir: the kernel caches listings
        return inode

    async def readdir(self, fh, start_id, token):
        self.ops["readdir"] += 1
        node = self.table.node(fh)  # a handle is the directory's inode
        listing = self.table.listing(node)
        attr = self._blank_attr()  # one object for every entry: readdir_reply copies it out
        # "." and "..", as a local disk lists them. They also keep the kernel's cached copy of
        # a listing from being empty: the kernel answers an empty cached listing without looking
        # for its pages, so invalidating them (set_workspace) would not drop it, and a folder
        # listed while empty stayed empty after a publish added names to it (unless its mtime
        # changed). The kernel takes no lookup for these two.
        for i in range(start_id, 2):
            ino = fh if i == 0 else self.table.parent_ino(node, fh)
            if not pyfuse3.readdir_reply(token, b"." if i == 0 else b"..",
                                         self._set_attr(attr, ino, node), i + 1):
                return
        for i in range(max(start_id - 2, 0), len(listing)):
            name, child = listing[i]
            ino, live = self.table.ino(child)
            if not pyfuse3.readdir_reply(token, name, self._set_attr(attr, ino, live), i + 3):
                return
            live.lookups += 1

    async def releasedir(self, fh):
        self.ops["releasedir"] += 1

    async def open(self, inode, flags, ctx):
        self.ops["open"] += 1
        node = self.table.node(inode)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.kind != FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if node.entry.kind == DIR else errno.EINVAL)
        await self._decided()  # the first opens, while check_passthrough() runs
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-open: reads come with the inode
        if self.on_read is not None:
            self.on_read(node.ws, node.entry.path, None)
        backing_id = await self._backing_id(inode, node) if self.passthrough else 0
        node.opens += 1
        if backing_id:
            self.passthrough_opens += 1
            return pyfuse3.FileInfo(fh=inode, keep_cache=False, backing_id=backing_id)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        self.ops["read"] += 1
        # A handle is the file's inode. The kernel holds the inode while the file is open, so
        # the node (and the content it was opened with) outlives any publish.
        node = self.table.node(fh)
        entry, chunk_size = node.entry, node.chunk_size
        end = min(off + size, entry.size)
        if self.on_read is not None and end > off:
            for i in range(off // chunk_size, (end - 1) // chunk_size + 1):
                self.on_read(node.ws, entry.path, i)
        if end > off:
            self.bytes_served += end - off
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
        node = self.table.nodes.get(fh)
        if node is None:
            return
        node.opens = max(0, node.opens - 1)
        if not node.opens and node.backing_id:
            backing_id, node.backing_id = node.backing_id, 0
            try:
                passthrough.close_backing(backing_id)
            except OSError as e:
                log.warning("closing backing id %d: %s", backing_id, e)
        if not node.opens and self.table.tree(node) is None:
            # The last open of a file no served version has (removed, or dropped while it was
            # open): drop the kernel's entry, else it stays cached, the kernel never forgets
            # the file, and its chunks are kept until memory runs short.
            parent = self.table.known_ino(dir_key(node.ws, node.view, node.entry.parent))
            if parent is not None:
                pyfuse3.invalidate_entry_async(parent, node.entry.name, ignore_enoent=True)

    async def statfs(self, ctx):
        self.ops["statfs"] += 1
        s = pyfuse3.StatvfsData()
        total = sum(t[0].total_bytes for t in self.table.workspaces.values())
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(len(t[0].entries) for t in self.table.workspaces.values())
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def _xattrs(self, node: Node) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        if node.special == "root":
            out[b"user.monarch.workspaces"] = b" ".join(
                ws + b"=" + t[0].hex.encode() for ws, t in sorted(self.table.workspaces.items()))
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
        tree = self.table.tree(node) if node.ws else None
        if tree is not None:
            out[b"user.monarch.workspace"] = node.ws
            out[b"user.monarch.version"] = tree.hex.encode()
        if node.entry.kind == FILE:
            out[b"user.monarch.chunks"] = " ".join(c.hex() for c in node.entry.chunks).encode()
            backing = self.backing if self.passthrough and backing_wanted(node.entry) else None
            path = None if backing is None else await trio.to_thread.run_sync(backing.ready,
                                                                                node.entry)
            if path is not None:  # opens of this file read it from there
                out[b"user.monarch.backing"] = os.fsencode(path)
        return out

    async def getxattr(self, inode, name, ctx):
        self.ops["getxattr"] += 1
        value = (await self._xattrs(self.table.node(inode))).get(name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode, ctx):
        self.ops["listxattr"] += 1
        return list(await self._xattrs(self.table.node(inode)))
