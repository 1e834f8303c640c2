"""The base class of actors: what a proc's runtime gives every actor it constructs.

    class Trainer(Actor):
        @endpoint
        def step(self, lr: float) -> float: ...        # sync: on the actor's own thread
        @endpoint
        async def ping(self) -> str: ...                # async: on the proc's asyncio loop

Calling them is actor_mesh.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .actor_mesh import ActorMesh, Endpoint, class_ref, endpoint, is_endpoint
from .errors import MeshError

if TYPE_CHECKING:
    from .host_mesh import HostMesh
    from .hosts import HostInfo


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


__all__ = ["Actor", "ActorMesh", "Endpoint", "class_ref", "endpoint", "is_endpoint"]
