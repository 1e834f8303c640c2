"""`monarch-fs status` and `monarch-fs rm`: one request to every node at once; an unreachable or
refusing node is reported, never fatal to the others."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..wire.requests import check_workspace_name
from ..wire.transport import connect, describe_failure

TIMEOUT = 10.0


async def ask_all(hosts: Sequence[str], token: bytes, op: str,
                  **args: object) -> list[tuple[str, dict | Exception]]:
    """Send request `op` to every host at once: per host, in order, its reply or what failed."""
    results: dict[str, dict | Exception] = {}

    async def one(host: str) -> None:
        try:
            with trio.fail_after(TIMEOUT):
                chan = await connect(host, token, timeout=TIMEOUT)
                async with chan:
                    results[host] = await chan.request(op, **args)
        except Exception as e:  # any failure is that node's answer, never the command's
            results[host] = e

    async with trio.open_nursery() as nursery:
        for h in hosts:
            nursery.start_soon(one, h)
    return [(h, results[h]) for h in hosts]


async def status(hosts: Sequence[str], token: bytes) -> list[dict]:
    out = []
    for host, reply in await ask_all(hosts, token, "status"):
        if isinstance(reply, Exception):
            msg = str(reply).removeprefix(f"{host}: ") or type(reply).__name__
            out.append({"host": host, "reachable": False, "error": msg})
        else:
            out.append({"host": host, "reachable": True, **reply})
    return out


async def remove(hosts: Sequence[str], token: bytes, name: str) -> list[dict]:
    """Delete workspace `name` on every host: per host, whether it was removed, the versions
    it had, and else why not (unknown there, in use, unreachable)."""
    check_workspace_name(name)
    out = []
    for host, reply in await ask_all(hosts, token, "remove", name=name):
        if isinstance(reply, Exception):
            out.append({"host": host, "removed": False, "versions": [],
                        "error": describe_failure(reply, TIMEOUT)})
        else:
            out.append({"host": host, "removed": True, "versions": reply["versions"],
                        "error": None})
    return out
