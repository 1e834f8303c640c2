"""`monarch-fs` and `python -m monarch_fs`: a push that a running `push --watch` of the same
folder can take is handed to it before anything else is imported (daemon/client/handoff.py);
everything else runs cli.main."""

from __future__ import annotations

import sys

from .daemon.client.handoff import hand_off


def main() -> int:
    code = hand_off(sys.argv[1:])
    if code is not None:
        return code
    from .cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
