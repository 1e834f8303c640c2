"""Calls in flight to the ranks of a mesh: what a call waits for, how answers settle it, and
what both kinds of mesh handle share (the owner's `MeshState`, and `PeerMesh`, a mesh this
process calls directly because it was passed an actor mesh as an argument).

A call's id is drawn where the call is made, in any thread (its header is encoded there); a
rank's answer settles it on whichever connection it arrives; a call that waits for a rank that
died fails at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.calls import Call, Calls
from . import wire
from .errors import ActorError, Failure, MeshError, SupervisionError


class Target(Protocol):
    """One rank as a call target: where it runs, why it is gone, and its queue."""

    rank: int
    failure: Failure | None

    @property
    def info(self) -> object: ...

    def post(self, msg: p.Data) -> None: ...


class PendingCall(Call[dict[int, Any]]):
    """A call to some ranks: settled with the results by rank once every rank has answered
    (or with the lowest rank's ActorError), or failed at once when a rank it targets dies."""

    def __init__(self, cid: int, ranks: Iterable[int], actor: str, method: str) -> None:
        super().__init__()
        self.id = cid
        self.remaining = set(ranks)
        self.actor, self.method = actor, method
        self.results: dict[int, Any] = {}
        self.errors: dict[int, ActorError] = {}
        self.posted_at = 0.0  # trio.current_time() when it was queued to its ranks
        self.arrivals: list[int] = []  # ranks in the order they answered (for stream())
        self.watchers: list[Callable[[], None]] = []  # called once settled (any thread's)
        self.arrived = trio.Event()  # set, and replaced, at each answer

    def _settle(self, value: dict[int, Any] | None, error: BaseException | None) -> bool:
        if not super()._settle(value, error):
            return False
        for watcher in self.watchers:
            watcher()
        return True

    def answer(self, rank: int, value: Any = None, error: ActorError | None = None) -> None:
        """One rank's answer (a reader calls this)."""
        if rank not in self.remaining:
            return
        self.remaining.discard(rank)
        if error is not None:
            self.errors[rank] = error
        else:
            self.results[rank] = value
        self.arrivals.append(rank)
        self.arrived.set()
        self.arrived = trio.Event()
        if self.remaining:
            return
        if self.errors:
            first = self.errors[min(self.errors)]
            first.others = len(self.errors) - 1
            self.set_error(first)
        else:
            self.set_value(self.results)

    def outcome(self) -> dict[int, Any]:
        """The results of a settled call, or raise its error."""
        assert self.settled
        if self._error is not None:
            raise self._error.with_traceback(None)
        return self._value or {}


class MeshCalls(Calls[PendingCall]):
    """The calls in flight on a mesh. Their ids are drawn by whoever makes the call, in any
    thread (the call's header is encoded there), so `add` keeps the id it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(1)  # next() on a count is atomic: any thread may draw

    def add(self, call: PendingCall) -> PendingCall:
        self._pending[call.id] = call
        return call

    def pending(self) -> list[PendingCall]:
        return list(self._pending.values())


def error_message(cid: Any, actor: str, method: str, exc_type: str, message: str,
                  tb: str) -> p.Data:
    """The answer to call `cid` that raised (its caller makes an ActorError of it)."""
    return wire.encode({"op": "error", "call": cid, "actor": actor, "method": method,
                        "type": exc_type, "message": message, "traceback": tb})


def settle_answer(calls: MeshCalls, rank: int, host: str, h: dict, msg: p.Data) -> None:
    """A "result" or "error" message from `rank`, to the call it answers (a reader calls
    this, on the owner's connections and on direct ones alike)."""
    call = calls.get(h.get("call"))
    if call is None:
        return
    if h["op"] == "error":
        call.answer(rank, error=ActorError(
            str(h.get("actor", call.actor)), str(h.get("method", call.method)), rank, host,
            str(h.get("type", "Exception")), str(h.get("message", "")),
            str(h.get("traceback", ""))))
    else:
        try:
            value = wire.body(msg)
        except Exception as e:
            call.answer(rank, error=ActorError(
                call.actor, call.method, rank, host, type(e).__name__,
                f"the result could not be unpickled here: {e}", ""))
        else:
            call.answer(rank, value)
    if call.settled:  # its futures hold the outcome; nothing else waits for the id
        calls.remove(call)


@dataclass(frozen=True)
class MeshRef:
    """What a pickled actor mesh carries to reach its procs."""

    name: str
    dims: tuple[str, ...]
    extent: tuple[int, ...]
    token: bytes
    addrs: tuple[str, ...]  # per rank: its direct listener
    hosts: tuple[str, ...]  # per rank: where it runs, for errors


class CallTarget:
    """Calls to the ranks of one proc mesh, whoever holds the connections."""

    name: str
    procs: list[Any]  # Target per rank, by rank
    dims: tuple[str, ...]
    extent: tuple[int, ...]
    trio_token: trio.lowlevel.TrioToken
    stopping: bool = False

    def mesh_ref(self) -> MeshRef:
        """What a pickled actor mesh of this proc mesh carries."""
        raise NotImplementedError

    def _init_calls(self) -> None:
        self.calls = MeshCalls()
        self.call_timeout: float | None = None  # what Future.get() waits at most by default
        self.stopped_actors: set[tuple[str, int]] = set()  # (actor, rank) stopped on purpose
        self.chosen = 0  # where choose() starts looking, so ties take turns

    def check(self, ranks: Iterable[int] = (), actor: str | None = None) -> None:
        """Raise at once if a call to `ranks` (of actor `actor`) cannot be made: the mesh was
        stopped, one of those ranks failed, or the actor was stopped there."""
        if self.stopping:  # stop() sets it first
            raise MeshError(f"proc mesh {self.name!r} has been stopped")
        for rank in ranks:
            failure = self.procs[rank].failure
            if failure is not None:
                raise SupervisionError(failure)
            if actor is not None and (actor, rank) in self.stopped_actors:
                raise MeshError(f"actor mesh {actor!r} of proc mesh {self.name!r} was stopped "
                                f"on rank {rank}")

    # ---- calls -------------------------------------------------------------------------

    def post_call(self, ranks: list[int], op: str, actor: str, method: str, fields: dict,
                  args: tuple, kwargs: dict, reply: bool = True) -> PendingCall | None:
        """Queue one message to every rank in `ranks`, without waiting (in the loop). With
        `reply`, the call whose replies the readers settle; without, the arguments are copied
        now (the caller may change them as soon as this returns)."""
        pending = PendingCall(next(self.calls.ids), ranks, actor, method) if reply else None
        header = {"op": op, "call": pending.id if pending else None, "actor": actor, **fields}
        msg = wire.encode(header, (args, kwargs), has_body=True, copy=not reply)
        self.start_call(ranks, msg, pending)
        return pending

    def start_call(self, ranks: list[int], msg: p.Data, pending: PendingCall | None) -> None:
        """Hold `pending` (if any) for its answers and queue `msg` to `ranks` (in the loop)."""
        if pending is not None:
            pending.posted_at = trio.current_time()
            self.calls.add(pending)
        for rank in ranks:
            self.procs[rank].post(msg)

    def describe_waiting(self, pending: PendingCall, timeout: float) -> str:
        """Why a call has no answer yet: the ranks that have not answered, and what each one
        is running (the oldest call of that actor it has not answered, maybe another one)."""
        now = trio.current_time()
        calls = sorted((c for c in self.calls.pending() if c.actor == pending.actor),
                       key=lambda c: c.posted_at)
        lines = []
        for rank in sorted(pending.remaining):
            running = next((c for c in calls if rank in c.remaining), pending)
            what = f"{running.actor}.{running.method}"
            since = f"for {now - running.posted_at:.1f}s"
            if running is not pending:
                what += f" (this call waits behind it), {since}"
            else:
                what += f", {since}"
            lines.append(f"rank {rank} on {self.procs[rank].info}: running {what}")
        total = len(pending.remaining) + len(pending.results) + len(pending.errors)
        return (f"{pending.actor}.{pending.method}: no answer within {timeout:g}s from "
                f"{len(pending.remaining)} of {total} ranks (the call is still in flight; "
                f"get() again to wait more):\n  "
                + "\n  ".join(lines))

