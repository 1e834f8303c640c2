"""The node daemon: one per host. It owns the store, the FUSE mount and the published refs, and
answers pushes over the authenticated protocol.

A push is staged, then published in two phases: chunks land in the store as they arrive (never
visible in the mount); `prepare` checks that the manifest and every chunk it names are present,
writes the backing files passthrough reads large files from (fs/backing.py), and makes the store
durable; `commit` switches the workspace and returns once the kernel has dropped every changed
entry. A failed or abandoned push leaves the last good version serving; what it sent is reused,
except after this node failed to store a chunk (a full disk): then the open pack is cut back to
its last durable record, so the space comes back at once.

Everything under the state folder, and the log, is private to the daemon's user: the store and
the backing files hold every pushed file's bytes whatever its mode, and the log names every
process the daemon starts, argv included. Only the mount (with `default_permissions`, so each
file's own mode rules) shows content to other users.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyfuse3
import trio

from ..fs import passthrough
from ..fs.backing import BackingFiles
from ..fs.backing import key as backing_key
from ..fs.backing import wanted as backing_wanted
from ..fs.chunk import CorruptChunk
from ..fs.fuse_ops import SnapshotFS, mount_options, set_readahead
from ..fs.manifest import DEFAULT_MAX_ENTRIES, Manifest, ManifestError, TooManyEntries
from ..fs.store import PACK_LIMIT, Store, private_dir
from . import bulk
from . import protocol as p
from .auth import NO_TOKEN_HELP, default_token_file
from .limits import Limits, LogOnce, peer_host, serve_listeners
from .refs import Refs, check_workspace_name
from .procs import ProcessTable, SpawnError, free_port
from .relay import Relay
from .transport import Channel, ConnectionLost, accept, parse_addr

log = logging.getLogger("monarch_fs.daemon")

KEEP_VERSIONS = 3
WRITE_BATCH_BYTES = 4 << 20
WRITE_BATCH_CHUNKS = 256


class RequestError(Exception):
    """A request was refused; the message goes back to the client as is."""


class StoreFailed(RequestError):
    """A chunk could not be written to the store (a full disk, say)."""


class _Writes:
    """The store writes one connection has in flight, and the errors they met.

    Chunks are verified and written in batches on worker threads: for a tree of small files a
    thread hop per chunk costs more than the write. A batch goes out when it holds
    WRITE_BATCH_BYTES or WRITE_BATCH_CHUNKS, or when the connection waits for `idle`; the
    daemon-wide limiter bounds the batches in flight, which bounds memory and pushes back on
    the sender."""

    def __init__(self, counters: dict[str, int], limiter: trio.CapacityLimiter,
                 put: Callable[[p.PutChunk], bool]) -> None:
        self.counters = counters
        self.limiter = limiter
        self.put = put
        self.pending = 0
        self.errors: list[str] = []
        self.store_failed = False  # a write failed: what this push stored is given back
        self._batch: list[p.PutChunk] = []
        self._batch_bytes = 0
        self._idle = trio.Event()
        self._idle.set()

    async def start(self, nursery: trio.Nursery, msg: p.PutChunk) -> None:
        self._batch.append(msg)
        self._batch_bytes += len(msg.blob)
        if self._batch_bytes >= WRITE_BATCH_BYTES or len(self._batch) >= WRITE_BATCH_CHUNKS:
            await self._launch(nursery)

    async def _launch(self, nursery: trio.Nursery) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        token = object()
        await self.limiter.acquire_on_behalf_of(token)
        self.pending += 1
        self._idle = trio.Event() if self.pending == 1 else self._idle
        nursery.start_soon(self._run, token, batch)

    def _put_all(self, batch: list[p.PutChunk]) -> tuple[int, list[str], bool]:
        stored, errors, store_failed = 0, [], False
        for msg in batch:
            try:
                stored += self.put(msg)
            except RequestError as e:
                errors.append(str(e))
                store_failed |= isinstance(e, StoreFailed)
        return stored, errors, store_failed

    async def _run(self, token: object, batch: list[p.PutChunk]) -> None:
        try:
            stored, errors, store_failed = await trio.to_thread.run_sync(self._put_all, batch)
            self.counters["chunks_stored"] += stored
            self.errors += errors
            self.store_failed |= store_failed
        finally:
            self.limiter.release_on_behalf_of(token)
            self.pending -= 1
            if self.pending == 0:
                self._idle.set()

    async def idle(self, nursery: trio.Nursery) -> None:
        """Wait until every chunk received so far is stored (or has failed)."""
        if self._batch:
            await self._launch(nursery)
        await self._idle.wait()

    def raise_first(self) -> None:
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise RequestError(self.errors[0] + more)


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


def make_log_private() -> None:
    """The log names every process the daemon starts, argv included: when stderr is a file
    this user owns (the local cluster's node-I/log, a `2>>` redirect), only this user may read
    it. A journal or a terminal is left alone."""
    st = os.fstat(2)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(2, stat.S_IMODE(st.st_mode) & 0o700)


def clear_stale_mount(mountpoint: Path) -> None:
    """A daemon killed with SIGKILL leaves its mount behind ("transport endpoint is not
    connected"); detach it so the new daemon can mount in its place."""
    try:
        os.stat(mountpoint)
        stale = os.path.ismount(mountpoint)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise
        stale = True
    if stale:
        log.warning("detaching stale mount at %s", mountpoint)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                       stderr=subprocess.DEVNULL)
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)


class NodeDaemon:
    def __init__(self, *, state: str | os.PathLike[str], mount: str | os.PathLike[str],
                 listen: str, token: bytes, keep: int = KEEP_VERSIONS, node_name: str = "",
                 transport: bulk.LocalTransport | None = None, store_raw: bool = True,
                 encrypt: str = "auto", limits: Limits | None = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES):
        parse_addr(listen, listen=True)
        if not token:  # anyone who reached the port could run anything as this daemon's user
            raise ValueError("a daemon needs a token to accept requests: "
                             + NO_TOKEN_HELP.format(default=default_token_file()))
        self.listen = listen
        self.token = token
        # Sessions are always authenticated; encrypted under this policy (transport.encrypts).
        self.encrypt = encrypt
        self.limits = limits or Limits()
        self._log_once = LogOnce(log)  # refused handshakes: a line per peer per minute
        # What this node offers for chunk payloads (--transport; RDMA only if a device works).
        self.transport = transport or bulk.LocalTransport("tcp", "tcp", "not probed")
        # Chunks are kept decompressed: reads then cost a hash, not a decompression (twice the
        # disk for text-like content). --store-compressed trades read speed for disk.
        self.store_raw = store_raw
        self.keep = keep
        self.max_entries = max_entries  # a larger manifest is refused at prepare
        self.state = Path(state)
        self.mount = Path(mount)
        make_private(self.state)
        # MONARCH_FS_PACK_MIB: pack file size. A pack is deleted once nothing in it is used,
        # so smaller packs give space back sooner, for more files.
        pack_mib = int(os.environ.get("MONARCH_FS_PACK_MIB", PACK_LIMIT >> 20))
        self.store = Store(self.state / "store", pack_limit=max(1, pack_mib) << 20)
        self.refs = Refs(self.state / "refs.json")
        # What could not be loaded at start: logged, shown by `status`, and the rest served.
        # A workspace's own problems go once it is published again.
        self.problems: list[str] = [*self.store.problems, *self.refs.problems]
        self.workspace_problems: dict[str, list[str]] = {}
        self.backing = BackingFiles(self.state / "backing")
        self.fs = SnapshotFS(self.store.get, self.backing, self.store.get_if_cached)
        # The kernel let go of a file no served version has (after `rm`, or a dropped version
        # a reader held): its chunks may go now.
        self.fs.on_orphan_forgotten = self._start_collect
        self.node_name = node_name or socket.gethostname()
        self.addr = listen  # the bound address, once listening
        self._manifests: dict[bytes, Manifest] = {}
        self._prepared: set[tuple[str, bytes]] = set()
        # The version each workspace is being prepared for: its backing files are kept.
        self._pinned: dict[str, bytes] = {}
        self.backing_error: str | None = None  # why a file of the latest version has none
        self._nursery: trio.Nursery | None = None  # background work: backing files
        self._publish_lock = trio.Lock()
        # A collect, the answers to "which chunks do you lack", a prepare's check that it has
        # every chunk, durably, and a cut back of the open pack (which only drops what is not
        # durable): none of them runs during another.
        self._gc_lock = trio.Lock()
        self._collect_queued = False  # a collect is started and waits for the lock
        self._negotiating = 0  # sessions told what this node has, and not committed since
        self.procs: ProcessTable | None = None
        self._write_limiter = trio.CapacityLimiter(4)
        self.started = time.time()
        # What crossed this node since it started: a push's edges carry only what is lacking.
        self.counters = {"chunks_received": 0, "bytes_received": 0, "chunks_stored": 0,
                         "chunks_forwarded": 0, "packs_collected": 0, "bytes_collected": 0}

    # ---- life cycle -----------------------------------------------------------------------

    async def run(self, *, ready_file: str | None = None,
                  task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, SIGTERM or SIGINT; always unmounts on the way out."""
        await self._load_workspaces()
        for problem in self._problems():
            log.error("%s", problem)
        clear_stale_mount(self.mount)
        self.mount.mkdir(parents=True, exist_ok=True)
        host, port = parse_addr(self.listen, listen=True)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        self.addr = f"{host}:{bound[1]}" if ":" not in host else f"[{host}]:{bound[1]}"
        passthrough.request(self.fs.passthrough_unavailable() is None)
        pyfuse3.init(self.fs, str(self.mount), mount_options())
        self.fs.mounted = True
        try:
            async with trio.open_nursery() as nursery:
                self.procs = ProcessTable(self.mount, nursery)
                self.fs.nursery = self._nursery = nursery
                nursery.start_soon(self._fuse_main, nursery.cancel_scope)
                nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
                nursery.start_soon(serve_listeners, self._serve, listeners, self.limits, log)
                # A stat from another thread returns once the kernel finished FUSE INIT (which
                # resets the readahead window): then the mount is ready, and tunable.
                await trio.to_thread.run_sync(os.stat, self.mount)
                set_readahead(str(self.mount))
                await self.fs.check_passthrough()
                # Backing files this node's versions lack (all of them after a crash, see
                # fs/backing.py) are written now; until then the chunk store serves those files.
                nursery.start_soon(self._fill_backing)
                nursery.start_soon(self._collect)  # what a crash left behind
                log.info("serving %s on %s (state %s)", self.mount, self.addr, self.state)
                if ready_file:
                    tmp = ready_file + ".tmp"
                    Path(tmp).write_text(json.dumps({"addr": self.addr, "pid": os.getpid()}))
                    os.rename(tmp, ready_file)
                task_status.started(self.addr)
        finally:
            if self.procs is not None:
                await self.procs.stop_all()  # no process outlives its daemon
            self.fs.mounted = False
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", self.mount)
            try:
                self.backing.close()
            except OSError as e:  # they will be written again at the next start
                log.warning("flushing backing files: %s", e)

    async def _load_workspaces(self) -> None:
        """Serve the saved workspaces, each version whose manifest loads. A workspace whose
        current version does not load is not served at all (an older one in its place would be
        stale content nobody is told about) but kept in refs.json (Refs.hold); an older version
        that does not load is dropped. Each is a problem in `status`."""
        for name, versions in list(self.refs.workspaces.items()):
            loaded, problems = [], []
            for v in versions:
                try:
                    loaded.append((v, self._manifest(v)))
                except (KeyError, CorruptChunk, ManifestError, OSError) as e:
                    why = "manifest not in the store" if isinstance(e, KeyError) else str(e)
                    if v == versions[0]:
                        problems.append(f"workspace {name!r} not served: its current version "
                                        f"{v.hex()[:12]} does not load: {why}")
                        break
                    problems.append(f"workspace {name!r}: older version {v.hex()[:12]} "
                                    f"dropped: {why}")
            if problems:
                self.workspace_problems[name] = problems
            if not loaded:
                self.refs.hold(name)
                continue
            self.refs.workspaces[name] = [v for v, _ in loaded]
            await self.fs.set_workspace(name.encode(), loaded)

    async def _fuse_main(self, scope: trio.CancelScope) -> None:
        await pyfuse3.main()
        log.warning("mount %s went away; stopping", self.mount)
        scope.cancel()

    async def _stop_on_signal(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for sig in signals:
                log.info("received %s; stopping", signal.Signals(sig).name)
                scope.cancel()
                return

    # ---- connections ----------------------------------------------------------------------

    async def _serve(self, stream: trio.SocketStream) -> None:
        try:
            peer = "%s:%d" % stream.socket.getpeername()[:2]
        except OSError:
            peer = "?"
        try:
            chan = await accept(stream, self.token, {"node": self.node_name, "addr": self.addr,
                                                     "max_entries": self.max_entries,
                                                     **self.transport.info()},
                                timeout=self.limits.handshake_timeout, encrypt=self.encrypt)
        except Exception as e:  # a line per peer address per minute, however many attempts
            if isinstance(e, trio.TooSlowError):
                why = f"no handshake within {self.limits.handshake_timeout:g}s"
            else:
                why = str(e) or type(e).__name__
            self._log_once(("handshake", peer_host(stream)), logging.WARNING,
                           "refused connection from %s: %s", peer, why)
            await trio.aclose_forcefully(stream)
            return
        try:
            await self._session(chan)
        except Exception as e:  # a broken client must never take the daemon down
            log.warning("connection from %s ended: %s", peer, e)
        finally:
            await chan.aclose()

    async def _session(self, chan: Channel) -> None:
        """One client or parent connection. Chunks land in the store as they arrive (a few
        writes at a time, overlapping the next receive); in a relay session they are also
        forwarded to the children whose subtrees lack them."""
        writes = _Writes(self.counters, self._write_limiter, self._put)
        relay: Relay | None = None
        own_missing: set[bytes] | None = None  # what this node lacks, once asked
        claimed = False  # this session was told what this node has: no collect until commit
        bulk_rx: bulk.BulkReceiver | None = None  # an RDMA channel the client opened

        async def on_chunk(cid: bytes, blob: bytes) -> None:  # PutChunk frames and RDMA alike
            self.counters["chunks_received"] += 1
            self.counters["bytes_received"] += len(blob)
            if relay is not None:
                await relay.forward(cid, blob)
            if own_missing is None or cid in own_missing:
                await writes.start(nursery, p.PutChunk(cid, blob))

        async with trio.open_nursery() as nursery:
            try:
                while True:
                    try:
                        msg = await chan.receive()
                    except ConnectionLost:
                        return  # the peer went away: the normal end of a session
                    except Exception as e:  # a broken or forged frame ends this session only
                        log.warning("session with %s ended: %s", chan.peer, e)
                        return
                    if isinstance(msg, p.PutChunk):
                        await on_chunk(msg.cid, msg.blob)
                    elif isinstance(msg, p.QueryMissing):
                        async with self._gc_lock:  # not while a collect drops chunks
                            own = await trio.to_thread.run_sync(self.store.missing, msg.ids)
                        if not claimed:
                            claimed, self._negotiating = True, self._negotiating + 1
                        own_missing = set(own)
                        below = await relay.query(msg.ids) if relay is not None else set()
                        await chan.send(p.MissingIds(
                            [i for i in msg.ids if i in own_missing or i in below]))
                    elif isinstance(msg, p.Request) and msg.op == "relay":
                        relay = Relay(self.token, msg.args.get("children", []),
                                      float(msg.args.get("timeout", 60)), nursery,
                                      self.counters, self.transport, self.encrypt)
                        await chan.send(p.Reply(msg.id, {"failed": await relay.open()}))
                    elif isinstance(msg, p.Request) and msg.op in ("spawn", "kill", "free_port"):
                        try:
                            value = await self._proc_request(chan, msg)
                        except (SpawnError, ValueError) as e:
                            await chan.send(p.Error(str(e), code="refused", id=msg.id))
                        else:
                            await chan.send(p.Reply(msg.id, value))
                    elif isinstance(msg, p.Request) and msg.op == "bulk":
                        try:  # an RDMA channel for chunk payloads; control stays here
                            bulk_rx, value = bulk.accept_receiver(self.transport, msg.args,
                                                                  on_chunk, nursery,
                                                                  chan.conn.bulk_key)
                        except Exception as e:
                            await chan.send(p.Error(f"bulk: {e}", code="refused", id=msg.id))
                        else:
                            await chan.send(p.Reply(msg.id, value))
                    elif isinstance(msg, p.Request) and msg.op == "flush":
                        bulk_error = None  # RDMA chunks are not ordered with this request
                        if bulk_rx is not None:
                            bulk_error = await bulk_rx.wait_delivered(
                                int(msg.args.get("bulk_chunks", 0)))
                        await writes.idle(nursery)
                        await self._cut_back_after_failure(writes)
                        failed = await relay.flush() if relay is not None else {}
                        if writes.errors:
                            failed[""] = writes.errors[0]  # "" is this node, as its parent names it
                        if bulk_error:
                            failed[""] = f"rdma: {bulk_error}"
                        await chan.send(p.Reply(msg.id, {"failed": failed}))
                    elif isinstance(msg, p.Request):
                        await writes.idle(nursery)  # a request sees every chunk sent before it
                        try:
                            writes.raise_first()
                            value = await self._handle(msg.op, msg.args)
                            if msg.op == "commit" and claimed:  # what it has is now retained
                                claimed = False
                                self._release_claim()
                            elif msg.op == "commit":
                                self._start_collect()
                        except (RequestError, ValueError, ManifestError) as e:
                            await chan.send(p.Error(str(e), code="refused", id=msg.id))
                        except Exception as e:
                            log.exception("request %s failed", msg.op)
                            await chan.send(p.Error(f"internal error: {e!r}", code="internal",
                                                    id=msg.id))
                        else:
                            await chan.send(p.Reply(msg.id, value))
            finally:
                if claimed:
                    self._release_claim()
                if relay is not None:
                    await relay.aclose()
                if bulk_rx is not None:
                    await bulk_rx.aclose()
                await self.procs.kill_owned_by(chan)  # the controller went away
                if writes.store_failed:  # and did not flush: its writes may still run
                    await writes.idle(nursery)
                    await self._cut_back_after_failure(writes)
                nursery.cancel_scope.cancel()

    async def _proc_request(self, chan: Channel, msg: p.Request) -> dict:
        args = msg.args
        if msg.op == "kill":
            self.procs.kill(chan, int(args.get("proc", 0)), int(args.get("signal", signal.SIGTERM)))
            return {}
        if msg.op == "free_port":  # MASTER_PORT for an SPMD job whose rank 0 runs here
            return {"port": free_port()}
        pin = None
        if args.get("workspace"):
            name = str(args["workspace"])
            versions = self.refs.workspaces.get(name)
            if not versions:
                raise SpawnError(f"no workspace {name!r} on this node; push it first")
            version = bytes.fromhex(args["version"]) if args.get("version") else versions[0]
            if version not in versions:
                raise SpawnError(f"workspace {name!r} has no version {version.hex()[:12]} here")
            pin = str(self.mount / ".versions" / name / version.hex())

        async def emit(kind: str, data: dict) -> None:
            await chan.send(p.Event(kind, data))

        return await self.procs.spawn(chan, emit, args, pin, workspace=name if pin else "")

    def _put(self, msg: p.PutChunk) -> bool:
        try:
            return self.store.put_blob(msg.cid, msg.blob, raw=self.store_raw)
        except CorruptChunk as e:
            raise RequestError(f"rejected {e}") from None
        except OSError as e:
            raise StoreFailed(f"cannot store chunk {msg.cid.hex()}: {e.strerror or e}") from None

    async def _cut_back_after_failure(self, writes: _Writes) -> None:
        """After this session failed to store a chunk: cut the open pack back to its last
        durable record, so the chunks this failed push did store give their space back now
        (Store.cut_back). A push that fails for another reason keeps them, for the next."""
        if not writes.store_failed:
            return
        writes.store_failed = False
        async with self._gc_lock:
            try:
                freed = await trio.to_thread.run_sync(self.store.cut_back)
            except OSError as e:
                log.warning("cutting back the open pack after a failed write: %s", e)
                return
        if freed:
            log.info("a write failed: gave back the %d bytes the push had stored since the "
                     "last durable record", freed)

    # ---- requests -------------------------------------------------------------------------

    async def _handle(self, op: str, args: dict) -> dict:
        if op == "status":
            return await self.status()
        if op == "remove":
            name = args.get("name")
            if not isinstance(name, str):
                raise RequestError("remove: a workspace name is required")
            check_workspace_name(name)
            return await self._remove(name)
        if op in ("prepare", "commit"):
            name, version = args.get("name"), args.get("version")
            if not isinstance(name, str) or not isinstance(version, str):
                raise RequestError(f"{op}: name and version are required")
            check_workspace_name(name)
            try:
                vid = bytes.fromhex(version)
            except ValueError:
                raise RequestError(f"{op}: bad version {version!r}") from None
            if op == "prepare":
                return await self._prepare(name, vid)
            return await self._commit(name, vid)
        raise RequestError(f"unknown request {op!r}")

    def _manifest(self, version: bytes) -> Manifest:
        """A version's manifest, decoded once. One with more than max_entries entries is
        refused from its header (TooManyEntries), unless it was published before the limit
        was lowered: a prepare that refused it, and every collect after, decode nothing."""
        m = self._manifests.get(version)
        if m is None:
            published = any(version in vs for vs in self.refs.workspaces.values())
            m = Manifest.decode(self.store.get(version),
                                max_entries=None if published else self.max_entries)
            if self._manifests:  # share memory with the version loaded last
                m.share_entries(next(reversed(self._manifests.values())))
            self._manifests[version] = m
        return m

    def _check_complete(self, version: bytes) -> None:
        try:
            manifest = self._manifest(version)
        except KeyError:
            raise RequestError(f"version {version.hex()[:12]}: manifest not received") from None
        except TooManyEntries as e:  # a ManifestError: first
            raise RequestError(
                f"version {version.hex()[:12]}: the manifest has {e.count:,} entries, more than "
                f"this node accepts ({e.limit:,}: its --max-entries or MONARCH_FS_MAX_ENTRIES)"
            ) from None
        except (CorruptChunk, ManifestError) as e:
            raise RequestError(f"version {version.hex()[:12]}: {e}") from None
        missing = self.store.missing(manifest.chunk_ids())
        if missing:
            raise RequestError(f"version {version.hex()[:12]}: {len(missing)} chunks missing")

    async def _make_ready(self, name: str, version: bytes) -> None:
        """Everything a publish of `version` needs: every chunk, durable in the store. The
        version is pinned (kept from collection) meanwhile, and stays pinned if it is ready.
        Checked and synced under the collect lock: a cut back in between could drop a chunk
        found present but not yet durable."""
        before = self._pinned.get(name)
        self._pinned[name] = version
        try:
            async with self._gc_lock:
                await trio.to_thread.run_sync(self._check_complete, version)
                await trio.to_thread.run_sync(self.store.sync)
        except BaseException:
            if before is None:
                self._pinned.pop(name, None)
            else:
                self._pinned[name] = before
            raise

    async def _write_backing(self, manifest: Manifest, *,
                             task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write the backing files `manifest` lacks; a file that cannot be written is served
        from the chunk store, and `status` says why. Started once the copies are queued."""
        try:
            failed = await self.backing.write_missing(manifest.entries, self.store,
                                                      task_status=task_status)
        except OSError as e:  # the folder itself (this runs in the background: never fatal)
            failed = [f"backing files in {self.backing.root}: {e.strerror or e}"]
        self.backing_error = None  # about the latest version's files only
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            self.backing_error = failed[0] + more
            log.warning("backing files: %s; those files are read through the daemon",
                        self.backing_error)

    async def _fill_backing(self) -> None:
        """At start: write the backing files the current versions lack (files of older retained
        versions without one are read through the daemon), and drop unused ones."""
        if not self.fs.passthrough:
            return
        for versions in list(self.refs.workspaces.values()):
            await self._write_backing(self._manifest(versions[0]))
        await self._prune_backing()

    async def _prune_backing(self) -> None:
        """Delete the backing files that no retained or in-flight version uses (all of them
        when the mount is not in passthrough mode)."""
        if not self.fs.passthrough:
            await trio.to_thread.run_sync(self.backing.prune, set())
            return
        manifests = []
        for v in {v for vs in self.refs.workspaces.values() for v in vs} | {*self._pinned.values()}:
            try:
                manifests.append(self._manifest(v))
            except (KeyError, CorruptChunk, ManifestError):
                continue  # a pinned version whose manifest never arrived

        def keep() -> set[str]:
            return {backing_key(e) for m in manifests for e in m.entries if backing_wanted(e)}

        try:
            await trio.to_thread.run_sync(lambda: self.backing.prune(keep()))
        except OSError as e:
            log.warning("pruning backing files: %s", e)

    def _release_claim(self) -> None:
        """A session told what this node has committed or went away."""
        self._negotiating -= 1
        self._start_collect()

    def _start_collect(self) -> None:
        """After a commit, a released claim, a removal or a forgotten file: once no push is in
        flight, the chunks the last ones left unused can go. One collect waiting for the lock
        does for every request made meanwhile (the kernel forgets files in many batches)."""
        if self._negotiating == 0 and self._nursery is not None and not self._collect_queued:
            self._collect_queued = True
            self._nursery.start_soon(self._collect)

    async def _collect(self) -> None:
        """Delete the store's packs that hold only chunks nothing uses (no retained version, no
        version being published, no file the kernel still holds), and compact those that hold
        mostly such chunks (Store.collect). Skipped while another push has been told what this
        node has (those chunks must stay): its commit collects."""
        async with self._gc_lock:
            self._collect_queued = False
            if self._negotiating:
                return
            if self.refs.held:  # what their versions use is unknown (`status` says why)
                log.warning("not collecting: workspaces not loaded at start: %s",
                            ", ".join(map(repr, self.refs.held)))
                return
            retained = {v for vs in self.refs.workspaces.values() for v in vs}
            versions = retained | set(self._pinned.values())
            manifests = []
            for v in versions:
                try:
                    manifests.append(self._manifest(v))
                except (KeyError, CorruptChunk, ManifestError) as e:
                    if v in retained:  # what it uses is unknown: delete nothing
                        log.warning("not collecting: version %s: %s", v.hex()[:12], e)
                        return
                    # else a version being published whose manifest has not arrived
            held = self.fs.held_chunks()

            def live() -> Iterator[Iterable[bytes]]:  # by version: few repeats in each
                yield versions
                yield held
                for m in manifests:
                    yield (c for e in m.entries for c in e.chunks)

            try:
                packs, freed = await trio.to_thread.run_sync(self.store.collect, live)
            except OSError as e:
                log.warning("collecting the store: %s", e)
                return
        if packs:
            self.counters["packs_collected"] += packs
            self.counters["bytes_collected"] += freed
            log.info("collected %d packs, freeing %d bytes no version uses", packs, freed)

    async def _prepare(self, name: str, version: bytes) -> dict:
        await self._make_ready(name, version)
        self._prepared.add((name, version))
        return {"prepared": version.hex()}

    async def _commit(self, name: str, version: bytes) -> dict:
        if (name, version) not in self._prepared:
            await self._make_ready(name, version)
        async with self._publish_lock:
            # Everything that can fail comes before the refs are saved, and nothing changes
            # before the save: a commit that fails leaves no trace in memory, on disk, or in
            # the mount (issue 16, finding 5). Backing files are only a cache of the store.
            versions = self.refs.next_versions(name, version, self.keep)
            staged = await self.fs.stage(name.encode(),
                                         [(v, self._manifest(v)) for v in versions])
            if self.fs.passthrough and self._nursery is not None:
                # Backing files are a cache of the store (fs/backing.py), written in the
                # background from the commit on: not at prepare, where the copies slowed the
                # other nodes' prepares (4.5 s vs 4.2 s for 3 hosts on one 2-core machine) and
                # would compete with the store's fsync on a real disk. Queued before the switch,
                # so an open of a new file waits for its copy rather than missing passthrough.
                await self._nursery.start(self._write_backing, self._manifest(version))
            previous = self.refs.workspaces.get(name, [None])[0]
            try:
                self.refs.publish(name, versions)
            except OSError as e:
                raise RequestError(f"cannot save {self.refs.path}: {e.strerror or e}; "
                                   f"{name!r} stays at its last version") from None
            await self.fs.switch(staged)
            self.workspace_problems.pop(name, None)
            self._prepared.discard((name, version))
            if self._pinned.get(name) == version:
                del self._pinned[name]
            self._drop_manifests()
            await self._prune_backing()
        log.info("published %s = %s", name, version.hex())
        return {"version": version.hex(), "previous": previous.hex() if previous else None}

    def _drop_manifests(self) -> None:
        """Forget the decoded manifests no retained or in-flight version uses."""
        self._manifests = {v: m for v, m in self._manifests.items()
                           if v in self._pinned.values()
                           or any(v in vs for vs in self.refs.workspaces.values())}

    async def _remove(self, name: str) -> dict:
        """Delete a workspace (`monarch-fs rm`): the mount drops it at once, kernel entries
        included; its manifests leave memory, its backing files go, and a collect gives back
        its chunks (the open pack is sealed first, so that a collect may reach those in it).
        A file a reader holds open keeps reading until closed, as for dropped versions.

        Refused while a process this daemon started with `--workspace NAME` runs: it runs
        from MOUNT/.versions/NAME/VERSION, which would vanish under it."""
        async with self._publish_lock:
            versions = self.refs.workspaces.get(name)
            if not versions:
                raise RequestError(f"no workspace {name!r} on this node")
            users = self.procs.pinned_to(name) if self.procs is not None else []
            if users:
                pids = ", ".join(str(pid) for pid in users[:5])
                raise RequestError(
                    f"workspace {name!r} is in use by {len(users)} "
                    f"process{'es' if len(users) > 1 else ''} started with --workspace (pid "
                    f"{pids}{', ...' if len(users) > 5 else ''}); stop them, then remove it")
            self.refs.remove(name)
            await self.fs.remove_workspace(name.encode())
            self._drop_manifests()
            await self._prune_backing()
        try:
            await trio.to_thread.run_sync(self.store.seal)
        except OSError as e:  # a full disk: what the open pack holds waits for a later seal
            log.warning("sealing the open pack after removing %s: %s", name, e)
        self._start_collect()
        log.info("removed workspace %s (%d versions)", name, len(versions))
        return {"versions": [v.hex() for v in versions]}

    async def status(self) -> dict:
        objects, size = await trio.to_thread.run_sync(self.store.usage)
        backing = await trio.to_thread.run_sync(self.backing.usage)
        return {
            "node": self.node_name,
            "addr": self.addr,
            "mount": str(self.mount),
            **self.transport.info(),
            "pid": os.getpid(),
            "uptime": round(time.time() - self.started, 1),
            "store_objects": objects,
            "store_bytes": size,
            "fuse": self.fs.open_mode,
            "backing_files": backing[0],
            "backing_bytes": backing[1],
            "backing_writing": self.backing.writing,
            "backing_waits": self.backing.waits,
            "backing_error": self.backing_error,
            **self.counters,
            "workspaces": {n: [v.hex() for v in vs] for n, vs in self.refs.workspaces.items()},
            "problems": self._problems(),
        }

    def _problems(self) -> list[str]:
        return [*self.problems, *(p for ps in self.workspace_problems.values() for p in ps)]
