"""Launching the procs of a mesh: each proc once when the mesh starts (proc_mesh.py), and again
for a rank that died, on purpose (`ProcMesh.respawn(rank)`).

A respawned rank is a fresh proc with the same rank, host, environment and secrets as the one
it replaces (the daemon starts it from the same spec); it connects back like any proc, and the
actors that were on the dead one are constructed on it again, with the arguments they were
spawned with (not their state: an actor that must resume loads its own checkpoint). Calls that
failed with the old proc stay failed; later calls to the rank go to the new one. A reference
to the mesh held elsewhere (mesh_ref.py) reaches the new proc once it is passed again.
"""

from __future__ import annotations

from typing import Any

import trio

from .calls import PendingCall
from .errors import MeshError, SpawnError, SupervisionError
from .mesh_state import MeshState, Proc

SPAWN_TIMEOUT = 30.0  # for a daemon to answer a spawn request


async def spawn_one(state: MeshState, proc: Proc, spec: dict[str, Any],
                     errors: list[SpawnError]) -> None:
    try:
        # Once asked, learn the proc id (so stop() can kill it) even if we are being cancelled.
        reply = None
        with trio.CancelScope(shield=True, deadline=trio.current_time() + SPAWN_TIMEOUT):
            reply = await state.launcher.spawn(
                proc.host, spec, lambda kind, data: state.on_proc_event(proc, kind, data))
    except MeshError as e:
        errors.append(SpawnError(f"proc mesh {state.name!r}, rank {proc.rank}: {e}"))
        return
    if reply is None:
        errors.append(SpawnError(f"proc mesh {state.name!r}, rank {proc.rank}: {proc.info} "
                                 f"did not answer the spawn request within {SPAWN_TIMEOUT:g}s"))
        return
    proc.proc_id, proc.pid = reply["proc"], reply["pid"]
    proc.spawned.set()


async def respawn_rank(state: MeshState, rank: int, timeout: float) -> None:
    if not 0 <= rank < len(state.procs):
        raise IndexError(f"proc mesh {state.name!r} has no rank {rank}")
    state.check()
    old = state.procs[rank]
    if old.failure is None:
        raise MeshError(f"rank {rank} of proc mesh {state.name!r} is alive: only a failed rank "
                        "is replaced")
    new = state.procs[rank] = Proc(old.rank, old.host, old.local_rank, old.info)
    errors: list[SpawnError] = []
    await spawn_one(state, new, state.specs[rank], errors)
    if errors:
        new.failure = old.failure
        raise errors[0]
    with trio.move_on_after(timeout):
        while not new.connected:
            if new.failure is not None:
                raise SupervisionError(new.failure, f"respawning rank {rank}")
            await state.changed()
        for name, ranks, fields, args, kwargs in state.constructed:
            if rank in ranks and (name, rank) not in state.stopped_actors:
                pending = state.post_call([rank], "spawn", name, "__init__", fields, args, kwargs)
                assert isinstance(pending, PendingCall)
                await pending.result()
        return
    raise SpawnError(f"proc mesh {state.name!r}: the new rank {rank} did not start within "
                     f"{timeout:g}s")


