"""What many commands' options have in common, declared once: the nodes a client command talks
to (--hosts, --token-file) and on/off switches given as a table of flag and help. options.py and
debug_options.py declare the commands with them."""

from __future__ import annotations

import argparse

HOSTS_HELP = ("host:port,host:port or @hostfile (default $MONARCH_FS_HOSTS, then the local "
              "cluster)")


def add_target(parser: argparse.ArgumentParser) -> None:
    """--hosts, then --token-file: the nodes, and the token the command proves itself with."""
    parser.add_argument("--hosts", metavar="SPEC", help=HOSTS_HELP)
    parser.add_argument("--token-file", metavar="F")


def add_switches(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                 switches: dict[str, str]) -> None:
    """Options that are off unless given (store_true), in the order of `switches`, each with
    its help."""
    for flag, text in switches.items():
        parser.add_argument(flag, action="store_true", help=text)
