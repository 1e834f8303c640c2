"""Broadcast topologies: who sends to whom, so the dev box sends each missing byte once.

A plan is a list of roots the dev box sends to; each node is {"addr": ..., "children": [...]},
and every node forwards to its children what their subtrees lack while it receives the next chunk.

- star: every node is a root. The dev box sends N copies; best for tiny payloads (latency).
- chain: one root, each node forwards to the next. Dev-box egress = payload; time is about
  payload / bandwidth + N x (one chunk's transfer time), because the chain is pipelined.
- tree: a k-ary tree (--fanout K). Depth log_k(N), but inner nodes send k copies.
- auto: star for one node or a payload under AUTO_STAR_BYTES per node, else chain. Even two
  nodes get a chain: a star would send the dev box's uplink twice the bytes (measured over
  1 Gbit/s links in network namespaces: 512 MiB to 2 hosts took 7.2 s as a star, 4.2 s as a
  chain, 3.9 s to 1 host).
"""

from __future__ import annotations

from collections.abc import Sequence

AUTO_STAR_BYTES = 8 * 1024 * 1024
KINDS = ("auto", "chain", "tree", "star")

# How a push's control requests (current, what do you lack, prepare, commit) reach the nodes.
# star: the dev box asks every node itself (one round trip, N requests from one thread). tree:
# it asks CONTROL_FANOUT roots, and every node asks up to that many children (`forest`): about
# log_k(N) round trips, and no node, the dev box included, sends more than k copies. auto: tree
# above CONTROL_STAR_MAX nodes (each node costs the dev box about 3 ms of CPU an edit, measured:
# bench/edit_fanout_bench.py).
CONTROLS = ("auto", "star", "tree")
CONTROL_STAR_MAX = 16
CONTROL_FANOUT = 16


def control(kind: str, nodes: int, early: bool = False) -> str:
    """The control plane `kind` resolves to for a push to `nodes` nodes. push --early needs
    the star: it publishes while chunks stream, on a connection of each node's own."""
    if kind not in CONTROLS:
        raise ValueError(f"unknown control plane {kind!r}: use one of {CONTROLS}")
    if kind == "tree" and early:
        raise ValueError("push --early publishes over the star control plane: drop "
                         "--control tree")
    if kind == "auto":
        return "tree" if nodes > CONTROL_STAR_MAX and not early else "star"
    return kind


def choose(kind: str, nodes: int, payload: int) -> str:
    """The topology `auto` resolves to, for `nodes` nodes each lacking up to `payload` bytes."""
    if kind != "auto":
        return kind
    if nodes <= 1 or payload < AUTO_STAR_BYTES:
        return "star"
    return "chain"


def plan(hosts: Sequence[str], kind: str, fanout: int = 2) -> list[dict]:
    if kind not in KINDS or kind == "auto":
        raise ValueError(f"unknown topology {kind!r}")
    children: list[list[dict]] = [[] for _ in hosts]
    nodes: list[dict] = [{"addr": h, "children": c} for h, c in zip(hosts, children)]
    if kind == "star" or not nodes:
        return nodes
    if kind == "chain":
        for below, child in zip(children, nodes[1:]):
            below.append(child)
        return nodes[:1]
    if fanout < 1:
        raise ValueError("--fanout must be at least 1")
    for i, node in enumerate(nodes[1:], start=1):  # heap order: node i's parent is (i-1)//k
        children[(i - 1) // fanout].append(node)
    return nodes[:1]


def forest(hosts: Sequence[str], fanout: int) -> list[dict]:
    """The control tree of a push to many nodes (push.py, `control`): the dev box sends each
    request to `fanout` roots, and every node forwards it to up to `fanout` children, so a
    request reaches N nodes in about log_k(N) hops. Heap order with the dev box at the top:
    host i's parent is host i // k - 1 (the first k are roots)."""
    if fanout < 1:
        raise ValueError("the control fanout must be at least 1")
    nodes: list[dict] = [{"addr": h, "children": []} for h in hosts]
    for i, node in enumerate(nodes[fanout:], start=fanout):
        nodes[i // fanout - 1]["children"].append(node)
    return nodes[:fanout]


def subtree(spec: dict) -> list[str]:
    """Every address in a plan node's subtree, itself first."""
    out = [spec["addr"]]
    for child in spec["children"]:
        out += subtree(child)
    return out


def depth(spec: dict) -> int:
    """Hops below a plan node: a parent waits for its subtree, so its timeouts scale with this."""
    return 1 + max(map(depth, spec["children"])) if spec["children"] else 0


MAX_PATIENCE = 4


def patience(children: list[dict]) -> int:
    """How many timeouts a parent waits on a node with these children before blaming it.

    A stalled node stops reading, its parent's queue fills, and the parent stops reading too:
    every hop above a stall sees it. Waiting longer the more levels lie below lets the node right
    above the stall, which times out first, be the one that names it. Capped, so a deep chain
    still detects a stall near its top in bounded time (then the blame may land one hop high).
    """
    return 1 + min(depth({"children": children}), MAX_PATIENCE - 1)
