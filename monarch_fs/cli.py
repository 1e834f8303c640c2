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
from typing import TYPE_CHECKING, Any

import trio

from . import collector, debug_commands, push_command
from .daemon.client.hosts import HostsError, target
from .daemon.client.progress import fmt_bytes
from .daemon.client.push_result import PushError
from .daemon.wire.auth import (
    TokenError,
    default_token_file,
    resolve_token,
    write_new_token,
)
from .daemon.wire.bulk import resolve_local
from .daemon.wire.identity import ROOT_PROCS_FLAG
from .options import build_parser
from .settings import settings

if TYPE_CHECKING:
    from .daemon.client.controller_store import Summary
    from .daemon.wire.replies import StatusReply

# What each command needs beyond a push's own modules is imported in that command: a push pays
# only for what it uses (its start is part of every push's time).

log = logging.getLogger("monarch_fs")



def cmd_daemon(args: argparse.Namespace, serve: Callable[[Any], Awaitable[Any]] | None = None
               ) -> int:
    """Run a node daemon; `serve(daemon)`, when given, runs it instead of daemon.run (the
    SLURM task announces its address once the daemon is up)."""
    from .daemon.node.daemon import NodeDaemon, make_log_private
    from .daemon.wire import identity
    from .daemon.wire.limits import Limits
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
        collector.settle()  # a long life of many short-lived objects (collector.py)
        if serve is not None:
            trio.run(serve, daemon)
        else:
            trio.run(lambda: daemon.run(ready_file=args.ready_file))
    except MountError as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .daemon.client.controller_store import read_summary
    from .daemon.client.status import status

    held = read_summary(settings.store_dir, settings.store_bound, filler=True)
    if args.store:
        print(json.dumps(held.to_json()) if args.json else store_line(held))
        return 0
    hosts, token = target(args.hosts, args.token_file)
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
    filling = "" if held.filling is None else f"; its filler (pid {held.filling}) fills it now"
    return (f"dev box store {held.path}: {fmt_bytes(held.bytes)} in {held.objects} objects "
            f"(bound {fmt_bytes(held.bound)}); {kept}{filling}")


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
    from .daemon.client.status import remove

    hosts, token = target(args.hosts, args.token_file)
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
    hosts, token = target(args.hosts, args.token_file)
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

    hosts, token = target(args.hosts, args.token_file)
    try:
        return trio.run(lambda: top(hosts, token, interval=args.interval, once=args.once,
                                    as_json=args.json))
    except KeyboardInterrupt:
        return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from .daemon.client.stacks import stacks

    hosts, token = target(args.hosts, args.token_file)
    return trio.run(lambda: stacks(hosts, token, args.job, native=args.native,
                                   as_json=args.json))


def cmd_cluster(args: argparse.Namespace) -> int:
    from .daemon.client import cluster

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
    from .daemon.client import slurm

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
    from .daemon.client import slurm

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
    from .mesh.spmd import Job, run_until_interrupted

    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        print("monarch-fs: error: run needs a command: monarch-fs run [options] -- CMD ARGS...",
              file=sys.stderr)
        return 2
    if args.per_host < 1 or args.max_restarts < 0:
        print("monarch-fs: error: --per-host must be >= 1 and --max-restarts >= 0",
              file=sys.stderr)
        return 2
    hosts, token = target(args.hosts, args.token_file)
    # --transport rdma without a device here: exit 1 before connecting; the hosts are checked
    # once connected (spmd.choose_transports), still before anything is launched.
    local = resolve_local(args.transport, where=f"the controller {socket.gethostname()}")
    job = Job(argv, per_host=args.per_host, cwd=args.cwd, workspace=args.workspace,
              env=_env_pairs(args.env), max_restarts=args.max_restarts,
              transport=args.transport, hang_timeout=args.hang_timeout,
              on_hang=args.on_hang, fold=not args.no_fold)
    return trio.run(run_until_interrupted, hosts, token, job, local)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "daemon": cmd_daemon, "push": push_command.cmd_push, "status": cmd_status, "rm": cmd_rm,
    "run": cmd_run, "cluster": cmd_cluster, "slurm": cmd_slurm, "token": cmd_token,
    "query": cmd_query, "top": cmd_top, "stacks": cmd_stacks,
    "logs": debug_commands.cmd_logs, "repro": debug_commands.cmd_repro,
}


def reported() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line: a cluster's and a SLURM job's only when their
    modules were imported (else the command cannot have raised them)."""
    errors: tuple[type[Exception], ...] = (PushError, HostsError, TokenError, ValueError, OSError)
    for module, name in (("monarch_fs.daemon.client.cluster", "ClusterError"),
                         ("monarch_fs.daemon.client.slurm", "SlurmError")):
        if module in sys.modules:
            errors += (getattr(sys.modules[module], name),)
    return errors


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
    except Exception as e:
        if not isinstance(e, reported()):
            raise
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("monarch-fs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
