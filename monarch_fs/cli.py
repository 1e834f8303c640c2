"""The `monarch-fs` command: a thin dispatcher over the daemon, push, status, run and cluster
code."""

# It sits at the package top, not in daemon/, because it is the one module that sees all three
# layers (`run` drives the mesh): fs/, daemon/ and mesh/ only ever import downward.

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from .daemon.client import cluster, slurm
from .daemon.client.hosts import HostsError, resolve_target
from .daemon.client.progress import Progress, fmt_bytes
from .daemon.client.push import PushError, push, workspace_name
from .daemon.client.status import remove, status
from .daemon.node.procs import ROOT_PROCS_FLAG
from .daemon.wire import identity
from .daemon.wire.addresses import ENCRYPT_POLICIES
from .daemon.wire.auth import (
    TokenError,
    default_token_file,
    home_dir,
    resolve_token,
    write_new_token,
)
from .daemon.wire.bulk import TRANSPORTS, resolve_local
from .daemon.wire.limits import Limits
from .daemon.wire.replies import StatusReply
from .fs.manifest import DEFAULT_MAX_ENTRIES
from .fs.scan import SourceChanged
from .settings import settings

log = logging.getLogger("monarch_fs")
TRANSPORT_HELP = ("how chunk payloads travel: auto (RDMA when both ends have a usable device, "
                  "else TCP, saying why), tcp, or rdma (an error without a device)")
ENCRYPT_HELP = ("encrypt sessions (every frame is authenticated either way): auto (links that "
                "leave this machine; loopback is not), on, or off; a client asks, a daemon "
                "requires, and either is enough")


class BarProgress(Progress):
    """A tqdm bar per phase on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar = None

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(total=total or None, desc=f"{name:>10}", unit=unit,
                        unit_scale=unit == "B", unit_divisor=1024, leave=False,
                        dynamic_ncols=True)

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def cmd_daemon(args: argparse.Namespace, serve: Callable[[Any], Awaitable[Any]] | None = None
               ) -> int:
    """Run a node daemon; `serve(daemon)`, when given, runs it instead of daemon.run (the
    SLURM task announces its address once the daemon is up)."""
    from .daemon.node.daemon import NodeDaemon, make_log_private
    from .fs.mount_check import MountError, check_mount

    make_log_private()
    token = resolve_token(args.token_file)  # no token: refuse to start (auth.NoToken)
    allow_other = {"auto": None, "yes": True, "no": False}[args.allow_other]
    try:
        # Before anything is logged or made (the state folder): a mount that cannot be made
        # is one line with the fix, and NodeDaemon.run tells a failure it could not foresee
        # the same way.
        check_mount(Path(args.mount), allow_other)
        munge_socket = args.munge_socket or identity.munge_socket()
        if args.identity == identity.MODE and not os.path.exists(munge_socket):
            print(f"monarch-fs: error: {socket.gethostname()}: --identity munge: no munged "
                  f"socket at {munge_socket}: start munged (package munge) or pass "
                  "--munge-socket PATH", file=sys.stderr)
            return 1
        transport = resolve_local(args.transport)  # --transport rdma without a device: exit 1
        log.info("transport: %s (%s)", transport.kind, transport.reason)
        limits = Limits(max_connections=args.max_connections,
                        max_per_peer=args.max_connections_per_peer,
                        handshake_timeout=args.handshake_timeout)
        daemon = NodeDaemon(state=args.state, mount=args.mount, listen=args.listen, token=token,
                            keep=args.keep, node_name=args.node_name, transport=transport,
                            store_raw=not args.store_compressed, encrypt=args.encrypt,
                            limits=limits, allow_root_procs=args.allow_root_procs,
                            identity_mode="" if args.identity == "token" else args.identity,
                            munge_socket=munge_socket,
                            max_entries=args.max_entries or settings.max_entries,
                            allow_other=allow_other)
        if serve is not None:
            trio.run(serve, daemon)
        else:
            trio.run(lambda: daemon.run(ready_file=args.ready_file))
    except MountError as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    return 0


def scan_cache_dir() -> Path:
    """Where push keeps its scan caches: $MONARCH_FS_HOME/scan-cache (~/.monarch-fs/...)."""
    return home_dir() / "scan-cache"


def cmd_push(args: argparse.Namespace) -> int:
    hosts, token = target(args)
    cache_dir = None if args.no_cache else scan_cache_dir()
    transport = resolve_local(args.transport)  # --transport rdma without a device: exit 1

    def run(progress: Progress | None = None):
        return push(
            args.src, hosts, token, name=args.name, excludes=args.exclude, progress=progress,
            topology_kind=args.topology, fanout=args.fanout, allow_partial=args.allow_partial,
            timeout=args.timeout, cache_dir=cache_dir, transport=transport,
            encrypt=args.encrypt, at_source=args.at_source)

    if args.watch:
        from .daemon.client.watch import watch

        workspace_name(args.src, args.name)  # a name no node takes: say so once, not per change

        return trio.run(lambda: watch(args.src, run, excludes=args.exclude,
                                      ignore=[cache_dir] if cache_dir else [],
                                      json_lines=args.json))
    bar = BarProgress() if sys.stderr.isatty() and not args.json else None
    try:
        result = trio.run(run, bar)
    except SourceChanged as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    finally:
        if bar:
            bar.close()
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for line in result.left_behind():
        print(line, file=sys.stderr)
    if args.json:
        out = result.to_json()
        out.pop("warnings")
        print(json.dumps(out))
    else:
        print(f"pushed {result.name} {result.version[:12]} to {result.nodes} nodes in "
              f"{result.seconds:.2f}s: {result.files} files, {fmt_bytes(result.bytes)}; sent "
              f"{fmt_bytes(result.bytes_sent)} ({result.chunks_sent} chunks; the snapshot has "
              f"{result.chunks_total}), "
              f"{result.topology}, {result.transport})")
    return 0


def target(args: argparse.Namespace) -> tuple[list[str], bytes]:
    """The hosts and token a client command talks to: --hosts and --token-file, else the
    environment's, else this SLURM job's (`slurm up`), else the local cluster's."""
    hosts, token_file = resolve_target(args.hosts, args.token_file)
    return hosts, resolve_token(token_file)


def cmd_status(args: argparse.Namespace) -> int:
    hosts, token = target(args)
    nodes = trio.run(status, hosts, token)
    if args.json:
        print(json.dumps([n.to_json() for n in nodes]))
    else:
        for n in nodes:
            s = n.reply
            if s is None:
                print(f"{n.host}  UNREACHABLE  {n.error}")
                continue
            ws = ", ".join(
                f"{name}={vs[0][:12]}" + (f" (+{len(vs) - 1} older)" if len(vs) > 1 else "")
                + (f" by {s.owners[name]}" if name in s.owners else "")
                for name, vs in sorted(s.workspaces.items())) or "no workspaces"
            print(f"{n.host}  {s.node}  {ws}  store {fmt_bytes(s.store_bytes)}"
                  f" in {s.store_objects} objects  transport {s.transport.get('transport', 'tcp')}"
                  f"  fuse {s.fuse}"
                  + (f" ({s.backing_files} backing files, {fmt_bytes(s.backing_bytes)})"
                     if s.backing_files else "")
                  + (f" (writing {s.backing_writing} more)" if s.backing_writing else "")
                  + f"  mode {s.mode}  processes {_procs_line(s)}")
            if s.backing_error:
                print(f"{n.host}  warning: {s.backing_error}; read through the daemon")
            for problem in s.problems:
                print(f"{n.host}  problem: {problem}")
    return 0 if all(n.reachable for n in nodes) else 1


def _procs_line(s: StatusReply) -> str:
    if s.identity:
        return (f"as the user who asks ({s.identity} credentials; root "
                + ("allowed)" if s.root_procs else "refused)"))
    if s.root_procs:
        return f"as root ({ROOT_PROCS_FLAG})"
    if not s.procs_user:
        return f"refused (root without {ROOT_PROCS_FLAG})"
    return f"as {s.procs_user}"


def cmd_rm(args: argparse.Namespace) -> int:
    hosts, token = target(args)
    nodes = trio.run(remove, hosts, token, args.name)
    if args.json:
        print(json.dumps([n.to_json() for n in nodes]))
    else:
        for n in nodes:
            if n.removed:
                print(f"{n.host}: removed {args.name} ({len(n.versions)} versions)")
            else:
                print(f"{n.host}: {n.error}", file=sys.stderr)
    return 0 if all(n.removed for n in nodes) else 1


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.action == "up":
        addrs = cluster.up(args.nodes, args.dir, root_procs=not args.no_root_procs)
        d = args.dir or cluster.default_cluster_dir()
        print(f"cluster of {len(addrs)} nodes up in {d}: {' '.join(addrs)}")
        print(f"hosts file: {os.path.join(d, 'hosts')}")
        print(cluster.describe_procs(root_procs=not args.no_root_procs))
    else:
        n = cluster.down(args.dir)
        print(f"stopped {n} daemons")
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    extra = args.daemon_args
    if args.action == "node":
        return slurm_node(args, extra)
    if args.action == "down":
        step = slurm.down()
        print(f"stopped the daemons of step {step} (unmounted)" if step else
              f"no daemons up in job {slurm.job_id()}")
        return 0
    node_args = ["--mount", args.mount, *(["--state", args.state] if args.state else []),
                 "--", *extra]
    # (Said only inside a job: outside one, `up` fails in one line below.)
    if os.geteuid() == 0 and ROOT_PROCS_FLAG not in extra and slurm.job_id() is not None:
        # A root daemon refuses to launch processes without it; the job asked for root.
        node_args.append(ROOT_PROCS_FLAG)
        print(f"monarch-fs: running as root: the daemons run processes as root "
              f"({ROOT_PROCS_FLAG})", file=sys.stderr)
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, r: slurm.Ready) -> None:
        """One line, rewritten in place on a terminal; a line per node in a job's log."""
        print(("\r" if tty else "") + f"slurm up: {done}/{total} nodes mounted "
              f"({r.node} {r.addr})", end="" if tty and done < total else "\n",
              file=sys.stderr, flush=True)

    res = slurm.up(node_args, timeout=args.timeout, on_ready=progress)
    print(f"job {res.job}: {len(res.nodes)} daemons up in {res.seconds:.1f}s on "
          f"{' '.join(r.node for r in res.nodes)}, mounted at "
          f"{slurm.expand(args.mount, res.job, '{node}')}; hosts {res.hosts_file} "
          "(push, status and run use them in this job)")
    return 0


def slurm_node(args: argparse.Namespace, extra: list[str]) -> int:
    """One srun task: read the job's token on stdin, serve this node's mount on its address,
    print one ready (or failed) line on stdout, and remove the node's folders at the end."""
    try:
        task = slurm.NodeTask.from_env()
    except slurm.SlurmError as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    mount = state = None
    announced = False

    async def serve(daemon: Any) -> None:
        nonlocal announced
        async with trio.open_nursery() as nursery:
            addr = await nursery.start(daemon.run)
            print(task.ready_line(addr), flush=True)
            announced = True

    try:
        mount, state, token_file = slurm.prepare_node(task, args.mount, args.state,
                                                      sys.stdin.buffer.read())
        daemon_args = build_parser().parse_args([
            "daemon", "--listen", f"{slurm.node_address()}:0", "--mount", str(mount),
            "--state", str(state), "--token-file", str(token_file), "--node-name", task.node,
            *extra])
        return cmd_daemon(daemon_args, serve=serve)
    except BaseException as e:
        if isinstance(e, SystemExit):  # argparse said why on stderr (the daemons' log)
            cause = f"daemon options {' '.join(extra) or '(none)'} refused"
        else:
            cause = str(e).strip() or type(e).__name__
        if not announced:
            print(task.failed_line(cause), flush=True)
        print(f"monarch-fs: error: {task.node}: {cause}", file=sys.stderr)
        return 1
    finally:
        if mount is not None and state is not None:
            slurm.remove_node_dirs(mount, state)


def cmd_token(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser() if args.path else default_token_file()
    try:
        write_new_token(path, replace=args.force)
    except TokenError as e:
        raise TokenError(f"{e}; --force replaces it (every daemon and client must then get "
                         "the new one)") from None
    print(f"wrote a new token to {path} (mode 0600): give it to every daemon and client with "
          f"--token-file {path}")
    return 0


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def cmd_run(args: argparse.Namespace) -> int:
    from .mesh.spmd import Job, run_job

    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        print("monarch-fs: error: run needs a command: monarch-fs run [options] -- CMD ARGS...",
              file=sys.stderr)
        return 2
    if args.per_host < 1 or args.max_restarts < 0:
        print("monarch-fs: error: --per-host must be >= 1 and --max-restarts >= 0",
              file=sys.stderr)
        return 2
    hosts, token = target(args)
    # --transport rdma without a device here: exit 1 before connecting; the hosts are checked
    # once connected (spmd.choose_transports), still before anything is launched.
    local = resolve_local(args.transport, where=f"the controller {socket.gethostname()}")
    job = Job(argv, per_host=args.per_host, cwd=args.cwd, workspace=args.workspace,
              env=_env_pairs(args.env), max_restarts=args.max_restarts,
              transport=args.transport)
    return trio.run(run_job, hosts, token, job, local)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monarch-fs", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run a node daemon: serve the mount, accept pushes")
    d.add_argument("--listen", required=True, metavar="HOST:PORT")
    d.add_argument("--mount", required=True, metavar="DIR")
    d.add_argument("--state", required=True, metavar="DIR")
    d.add_argument("--token-file", metavar="F")
    d.add_argument("--keep", type=int, default=3, help="versions kept per workspace (default 3)")
    d.add_argument("--store-compressed", action="store_true",
                   help="keep chunks zstd-compressed on disk (less disk, slower cold reads)")
    d.add_argument("--ready-file", help="write {addr, pid} here once mounted and listening")
    d.add_argument("--node-name", default="", help="name reported in status (default hostname)")
    d.add_argument("--transport", choices=TRANSPORTS, default="auto", help=TRANSPORT_HELP)
    d.add_argument("--encrypt", choices=ENCRYPT_POLICIES, default="auto", help=ENCRYPT_HELP)
    d.add_argument("--max-connections", type=int, default=Limits.max_connections, metavar="N",
                   help="open connections in all; more are refused at once "
                        f"(default {Limits.max_connections})")
    d.add_argument("--max-connections-per-peer", type=int, default=Limits.max_per_peer,
                   metavar="N", help="open connections from one address; more are refused at "
                                     f"once (default {Limits.max_per_peer})")
    d.add_argument("--handshake-timeout", type=float, default=Limits.handshake_timeout,
                   metavar="S", help="drop a peer that has not authenticated S seconds after "
                                     f"connecting (default {Limits.handshake_timeout:g})")
    d.add_argument("--allow-other", choices=["auto", "yes", "no"], default="auto",
                   help="let other users read the mount: auto (as root, or as a normal user "
                        "where /etc/fuse.conf has user_allow_other), yes (an error where it "
                        "cannot), no (only this user)")
    d.add_argument("--max-entries", type=int, metavar="N",
                   help="refuse a snapshot of more than N files, folders and links "
                        f"(default $MONARCH_FS_MAX_ENTRIES, else {DEFAULT_MAX_ENTRIES:,})")
    d.add_argument(ROOT_PROCS_FLAG, action="store_true",
                   help="as root, run the processes `run` and meshes ask for (as root); without "
                        "it a root daemon refuses them, since anyone holding the token could "
                        "then run anything as root (the local `cluster up` passes it)")
    d.add_argument("--identity", choices=["token", identity.MODE], default="token",
                   help="munge: the requests that launch processes or publish carry a MUNGE "
                        "credential; a root daemon runs each process as the user who asks, and "
                        "a workspace belongs to who pushed it. token (default): the shared "
                        "token only, processes run as the daemon's user")
    d.add_argument("--munge-socket", metavar="PATH",
                   help="munged's socket (default $MONARCH_FS_MUNGE_SOCKET, else "
                        f"{identity.DEFAULT_SOCKET})")
    d.set_defaults(fn=cmd_daemon)

    hosts_help = ("host:port,host:port or @hostfile (default $MONARCH_FS_HOSTS, then the local "
                  "cluster)")
    p = sub.add_parser("push", help="push a folder to every node and publish it")
    p.add_argument("src", metavar="SRC")
    p.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    p.add_argument("--name", help="workspace name (default: the folder's name)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip names or relative paths matching GLOB (repeatable)")
    p.add_argument("--topology", choices=["auto", "chain", "tree", "star"], default="auto",
                   help="how chunks fan out: nodes relay along a chain or tree (default auto: "
                        "star for one node or small payloads, else chain)")
    p.add_argument("--fanout", type=int, default=2, metavar="K", help="children per tree node")
    p.add_argument("--allow-partial", action="store_true",
                   help="route around failed nodes and publish on the healthy ones")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a node making no progress for S seconds has failed (default 60)")
    p.add_argument("--token-file", metavar="F")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with --watch: one per push, one per line)")
    p.add_argument("--watch", action="store_true",
                   help="keep watching SRC and push again after every change (Ctrl-C stops)")
    p.add_argument("--no-cache", action="store_true",
                   help="hash every file: do not use or update the scan cache "
                        "(default: $MONARCH_FS_HOME/scan-cache, so unchanged files are not read)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto", help=TRANSPORT_HELP)
    p.add_argument("--encrypt", choices=ENCRYPT_POLICIES, default="auto", help=ENCRYPT_HELP)
    p.add_argument("--at-source", action=argparse.BooleanOptionalAction, default=None,
                   help="every node also exposes the workspace at SRC's absolute path (a link "
                        "to MOUNT/NAME), so a venv's scripts and pyvenv.cfg resolve as on this "
                        "machine; never replaces what is there (default: on where the path "
                        "allows it, else a warning; --at-source makes that an error)")
    p.set_defaults(fn=cmd_push)

    s = sub.add_parser("status", help="what every node serves")
    s.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    s.add_argument("--token-file", metavar="F")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    rm = sub.add_parser("rm", help="delete a workspace on every node",
                        description="Delete workspace NAME on every node: it leaves the mount at "
                                    "once and its disk is given back (a file held open keeps "
                                    "reading until closed). A node refuses while a process "
                                    "started with --workspace NAME runs there.")
    rm.add_argument("name", metavar="NAME")
    rm.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    rm.add_argument("--token-file", metavar="F")
    rm.add_argument("--json", action="store_true",
                    help="print one list: per node host, removed, versions, error")
    rm.set_defaults(fn=cmd_rm)

    r = sub.add_parser(
        "run", help="run a command on every proc of every host (SPMD, torchrun-style)",
        description="Run CMD on K procs per host with RANK, WORLD_SIZE, LOCAL_RANK, "
                    "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun does; "
                    "output lines are prefixed with their rank. When a rank fails, the others "
                    "are stopped and the whole group restarts (up to --max-restarts times). "
                    "Exit status: 0 if every rank exited 0, else the first failing rank's exit "
                    "code (128+N for signal N) in the last attempt, 1 if the job could not be "
                    "launched. {mount} and {workspace} in CMD, --cwd expand on each node.")
    r.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    r.add_argument("--per-host", type=int, default=1, metavar="K", help="procs per host")
    r.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="restart the whole group up to R times after a failure (default 0)")
    r.add_argument("--cwd", metavar="DIR", help="working directory on the nodes "
                   "(default: {workspace} with --workspace, else the daemon's)")
    r.add_argument("--workspace", metavar="NAME",
                   help="pin the procs to the version of workspace NAME that the first host "
                        "serves now, the same on every node; {workspace} is its folder")
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set NAME in every proc's environment (repeatable); procs start from "
                        "a small clean environment, not the daemon's (see the README)")
    r.add_argument("--token-file", metavar="F")
    r.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="auto (RDMA when this host and a node both have a usable device, else "
                        "TCP, saying why), tcp, or rdma (an error naming the host without one). "
                        "run moves no bulk data itself: ranks get MONARCH_FS_TRANSPORT "
                        "(tcp, rdma-rc, rdma-srd) and the summary names it")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("cluster", help="start or stop a local cluster on loopback")
    c.add_argument("action", choices=["up", "down"])
    c.add_argument("--nodes", type=int, default=3)
    c.add_argument("--dir", help="cluster folder (default ~/.monarch-fs/cluster)")
    c.add_argument("--no-root-procs", action="store_true",
                   help=f"as root, start the daemons without {ROOT_PROCS_FLAG}: they then "
                        "refuse to run processes")
    c.set_defaults(fn=cmd_cluster)

    sl = sub.add_parser(
        "slurm", help="start or stop the daemons of this SLURM job (in sbatch or salloc)",
        description="up: one daemon per allocated node through srun; returns once every node "
                    "is mounted, and writes the job's hosts and a fresh token to "
                    "$MONARCH_FS_HOME/slurm/$SLURM_JOB_ID (push, status and run then use them "
                    "by default). The daemons unmount and stop when the job ends, or at down. "
                    "Options after -- go to every daemon: slurm up [options] -- --keep 5.")
    sl.add_argument("action", choices=["up", "down", "node"],
                    help="node is what srun runs on each node; up starts it")
    sl.add_argument("--mount", default=slurm.DEFAULT_MOUNT, metavar="DIR",
                    help="each node's mount point; {job} and {node} expand "
                         f"(default {slurm.DEFAULT_MOUNT})")
    sl.add_argument("--state", metavar="DIR",
                    help="each node's store, node-local and removed at the end (default "
                         "MOUNT.state)")
    sl.add_argument("--timeout", type=float, default=slurm.UP_TIMEOUT, metavar="S",
                    help=f"up: give up when a node is not mounted after S seconds "
                         f"(default {slurm.UP_TIMEOUT:g})")
    sl.set_defaults(fn=cmd_slurm)

    t = sub.add_parser("token", help="make a cluster token (every daemon and client needs one)")
    t.add_argument("action", choices=["new"])
    t.add_argument("path", nargs="?", metavar="PATH",
                   help="where to write it, mode 0600 (default $MONARCH_FS_HOME/cluster/token)")
    t.add_argument("--force", action="store_true", help="replace an existing token file")
    t.set_defaults(fn=cmd_token)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `slurm up|node ... -- DAEMON OPTIONS`: what follows -- is for the daemons, not for us
    daemon_args: list[str] = []
    if "--" in argv and "slurm" in argv[:argv.index("--")]:
        daemon_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    args = build_parser().parse_args(argv)
    args.daemon_args = daemon_args
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    serves = args.command == "daemon" or (args.command, getattr(args, "action", "")) == (
        "slurm", "node")
    if not serves:
        logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return args.fn(args)
    except (PushError, HostsError, TokenError, cluster.ClusterError, slurm.SlurmError,
            ValueError, OSError) as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("monarch-fs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
