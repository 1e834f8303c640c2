"""The node service: everything a node answers over the protocol, with or without a mount.

Everything under the state folder is private to the daemon's user: the store and the backing
files hold every pushed file's bytes whatever its mode. Only the mount (with
`default_permissions`, so each file's own mode rules) shows content to other users.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from pathlib import Path

import trio

from ...fs.backing import BackingFiles
from ...fs.fuse_ops import SnapshotFS
from ...fs.manifest import DEFAULT_MAX_ENTRIES
from ...fs.private_files import private_dir
from ...fs.store import Store
from ...settings import DURABLE_MODES, settings
from ..wire import bulk, identity
from ..wire.addresses import parse_addr
from ..wire.auth import NO_TOKEN_HELP, default_token_file
from ..wire.identity import ROOT_PROCS_FLAG
from ..wire.limits import Limits, LogOnce
from ..wire.replies import COUNTERS, StatusReply
from ..wire.telemetry_calls import StatsReply
from .events import EventLog
from .fetch import Fetcher
from .first_reads import FirstReads
from .flusher import Flusher
from .procs import ProcessTable, procs_user
from .publisher import KEEP_VERSIONS, Publisher
from .readers import TailPace
from .refs import Refs, describe_user
from .source_links import SourceLinks

log = logging.getLogger("monarch_fs.daemon")


def make_private(state: Path) -> None:
    """Make a state folder and everything in it private to this user (folders 0700, files
    without group or other bits), whatever the umask was and whatever an older version left
    (it made packs and refs.json 0644 in 0755 folders, backing files 0444). Files are created
    private from then on; this tightens what already exists, at start."""
    private_dir(state)
    dev = state.stat().st_dev
    for dirpath, dirnames, filenames in os.walk(state):
        for name in list(dirnames):
            path = os.path.join(dirpath, name)
            try:
                theirs = os.lstat(path).st_dev != dev  # something mounted here (maybe stale)
            except OSError:
                theirs = True
            if theirs:
                dirnames.remove(name)
            else:
                os.chmod(path, 0o700)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


async def open_listeners(listen: str) -> tuple[list[trio.SocketListener], str]:
    """Listen on `listen` ("host:port"; port 0 picks one); returns the listeners and the
    address they are bound to, as clients dial it."""
    host, port = parse_addr(listen, listen=True)
    listeners = await trio.open_tcp_listeners(port, host=host)
    return listeners, dial_addr(host, listeners[0].socket.getsockname()[1])


def dial_addr(host: str, port: int) -> str:
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


class NodeService:
    """A node's store, refs, publisher and process table, and the authenticated sessions that
    drive them: the whole node except the FUSE mount.

    Apart from the mount so that it can be built and served in a test (S3QL builds its
    Operations the same way): `fs` is the snapshot view it publishes to, left unmounted here;
    NodeDaemon mounts it. `serve` answers connections until cancelled."""

    def __init__(self, *, state: str | os.PathLike[str], mount: str | os.PathLike[str],
                 token: bytes, keep: int = KEEP_VERSIONS, node_name: str = "",
                 addr: str = "", transport: bulk.LocalTransport | None = None,
                 store_raw: bool = True, encrypt: str = "auto", limits: Limits | None = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES,
                 allow_root_procs: bool = False, identity_mode: str = "",
                 munge_socket: str = identity.DEFAULT_SOCKET,
                 source_prefixes: tuple[str, ...] = (), durable: str = "background") -> None:
        if not token:  # anyone who reached the port could run anything as this daemon's user
            raise ValueError("a daemon needs a token to accept requests: "
                             + NO_TOKEN_HELP.format(default=default_token_file()))
        self.token = token
        # Sessions are always authenticated; encrypted under this policy (addresses.encrypts).
        self.encrypt = encrypt
        self.limits = limits or Limits()
        self.log_once = LogOnce(log)  # refused handshakes: a line per peer per minute
        # What this node offers for chunk payloads (--transport; RDMA only if a device works).
        self.transport = transport or bulk.LocalTransport("tcp", "tcp", "not probed")
        # Chunks are kept decompressed: reads then cost a hash, not a decompression (twice the
        # disk for text-like content). --store-compressed trades read speed for disk.
        self.store_raw = store_raw
        self.max_entries = max_entries
        self.state = Path(state)
        self.mount = Path(mount)  # where processes find the workspaces ({mount})
        make_private(self.state)
        # A pack is deleted once nothing in it is used, so smaller packs
        # (MONARCH_FS_PACK_MIB) give space back sooner, for more files.
        # --durable: flush before each publish (sync), or after, in the background (flusher.py)
        if durable not in DURABLE_MODES:
            raise ValueError(f"--durable {durable!r}: expected one of {', '.join(DURABLE_MODES)}")
        self.durable = durable
        self.store = Store(self.state / "store", pack_limit=settings.pack_limit,
                           flush_later=durable == "background")
        self.backing = BackingFiles(self.state / "backing", self.store)
        self.node_name = node_name or socket.gethostname()
        # Chunks a reader needs before they arrive (push --early): asked of the pushers.
        self.fetcher = Fetcher(self.store, self.node_name)
        self.fs = SnapshotFS(self.store.get, self.backing, self.store.get_if_cached,
                             self.fetcher.fetch)
        # What is read first after each publish: push --early sends it first.
        self.first_reads = FirstReads(self.state / "first-reads", self.fs.resident_chunks)
        self.fs.on_read = self.first_reads.note
        # What happened here, queryable (`monarch-fs query`); MONARCH_FS_EVENTS=0 turns it off.
        self.events = EventLog(self.state / "events.db", self.node_name,
                               max_bytes=settings.events_bound,
                               max_age=settings.events_max_age,
                               interval=settings.events_interval,
                               sample=self.fs.read_counters, enabled=settings.events)
        self.addr = addr  # the bound address, once listening
        self.started = time.time()
        # What crossed this node since it started: a push's edges carry only what is lacking.
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.refs = Refs(self.state / "refs.json")
        self.flusher = (Flusher(self.store, settings.flush_delay) if durable == "background"
                        else None)
        self.publisher = Publisher(self.store, self.refs, self.backing, self.fs, keep=keep,
                                   max_entries=max_entries, counters=self.counters,
                                   mount=self.mount, fetcher=self.fetcher,
                                   events=self.events,
                                   links=SourceLinks(self.state, bool(identity_mode),
                                                     source_prefixes),
                                   flusher=self.flusher)
        # A push --early's tail waits while the mount's readers are busy (readers.py).
        self.tail = TailPace(lambda: self.fs.last_request_ns, self.publisher.incomplete.has,
                             self.fetcher.waiting, self.counters)
        # A root daemon runs no process unless its operator allowed it (procs.py).
        self.allow_root_procs = allow_root_procs
        # "munge" (--identity munge): the requests that act for a user carry a MUNGE credential,
        # checked against munged at `munge_socket`; processes run as that user, and a
        # workspace belongs to who pushed it (wire/identity.py). "": the shared token only.
        self.identity = identity_mode
        self.munge_socket = munge_socket
        self.fan_scopes = identity.SeenScopes()  # control-tree requests acted on (replays)
        self.procs: ProcessTable | None = None  # while serving
        # root or unprivileged, as status tells (fs/mount_options.py); set by the mounting daemon
        self.mount_mode = "not mounted"
        self.write_limiter = trio.CapacityLimiter(4)  # store write batches in flight, in all

    async def status(self) -> StatusReply:
        """What `monarch-fs status` shows for this node."""
        objects, size = await trio.to_thread.run_sync(self.store.usage)
        backing = await trio.to_thread.run_sync(self.backing.usage)
        return StatusReply(
            node=self.node_name,
            addr=self.addr,
            mount=str(self.mount),
            transport=self.transport.info(),
            pid=os.getpid(),
            uptime=round(time.time() - self.started, 1),
            store_objects=objects,
            store_bytes=size,
            fuse=self.fs.open_mode,
            backing_files=backing[0],
            backing_bytes=backing[1],
            backing_writing=self.backing.writing,
            backing_waits=self.backing.waits,
            backing_error=self.publisher.backing_upkeep.error,
            counters=dict(self.counters),
            workspaces={n: [v.hex() for v in vs] for n, vs in self.refs.workspaces.items()},
            problems=self.publisher.all_problems(),
            root_procs=os.geteuid() == 0 and self.allow_root_procs,
            procs_user=(identity.ASKER if self.identity else procs_user(self.allow_root_procs)),
            mode=self.mount_mode,
            identity=self.identity,
            owners={n: describe_user(u) for n, u in self.refs.owners.items()},
            incomplete=self.publisher.incomplete.names(),
            incomplete_chunks=await self._incomplete_chunks(),
            durable=self.durable,
            lost=self.publisher.losses.to_wire(),
        )

    async def _incomplete_chunks(self) -> dict[str, int]:
        """Workspace -> how many chunks its current version lacks, for those serving one
        published early."""
        names = self.publisher.incomplete.names()
        current = {n: [self.refs.workspaces[n][0]] for n in names}
        lacking = await self.publisher.lacking(current)
        return {n: lacking[vs[0]] for n, vs in current.items() if vs[0] in lacking}



    def stats(self, asker: identity.Identity | None = None) -> StatsReply:
        """What `monarch-fs top` shows for this node, now: cheap, nothing read from disk. An
        `asker` who is not root (--identity munge) sees their own processes only."""
        now = time.time()
        mine = asker.uid if asker is not None and asker.uid != 0 else None
        procs = self.procs.describe(mine) if self.procs is not None else []
        return StatsReply(node=self.node_name, time=now, uptime=round(now - self.started, 1),
                          workspaces={n: vs[0].hex() for n, vs in self.refs.workspaces.items()},
                          reads=self.fs.read_counters(),
                          received=self.counters["bytes_received"], procs=procs)

    def describe_procs(self) -> str:
        """One line for the log: as whom this node runs processes, or that it refuses them."""
        user = procs_user(self.allow_root_procs)
        if self.identity:
            return (f"processes: run as the user who asks ({self.identity} credentials, "
                    f"{self.munge_socket}); as root "
                    + ("too" if self.allow_root_procs else f"never (no {ROOT_PROCS_FLAG})"))
        if not user:
            return f"processes: refused (this daemon runs as root; {ROOT_PROCS_FLAG} allows them)"
        if os.geteuid() == 0:
            return f"processes: run as root ({ROOT_PROCS_FLAG})"
        return f"processes: run as {user}, this daemon's user"

