"""The `monarch-fs` command: a thin dispatcher over the daemon, push, status, run and cluster
code."""

# It sits at the package top, not in daemon/, because it is the one module that sees all three
# layers (`run` drives the mesh): fs/, daemon/ and mesh/ only ever import downward.

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from . import debug_commands
from .daemon.client import cluster, handoff, slurm
from .daemon.client.controller_store import Summary, read_summary
from .daemon.client.hosts import HostsError, resolve_target
from .daemon.client.links import Sessions
from .daemon.client.progress import Progress, fmt_bytes
from .daemon.client.push import push
from .daemon.client.push_options import PushOptions, workspace_name
from .daemon.client.push_result import PushError, PushResult
from .daemon.client.status import remove, status
from .daemon.wire import identity
from .daemon.wire.auth import (
    TokenError,
    default_token_file,
    home_dir,
    resolve_token,
    write_new_token,
)
from .daemon.wire.bulk import resolve_local
from .daemon.wire.identity import ROOT_PROCS_FLAG
from .daemon.wire.limits import Limits
from .daemon.wire.replies import StatusReply
from .fs.scan_cache import ScanCache
from .fs.snapshot import Snapshot, SourceChanged
from .options import KEEP_WARM_IDLE, build_parser
from .settings import settings

log = logging.getLogger("monarch_fs")



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
                            durable=args.durable or settings.durable,
                            limits=limits, allow_root_procs=args.allow_root_procs,
                            identity_mode="" if args.identity == "token" else args.identity,
                            munge_socket=munge_socket,
                            source_prefixes=tuple(args.source_prefix),
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

    async def run(progress: Progress | None = None, snapshot: Snapshot | None = None,
                  held: Snapshot | None = None,
                  sessions: Sessions | None = None) -> PushResult:
        if args.compile:
            await compile_first(args.src)
        return await push(args.src, hosts, token, PushOptions(
            name=args.name, excludes=args.exclude, topology=args.topology, fanout=args.fanout,
            allow_partial=args.allow_partial, timeout=args.timeout, cache_dir=cache_dir,
            transport=transport, encrypt=args.encrypt, at_source=args.at_source,
            # push --watch: after a push every node took, the next go without the dev box
            # store, whose open and fill cost grows with the tree, not the change (a later push
            # to fresh nodes reads the few edited files again).
            store_dir=None if args.no_store or held is not None else settings.store_dir,
            store_bound=settings.store_bound, compress=args.compress, early=args.early,
            first_reads_dir=home_dir() / "first-reads", bwlimit=args.bwlimit * (1 << 20),
            control=args.control, control_fanout=args.control_fanout, freeze_scan=True),
            progress=progress, on_usable=usable, snapshot=snapshot, held=held, sessions=sessions)

    def usable(seconds: float, nodes: int) -> None:
        """push --early: the version is served everywhere (the rest still streams)."""
        if args.json:
            print(json.dumps({"event": "usable", "seconds": seconds, "nodes": nodes}),
                  flush=True)
        else:
            print(f"usable on {nodes} nodes after {seconds:.2f} s", flush=True)

    if (args.on_demand or args.idle) and not args.watch and not args.keep_warm:
        raise ValueError("--on-demand and --idle are for push --watch (a one-shot push leaves "
                         "such a watch behind with --keep-warm)")
    if args.watch:
        from .daemon.client.watch import watch

        workspace_name(args.src, args.name)  # a name no node takes: say so once, not per change

        cache = ScanCache.for_folder(cache_dir, args.src) if cache_dir else None
        mine = handoff_key(args, os.getcwd(), os.environ)

        def judge(request: dict) -> Callable[[PushResult | BaseException], dict] | None:
            """How to answer a one-shot push handed to this watch, if it is this push."""
            try:
                theirs = build_parser().parse_args(request["argv"])
                key = handoff_key(theirs, request["cwd"], request["env"])
            except (SystemExit, KeyError, TypeError, ValueError, OSError, HostsError,
                    TokenError):
                return None
            if key != mine:
                return None
            return lambda outcome: dict(zip(("stdout", "stderr", "code"),
                                            push_report(outcome, theirs.json, os.getpid())))

        async def watching() -> int:
            async with Sessions() as sessions:  # open from one push to the next
                return await watch(args.src, lambda snap, held: run(None, snap, held, sessions),
                                   cache=cache, excludes=args.exclude,
                                   ignore=[cache_dir] if cache_dir else [],
                                   json_lines=args.json, judge=judge, on_demand=args.on_demand,
                                   idle_s=args.idle * 60 if args.idle else None)

        return trio.run(watching)
    bar = BarProgress() if sys.stderr.isatty() and not args.json else None
    try:
        outcome: PushResult | BaseException = trio.run(run, bar)
    except (SourceChanged, PushError) as e:
        outcome = e
    finally:
        if bar:
            bar.close()
    out, err, code = push_report(outcome, args.json)
    if args.keep_warm and code == 0:  # (a push handed to a warm watch never gets here)
        idle = args.idle or KEEP_WARM_IDLE
        pid = handoff.start_warm(args.argv, idle)
        err += (f"keeping {args.src} warm for the next push: push --watch --on-demand, pid "
                f"{pid}, stops after {idle:g} min without a push\n")
    sys.stderr.write(err)
    sys.stdout.write(out)
    return code


def handoff_key(args: argparse.Namespace, cwd: str, env: Mapping[str, str]) -> tuple:
    """What a push must share with a running `push --watch` to be handed to it
    (daemon/client/handoff.py): the folder, hosts, token, workspace name and every option
    that changes what a push does, with paths made absolute, and the MONARCH_FS_* settings."""
    def absolute(path: str) -> str:
        return os.path.realpath(os.path.join(cwd, os.path.expanduser(path)))

    options = {k: v for k, v in vars(args).items()
               if k not in ("watch", "json", "verbose", "src", "hosts", "token_file", "name",
                            "daemon_args", "argv", "keep_warm", "on_demand", "idle")}
    src = absolute(args.src)
    spec = args.hosts
    if spec and spec.startswith("@"):  # a host file
        spec = "@" + absolute(spec[1:])
    # What the files say now: a host file or token rewritten since the watch started (a new
    # allocation at the same path) is another push.
    hosts, token_file = resolve_target(spec, absolute(args.token_file) if args.token_file
                                       else None)
    token = hashlib.sha256(resolve_token(token_file)).hexdigest()
    return (src, hosts, token, workspace_name(src, args.name),
            json.dumps(options, sort_keys=True, default=str),
            sorted((k, v) for k, v in env.items() if handoff.shared_setting(k)))


def push_report(outcome: PushResult | BaseException, as_json: bool,
                watch: int | None = None) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of a one-shot push: its result, or why it failed. `watch`:
    the pid of the `push --watch` that pushed it (a hand-off), said in the output."""
    if isinstance(outcome, BaseException):
        return "", f"monarch-fs: error: {outcome}\n", 1
    result = outcome
    err = [f"warning: {w}" for w in result.warnings] + result.left_behind()
    if as_json:
        obj = result.to_json()
        obj.pop("warnings")
        out = [json.dumps(obj if watch is None else {**obj, "watch": watch})]
    else:
        by = "" if watch is None else f" (by the running push --watch, pid {watch})"
        out = [f"pushed {result.name} {result.version[:12]} to {result.nodes} nodes in "
               f"{result.seconds:.2f}s{by}: {result.files} files, {fmt_bytes(result.bytes)}; "
               f"sent {fmt_bytes(result.bytes_sent)} ({result.chunks_sent} chunks; the "
               f"snapshot has {result.chunks_total}), {result.topology}, {result.transport}",
               *link_lines(result)]
        if result.usable_seconds is not None and result.complete_seconds is not None:
            out.append(f"usable after {result.usable_seconds:.2f}s, complete after "
                       f"{result.complete_seconds:.2f}s")
    return "".join(f"{ln}\n" for ln in out), "".join(f"{ln}\n" for ln in err), 0


async def compile_first(src: str) -> None:
    """push --compile: byte-compile SRC in a worker thread (it can take a minute for a big venv)
    and say which files would not compile."""
    from .daemon.client.bytecode import compile_tree

    done = await trio.to_thread.run_sync(compile_tree, src)
    if done.failures:
        print(f"warning: --compile: {done.failures} files under {src} did not compile with "
              f"{done.python} (they are pushed as they are)", file=sys.stderr)


def link_lines(result: PushResult) -> list[str]:
    """The compression of each link, when it is not what the link's kind makes obvious (zstd
    off loopback, none on it)."""
    return [f"  {c['host']}: compression {c['compression']} ({c['why']})" for c in result.links
            if not c["why"].startswith("loopback")]


def target(args: argparse.Namespace) -> tuple[list[str], bytes]:
    """The hosts and token a client command talks to: --hosts and --token-file, else the
    environment's, else this SLURM job's (`slurm up`), else the local cluster's."""
    hosts, token_file = resolve_target(args.hosts, args.token_file)
    return hosts, resolve_token(token_file)


def cmd_status(args: argparse.Namespace) -> int:
    held = read_summary(settings.store_dir, settings.store_bound)
    if args.store:
        print(json.dumps(held.to_json()) if args.json else store_line(held))
        return 0
    hosts, token = target(args)
    nodes = trio.run(status, hosts, token)
    if args.json:
        print(json.dumps([n.to_json() for n in nodes]))
    else:
        # On stderr: stdout stays one line per node, for scripts (`status --store` prints it
        # on stdout).
        print(store_line(held), file=sys.stderr)
        for n in nodes:
            s = n.reply
            if s is None:
                print(f"{n.host}  UNREACHABLE  {n.error}")
                continue
            ws = ", ".join(
                f"{name}={vs[0][:12]}" + (f" (+{len(vs) - 1} older)" if len(vs) > 1 else "")
                + (f" by {s.owners[name]}" if name in s.owners else "")
                + (_incomplete_note(s, name) if name in s.incomplete else "")
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


def _incomplete_note(s: StatusReply, name: str) -> str:
    """What `status` says of a workspace serving a version published early (push --early)."""
    lacks = s.incomplete_chunks.get(name)
    if lacks is None:
        return " (incomplete: published early)"
    return (f" (incomplete: published early, {lacks} chunks not here yet; a push of it "
            "completes it)")


def store_line(held: Summary) -> str:
    """The dev box store as `status` shows it, as of its last push."""
    kept = ", ".join(f"{h.workspace}={h.version[:12]}" for h in
                     sorted(held.snapshots, key=lambda h: -h.pushed)) or "no snapshots"
    return (f"dev box store {held.path}: {fmt_bytes(held.bytes)} in {held.objects} objects "
            f"(bound {fmt_bytes(held.bound)}); {kept}")


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


def cmd_query(args: argparse.Namespace) -> int:
    from .daemon.client import query

    if args.schema:
        print(query.schema_text(), end="")
        return 0
    if not args.sql:
        print('monarch-fs: error: query needs SQL: monarch-fs query "SELECT ..." '
              "(--schema lists the tables)", file=sys.stderr)
        return 2
    if args.explain:
        p = query.plan(args.sql)
        query.check(p)
        for table, sql in p.nodes.items():
            print(f"on every node, into {table}: {sql}")
        print(f"here: {p.final}\n({p.how})")
        return 0
    hosts, token = target(args)
    result = trio.run(query.query, hosts, token, args.sql, args.timeout)
    if args.json:
        print(query.json_text(result))
    elif args.csv:
        sys.stdout.write(query.csv_text(result))
        for host, error in result.failed.items():
            print(f"{host}: UNREACHABLE: {error}", file=sys.stderr)
    else:
        sys.stdout.write(query.table(result))
    return 1 if result.failed else 0


def cmd_top(args: argparse.Namespace) -> int:
    from .daemon.client.top import top

    hosts, token = target(args)
    try:
        return trio.run(lambda: top(hosts, token, interval=args.interval, once=args.once,
                                    as_json=args.json))
    except KeyboardInterrupt:
        return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from .daemon.client.stacks import stacks

    hosts, token = target(args)
    return trio.run(lambda: stacks(hosts, token, args.job, native=args.native,
                                   as_json=args.json))


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
              transport=args.transport, hang_timeout=args.hang_timeout,
              on_hang=args.on_hang, fold=not args.no_fold)
    return trio.run(run_job, hosts, token, job, local)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "daemon": cmd_daemon, "push": cmd_push, "status": cmd_status, "rm": cmd_rm,
    "run": cmd_run, "cluster": cmd_cluster, "slurm": cmd_slurm, "token": cmd_token,
    "query": cmd_query, "top": cmd_top, "stacks": cmd_stacks,
    "logs": debug_commands.cmd_logs, "repro": debug_commands.cmd_repro,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `slurm up|node ... -- DAEMON OPTIONS`: what follows -- is for the daemons, not for us
    daemon_args: list[str] = []
    if "--" in argv and "slurm" in argv[:argv.index("--")]:
        daemon_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    args = build_parser().parse_args(argv)
    args.daemon_args = daemon_args
    args.argv = argv
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    serves = args.command == "daemon" or (args.command, getattr(args, "action", "")) == (
        "slurm", "node")
    if not serves:
        logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return COMMANDS[args.command](args)
    except (PushError, HostsError, TokenError, cluster.ClusterError, slurm.SlurmError,
            ValueError, OSError) as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("monarch-fs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
