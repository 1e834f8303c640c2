"""What push --early sends first: what the nodes read first after earlier publishes of a
workspace, file by file and chunk by chunk (recorded by each daemon: daemon/node/
first_reads.py), merged across the nodes and kept on the dev box ($MONARCH_FS_HOME/first-reads/
NAME.json), so that a push to the fresh nodes of a new allocation, which have recorded nothing,
still knows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import trio

from ..wire.read_lists import MAX_READS, Read, decode_reads, load_reads, save_reads
from ..wire.replies import FirstReadsReply
from .links import NODE_ERRORS, NodeLink


def merge(lists: Sequence[Sequence[Read]], limit: int = MAX_READS) -> list[Read]:
    """One list from several, each read once: round robin over the lists, so every node's
    first reads come early, in each node's order."""
    out: dict[Read, None] = {}
    for i in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if i < len(x):
                out.setdefault(x[i], None)
    return list(out)[:limit]


async def learn(nodes: Sequence[NodeLink], name: str, timeout: float) -> list[list[Read]]:
    """Each healthy node's first reads of `name` (none from a node that cannot say: an older
    daemon, or one that fails; the push finds out about a failed node in its own steps)."""
    found: list[list[Read]] = []

    async def ask(node: NodeLink) -> None:
        try:
            with trio.fail_after(timeout):
                reply = await node.channel.request("first_reads", name=name)
            found.append(decode_reads(FirstReadsReply.from_wire(reply).to_wire()))
        except NODE_ERRORS:
            pass

    async with trio.open_nursery() as nursery:
        for node in nodes:
            if node.error is None:
                nursery.start_soon(ask, node)
    return found


def known(folder: Path, name: str, fresh: Sequence[Sequence[Read]]) -> list[Read]:
    """The list to send first: the nodes' fresh lists, then what the dev box kept from earlier
    pushes; saved back when the nodes told something."""
    path = folder / f"{name}.json"
    try:
        kept = load_reads(path)
    except (OSError, ValueError, KeyError, TypeError):
        kept = []
    if not any(fresh):
        return kept
    merged = merge([merge(fresh), kept])
    try:
        save_reads(path, merged)
    except OSError:
        pass  # a cache: the next push asks the nodes again
    return merged
