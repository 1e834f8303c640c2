"""The `monarch-fs` command: a thin dispatcher over the daemon, push, status and cluster code."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import trio

from . import cluster
from .auth import TokenError, load_token, resolve_token
from .hosts import HostsError, parse_hosts
from .push import Progress, PushError, push
from .status import status

log = logging.getLogger("monarch_fs")


class BarProgress(Progress):
    """A tqdm bar per phase on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar = None

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        from tqdm import tqdm

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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def cmd_daemon(args: argparse.Namespace) -> int:
    from .node import NodeDaemon

    token = load_token(args.token_file) if args.token_file else b""
    daemon = NodeDaemon(state=args.state, mount=args.mount, listen=args.listen, token=token,
                        keep=args.keep, node_name=args.node_name)
    trio.run(lambda: daemon.run(ready_file=args.ready_file))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    hosts = parse_hosts(args.hosts)
    token = resolve_token(args.token_file)
    bar = BarProgress() if sys.stderr.isatty() and not args.json else None
    try:
        result = trio.run(lambda: push(
            args.src, hosts, token, name=args.name, excludes=args.exclude, progress=bar,
            topology_kind=args.topology, fanout=args.fanout, allow_partial=args.allow_partial,
            timeout=args.timeout))
    finally:
        if bar:
            bar.close()
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for host, cause in sorted(result.failed.items()):
        print(f"warning: {host} left behind (--allow-partial): {cause}", file=sys.stderr)
    if args.json:
        out = result.to_json()
        out.pop("warnings")
        print(json.dumps(out))
    else:
        print(f"pushed {result.name} {result.version[:12]} to {result.nodes} nodes in "
              f"{result.seconds:.2f}s: {result.files} files, {_size(result.bytes)}; sent "
              f"{_size(result.bytes_sent)} ({result.chunks_sent} chunks; the snapshot has {result.chunks_total}), "
              f"{result.topology})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    hosts = parse_hosts(args.hosts)
    token = resolve_token(args.token_file)
    nodes = trio.run(status, hosts, token)
    if args.json:
        print(json.dumps(nodes))
    else:
        for n in nodes:
            if not n["reachable"]:
                print(f"{n['host']}  UNREACHABLE  {n['error']}")
                continue
            ws = ", ".join(f"{name}={vs[0][:12]}" + (f" (+{len(vs) - 1} older)" if len(vs) > 1 else "")
                           for name, vs in sorted(n["workspaces"].items())) or "no workspaces"
            print(f"{n['host']}  {n['node']}  {ws}  store {_size(n['store_bytes'])}"
                  f" in {n['store_objects']} objects")
    return 0 if all(n["reachable"] for n in nodes) else 1


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.action == "up":
        addrs = cluster.up(args.nodes, args.dir)
        d = args.dir or cluster.default_cluster_dir()
        print(f"cluster of {len(addrs)} nodes up in {d}: {' '.join(addrs)}")
        print(f"hosts file: {os.path.join(d, 'hosts')}")
    else:
        n = cluster.down(args.dir)
        print(f"stopped {n} daemons")
    return 0


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
    d.add_argument("--ready-file", help="write {addr, pid} here once mounted and listening")
    d.add_argument("--node-name", default="", help="name reported in status (default hostname)")
    d.set_defaults(fn=cmd_daemon)

    hosts_help = "host:port,host:port or @hostfile (default $MONARCH_FS_HOSTS, then the local cluster)"
    p = sub.add_parser("push", help="push a folder to every node and publish it")
    p.add_argument("src", metavar="SRC")
    p.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    p.add_argument("--name", help="workspace name (default: the folder's name)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip names or relative paths matching GLOB (repeatable)")
    p.add_argument("--topology", choices=["auto", "chain", "tree", "star"], default="auto",
                   help="how chunks fan out: nodes relay along a chain or tree (default auto: "
                        "star for 1-2 nodes or small payloads, else chain)")
    p.add_argument("--fanout", type=int, default=2, metavar="K", help="children per tree node")
    p.add_argument("--allow-partial", action="store_true",
                   help="route around failed nodes and publish on the healthy ones")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a node making no progress for S seconds has failed (default 60)")
    p.add_argument("--token-file", metavar="F")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_push)

    s = sub.add_parser("status", help="what every node serves")
    s.add_argument("--hosts", metavar="SPEC", help=hosts_help)
    s.add_argument("--token-file", metavar="F")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    c = sub.add_parser("cluster", help="start or stop a local cluster on loopback")
    c.add_argument("action", choices=["up", "down"])
    c.add_argument("--nodes", type=int, default=3)
    c.add_argument("--dir", help="cluster folder (default ~/.monarch-fs/cluster)")
    c.set_defaults(fn=cmd_cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.command != "daemon":
        logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return args.fn(args)
    except (PushError, HostsError, TokenError, cluster.ClusterError, ValueError, OSError) as e:
        print(f"monarch-fs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("monarch-fs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
