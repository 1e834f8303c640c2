"""The `stacks` request and its reply: a py-spy dump of every rank of one job on a node.

What a node sends is the dump as py-spy gives it, cut down to what a reader uses (thread
name and state, and per frame its function, file and line, innermost first), so the client
can fold identical stacks across ranks and nodes (daemon/client/stacks.py). A rank the node
could not dump carries `error`, one line saying why (no py-spy, ptrace refused, the process
exited); the node's other ranks still come back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from .replies import MalformedReply
from .requests import RequestError

MAX_JOB_CHARS = 256


@dataclass(frozen=True)
class Frame:
    name: str  # the function
    file: str  # py-spy's short file name (module-relative)
    line: int

    def __str__(self) -> str:
        return f"{self.name} ({self.file}:{self.line})" if self.line else \
            f"{self.name} ({self.file})"


@dataclass(frozen=True)
class Thread:
    name: str
    id: int  # the OS thread id (the pid for the main thread)
    active: bool  # running or waiting on the GIL, as py-spy judges (idle otherwise)
    frames: tuple[Frame, ...]  # innermost first

    def key(self) -> tuple:
        """What two ranks' threads must share to fold: not their ids."""
        return (self.name, self.frames)  # not `active`: a waiting loop flips between the two


@dataclass(frozen=True)
class RankDump:
    """One process of the job: its rank, and its threads or why there are none."""

    rank: int | None
    pid: int
    proc: int
    threads: tuple[Thread, ...] = ()
    error: str | None = None

    def main_thread(self) -> Thread | None:
        for t in self.threads:
            if t.id == self.pid or t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> RankDump:
        threads = tuple(
            Thread(str(t["name"]), int(t["id"]), bool(t["active"]),
                   tuple(Frame(str(f["name"]), str(f["file"]), int(f["line"]))
                         for f in t["frames"]))
            for t in value.get("threads") or ())
        rank = value.get("rank")
        return cls(rank if isinstance(rank, int) else None, int(value["pid"]),
                   int(value["proc"]), threads, value.get("error") or None)


@dataclass(frozen=True)
class Stacks:
    """Dump every rank of job `job` running on this node (default: its newest job the asker
    may see); `native` adds C/C++ frames; `hang` (why, from `run --hang-timeout`) records a
    `job.hang` event with them."""

    op: ClassVar[str] = "stacks"
    after_chunks: ClassVar[bool] = False
    job: str = ""
    native: bool = False
    hang: str = ""

    @classmethod
    def parse(cls, args: dict) -> Stacks:
        job, native, hang = args.get("job") or "", args.get("native", False), \
            args.get("hang") or ""
        if not isinstance(job, str) or len(job) > MAX_JOB_CHARS:
            raise RequestError(f"stacks: job must be a name, not {job!r:.80}")
        if not isinstance(native, bool):
            raise RequestError(f"stacks: native must be true or false, not {native!r}")
        if not isinstance(hang, str):
            raise RequestError(f"stacks: hang must be a reason, not {hang!r:.80}")
        return cls(job, native, hang[:1000])


@dataclass(frozen=True)
class JobSeen:
    """A job with processes running on this node, that the asker may see."""

    job: str
    age: float  # seconds since its newest process started here
    ranks: list[int | None]


@dataclass(frozen=True)
class StacksReply:
    """The node's name, the jobs it runs for the asker, and the dumps of `job` (the one asked
    for, else the newest; "" if none runs here)."""

    op: ClassVar[str] = "stacks"
    node: str
    job: str
    jobs: list[JobSeen] = field(default_factory=list)
    dumps: list[RankDump] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"node": self.node, "job": self.job, "jobs": [asdict(j) for j in self.jobs],
                "dumps": [d.to_wire() for d in self.dumps]}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> StacksReply:
        try:
            return cls(str(value["node"]), str(value["job"]),
                       [JobSeen(str(j["job"]), float(j["age"]), list(j["ranks"]))
                        for j in value["jobs"]],
                       [RankDump.from_wire(d) for d in value["dumps"]])
        except (KeyError, TypeError, ValueError) as e:
            raise MalformedReply(f"malformed stacks reply: {e!r}") from None
