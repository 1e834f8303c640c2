"""The requests a node answers, one small dataclass each, built from the wire's Request.

The wire stays `protocol.Request(op, args, id)` (push, relay and mesh clients send it as
before); this module is where each op's arguments are named, typed and checked, once, before a
handler sees them. `parse` raises RequestError (or ValueError, from the checks it shares with
refs.py) with a message that goes back to the client as is. session.py dispatches through one
table from op to (request class, handler).

A request whose `after_chunks` is true is answered only once every chunk the client sent
before it is stored, and is refused if one of them could not be (a corrupt or unstorable
chunk): the requests that read or change what the node serves must see the whole push.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Self


def check_workspace_name(name: str) -> None:
    """Refuse a name that could not work everywhere a workspace name goes.

    Workspace names must be UTF-8; the names of files inside a snapshot stay arbitrary bytes.
    A workspace name travels as a JSON string (requests, `status --json`, `push --json`,
    refs.json), is expanded into the argv, environment and working folder of spawned processes
    (`{workspace}`), and is listed in `user.monarch.workspaces`. JSON has no bytes: a non-UTF-8
    name could only travel as lone surrogate escapes, which are not Unicode and which other
    JSON readers refuse. File names come from whatever a package installed, so they must stay
    bytes; a workspace name is the user's choice (`push --name`), so refusing costs one flag.
    Both sides check: the client before it scans, every node at prepare and commit, before any
    state changes (a name that slipped through once took every node it reached down, again at
    every restart).
    """
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"invalid workspace name {ascii(name)}: not UTF-8") from None
    if not raw or len(raw) > 255 or b"/" in raw or b"\0" in raw or raw.startswith(b"."):
        raise ValueError(f"invalid workspace name {name!r}: must be a plain name, not starting "
                         "with '.', with no '/' or NUL, at most 255 bytes")


# Where a node never exposes a workspace at its source path (push --at-source): the system's own
# folders, and kernel or runtime views, where a root daemon's link could change how the machine
# runs (a unit's drop-in folder, a profile.d entry) or cannot be made at all.
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/efi", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
                  "/lost+found", "/proc", "/run", "/sbin", "/snap", "/srv", "/sys", "/usr",
                  "/var")
ALLOWED_UNDER_SYSTEM = ("/var/tmp",)  # scratch space, like /tmp


def check_source_path(path: str) -> None:
    """Refuse a source path no node should expose a workspace at (push --at-source).

    The path must be absolute and normal (no '.', '..', '//' or trailing '/': the node walks it
    component by component and must not be steered elsewhere), UTF-8 like a workspace name, at
    least two folders deep (a link straight in / would be everybody's top-level name), and
    outside the system's folders (SYSTEM_FOLDERS; /var/tmp is scratch space). Checked by the
    client before it scans and by every node at prepare, before anything changes; where the
    path leads through a link on a node, the node checks where it really goes too
    (source_path.py). Raises ValueError saying why."""
    if not isinstance(path, str) or not path:
        raise ValueError("the source path is empty")
    shown = path.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"source path {ascii(path)} is not UTF-8") from None
    if "\0" in path:
        raise ValueError(f"source path {shown!r} holds a NUL byte")
    if not path.startswith("/"):
        raise ValueError(f"source path {shown!r} is relative: it must be absolute")
    parts = path.split("/")[1:]
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"source path {shown!r} is not normal (no '.', '..', '//' or "
                         "trailing '/')")
    if len(parts) < 2:
        raise ValueError(f"source path {shown!r} is a folder right in /: a node only exposes "
                         "a workspace at least two folders deep (e.g. /opt/NAME, /home/USER/NAME)")
    if not any(path == a or path.startswith(a + "/") for a in ALLOWED_UNDER_SYSTEM):
        for folder in SYSTEM_FOLDERS:
            if path == folder or path.startswith(folder + "/"):
                raise ValueError(f"source path {shown!r} is inside the system folder {folder}, "
                                 "where no node exposes a workspace")


class RequestError(Exception):
    """A request was refused; the message goes back to the client as is."""


def from_hex(value: object) -> bytes | None:
    """The bytes a hex string on the wire stands for; None if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _version(op: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise RequestError(f"{op}: name and version are required")
    version = from_hex(value)
    if version is None:
        raise RequestError(f"{op}: bad version {value!r}")
    return version


def int_arg(op: str, args: dict, key: str, default: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RequestError(f"{op}: {key} must be an integer, not {value!r}")
    try:
        return int(value)
    except ValueError:
        raise RequestError(f"{op}: {key} must be an integer, not {value!r}") from None


class NoArguments:
    """A request that takes no arguments (any it is sent are ignored)."""

    @classmethod
    def parse(cls, args: dict) -> Self:
        return cls()


@dataclass(frozen=True)
class Status(NoArguments):
    """What this node serves and holds (`monarch-fs status`)."""

    op: ClassVar[str] = "status"
    after_chunks: ClassVar[bool] = True


@dataclass(frozen=True)
class Prepare:
    """Phase one of a publish: check that `version`'s manifest and every chunk it names are
    here, make them durable, and keep them from collection until the commit."""

    op: ClassVar[str] = "prepare"
    after_chunks: ClassVar[bool] = True
    name: str  # the workspace, UTF-8 (refs.check_workspace_name)
    version: bytes  # the manifest's chunk id
    # The pushed folder's absolute path on the dev box, to expose the workspace at on this
    # node too (push --at-source; check_source_path), or None: not exposed there.
    source: str | None = None
    # The source folder's "DEV:INO" on the dev box: a node that finds that very folder at
    # the path (it shares the dev box's disk) leaves it quietly.
    source_id: str | None = None
    # push --early: the chunks the first reads need (ids). When given, the node checks the
    # manifest and these (waiting for them up to `wait` seconds: they stream first), not
    # every chunk, and serves the version as incomplete; a later prepare and commit without
    # it (the push's end, or a normal push) find it complete.
    early: tuple[bytes, ...] | None = None
    wait: float = 0.0
    # The chunks the nodes read first after earlier publishes (ids, in that order): a commit
    # reads those of its large files into the page cache (fs/readahead.py).
    ahead: tuple[bytes, ...] = ()

    @classmethod
    def parse(cls, args: dict) -> Self:
        name, version = args.get("name"), args.get("version")
        if not isinstance(name, str) or not isinstance(version, str):
            raise RequestError(f"{cls.op}: name and version are required")
        check_workspace_name(name)
        source = args.get("source")
        if source is not None:
            if not isinstance(source, str):
                raise RequestError(f"{cls.op}: source must be a path, not {source!r}")
            check_source_path(source)
        source_id = args.get("source_id")
        if source_id is not None and not (isinstance(source_id, str)
                                          and re.fullmatch(r"[0-9]+:[0-9]+", source_id)):
            raise RequestError(f"{cls.op}: source_id must be 'DEV:INO', not {source_id!r}")
        early, ahead = args.get("early"), _ids(cls.op, "ahead", args.get("ahead", []))
        ids = None if early is None else _ids(cls.op, "early", early)
        wait = args.get("wait", 0.0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
            raise RequestError(f"{cls.op}: wait must be a number of seconds, not {wait!r}")
        return cls(name, _version(cls.op, version), source, source_id, ids, float(wait), ahead)


def _ids(op: str, what: str, value: object) -> tuple[bytes, ...]:
    """A list of chunk ids in hex, decoded; RequestError naming `what` if it is not one."""
    ids = tuple(from_hex(i) or b"" for i in value) if isinstance(value, list) else None
    if ids is None or any(len(i) != 16 for i in ids):
        raise RequestError(f"{op}: {what} must be a list of chunk ids")
    return ids


@dataclass(frozen=True)
class Commit(Prepare):
    """Phase two: switch workspace `name` to `version` (preparing it first if that was not
    asked for); answered once the kernel dropped every changed entry."""

    op: ClassVar[str] = "commit"


@dataclass(frozen=True)
class Current(Prepare):
    """Whether workspace `name` serves `version` already, whole, exposed at `source` (None:
    nowhere), pushed by whoever asks: then a push of that version has nothing to do on this
    node, and a push with no change settles in this one round trip."""

    op: ClassVar[str] = "current"
    after_chunks: ClassVar[bool] = False


def _workspace(op: str, args: dict) -> str:
    """A request's `name`: a valid workspace name, or a RequestError saying what is wrong."""
    name = args.get("name")
    if not isinstance(name, str):
        raise RequestError(f"{op}: a workspace name is required")
    check_workspace_name(name)
    return name


@dataclass(frozen=True)
class WorkspaceArgument:
    """A request whose one argument is workspace `name`."""

    op: ClassVar[str]
    name: str

    @classmethod
    def parse(cls, args: dict) -> Self:
        return cls(_workspace(cls.op, args))


@dataclass(frozen=True)
class Remove(WorkspaceArgument):
    """Delete workspace `name` and every version of it (`monarch-fs rm`)."""

    op: ClassVar[str] = "remove"
    after_chunks: ClassVar[bool] = True


@dataclass(frozen=True)
class FirstReads(WorkspaceArgument):
    """The files this node read first after workspace `name`'s latest publishes, in order
    (daemon/node/first_reads.py): what push --early sends first."""

    op: ClassVar[str] = "first_reads"
    after_chunks: ClassVar[bool] = False


@dataclass(frozen=True)
class OpenRelay:
    """Make this session a hop of a broadcast: connect to `children` (each
    {"addr": "host:port", "children": [...]}, opening its own subtree) and forward to them
    the chunks their subtrees lack. `timeout` is the seconds to wait on one hop. `version`,
    if given, is the chunk id of the push's manifest, which comes first: the node decodes it on
    arrival and writes each large file's chunks once, into its file object (absent from older
    clients: every chunk goes to a pack). With `wants` (push --early) the node may send
    protocol.Want on this session, and asks its children to do the same."""

    op: ClassVar[str] = "relay"
    after_chunks: ClassVar[bool] = False
    children: list[dict] = field(default_factory=list)
    timeout: float = 60.0
    version: bytes | None = None
    wants: bool = False

    @classmethod
    def parse(cls, args: dict) -> OpenRelay:
        children = args.get("children", [])
        if not isinstance(children, list) or not all(
                isinstance(c, dict) and isinstance(c.get("addr"), str)
                and isinstance(c.get("children", []), list) for c in children):
            raise RequestError("relay: children must be a list of {addr, children}")
        timeout = args.get("timeout", 60)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise RequestError(f"relay: timeout must be a number of seconds, not {timeout!r}")
        version = args.get("version")
        return cls(children, float(timeout),
                   None if version is None else _version("relay", version),
                   args.get("wants") is True)


# The requests a push may send down its control tree (`Fan`): each node answers for itself
# and for the subtree its relay reaches.
FAN_OPS = ("current", "prepare", "commit")


@dataclass(frozen=True)
class Fan:
    """Answer request `request` (`args`) here and have every node below answer it too, down
    the subtree this session's relay reaches (OpenRelay): a push to many nodes sends each of
    its control requests to a few roots, not to every node (push.py, `control`). Answers
    {addr: reply} and {addr: cause} for the whole subtree ("" is this node). `scope` is what a
    MUNGE credential in `args` is bound to instead of one connection (identity.fan_scope): the
    same request reaches every node."""

    op: ClassVar[str] = "fan"
    after_chunks: ClassVar[bool] = True
    request: str
    args: dict
    scope: str = ""

    @classmethod
    def parse(cls, args: dict) -> Fan:
        request, inner, scope = args.get("request"), args.get("args"), args.get("scope", "")
        if request not in FAN_OPS:
            raise RequestError(f"fan: request must be one of {', '.join(FAN_OPS)}, "
                               f"not {request!r}")
        if not isinstance(inner, dict):
            raise RequestError("fan: args must be an object")
        if not isinstance(scope, str) or not re.fullmatch(r"[0-9a-f]{0,64}", scope):
            raise RequestError(f"fan: scope must be a hex nonce, not {scope!r}")
        return cls(request, inner, scope)


@dataclass(frozen=True)
class Flush:
    """Wait until every chunk sent so far is stored here and forwarded below; answers the
    failures seen anywhere in the subtree as {addr: cause} ("" is this node). `bulk_chunks`
    is how many chunks the RDMA channel must have delivered first (RDMA chunks are not
    ordered with the control channel's frames). `version`: the push these chunks are of,
    from a session that opened no relay (a push's helper: client/send_helpers.py), for the
    `push.received` event."""

    op: ClassVar[str] = "flush"
    after_chunks: ClassVar[bool] = False  # it waits for the writes itself, and reports them
    bulk_chunks: int = 0
    version: bytes | None = None

    @classmethod
    def parse(cls, args: dict) -> Flush:
        version = args.get("version")
        return cls(int_arg(cls.op, args, "bulk_chunks", 0),
                   None if version is None else _version(cls.op, version))


@dataclass(frozen=True)
class Bulk:
    """Open an RDMA channel for this session's chunk payloads (control stays on TCP).
    `kind` is the queue pair type; `setup` is the whole request, which the transport reads
    (bulk.accept_receiver: device kind, the sender's queue pair)."""

    op: ClassVar[str] = "bulk"
    after_chunks: ClassVar[bool] = False
    kind: str
    setup: dict

    @classmethod
    def parse(cls, args: dict) -> Bulk:
        kind = args.get("kind")
        if not isinstance(kind, str):
            raise RequestError(f"bulk: kind must be a string, not {kind!r}")
        return cls(kind, args)
