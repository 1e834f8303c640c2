"""How files are opened, decided once FUSE INIT is answered, and the binding of an open file to
its backing file.

With the patched pyfuse3 the Makefile builds (`fs/pyfuse3.patch`, against the system's libfuse
3), files are served one of two ways (check_passthrough decides):

- passthrough (root, Linux 6.9+, and a backing id from the kernel): a file of
  backing.MIN_SIZE or more is bound at open to its backing file on local disk (fs/backing.py),
  and the kernel reads and maps it directly, at local-disk speed and in large folios. Every
  open is then a round trip (the kernel has no passthrough without open), so smaller files
  are opened with `keep_cache` and read through the daemon.
- no-open (otherwise): `open` answers ENOSYS, so the kernel stops sending open and release at
  all and keeps file pages in its own cache; reads come with handle 0, which the patch turns
  into the inode.

Either way `opendir` answers ENOSYS (no-opendir): the kernel keeps directory listings itself, and
warm `find` costs no round trip. With a stock pyfuse3 every open is a round trip.

A base class of SnapshotFS (fs/fuse_ops.py) rather than part of it: the mode is state its `open`,
`opendir` and `getxattr` handlers read, but deciding it is a negotiation with the kernel that no
request takes part in.
"""

from __future__ import annotations

import logging
import os

import pyfuse3
import trio

from ..settings import settings
from . import passthrough
from .backing import BackingFiles
from .backing import wanted as backing_wanted
from .inodes import Node
from .manifest import Entry

log = logging.getLogger(__name__)

# No-open needs the patched pyfuse3 (this), and a kernel that supports it (checked at INIT, see
# init()); settings.no_open (MONARCH_FS_NO_OPEN=0) keeps the open round trips, to compare or debug.
NO_OPEN_BUILT = bool(getattr(pyfuse3, "FH_ZERO_IS_INODE", False))


class OpenMode(pyfuse3.Operations):
    """Passthrough, no-open or an open per file: what `open_mode` says, and why."""

    def __init__(self, backing: BackingFiles | None) -> None:
        super().__init__()
        self.backing = backing
        self.no_open = False  # files: decided at FUSE INIT
        self.no_opendir = False
        self.passthrough = False
        self.passthrough_opens = 0  # opens bound to a backing file (user.monarch.passthrough_opens)
        self._binding: dict[int, trio.Event] = {}  # inodes whose backing file is being opened
        self.open_mode = "not mounted"  # what `monarch-fs status` shows: no-open, or why not
        self._checked = trio.Event()  # check_passthrough() has decided

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

    async def _decided(self) -> None:
        """Wait until check_passthrough() has decided (the first opens, while it runs)."""
        if self.passthrough and not self._checked.is_set():
            await self._checked.wait()

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
