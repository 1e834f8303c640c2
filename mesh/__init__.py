"""The actor mesh: launch, supervise and talk to processes through the node daemons, with
Monarch's actor API (`monarch.actor`): a Monarch program ports by its imports.

    from monarch_fs.mesh import Actor, endpoint, this_host, current_rank

Most names are imported on first use: every proc of a mesh starts by importing this package
(its runtime is `monarch_fs.mesh.runtime`), and the controller's side (host and proc meshes,
hang watches, the daemons' clients) cost each proc's start ~50 ms of CPU it never used; four
procs starting on two cores wait for each other's imports.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Light, and eager: the submodule `context` must not hide the function of that name.
from .context import Context, context, current_rank, this_host, this_proc
from .errors import ActorError, Failure, MeshError, MeshFailure, SpawnError, SupervisionError

if TYPE_CHECKING:
    from .actor import Actor, ActorMesh, Endpoint, endpoint
    from .future import CallTimeout, Future
    from .host_mesh import HostMesh
    from .proc_mesh import ProcMesh
    from .shape import Point, ValueMesh
    from .tensor_buffer import TensorBuffer
    from .unsupported import NotSupported

_WHERE = {  # name -> the module that defines it
    **dict.fromkeys(("Actor", "ActorMesh", "Endpoint", "endpoint"), ".actor"),
    **dict.fromkeys(("CallTimeout", "Future"), ".future"),
    "HostMesh": ".host_mesh", "ProcMesh": ".proc_mesh", "Point": ".shape",
    "ValueMesh": ".shape", "TensorBuffer": ".tensor_buffer", "NotSupported": ".unsupported",
}


def current_size() -> dict[str, int]:
    """The extent of the current proc's mesh, by dimension (empty in the controller)."""
    return dict(current_rank().extent)


def current_actor_name() -> str:
    """The name of the actor handling the current message ("" outside actors)."""
    return getattr(context().actor_instance, "name", "")


def __getattr__(name: str) -> Any:
    """Our names, imported on first use; Monarch names with no meaning here: importable,
    refused when used (unsupported.py)."""
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    from .unsupported import STUBS

    if name in STUBS:
        return STUBS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Actor", "ActorError", "ActorMesh", "CallTimeout", "Context", "Endpoint", "Failure",
           "Future", "HostMesh", "MeshError", "MeshFailure", "NotSupported", "Point", "ProcMesh",
           "SpawnError", "SupervisionError", "TensorBuffer", "ValueMesh", "context",
           "current_actor_name", "current_rank", "current_size", "endpoint", "this_host",
           "this_proc"]
