"""Who asks: a MUNGE credential on the requests that act as a user (`--identity munge`).

The shared token only says "someone holding the token". A daemon started with `--identity
munge` advertises it in its Welcome (`identity: "munge"`); a client then puts a MUNGE
credential (`cred`) on each request that acts for a user: spawn (the process runs as that
user), prepare, commit and remove (a workspace belongs to who pushed it), query and stats (a
user reads the telemetry rows of their own processes and the node's, and sees their own
running processes in `top`). SLURM identifies users the same way: munged on every node shares
one key, so a credential made on the dev box decodes on every node, and munged vouches for the
uid and gid of the process that asked it.

The credential's payload binds it to one request: a hash of the op, its arguments (all but
`cred`) and this connection (a digest of the key the handshake derived, which both ends know
and nobody else does). A credential lifted from one request cannot authorize another; munged
itself refuses one decoded twice (replayed) or past its time to live (300 s by default).

Through the `munge` and `unmunge` commands (package munge), not libmunge through ctypes: a
credential per spawn or publish is a fork each way, noise next to starting a process, and the
commands are what an operator debugs with, their exit status being libmunge's error code.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ...settings import settings

if TYPE_CHECKING:
    from .transport import Channel

MODE = "munge"  # --identity munge; what a daemon advertises as `identity` in its Welcome
ASKER = "the user who asks"  # status's procs_user under --identity munge
# Without --identity, a daemon running as root runs processes as root only given this flag
# (daemon/node/procs.py); the client starts daemons with it and names it (client/cluster.py).
ROOT_PROCS_FLAG = "--allow-root-procs"
FIELD = "cred"  # the request argument that carries the credential
# The requests that act for a user (`current` answers for one: is that workspace theirs?;
# `query` reads the rows of theirs and the node's own, `stats` and `stacks` their processes,
# `logs` their processes' output, `read_chunks` of their workspace).
OPS = frozenset({"spawn", "prepare", "commit", "current", "remove", "query", "stats", "stacks",
                 "logs", "read_chunks"})
DEFAULT_SOCKET = "/run/munge/munge.socket.2"  # libmunge's
TIMEOUT = 10.0  # seconds for munge or unmunge to answer
_PAYLOAD_TAG = "monarch-fs-identity-1"

# libmunge's error codes (munge.h), as unmunge's exit status and STATUS field
EXPIRED, REWOUND, REPLAYED, UNAUTHORIZED = 15, 16, 17, 18
INVALID = frozenset({8, 9, 10, 11, 12, 13, 14})  # bad credential, version, cipher, mac, ...
SOCKET = 6


class IdentityError(Exception):
    """A credential was missing or refused; the message says why, for the client."""


@dataclass(frozen=True)
class Identity:
    """The user a credential vouches for."""

    uid: int
    gid: int


def munge_socket() -> str:
    return settings.munge_socket or DEFAULT_SOCKET


def session_id(chan: Channel) -> str:
    """What binds a credential to this connection: a digest of the key both ends derived in
    the handshake (a digest: the key itself seals chunks)."""
    key = chan.conn.bulk_key
    if key is None:
        raise IdentityError("this connection has no session key (handshake not done)")
    return hashlib.sha256(b"monarch-fs identity session\0" + key).hexdigest()[:32]


def fan_scope(nonce: str) -> str:
    """What binds a credential to a request sent down a push's control tree (requests.Fan):
    the same request reaches every node of the tree, over connections the dev box does not
    hold, so it is bound to a fresh nonce of the dev box's instead of one connection. munged
    on each node still decodes it once only, and it authorizes only that op with those
    arguments: a node that passes it on can make it do what the user asked, nothing else."""
    if not re.fullmatch(r"[0-9a-f]{32,64}", nonce):
        raise IdentityError("fan: a request down the control tree carries no nonce to bind "
                            "its MUNGE credential to")
    return "fan-" + nonce


class SeenScopes:
    """The control-tree requests (fan_scope, op) this daemon acted on, for as long as their
    credentials could still decode (KEEP seconds): a second one is a replay."""

    KEEP = 900.0  # past munged's default time to live (300 s), with room for clock skew

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], float] = {}

    def record(self, session: str, op: str) -> None:
        now = time.monotonic()
        if (session, op) in self.seen:
            raise IdentityError(f"{op}: the MUNGE credential was replayed (this node already "
                                "acted on that request of the control tree)")
        if len(self.seen) >= 4096:
            self.seen = {k: until for k, until in self.seen.items() if until > now}
        self.seen[(session, op)] = now + self.KEEP


def payload(op: str, args: dict[str, Any], session: str) -> str:
    """The text a credential carries for request `op` with `args` on connection `session`."""
    body = json.dumps({k: v for k, v in args.items() if k != FIELD}, sort_keys=True,
                      separators=(",", ":"), default=lambda v: bytes(v).hex())
    digest = hashlib.sha256(f"{op}\0{body}".encode()).hexdigest()
    return f"{_PAYLOAD_TAG} {session} {op} {digest}"


async def _run(argv: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    """Run munge or unmunge (argv[2] is the socket), bounded."""
    try:
        with trio.fail_after(TIMEOUT):
            return await trio.run_process(argv, stdin=stdin, capture_stdout=True,
                                          capture_stderr=True, check=False)
    except FileNotFoundError:
        raise IdentityError(f"{argv[0]} is not installed (package munge)") from None
    except trio.TooSlowError:
        raise IdentityError(f"{argv[0]} -S {argv[2]} did not answer within "
                            f"{TIMEOUT:g}s") from None


async def sign(chan: Channel, op: str, args: dict[str, Any], ttl: int | None = None,
               scope: str | None = None) -> dict[str, Any]:
    """`args` with a credential for request `op` on `chan` when its node asks for one (it
    advertised `identity: munge`) and the op acts for a user; else `args` as they are. With
    `scope` (a nonce: fan_scope), the credential is bound to it instead of `chan`."""
    if chan.info.get("identity") != MODE or op not in OPS:
        return args
    text = payload(op, args, session_id(chan) if scope is None else fan_scope(scope))
    argv = ["munge", "-S", munge_socket(), "-s", text]
    if ttl is not None:
        argv += ["-t", str(ttl)]
    out = await _run(argv, b"")
    if out.returncode != 0:
        why = out.stderr.decode(errors="replace").strip().removeprefix("munge: Error: ")
        raise IdentityError(f"cannot make a MUNGE credential (the node {chan.peer} asks who "
                            f"you are): {why}")
    return {**args, FIELD: out.stdout.decode().strip()}


def _parse(stdout: bytes) -> tuple[dict[str, str], bytes]:
    """unmunge -N's metadata ("KEY: value" lines) and the payload after the blank line."""
    head, _, body = stdout.partition(b"\n\n")
    meta = {}
    for line in head.decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        meta[key.strip()] = value.strip()
    return meta, body


async def verify(cred: object, op: str, args: dict[str, Any], session: str, socket: str,
                 seen: SeenScopes | None = None) -> Identity:
    """Who `cred` says asks for request `op` with `args` on connection `session`, decoded by
    this node's munged (at `socket`); IdentityError naming the cause if it is missing or
    refused. A credential bound to a control tree's scope (fan_scope) is checked against
    `seen` instead of munged's replay cache, which other daemons on the host may share: each
    of them decodes the same credential once."""
    if not cred:
        raise IdentityError(f"{op}: this daemon acts as the user who asks (--identity munge) "
                            "and the request carries no MUNGE credential; send it from a "
                            "monarch-fs client on a host where munged runs")
    if not isinstance(cred, str) or not cred.isascii():
        raise IdentityError(f"{op}: the MUNGE credential is not a credential's text")
    out = await _run(["unmunge", "-S", socket, "-N"], cred.encode())
    meta, body = _parse(out.stdout)
    code = out.returncode
    if code == EXPIRED:
        raise IdentityError(f"{op}: the MUNGE credential expired (its time to live was "
                            f"{meta.get('TTL', '?')} s); make a fresh one for each request")
    if seen is not None and code == REPLAYED:
        code = 0  # `seen` says whether this daemon decoded it before, below
    if code == REPLAYED:
        raise IdentityError(f"{op}: the MUNGE credential was replayed (this node's munged "
                            "already decoded it once)")
    if code == REWOUND:
        raise IdentityError(f"{op}: the MUNGE credential was made in the future (a clock "
                            "rewound, or clocks out of sync)")
    if code in INVALID:
        raise IdentityError(f"{op}: the MUNGE credential is invalid: forged, damaged, or made "
                            "with another key than this node's munged (every node and client "
                            "host must share one munge.key)")
    if code == SOCKET:
        raise IdentityError(f"{op}: this node cannot reach munged at {socket} to "
                            "check who asks")
    if code != 0:
        why = out.stderr.decode(errors="replace").strip().removeprefix("unmunge: Error: ")
        raise IdentityError(f"{op}: the MUNGE credential was refused: {why or f'code {code}'}")
    if body.decode(errors="replace") != payload(op, args, session):
        raise IdentityError(f"{op}: the MUNGE credential was made for another request or "
                            "connection (payload mismatch)")
    try:
        who = Identity(int(meta["UID"]), int(meta["GID"]))
    except (KeyError, ValueError):
        raise IdentityError(f"{op}: unmunge gave no uid and gid") from None
    if seen is not None:
        seen.record(session, op)  # once per daemon, whatever munged remembers
    return who
