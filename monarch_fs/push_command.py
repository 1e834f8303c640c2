"""`monarch-fs push`: a one-shot push, a push --watch, and a push handed to a running watch
(--keep-warm), with what each prints. cli.py dispatches here; options.py declares the options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from . import collector
from .daemon.client import handoff
from .daemon.client.hosts import HostsError, resolve_target, target
from .daemon.client.links import Sessions
from .daemon.client.progress import Progress, fmt_bytes
from .daemon.client.push import push
from .daemon.client.push_options import PushOptions, workspace_name
from .daemon.client.push_result import PushError, PushResult
from .daemon.wire.auth import TokenError, home_dir, resolve_token
from .daemon.wire.bulk import resolve_local
from .fs.scan_cache import ScanCache
from .fs.snapshot import Snapshot, SourceChanged
from .options import KEEP_WARM_IDLE, build_parser
from .settings import settings

SWITCH_INTERVAL = 0.0005  # seconds: the GIL's hand-over in a push process (cmd_push)


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


def scan_cache_dir() -> Path:
    """Where push keeps its scan caches: $MONARCH_FS_HOME/scan-cache (~/.monarch-fs/...)."""
    return home_dir() / "scan-cache"


def cmd_push(args: argparse.Namespace) -> int:
    # A push's encoder threads give up the GIL three or four times per small file (open,
    # read, fstat, close) and wait to take it back from the thread that holds it; at the
    # default 5 ms that wait is what a venv's 43k files cost (py-spy: Snapshot.read_into's
    # read). The torch venv to a fresh node, 3 alternating pairs at load 5-8: 0.5 ms against
    # 5 ms, 8.8-15.5 against 9.2-17.5 s, push 4.2-4.7 against 4.4-5.1 CPU-s.
    sys.setswitchinterval(SWITCH_INTERVAL)
    collector.settle()
    hosts, token = target(args.hosts, args.token_file)
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
            helpers=args.helpers,
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
