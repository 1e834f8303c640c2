"""The actor mesh: launch, supervise and talk to processes through the node daemons, with
Monarch's actor API (`monarch.actor`): a Monarch program ports by its imports.

    from monarch_fs.mesh import Actor, endpoint, this_host, current_rank
"""

from typing import Any

from .actor import Actor, ActorMesh, Endpoint, endpoint
from .context import Context, context, current_rank, this_host, this_proc
from .errors import ActorError, Failure, MeshError, MeshFailure, SpawnError, SupervisionError
from .future import CallTimeout, Future
from .host_mesh import HostMesh
from .proc_mesh import ProcMesh
from .shape import Point, ValueMesh
from .tensor_buffer import TensorBuffer
from .unsupported import STUBS, NotSupported


def current_size() -> dict[str, int]:
    """The extent of the current proc's mesh, by dimension (empty in the controller)."""
    return dict(current_rank().extent)


def current_actor_name() -> str:
    """The name of the actor handling the current message ("" outside actors)."""
    return getattr(context().actor_instance, "name", "")


def __getattr__(name: str) -> Any:  # Monarch names with no meaning here: importable, refused
    if name in STUBS:
        return STUBS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Actor", "ActorError", "ActorMesh", "CallTimeout", "Context", "Endpoint", "Failure",
           "Future", "HostMesh", "MeshError", "MeshFailure", "NotSupported", "Point", "ProcMesh",
           "SpawnError", "SupervisionError", "TensorBuffer", "ValueMesh", "context",
           "current_actor_name", "current_rank", "current_size", "endpoint", "this_host",
           "this_proc"]
