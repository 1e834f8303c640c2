"""Every `monarch-fs` command and option, with its help: what a user can type, declared in one
place (cli.py holds what each command does)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from .daemon.client import slurm
from .daemon.client.link_codec import POLICIES as COMPRESS_POLICIES
from .daemon.wire import identity, topology
from .daemon.wire.addresses import ENCRYPT_POLICIES
from .daemon.wire.bulk import TRANSPORTS
from .daemon.wire.identity import ROOT_PROCS_FLAG
from .daemon.wire.limits import Limits
from .debug_options import add_debug_commands
from .fs.manifest import DEFAULT_MAX_ENTRIES
from .option_tables import add_switches, add_target

DESCRIPTION = ("Push code and Python environments to every node of a cluster, serve them "
               "read-only over FUSE, and run the processes that use them.")
TRANSPORT_HELP = ("how chunk payloads travel: auto (RDMA when both ends have a usable device, "
                  "else TCP, saying why), tcp, or rdma (an error without a device)")
ENCRYPT_HELP = ("encrypt sessions (every frame is authenticated either way): auto (links that "
                "leave this machine; loopback is not), on, or off; a client asks, a daemon "
                "requires, and either is enough")


KEEP_WARM_IDLE = 30.0  # minutes a --keep-warm watch lives without a push, by default


def positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number of `unit` (argparse says which option)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of {unit}")
        return value
    return parse


positive_minutes = positive("minutes")  # --idle
positive_rate = positive("MiB/s")  # --bwlimit
positive_seconds = positive("seconds")


def folder_prefix(text: str) -> str:
    """An argparse type: an absolute, normal folder path (--source-prefix)."""
    if not text.startswith("/") or os.path.normpath(text) != text or text == "/":
        raise argparse.ArgumentTypeError(f"{text!r} is not an absolute, normal folder path "
                                         "other than /")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monarch-fs", description=DESCRIPTION)
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
    d.add_argument("--durable", choices=["background", "sync"],
                   help="when a pushed version is on disk: background publishes once its "
                        "chunks are written and verified, and flushes them after (a power cut "
                        "before the flush serves the last whole version until a push repairs "
                        "it); sync flushes before every publish. Default $MONARCH_FS_DURABLE, "
                        "else background")
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
    d.add_argument("--source-prefix", action="append", default=[], type=folder_prefix,
                   metavar="PATH",
                   help="as root without --identity munge, expose pushed folders at their "
                        "source path (push --at-source) only under PATH (repeatable; default "
                        "none: nobody known asks, and root's rights are not lent to a token)")
    d.add_argument("--munge-socket", metavar="PATH",
                   help="munged's socket (default $MONARCH_FS_MUNGE_SOCKET, else "
                        f"{identity.DEFAULT_SOCKET})")

    p = sub.add_parser("push", help="push a folder to every node and publish it")
    p.add_argument("src", metavar="SRC")
    add_target(p)
    p.add_argument("--name", help="workspace name (default: the folder's name)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip names or relative paths matching GLOB (repeatable)")
    p.add_argument("--topology", choices=["auto", "chain", "tree", "star"], default="auto",
                   help="how chunks fan out: nodes relay along a chain or tree (default auto: "
                        "star for one node or small payloads, else chain)")
    p.add_argument("--fanout", type=int, default=2, metavar="K", help="children per tree node")
    p.add_argument("--control", choices=list(topology.CONTROLS), default="auto",
                   help="how requests reach the nodes: star (the dev box asks each node) or "
                        "tree (it asks a few roots, each node asks its children; default "
                        f"auto: tree above {topology.CONTROL_STAR_MAX} nodes)")
    p.add_argument("--control-fanout", type=int, default=topology.CONTROL_FANOUT, metavar="K",
                   help=f"children per node of the control tree (default "
                        f"{topology.CONTROL_FANOUT})")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a node making no progress for S seconds has failed (default 60)")
    add_switches(p, {
        "--allow-partial": "route around failed nodes and publish on the healthy ones",
        "--early": "publish as soon as every node holds the manifest and the files the nodes "
                   "read first after earlier pushes (else the small files); the rest streams "
                   "on, and a read of a chunk not there yet fetches it first. Prints when the "
                   "version became usable and when complete",
        "--json": "print one JSON object (with --watch: one per push, one per line; with "
                  '--early, first {"event": "usable", ...} when usable)',
        "--watch": "keep watching SRC and push again after every change (Ctrl-C stops)",
        "--on-demand": "with --watch: keep the tree and the sessions warm, but push only when a "
                       "`monarch-fs push` of SRC with the same options is handed over",
        "--keep-warm": "after the push, leave a `push --watch --on-demand` of SRC in the "
                       "background (unless one runs), so that the next push of SRC with the "
                       "same options costs what changed, not a look at every file; it stops "
                       "after --idle minutes without a push",
        "--no-cache": "hash every file: do not use or update the scan cache (default: "
                      "$MONARCH_FS_HOME/scan-cache, so unchanged files are not read)",
        "--no-store": "neither send from nor add to the dev box store ($MONARCH_FS_STORE, "
                      "default $MONARCH_FS_HOME/store), which keeps what push sent so a later "
                      "push of unchanged content reads nothing of SRC",
        "--compile": "byte-compile SRC's Python modules before sending (compileall, as pip "
                     "does; with the venv's own bin/python when SRC has pyvenv.cfg): writes "
                     "__pycache__ into SRC. The mount is read-only, so modules pushed without "
                     ".pyc are compiled again by every import on every node"})
    p.add_argument("--idle", type=positive_minutes, metavar="MIN",
                   help="with --watch: stop after MIN minutes without a push (default: never; "
                        f"with --keep-warm: {KEEP_WARM_IDLE:g})")
    p.add_argument("--compress", choices=COMPRESS_POLICIES, default="auto",
                   help="zstd on each link from this machine: auto (measured per link: none on "
                        "loopback or where the link is faster than decompressing; reported in "
                        "--json under links), on, or off")
    p.add_argument("--bwlimit", type=positive_rate, default=0.0, metavar="MIB_S",
                   help="send at most MIB_S MiB a second from this machine, all nodes together "
                        "(a shared link); with --early, chunks a reader waits for go unpaced")
    p.add_argument("--helpers", type=int, default=None, metavar="N",
                   help="processes that share the sending of small files with this one, each "
                        "on connections of its own (default: one per core beyond the first, up "
                        "to 3, when a push sends 4096 or more over raw links; 0: none)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto", help=TRANSPORT_HELP)
    p.add_argument("--encrypt", choices=ENCRYPT_POLICIES, default="auto", help=ENCRYPT_HELP)
    p.add_argument("--at-source", action=argparse.BooleanOptionalAction, default=None,
                   help="every node also exposes the workspace at SRC's absolute path (a link "
                        "to MOUNT/NAME), so a venv's scripts and pyvenv.cfg resolve as on this "
                        "machine; never replaces what is there (default: on where the path "
                        "allows it, else a warning; --at-source makes that an error)")

    s = sub.add_parser("status", help="what every node serves, and the dev box store")
    add_target(s)
    add_switches(s, {
        "--json": "print one list, an object per node (with --store: one object)",
        "--store": "only the dev box store: objects, bytes, bound and the snapshots it holds "
                   "(asks no node)"})

    rm = sub.add_parser("rm", help="delete a workspace on every node",
                        description="Delete workspace NAME on every node: it leaves the mount at "
                                    "once and its disk is given back (a file held open keeps "
                                    "reading until closed). A node refuses while a process "
                                    "started with --workspace NAME runs there.")
    rm.add_argument("name", metavar="NAME")
    add_target(rm)
    add_switches(rm, {"--json": "print one list: per node host, removed, versions, error"})

    r = sub.add_parser(
        "run", help="run a command on every proc of every host (SPMD, torchrun-style)",
        description="Run CMD on K procs per host with RANK, WORLD_SIZE, LOCAL_RANK, "
                    "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun does; "
                    "output lines are prefixed with their rank. When a rank fails, the others "
                    "are stopped and the whole group restarts (up to --max-restarts times). "
                    "Exit status: 0 if every rank exited 0, else the first failing rank's exit "
                    "code (128+N for signal N) in the last attempt, 1 if the job could not be "
                    "launched. {mount} and {workspace} in CMD, --cwd expand on each node.")
    add_target(r)
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
                        "a small clean environment, not the daemon's (see the docs: Identity)")
    r.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="auto (RDMA when this host and a node both have a usable device, else "
                        "TCP, saying why), tcp, or rdma (an error naming the host without one). "
                        "run moves no bulk data itself: ranks get MONARCH_FS_TRANSPORT "
                        "(tcp, rdma-rc, rdma-srd) and the summary names it")
    r.add_argument("--hang-timeout", type=positive_seconds, metavar="S",
                   help="when no rank has printed anything for S seconds, print every rank's "
                        "stacks (as `stacks` does), record a job.hang event on each node, then "
                        "do what --on-hang says (default: never)")
    r.add_argument("--on-hang", choices=["kill", "wait"], default="kill",
                   help="after a hang's stacks: kill (default) fails the attempt, so "
                        "--max-restarts can restart the group; wait lets it run on")
    add_switches(r, {"--no-fold": "print every line of every rank; by default identical lines "
                                  "that ranks print within half a second print once, "
                                  "`[ranks 0-63] ...`"})
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")

    q = sub.add_parser(
        "query", help="one SQL query over the telemetry of every node",
        description="Run one SELECT over the `events`, `reads`, `stacks` and `logs` tables of "
                    "every node (see --schema); rows come back with a `host` column. Filters and "
                    "aggregates run on the nodes, the rest here. A node that does not answer "
                    "is reported and the others still answer (exit status 1 then).")
    q.add_argument("sql", nargs="?", metavar="SQL")
    add_target(q)
    add_switches(q.add_mutually_exclusive_group(), {
        "--json": 'print one object: {"columns", "rows" (an object each), "unreachable" '
                  '(host, error)}',
        "--csv": "print CSV with a header line (unreachable nodes on stderr)"})
    q.add_argument("--timeout", type=positive_seconds, default=10.0, metavar="S",
                   help="seconds a node may spend on its part (default 10)")
    add_switches(q, {
        "--explain": "print what each node runs and what runs here, and ask no node",
        "--schema": "print the tables and their columns"})

    add_debug_commands(sub)

    tp = sub.add_parser("top", help="a live view of every node: version, throughput, cache "
                                    "hit rate, running processes")
    add_target(tp)
    tp.add_argument("--interval", type=positive_seconds, default=1.0, metavar="S",
                    help="seconds between refreshes (default 1)")
    add_switches(tp, {"--once": "print one view (rates over one interval) and exit",
                      "--json": "one JSON list per view, a line each"})

    st = sub.add_parser(
        "stacks", help="what every rank of a job is doing: py-spy stacks from every node",
        description="Dump the Python stacks of every rank of a running `run` job or proc "
                    "mesh, on every node at once (each node's daemon runs py-spy), and print "
                    "them with identical stacks folded across ranks. Exit status 1 when a "
                    "rank could not be dumped (each node says why in one line) or no job runs.")
    st.add_argument("job", nargs="?", default="", metavar="JOB",
                    help="the job (run-XXXXXXXX, or a proc mesh's name; default: the newest "
                         "running one)")
    add_target(st)
    add_switches(st, {"--native": "add native frames (C, C++, Cython) to the Python ones",
                      "--json": "print one object: job, summary, groups, ranks, errors"})

    c = sub.add_parser("cluster", help="start or stop a local cluster on loopback")
    c.add_argument("action", choices=["up", "down"])
    c.add_argument("--nodes", type=int, default=3)
    c.add_argument("--dir", help="cluster folder (default ~/.monarch-fs/cluster)")
    c.add_argument("--no-root-procs", action="store_true",
                   help=f"as root, start the daemons without {ROOT_PROCS_FLAG}: they then "
                        "refuse to run processes")

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

    t = sub.add_parser("token", help="make a cluster token (every daemon and client needs one)")
    t.add_argument("action", choices=["new"])
    t.add_argument("path", nargs="?", metavar="PATH",
                   help="where to write it, mode 0600 (default $MONARCH_FS_HOME/cluster/token)")
    t.add_argument("--force", action="store_true", help="replace an existing token file")
    return parser
