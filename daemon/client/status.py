"""`monarch-fs status` and `monarch-fs rm`: one request to every node at once; an unreachable or
refusing node is reported, never fatal to the others."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from ..wire import identity
from ..wire.replies import RemoveReply, StatusReply
from ..wire.requests import check_workspace_name
from ..wire.transport import Channel, connect, describe_failure

TIMEOUT = 10.0

R = TypeVar("R")


async def ask_each(hosts: Sequence[str], token: bytes,
                   talk: Callable[[str, Channel], Awaitable[None]],
                   timeout: float = TIMEOUT) -> list[tuple[str, Exception | None]]:
    """Connect to every host at once and run `talk(host, channel)` on each, within `timeout`
    seconds: per host, in order, None or what failed (never raised: one node's failure is
    that node's answer, not the command's)."""
    results: dict[str, Exception | None] = {}

    async def one(host: str) -> None:
        try:
            with trio.fail_after(timeout):
                chan = await connect(host, token, timeout=timeout)
                async with chan:
                    await talk(host, chan)
            results[host] = None
        except Exception as e:
            results[host] = e

    async with trio.open_nursery() as nursery:
        for h in hosts:
            nursery.start_soon(one, h)
    return [(h, results[h]) for h in hosts]


async def ask_all(hosts: Sequence[str], token: bytes, op: str,
                  decode: Callable[[Mapping[str, Any]], R],
                  **args: object) -> list[tuple[str, R | Exception]]:
    """Send request `op` to every host at once: per host, in order, its reply (decoded by
    `decode`, a reply class's from_wire) or what failed."""
    replies: dict[str, R] = {}

    async def talk(host: str, chan: Channel) -> None:
        signed = await identity.sign(chan, op, args)  # if the node asks who
        replies[host] = decode(await chan.request(op, **signed))

    return [(h, e if e is not None else replies[h])
            for h, e in await ask_each(hosts, token, talk)]


@dataclass(frozen=True)
class NodeStatus:
    """One host's line of `status`: what it reported, or why it could not be asked."""

    host: str
    reply: StatusReply | None  # None: unreachable (or refused), `error` says why
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.reply is not None

    def to_json(self) -> dict[str, Any]:
        """As `status --json` prints it: host, reachable, then the node's reply or error."""
        if self.reply is None:
            return {"host": self.host, "reachable": False, "error": self.error}
        return {"host": self.host, "reachable": True, **self.reply.to_wire()}


@dataclass(frozen=True)
class NodeRemoval:
    """One host's answer to `rm`: whether the workspace went, its versions, else why not."""

    host: str
    removed: bool
    versions: list[str]  # hex ids, current first
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "removed": self.removed, "versions": self.versions,
                "error": self.error}


async def status(hosts: Sequence[str], token: bytes) -> list[NodeStatus]:
    out = []
    for host, reply in await ask_all(hosts, token, "status", StatusReply.from_wire):
        if isinstance(reply, Exception):
            msg = str(reply).removeprefix(f"{host}: ") or type(reply).__name__
            out.append(NodeStatus(host, None, msg))
        else:
            out.append(NodeStatus(host, reply))
    return out


async def remove(hosts: Sequence[str], token: bytes, name: str) -> list[NodeRemoval]:
    """Delete workspace `name` on every host: per host, whether it was removed, the versions
    it had, and else why not (unknown there, in use, unreachable)."""
    check_workspace_name(name)
    out = []
    for host, reply in await ask_all(hosts, token, "remove", RemoveReply.from_wire, name=name):
        if isinstance(reply, Exception):
            out.append(NodeRemoval(host, False, [], describe_failure(reply, TIMEOUT)))
        else:
            out.append(NodeRemoval(host, True, [v.hex() for v in reply.versions], None))
    return out
