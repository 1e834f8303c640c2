"""The actor mesh: launch, supervise and talk to processes through the node daemons.

    from monarch_fs.mesh import HostMesh, Actor, endpoint
"""

from .actor import Actor, ActorMesh, Endpoint, endpoint
from .errors import ActorError, Failure, MeshError, SpawnError, SupervisionError
from .host_mesh import HostMesh
from .proc_mesh import ProcMesh
from .shape import ValueMesh

__all__ = ["Actor", "ActorError", "ActorMesh", "Endpoint", "Failure", "HostMesh", "MeshError",
           "ProcMesh", "SpawnError", "SupervisionError", "ValueMesh", "endpoint"]
