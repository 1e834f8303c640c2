"""Actors: classes whose `@endpoint` methods are called on every rank of a mesh at once.

    class Trainer(Actor):
        @endpoint
        def step(self, lr: float) -> float: ...        # sync: on the actor's own thread
        @endpoint
        async def ping(self) -> str: ...                # async: runs in the proc's trio loop

    trainers = procs.spawn("trainers", Trainer, 0.1)
    trainers.step.call(0.01)            # -> ValueMesh, one result per rank
    trainers.slice(host=0, proc=1).ping.call_one()
    trainers.step.broadcast(0.01)       # no reply; a failure surfaces through supervision

In trio code, await `call_async` / `call_one_async` instead. An actor's messages are handled
one at a time, in the order they were sent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import MeshError
from .loop import post_sync_api, run_async_api, run_sync_api
from .shape import Selector, Shaped, ValueMesh

if TYPE_CHECKING:
    from .host_mesh import HostMesh
    from .hosts import HostInfo
    from .mesh_state import MeshState, PendingCall

F = TypeVar("F", bound=Callable[..., Any])
_ENDPOINT = "_monarch_endpoint"


def endpoint(fn: F) -> F:
    """Mark a method as callable from other processes. Only endpoints can be called remotely."""
    setattr(fn, _ENDPOINT, True)
    return fn


def is_endpoint(fn: object) -> bool:
    return callable(fn) and getattr(fn, _ENDPOINT, False) is True


class Actor:
    """Base class for actors. In a proc, the runtime sets `rank`, `world_size`, `local_rank`,
    `host` and `name` before `__init__` runs.

    Define `__supervise__(self, failure) -> bool` to handle the failure of a mesh this actor
    spawned (through `self.hosts`): return True if handled; otherwise the failure makes this
    actor's own mesh fail, and so travels up to whoever owns it, up to the controller.
    """

    rank: int
    world_size: int
    local_rank: int
    host: HostInfo
    name: str
    _mesh_hosts: Callable[[], HostMesh] | None = None

    @property
    def hosts(self) -> HostMesh:
        """The controller's hosts, for spawning meshes this actor owns (their procs launch
        through the controller, which holds the daemon connections)."""
        if self._mesh_hosts is None:
            raise MeshError("hosts is only available inside a proc of a mesh")
        return self._mesh_hosts()


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

    def __init__(self, state: MeshState, name: str, cls: type | None,
                 host_coords: tuple[int, ...], proc_coords: tuple[int, ...]) -> None:
        self._state = state
        self._name = name
        self._cls = cls
        self._host_coords = host_coords
        self._proc_coords = proc_coords
        self._per_host = state.per_host

    def __getattr__(self, attr: str) -> Endpoint:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._cls is not None and not is_endpoint(getattr(self._cls, attr, None)):
            raise AttributeError(f"{self._cls.__qualname__}.{attr} is not an @endpoint")
        return Endpoint(self, attr)

    def slice(self, host: Selector = None, proc: Selector = None) -> ActorMesh:
        """The actors on some hosts and/or some procs of each host, by position in this mesh:
        an int, a slice or a list."""
        hosts, procs = self._sliced(host, proc)
        return ActorMesh(self._state, self._name, self._cls, hosts, procs)

    def _post(self, method: str, args: tuple, kwargs: dict, reply: bool) -> PendingCall | None:
        """Queue the call to every rank of this view, in the loop, without waiting: sends keep
        the order of posts, so one actor sees calls in the order they were made."""
        self._state.check()
        return self._state.post_call(self.ranks, "call", self._name, method, {"method": method},
                                     args, kwargs, reply)

    async def _call(self, method: str, args: tuple, kwargs: dict) -> ValueMesh:
        pending = self._post(method, args, kwargs, True)
        assert pending is not None
        results = await self._state.wait_call(pending)
        return ValueMesh(self.ranks, [results[r] for r in self.ranks])

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name!r} of {self._state.name!r} ranks {self.ranks}>"


class Endpoint:
    """One endpoint of an actor mesh."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name

    @property
    def _token(self):
        return self._mesh._state.trio_token

    async def call_async(self, *args: Any, **kwargs: Any) -> ValueMesh:
        """Call on every rank; the results by rank. Raises ActorError if an endpoint raised
        (the lowest such rank), SupervisionError if a proc of the mesh died."""
        return await run_async_api(self._token, self._mesh._call, self._name, args, kwargs)

    def call(self, *args: Any, **kwargs: Any) -> ValueMesh:
        """call_async for synchronous code."""
        return run_sync_api(self._token, "call", self._mesh._call, self._name, args, kwargs)

    async def call_one_async(self, *args: Any, **kwargs: Any) -> Any:
        """Call the one actor of a mesh of exactly one; its result."""
        self._check_one()
        return (await self.call_async(*args, **kwargs)).values()[0]

    def call_one(self, *args: Any, **kwargs: Any) -> Any:
        self._check_one()
        return self.call(*args, **kwargs).values()[0]

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every rank without waiting for replies (from a script or from trio code).
        Arguments are copied before this returns, so mutating them afterwards is safe."""
        post_sync_api(self._token, self._mesh._post, self._name, args, kwargs, False)

    def _check_one(self) -> None:
        if len(self._mesh) != 1:
            raise ValueError(f"call_one needs a mesh of exactly one actor; this one has "
                             f"{len(self._mesh)} (use .slice(host=..., proc=...))")

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._name}>"

