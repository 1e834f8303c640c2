"""The options of the commands that look back at a job (`logs`, `repro`); options.py adds them
to the parser, and debug_commands.py holds what they do."""

from __future__ import annotations

import argparse

from .option_tables import add_switches, add_target


def add_debug_commands(sub: argparse._SubParsersAction) -> None:
    lg = sub.add_parser(
        "logs", help="what every rank of a job printed, from every node",
        description="Print the output of every rank of job JOB (default: the newest job any "
                    "node holds output of), as each node recorded it in its `logs` table, in "
                    "the order it was printed. Identical lines of many ranks print once, "
                    "`[ranks 0-63] epoch 3 done`, unless --no-fold. Exit status 1 when a "
                    "node did not answer (the others' lines are printed), or, as grep, when "
                    "no line was printed.")
    lg.add_argument("job", nargs="?", metavar="JOB",
                    help="the job's id (`run` prints it when a rank fails; MONARCH_FS_JOB in "
                         "each rank) or a proc mesh's name")
    lg.add_argument("--rank", type=int, metavar="R", help="only rank R's lines")
    lg.add_argument("--grep", metavar="RE", help="only lines that match the regular "
                                                 "expression RE (Python's re, searched)")
    lg.add_argument("--since", metavar="T",
                    help="only lines printed after T: a time ago (90s, 10m, 2h, 1d) or a date "
                         "and time (2026-12-06T01:30)")
    lg.add_argument("--follow", "-f", action="store_true",
                    help="keep printing new lines as the nodes record them (Ctrl-C stops)")
    add_switches(lg, {"--no-fold": "print every line of every rank, `[rank R] ...`"})
    add_target(lg)

    rp = sub.add_parser(
        "repro", help="run a rank of a job (or all: --world) again, here, as on the cluster",
        description="Run rank R of job JOB (default: the newest job) on this machine: the "
                    "same command, arguments and environment the node recorded when it "
                    "started it, from the same workspace version (taken from the dev box "
                    "store, else the workspace's source folder, checked chunk by chunk), "
                    "in a temporary folder, with MASTER_ADDR pointed here. Says what differs "
                    "from the cluster run (host, paths) and exits as the process does.")
    rp.add_argument("job", nargs="?", metavar="JOB", help="the job's id (default: the newest)")
    which = rp.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, metavar="R", help="the rank to run")
    which.add_argument("--world", action="store_true",
                       help="run every rank of the job here at once, MASTER_ADDR and "
                            "MASTER_PORT shared, output folded as `run` folds it; the first "
                            "rank that fails stops the others and gives the exit status")
    rp.add_argument("--source", metavar="DIR",
                    help="the workspace's source folder, for what the dev box store does not "
                         "hold (default: the folder the node was told it was pushed from)")
    add_switches(rp, {
        "--pdb": "with --rank: run it under pdb (`python -m pdb`): it stops at the first line, "
                 "and at an uncaught exception",
        "--no-fold": "with --world: print every line of every rank",
        "--keep": "keep the temporary folder the version was written to"})
    add_target(rp)
