"""What goes wrong in a mesh, worded for the person reading the traceback.

Two kinds of failure, because a person reacts to them differently:

- ActorError: an endpoint raised. The actor is still alive; only that call failed. The message
  names the actor, the rank and the host, and carries the remote traceback as text (the
  exception object itself is not sent: its class may not exist on the controller).
- SupervisionError: a proc died or became unreachable. The calls that target that rank fail
  at once, and so does every later call to it, with the same cause; the other ranks go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class MeshError(Exception):
    """Base class of every error the mesh raises."""


class SpawnError(MeshError):
    """A proc or an actor could not be started."""


class ActorError(MeshError):
    """An endpoint (or an actor's constructor) raised on one rank."""

    def __init__(self, actor: str, method: str, rank: int, host: str, exc_type: str,
                 message: str, traceback: str, others: int = 0) -> None:
        self.actor, self.method, self.rank, self.host = actor, method, rank, host
        self.exc_type, self.message, self.traceback = exc_type, message, traceback
        self.others = others  # how many other ranks raised in the same call
        super().__init__(str(self))

    def __str__(self) -> str:
        also = f" (and {self.others} other ranks)" if self.others else ""
        return (f"{self.actor}.{self.method} raised on rank {self.rank} ({self.host}){also}: "
                f"{self.exc_type}: {self.message}\n--- remote traceback ---\n"
                f"{self.traceback.rstrip()}")


@dataclass
class Failure:
    """Why a proc is gone: the exit code or signal, the last lines of its stderr, and what the
    supervisor noticed (e.g. "lost its connection to the node daemon")."""

    mesh: str
    rank: int
    host: str
    pid: int | None = None
    code: int | None = None
    signal: str | None = None
    reason: str = ""
    stderr_tail: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.signal:
            how = f"killed by {self.signal}"
        elif self.code is not None:
            how = f"exited with code {self.code}"
        else:
            how = self.reason or "is gone"
        if self.reason and (self.signal or self.code is not None):
            how += f" ({self.reason})"
        pid = f", pid {self.pid}" if self.pid else ""
        text = f"proc rank {self.rank} of mesh {self.mesh!r} on {self.host}{pid}: {how}"
        if self.stderr_tail:
            tail = "\n".join("    " + line for line in self.stderr_tail)
            text += f"\n  its stderr ended with:\n{tail}"
        return text


    def report(self) -> str:
        """Monarch's name for describe()."""
        return self.describe()

    def __str__(self) -> str:
        return self.describe()


MeshFailure = Failure  # what `__supervise__` receives, by Monarch's name


class SupervisionError(MeshError):
    """A rank a call targets has failed; calls to it cannot be answered any more."""

    def __init__(self, failure: Failure, context: str = "") -> None:
        self.failure = failure
        self.context = context
        super().__init__(str(self))

    def __str__(self) -> str:
        prefix = f"{self.context}: " if self.context else ""
        return prefix + self.failure.describe()

