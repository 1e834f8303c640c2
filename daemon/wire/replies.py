"""The replies a node sends, one small dataclass each, next to the requests in requests.py.

A handler on the node returns one of these and the session sends `to_wire()` as the value of
`protocol.Reply`; the dict is exactly what a node has always sent (same keys, same order), so
older clients, the mesh and tests that read the loose dict still match. A client decodes a
reply with `from_wire`, which checks every field it reads and raises MalformedReply (a
ProtocolError: that node broke the protocol, which fails it, never the others) naming the op
and the field, instead of a KeyError deep in the caller.

Versions travel as hex strings and are bytes here, as in the requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeVar, get_origin, get_type_hints

from .protocol import ProtocolError
from .requests import from_hex

# What crossed a node since it started (NodeService.counters); `status` reports each.
COUNTERS = ("chunks_received", "bytes_received", "chunks_stored", "chunks_forwarded",
            "packs_collected", "bytes_collected", "tail_held_ms")
# The keys of the node's transport description (bulk.LocalTransport.info) in `status`.
TRANSPORT_KEYS = ("transport", "transport_reason", "rdma")


class MalformedReply(ProtocolError):
    """A node's reply lacks a field or has one of the wrong type."""


T = TypeVar("T")


def _field(op: str, value: Mapping[str, Any], key: str) -> object:
    if not isinstance(value, Mapping):
        raise MalformedReply(f"malformed {op} reply: expected an object, not {value!r}")
    if key not in value:
        raise MalformedReply(f"malformed {op} reply: no {key!r}")
    return value[key]


def typed_field(op: str, value: Mapping[str, Any], key: str, kind: type[T]) -> T:
    """`value[key]`, checked to be a `kind` (a bool is not an int here)."""
    got = _field(op, value, key)
    if not isinstance(got, kind) or (isinstance(got, bool) and kind is not bool):
        raise MalformedReply(f"malformed {op} reply: {key!r} is {got!r}")
    return got


@dataclass(frozen=True)
class PlainReply:
    """A reply whose fields cross the wire as they are, by name, each checked on arrival to be
    of the type it is declared with: one to_wire and from_wire for every reply of that shape."""

    op: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> Self:
        if not isinstance(value, Mapping):
            raise MalformedReply(f"malformed {cls.op} reply: expected an object, not {value!r}")
        hints = get_type_hints(cls)  # the declared types (`dict[str, Any]` checks as a dict)
        return cls(**{f.name: typed_field(cls.op, value, f.name,
                                          get_origin(hints[f.name]) or hints[f.name])
                      for f in fields(cls)})


def number_field(op: str, value: Mapping[str, Any], key: str) -> float:
    got = _field(op, value, key)
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise MalformedReply(f"malformed {op} reply: {key!r} is {got!r}")
    return got


def counts_field(value: object) -> dict[str, int]:
    """A {name: count} field of a newer reply; what is not one is left out (an older node
    sends none)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items()
            if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}


def _hex(op: str, key: str, text: object) -> bytes:
    got = from_hex(text)
    if got is None:
        why = ", not hex" if isinstance(text, str) else ""
        raise MalformedReply(f"malformed {op} reply: {key!r} is {text!r}{why}")
    return got


def _failures(op: str, value: Mapping[str, Any]) -> dict[str, str]:
    failed = typed_field(op, value, "failed", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in failed.items()):
        raise MalformedReply(f"malformed {op} reply: 'failed' is {failed!r}")
    return dict(failed)


@dataclass(frozen=True)
class StatusReply:
    """What `monarch-fs status` shows for one node. `transport` is the node's
    LocalTransport.info() and `counters` the COUNTERS, both spread into the wire dict."""

    op: ClassVar[str] = "status"
    node: str
    addr: str
    mount: str
    transport: dict[str, Any]
    pid: int
    uptime: float
    store_objects: int
    store_bytes: int
    fuse: str
    backing_files: int
    backing_bytes: int
    backing_writing: int
    backing_waits: int
    backing_error: str | None
    counters: dict[str, int]
    workspaces: dict[str, list[str]]  # name -> version ids (hex), current first
    problems: list[str] = field(default_factory=list)
    # "root" or "unprivileged (user alice; fusermount3; ...)": how the node mounts
    # (fs/mount_options.py); "unknown" from a node that does not say
    mode: str = "unknown"
    root_procs: bool = False  # a root daemon started with --allow-root-procs
    procs_user: str = ""  # who the node's processes run as; "" when it refuses them (root)
    identity: str = ""  # "munge": processes run as, and workspaces belong to, who asks
    owners: dict[str, str] = field(default_factory=dict)  # workspace -> "alice (uid 1001)"
    # Workspaces serving a version published early (push --early) whose chunks have not all
    # arrived yet: a read of a missing chunk fetches it, or fails with EIO.
    incomplete: list[str] = field(default_factory=list)
    incomplete_chunks: dict[str, int] = field(default_factory=dict)  # name -> chunks it lacks
    durable: str = ""  # --durable: "background" or "sync" ("" from an older node)
    # name -> {version, chunks, serving}: its current version lost chunks in a crash before
    # they were flushed; the last whole version serves until a push (daemon/node/lost.py)
    lost: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"node": self.node, "addr": self.addr, "mount": self.mount, **self.transport,
                "pid": self.pid, "uptime": self.uptime, "store_objects": self.store_objects,
                "store_bytes": self.store_bytes, "fuse": self.fuse,
                "backing_files": self.backing_files, "backing_bytes": self.backing_bytes,
                "backing_writing": self.backing_writing, "backing_waits": self.backing_waits,
                "backing_error": self.backing_error, **self.counters,
                "workspaces": self.workspaces, "problems": self.problems, "mode": self.mode,
                "root_procs": self.root_procs, "procs_user": self.procs_user,
                "identity": self.identity, "owners": self.owners,
                "incomplete": self.incomplete, "incomplete_chunks": self.incomplete_chunks,
                "durable": self.durable, "lost": self.lost}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> StatusReply:
        op = cls.op
        workspaces = typed_field(op, value, "workspaces", dict)
        if not all(isinstance(n, str) and isinstance(vs, list)
                   and all(isinstance(v, str) for v in vs) for n, vs in workspaces.items()):
            raise MalformedReply(f"malformed {op} reply: 'workspaces' is {workspaces!r}")
        problems = typed_field(op, value, "problems", list)
        if not all(isinstance(x, str) for x in problems):
            raise MalformedReply(f"malformed {op} reply: 'problems' is {problems!r}")
        error = value.get("backing_error")
        if error is not None and not isinstance(error, str):
            raise MalformedReply(f"malformed {op} reply: 'backing_error' is {error!r}")
        mode = value.get("mode", "unknown")
        if not isinstance(mode, str):
            raise MalformedReply(f"malformed {op} reply: 'mode' is {mode!r}")
        identity = value.get("identity", "")
        owners = value.get("owners", {})
        if not isinstance(identity, str) or not isinstance(owners, dict) or not all(
                isinstance(n, str) and isinstance(u, str) for n, u in owners.items()):
            raise MalformedReply(f"malformed {op} reply: 'identity' or 'owners' is "
                                 f"{identity!r}, {owners!r}")
        return cls(
            node=typed_field(op, value, "node", str), addr=typed_field(op, value, "addr", str),
            mount=typed_field(op, value, "mount", str),
            transport={k: value[k] for k in TRANSPORT_KEYS if k in value},
            pid=typed_field(op, value, "pid", int), uptime=number_field(op, value, "uptime"),
            store_objects=typed_field(op, value, "store_objects", int),
            store_bytes=typed_field(op, value, "store_bytes", int),
            fuse=typed_field(op, value, "fuse", str),
            backing_files=typed_field(op, value, "backing_files", int),
            backing_bytes=typed_field(op, value, "backing_bytes", int),
            backing_writing=typed_field(op, value, "backing_writing", int),
            backing_waits=typed_field(op, value, "backing_waits", int), backing_error=error,
            counters={k: typed_field(op, value, k, int) for k in COUNTERS if k in value},
            workspaces={n: list(vs) for n, vs in workspaces.items()}, problems=list(problems),
            mode=mode, root_procs=typed_field(op, value, "root_procs", bool),
            procs_user=typed_field(op, value, "procs_user", str), identity=identity,
            owners=dict(owners), incomplete=[str(n) for n in value.get("incomplete", [])
                                             if isinstance(n, str)],
            incomplete_chunks=counts_field(value.get("incomplete_chunks", {})),
            durable=durable if isinstance(durable := value.get("durable", ""), str) else "",
            lost={n: dict(v) for n, v in lost.items() if isinstance(n, str)
                  and isinstance(v, dict)} if isinstance(lost := value.get("lost"), dict) else {})


@dataclass(frozen=True)
class PrepareReply:
    """`version` is here, complete and durable, and kept from collection until its commit."""

    op: ClassVar[str] = "prepare"
    prepared: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"prepared": self.prepared.hex()}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> PrepareReply:
        return cls(_hex(cls.op, "prepared", _field(cls.op, value, "prepared")))


@dataclass(frozen=True)
class CommitReply:
    """The workspace now serves `version`; `previous` is what it served before (None: new).
    `warnings`: what the node could not do but did not fail the commit for (exposing the
    workspace at its source path); sent only when there are some."""

    op: ClassVar[str] = "commit"
    version: bytes
    previous: bytes | None
    warnings: list[str] = field(default_factory=list)
    # Not sent: on the node, what the commit replaced (the version it dropped), freed with
    # the reply once it is sent. Freeing a version of 100k entries took 3 ms, which the push
    # waited for when it was freed inside the commit.
    replaced: object = field(default=None, repr=False, compare=False)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version.hex(),
                               "previous": self.previous.hex() if self.previous else None}
        if self.warnings:
            out["warnings"] = self.warnings
        return out

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> CommitReply:
        previous = _field(cls.op, value, "previous")
        warnings = value.get("warnings", [])
        if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
            raise MalformedReply(f"malformed {cls.op} reply: 'warnings' is {warnings!r}")
        return cls(_hex(cls.op, "version", _field(cls.op, value, "version")),
                   _hex(cls.op, "previous", previous) if previous is not None else None,
                   list(warnings))


@dataclass(frozen=True)
class CurrentReply:
    """Whether the workspace already serves the version asked about (requests.Current), and
    the version it serves whole, if any (for the one who asks to replace it: its owner), so
    that a push need only ask about what its own version adds to that one. (A node that does
    not send `serving` serves nothing a push can count on.)"""

    op: ClassVar[str] = "current"
    current: bool
    serving: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"current": self.current,
                "serving": self.serving.hex() if self.serving is not None else None}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> CurrentReply:
        current = typed_field(cls.op, value, "current", bool)
        serving = value.get("serving")
        return cls(current, _hex(cls.op, "serving", serving) if serving is not None else None)


@dataclass(frozen=True)
class RemoveReply:
    """The workspace is gone; these are the versions it had, current first."""

    op: ClassVar[str] = "remove"
    versions: list[bytes]

    def to_wire(self) -> dict[str, Any]:
        return {"versions": [v.hex() for v in self.versions]}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> RemoveReply:
        return cls([_hex(cls.op, "versions", v)
                    for v in typed_field(cls.op, value, "versions", list)])


@dataclass(frozen=True)
class _FailuresReply:
    """A reply that carries the failures seen in a relay subtree, as {addr: cause}."""

    op: ClassVar[str]
    failed: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"failed": self.failed}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> Self:
        return cls(_failures(cls.op, value))


@dataclass(frozen=True)
class RelayReply(_FailuresReply):
    """The hop is open; `failed` names the nodes of its subtree that could not be reached."""

    op: ClassVar[str] = "relay"


@dataclass(frozen=True)
class FlushReply(_FailuresReply):
    """Everything sent so far is stored (and forwarded); `failed` is every failure seen in the
    subtree, where "" is the node that answers."""

    op: ClassVar[str] = "flush"


@dataclass(frozen=True)
class FanReply(_FailuresReply):
    """Each node's reply to a request sent down a control tree (requests.Fan), by address
    ("" is the node that answers), and the failures seen anywhere in the subtree; a node of
    the subtree is in one or the other."""

    op: ClassVar[str] = "fan"
    replies: dict[str, dict] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"failed": self.failed, "replies": self.replies}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> Self:
        replies = typed_field(cls.op, value, "replies", dict)
        if not all(isinstance(k, str) and isinstance(v, dict) for k, v in replies.items()):
            raise MalformedReply(f"malformed {cls.op} reply: 'replies' is not {{addr: reply}}")
        return cls(_failures(cls.op, value), dict(replies))


@dataclass(frozen=True)
class BulkReply(PlainReply):
    """The RDMA channel is open on the node; `qp` is its queue pair, for the sender to connect
    to (read by rdma.RdmaSender.connect)."""

    op: ClassVar[str] = "bulk"
    qp: dict[str, Any]


@dataclass(frozen=True)
class FirstReadsReply:
    """What this node read first in a workspace, in order (push --early sends it first): the
    paths, strings with surrogate escapes for names that are not UTF-8, and the reads, [path
    index, chunk index or -1] (wire/read_lists.py; None from an older node: whole files)."""

    op: ClassVar[str] = "first_reads"
    paths: list[str]
    reads: list[list[int]] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"paths": self.paths, **({"reads": self.reads} if self.reads is not None else {})}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> FirstReadsReply:
        paths = typed_field(cls.op, value, "paths", list)
        if not all(isinstance(p, str) for p in paths):
            raise MalformedReply(f"malformed {cls.op} reply: 'paths' holds a non-string")
        reads = value.get("reads")
        if reads is not None and not (isinstance(reads, list) and all(
                isinstance(r, list) and len(r) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 0 <= r[0] < len(paths) and r[1] >= -1 for r in reads)):
            raise MalformedReply(f"malformed {cls.op} reply: 'reads' is not a list of "
                                 "[path index, chunk index]")
        return cls(list(paths), reads)
