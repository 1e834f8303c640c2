"""What the commands that look back at a job do (`logs`, `repro`): cli.py dispatches here, and
debug_options.py declares their options."""

from __future__ import annotations

import argparse
import sys

import trio

from .daemon.client.hosts import target


def cmd_logs(args: argparse.Namespace) -> int:
    from .daemon.client.logs import logs, parse_since

    since = parse_since(args.since) if args.since else None
    hosts, token = target(args.hosts, args.token_file)
    try:
        return trio.run(lambda: logs(hosts, token, args.job, rank=args.rank, grep=args.grep,
                                     since=since, follow=args.follow, fold=not args.no_fold,
                                     out=sys.stdout, err=sys.stderr))
    except KeyboardInterrupt:  # --follow ends so
        return 0


def cmd_repro(args: argparse.Namespace) -> int:
    from .daemon.client.repro import ReproError, find_launches, run
    from .daemon.client.repro_world import run_world
    from .settings import settings

    if args.pdb and args.world:
        raise ReproError("--pdb runs one rank (--rank R) under pdb, not --world")
    hosts, token = target(args.hosts, args.token_file)
    launches = trio.run(find_launches, hosts, token, args.job,
                        None if args.world else args.rank)
    if args.world:
        return trio.run(lambda: run_world(launches, token=token, store_dir=settings.store_dir,
                                          source=args.source, keep=args.keep,
                                          fold=not args.no_fold, out=sys.stdout,
                                          err=sys.stderr))
    return run(launches[0], token=token, store_dir=settings.store_dir, source=args.source,
               keep=args.keep, pdb=args.pdb, err=sys.stderr)
