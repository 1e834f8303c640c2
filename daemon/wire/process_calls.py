"""The requests that start and stop a node's processes (spawn, kill, free_port, probe) and their
replies: what `monarch-fs run` and the actor mesh ask (daemon/node/procs.py answers).

Apart from requests.py and replies.py, which hold what a push asks and the node's status.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import ClassVar

from .replies import PlainReply
from .requests import NoArguments, RequestError, int_arg


@dataclass(frozen=True)
class Spawn:
    """Start a process owned by this connection; its output and exit come back as Events.
    `spec` holds argv, env, secrets and cwd, which the process table checks
    (procs.ProcessTable.spawn); with `workspace`, the process runs from that workspace's
    `version` (default: the current one), which stays served while it runs."""

    op: ClassVar[str] = "spawn"
    after_chunks: ClassVar[bool] = False
    spec: dict
    workspace: str = ""
    version: bytes | None = None

    @classmethod
    def parse(cls, args: dict) -> Spawn:
        workspace = args.get("workspace") or ""
        version = args.get("version") or None
        if not isinstance(workspace, str):
            raise RequestError(f"spawn: workspace must be a string, not {workspace!r}")
        if version is not None and not isinstance(version, str):
            raise RequestError(f"spawn: version must be a string, not {version!r}")
        return cls(args, workspace, bytes.fromhex(version) if version else None)


@dataclass(frozen=True)
class Kill:
    """Send `signal` to the process group of process `proc`, which this connection started."""

    op: ClassVar[str] = "kill"
    after_chunks: ClassVar[bool] = False
    proc: int
    signal: int = signal.SIGTERM

    @classmethod
    def parse(cls, args: dict) -> Kill:
        return cls(int_arg(cls.op, args, "proc", 0),
                   int_arg(cls.op, args, "signal", signal.SIGTERM))


@dataclass(frozen=True)
class FreePort(NoArguments):
    """A TCP port free on this node now (MASTER_PORT for an SPMD job whose rank 0 runs here)."""

    op: ClassVar[str] = "free_port"
    after_chunks: ClassVar[bool] = False


@dataclass(frozen=True)
class Probe:
    """Padding the node only counts: the push times two of them, small and large, to measure
    the link's rate against the codec's (daemon/client/link_codec.py)."""

    op: ClassVar[str] = "probe"
    after_chunks: ClassVar[bool] = False
    size: int

    @classmethod
    def parse(cls, args: dict) -> Probe:
        pad = args.get("pad", "")
        if not isinstance(pad, str):
            raise RequestError(f"probe: pad must be a string, not {type(pad).__name__}")
        return cls(len(pad))




@dataclass(frozen=True)
class SpawnReply(PlainReply):
    """The process started: its id on this connection (for `kill` and its events) and its pid."""

    op: ClassVar[str] = "spawn"
    proc: int
    pid: int


@dataclass(frozen=True)
class KillReply(PlainReply):
    """The signal was sent. Carries nothing."""

    op: ClassVar[str] = "kill"


@dataclass(frozen=True)
class FreePortReply(PlainReply):
    """A TCP port nobody listened on when the node looked."""

    op: ClassVar[str] = "free_port"
    port: int


@dataclass(frozen=True)
class ProbeReply(PlainReply):
    """How many bytes of padding the probe carried."""

    op: ClassVar[str] = "probe"
    size: int
