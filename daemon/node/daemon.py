"""The node daemon: one per host. It serves a node's service (service.py: store, refs,
publisher, sessions, process table) on its listener and mounts the snapshots it publishes.

This module only wires those parts together and owns what only a real daemon has: the FUSE
mount, signals, the ready file (and systemd's readiness notice, notify.py) and the log. The log
names every process the daemon starts, argv included, so it is private to the daemon's user, as
the state folder is (service.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ...fs import passthrough
from ...fs.mount_check import check_mount, mount
from ...fs.mount_options import mount_mode, set_readahead
from ..wire.addresses import parse_addr
from ..wire.buffers import RECEIVING
from . import recovery
from .notify import notify
from .serve import serve
from .service import NodeService, open_listeners

# Receive buffers made when the daemon starts (~50 MB, held for its life): a 1 GiB push to
# one node held 6 at once (wire/buffers.py, RECEIVING).
PREPARED_BUFFERS = 8

log = logging.getLogger("monarch_fs.daemon")


def make_log_private() -> None:
    """The log names every process the daemon starts, argv included: when stderr is a file
    this user owns (the local cluster's node-I/log, a `2>>` redirect), only this user may read
    it. A journal or a terminal is left alone."""
    st = os.fstat(2)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(2, stat.S_IMODE(st.st_mode) & 0o700)


class NodeDaemon:
    """A NodeService on its listener, plus the FUSE mount of what it publishes.

    Thin on purpose: what a node answers lives in NodeService (and is tested without a
    mount); this class only orders start-up and shut-down around the mount: listen, mount,
    serve, tune the mount once the kernel finished INIT, recover, and on the way out stop the
    processes, then unmount. `allow_other`: None mounts with allow_other where this user may
    (root, or /etc/fuse.conf's user_allow_other), True requires it, False never asks.
    Keyword arguments other than `listen` and `allow_other` are NodeService's."""

    def __init__(self, *, listen: str, allow_other: bool | None = None, **service: Any) -> None:
        parse_addr(listen, listen=True)
        self.listen = listen
        self.allow_other = allow_other
        self._told_stopping = False
        self.service = NodeService(addr=listen, **service)

    async def run(self, *, ready_file: str | None = None,
                  task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, SIGTERM or SIGINT; always unmounts on the way out. A mount
        that cannot be made raises MountError (one line: cause and fix)."""
        service, fs = self.service, self.service.fs
        check_mount(service.mount, self.allow_other)
        mode = mount_mode(self.allow_other)
        await recovery.load(service.publisher)
        for problem in service.publisher.all_problems():
            log.error("%s", problem)
        listeners, service.addr = await open_listeners(self.listen)
        passthrough.request(fs.passthrough_unavailable() is None)
        try:
            mount(fs, service.mount, mode)
        except BaseException:
            for listener in listeners:
                await listener.aclose()
            raise
        service.mount_mode = mode.description
        log.info("mounted %s: %s", service.mount, mode.description)
        fs.mounted = True
        try:
            async with trio.open_nursery() as nursery:
                fs.nursery = nursery  # prefetches
                nursery.start_soon(self._fuse_main, nursery.cancel_scope)
                nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
                await nursery.start(serve, service, listeners)
                # A stat from another thread returns once the kernel finished FUSE INIT (which
                # resets the readahead window): then the mount is ready, and tunable.
                await trio.to_thread.run_sync(os.stat, service.mount)
                set_readahead(str(service.mount))
                await fs.check_passthrough()
                # Backing files this node's versions lack (all of them after a crash, see
                # fs/backing.py) are written now; until then the chunk store serves those
                # files. And what a crash left in the store is collected.
                nursery.start_soon(service.publisher.recover)
                # The receive buffers of the first push, made now rather than under it.
                nursery.start_soon(trio.to_thread.run_sync, RECEIVING.prepare, PREPARED_BUFFERS)
                log.info("serving %s on %s (state %s)", service.mount, service.addr,
                         service.state)
                if ready_file:
                    tmp = ready_file + ".tmp"
                    Path(tmp).write_text(json.dumps({"addr": service.addr, "pid": os.getpid()}))
                    os.rename(tmp, ready_file)
                notify(READY=1, STATUS=f"serving {service.mount} on {service.addr} "
                                      f"({mode.description}; fuse {fs.open_mode})",
                       MAINPID=os.getpid())
                task_status.started(service.addr)
        finally:
            self._stopping("unmounting")
            fs.mounted = False
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", service.mount)
            try:
                service.backing.close()
            except OSError as e:  # they will be written again at the next start
                log.warning("flushing backing files: %s", e)

    async def _fuse_main(self, scope: trio.CancelScope) -> None:
        await pyfuse3.main()
        log.warning("mount %s went away; stopping", self.service.mount)
        self._stopping("the mount went away")
        scope.cancel()

    async def _stop_on_signal(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for sig in signals:
                log.info("received %s; stopping", signal.Signals(sig).name)
                self._stopping(f"received {signal.Signals(sig).name}")
                scope.cancel()
                return

    def _stopping(self, why: str) -> None:
        """Tell systemd once, as soon as the daemon starts stopping (its processes, then the
        mount, take a moment)."""
        if not self._told_stopping:
            self._told_stopping = True
            notify(STOPPING=1, STATUS=f"stopping: {why}")
