"""What the commands that look back at a job do (`logs`, `repro`): cli.py dispatches here, and
debug_options.py declares their options."""

from __future__ import annotations

import argparse
import sys

import trio

from .daemon.client.hosts import resolve_target
from .daemon.wire.auth import resolve_token


def _target(args: argparse.Namespace) -> tuple[list[str], bytes]:
    hosts, token_file = resolve_target(args.hosts, args.token_file)
    return hosts, resolve_token(token_file)


def cmd_logs(args: argparse.Namespace) -> int:
    from .daemon.client.logs import logs, parse_since

    since = parse_since(args.since) if args.since else None
    hosts, token = _target(args)
    try:
        return trio.run(lambda: logs(hosts, token, args.job, rank=args.rank, grep=args.grep,
                                     since=since, follow=args.follow, fold=not args.no_fold,
                                     out=sys.stdout, err=sys.stderr))
    except KeyboardInterrupt:  # --follow ends so
        return 0


def cmd_repro(args: argparse.Namespace) -> int:
    from .daemon.client.repro import find_launch, run
    from .settings import settings

    hosts, token = _target(args)
    launch = trio.run(find_launch, hosts, token, args.job, args.rank)
    return run(launch, store_dir=settings.store_dir, source=args.source, keep=args.keep,
               err=sys.stderr)
