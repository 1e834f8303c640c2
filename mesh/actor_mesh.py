"""Actor meshes: the actors named N on some ranks of a proc mesh, and their endpoints.

    trainers = procs.spawn("trainers", Trainer, 0.1)
    trainers.step.call(0.01).get()           # Future -> ValueMesh, one result per rank
    trainers.slice(hosts=0, procs=1).ping.call_one().get(timeout=5)
    trainers.step.broadcast(0.01)            # no reply; a failure surfaces through supervision
    trainers.stop()                          # __cleanup__ runs on each rank, then they are gone

In trio code, `await trainers.step.call(0.01)`. An actor's messages are handled one at a time,
in the order they were sent. Calls are encoded in the caller's thread when `call()` returns, but
tensors are sent from their own memory: do not change a tensor passed to `call()` until its
future is done (`broadcast()` copies, since nothing tells you when it was sent).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from . import wire
from .calls import PendingCall
from .errors import MeshError
from .future import Arrival, Future
from .loop import _current_token, post_sync_api
from .mesh_ref import MeshRef, state_for
from .shape import Selector, Shaped, ValueMesh
from .unsupported import not_supported

if TYPE_CHECKING:
    from .calls import CallTarget

F = TypeVar("F", bound=Callable[..., Any])
_ENDPOINT = "_monarch_endpoint"


def endpoint(fn: F | None = None, *, propagate: Any = None,
             explicit_response_port: bool = False, instrument: bool = True) -> Any:
    """Mark a method as callable from other processes. Only endpoints can be called remotely.
    `@endpoint` or, as in Monarch, `@endpoint(...)`: propagate and instrument are accepted
    and have no effect here (no tensor engine; the daemons trace); explicit_response_port is
    refused."""
    if explicit_response_port:
        not_supported("endpoint(explicit_response_port=True)", "ports")

    def mark(f: F) -> F:
        setattr(f, _ENDPOINT, True)
        return f

    return mark if fn is None else mark(fn)


def is_endpoint(fn: object) -> bool:
    return callable(fn) and getattr(fn, _ENDPOINT, False) is True


def class_ref(cls: type | str) -> tuple[str, str, str | None]:
    """(module, qualname, main file) by which the procs import the class. A class defined in the
    controller's script (__main__) is found by running that script in the proc under the name
    __mp_main__, as multiprocessing does: guard the script's work with `if __name__ ==
    "__main__":`."""
    if isinstance(cls, str):
        module, sep, qualname = cls.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"actor class {cls!r}: expected 'module:QualName'")
        return module, qualname, None
    module, qualname = cls.__module__, cls.__qualname__
    if "<locals>" in qualname:
        raise ValueError(f"actor class {qualname} is defined inside a function; procs import "
                         "classes by name, so define it at module level")
    main = None
    if module in ("__main__", "__mp_main__"):
        main = getattr(sys.modules.get(module), "__file__", None)
        if not main:
            raise ValueError(f"actor class {qualname} lives in a __main__ without a file; "
                             "define it in a module the procs can import")
        module = "__main__"
    return module, qualname, main


class ActorMesh(Shaped):
    """The actors named `name` on some ranks of a proc mesh. Attribute access gives endpoints."""

    def __init__(self, state: CallTarget, name: str, cls: type | None,
                 coords: tuple[tuple[int, ...], ...] | None = None) -> None:
        self._state = state
        self._name = name
        self._cls = cls
        self._init_shape(state.dims, state.extent, coords)

    def __getattr__(self, attr: str) -> Endpoint:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._cls is not None and not is_endpoint(getattr(self._cls, attr, None)):
            raise AttributeError(f"{self._cls.__qualname__}.{attr} is not an @endpoint")
        return Endpoint(self, attr)

    def slice(self, **selectors: Selector) -> ActorMesh:
        """The actors at some coordinates, by dimension name and position in this view (an
        int, a slice or a list): `slice(hosts=0)`, `slice(gpus=1)`, `slice(**current_rank())`."""
        return ActorMesh(self._state, self._name, self._cls, self._sliced(selectors))

    def _start(self, method: str, args: tuple, kwargs: dict, *futures: Future) -> None:
        """Encode the call here, post it to the mesh's loop without waiting for the loop (its
        FIFO keeps the order of calls from one thread), and tie `futures` to its answers."""
        state, ranks = self._state, self.ranks
        cid = next(state.calls.ids)
        msg = wire.encode({"op": "call", "call": cid, "actor": self._name, "method": method},
                          (args, kwargs), has_body=True)
        pending = PendingCall(cid, ranks, self._name, method)
        state.calls.add(pending)  # at once, so that choose() from this thread counts it

        def post() -> None:
            try:
                state.check(ranks, self._name)
                state.start_call(ranks, msg, pending)
            except MeshError as e:
                state.calls.remove(pending)
                for future in futures:
                    future._set_posted(None, e)
            else:
                for future in futures:
                    future._set_posted(pending, None)

        if _current_token() is state.trio_token:
            post()
        else:
            try:
                state.trio_token.run_sync_soon(post)
            except trio.RunFinishedError:
                raise MeshError("its host mesh has been closed") from None

    def _one(self, rank: int) -> ActorMesh:
        point = self.point_of(rank)
        return ActorMesh(self._state, self._name, self._cls, tuple((c,) for c in point.values()))

    def _least_busy(self) -> int:
        """The rank of this view with the fewest calls of this actor in flight (ties: the one
        after the last chosen), read without the loop: a snapshot is enough to balance."""
        busy = dict.fromkeys(self.ranks, 0)
        for call in self._state.calls.pending():
            if call.actor == self._name:
                for r in call.remaining & busy.keys():
                    busy[r] += 1
        ranks = self.ranks
        start = self._state.chosen = (self._state.chosen + 1) % len(ranks)
        order = ranks[start:] + ranks[:start]
        return min(order, key=busy.__getitem__)

    def _post(self, method: str, args: tuple, kwargs: dict) -> None:
        """A broadcast, queued in the loop: its arguments are copied now."""
        self._state.check(self.ranks, self._name)
        self._state.post_call(self.ranks, "call", self._name, method, {"method": method},
                              args, kwargs, False)

    def stop(self) -> Future[None]:
        """Stop these actors: each runs `__cleanup__` (if it has one) after the messages it
        already has, and later calls to them fail. Their procs keep running."""
        state = self._state

        def finish(_: dict) -> None:
            return None

        future: Future[None] = Future(state, finish)

        def post() -> None:
            try:
                state.check(self.ranks, self._name)
                pending = state.post_call(self.ranks, "stop_actor", self._name, "__cleanup__",
                                          {}, (), {})
                state.stopped_actors.update((self._name, r) for r in self.ranks)
            except MeshError as e:
                future._set_posted(None, e)
            else:
                future._set_posted(pending, None)

        post_sync_api(state.trio_token, post)
        return future

    def __reduce__(self) -> tuple:
        """Pickled (passed to an actor, returned from one): a reference by which the receiver
        calls these actors directly (mesh_ref.py)."""
        return rebuild_actor_mesh, (self._state.mesh_ref(), self._name, self._coords)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._state.name!r} ranks {self.ranks}>"


def rebuild_actor_mesh(ref: MeshRef, name: str,
                       coords: tuple[tuple[int, ...], ...]) -> ActorMesh:
    return ActorMesh(state_for(ref), name, None, coords)


def _value_mesh(ranks: list[int]) -> Callable[[dict[int, Any]], ValueMesh]:
    return lambda results: ValueMesh(ranks, [results[r] for r in ranks])


def _only(rank: int) -> Callable[[dict[int, Any]], Any]:
    return lambda results: results[rank]


class Endpoint:
    """One endpoint of an actor mesh."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        """Call on every rank; a Future of the results by rank. It raises ActorError if an
        endpoint raised (the lowest such rank), SupervisionError if a rank it targets died,
        CallTimeout (a TimeoutError) if a timeout passed first."""
        future = Future(self._mesh._state, _value_mesh(self._mesh.ranks))
        self._mesh._start(self._name, args, kwargs, future)
        return future

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call the one actor of a mesh of exactly one; a Future of its result."""
        ranks = self._mesh.ranks
        if len(ranks) != 1:
            raise ValueError(f"call_one needs a mesh of exactly one actor; this one has "
                             f"{len(ranks)} (use .slice(host=..., proc=...))")
        future = Future(self._mesh._state, _only(ranks[0]))
        self._mesh._start(self._name, args, kwargs, future)
        return future

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call one actor of the mesh, the one with the fewest calls in flight; its result."""
        one = self._mesh._one(self._mesh._least_busy())
        future = Future(one._state, _only(one.ranks[0]))
        one._start(self._name, args, kwargs, future)
        return future

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Call every rank; one Future per answer, in the order the answers come (the first
        future is the first answer, whichever rank gave it)."""
        arrivals: list[Future[Any]] = [Arrival(self._mesh._state, n)
                                       for n in range(len(self._mesh))]
        self._mesh._start(self._name, args, kwargs, *arrivals)
        return iter(arrivals)

    async def call_async(self, *args: Any, **kwargs: Any) -> ValueMesh:
        """`await call(...)`, kept for trio code written before futures."""
        return await self.call(*args, **kwargs)

    async def call_one_async(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call_one(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every rank without waiting for replies (from a script or from trio code).
        Arguments are copied before this returns, so mutating them afterwards is safe."""
        post_sync_api(self._mesh._state.trio_token, self._mesh._post, self._name, args, kwargs)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        not_supported("Endpoint.rref", "tensor engine")

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._name}>"
