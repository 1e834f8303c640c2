"""`monarch-fs status`: ask every node what it serves; an unreachable node is reported, not fatal."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from .transport import connect

TIMEOUT = 10.0


async def status(hosts: Sequence[str], token: bytes) -> list[dict]:
    results: dict[str, dict] = {}

    async def one(host: str) -> None:
        try:
            with trio.fail_after(TIMEOUT):
                chan = await connect(host, token, timeout=TIMEOUT)
                async with chan:
                    info = await chan.request("status")
            results[host] = {"host": host, "reachable": True, **info}
        except Exception as e:  # any failure is that node's status, never the command's
            msg = str(e).removeprefix(f"{host}: ") or type(e).__name__
            results[host] = {"host": host, "reachable": False, "error": msg}

    async with trio.open_nursery() as nursery:
        for h in hosts:
            nursery.start_soon(one, h)
    return [results[h] for h in hosts]
