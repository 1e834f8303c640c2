"""The actor mesh: launch, supervise and talk to processes through the node daemons.

    from monarch_fs.mesh import HostMesh, Actor, endpoint
"""

from .actor import Actor, ActorMesh, Endpoint, endpoint
from .errors import ActorError, Failure, MeshError, MeshFailure, SpawnError, SupervisionError
from .future import CallTimeout, Future
from .host_mesh import HostMesh
from .proc_mesh import ProcMesh
from .shape import ValueMesh

__all__ = ["Actor", "ActorError", "ActorMesh", "CallTimeout", "Endpoint", "Failure", "Future",
           "HostMesh", "MeshError", "MeshFailure", "ProcMesh", "SpawnError", "SupervisionError",
           "ValueMesh", "endpoint"]
