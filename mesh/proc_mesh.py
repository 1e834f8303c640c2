"""A proc mesh: K actor-runtime processes on each host, connected back to their owner.

Launching: the owner starts its service (owner.py) on a fresh port, asks the daemons to run
`python -m monarch_fs.mesh.runtime` on every host with the mesh's fresh random token in the spawn
request's secrets (which reach a proc through a pipe, never its environment; never the cluster
token), and waits until every proc has connected back and authenticated. `ProcMesh` is the
handle (or a slice of it) that spawns actor meshes on those procs and stops them. What they
share, and supervision, is mesh_state.py.
"""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import trio

from ..daemon.wire.addresses import format_addr
from . import wire
from .actor import ActorMesh, class_ref
from .errors import Failure, MeshError, SpawnError
from .hosts import Launcher, workspace_version
from .loop import run_async_api, run_sync_api
from .mesh_state import MeshState, Output, Proc, Supervisor, print_output, report_unhandled
from .owner import OwnerService
from .shape import Selector, Shaped

SPAWN_TIMEOUT = 30.0  # for a daemon to answer a spawn request


async def spawn_proc_mesh(launcher: Launcher, nursery: trio.Nursery, *, per_host: int,
                          name: str = "procs", env: dict[str, str] | None = None,
                          cwd: str | None = None, workspace: str | None = None,
                          version: str | None = None, python: str | None = None,
                          python_path: Iterable[str] = (),
                          supervisor: Supervisor = report_unhandled,
                          output: Output | None = print_output,
                          connect_timeout: float = 60.0) -> MeshState:
    """Launch the runtimes and wait until every one has connected back."""
    if per_host < 1:
        raise ValueError("per_host must be at least 1")
    state = MeshState(name, launcher, per_host, supervisor, output)
    listeners: dict[str, trio.SocketListener] = {}
    addrs: list[str] = []  # per host: where its procs connect back to
    for host in range(len(launcher.hosts)):
        listen = launcher.listen_host(host)
        if listen not in listeners:
            listeners[listen] = (await trio.open_tcp_listeners(0, host=listen))[0]
        addrs.append(format_addr(listen, listeners[listen].socket.getsockname()[1]))
    await nursery.start(OwnerService(state).serve, list(listeners.values()))
    try:
        if workspace and not version:
            version = await workspace_version(launcher, workspace)
        specs = _spawn_specs(state, addrs, env, cwd, workspace, version, python,
                             list(python_path))
        errors: list[SpawnError] = []
        async with trio.open_nursery() as starting:
            for proc, spec in zip(state.procs, specs):
                starting.start_soon(_spawn_one, state, proc, spec, errors)
        if errors:
            raise errors[0]
        await state.wait_connected(connect_timeout)
    except BaseException:
        await state.stop()
        raise
    return state


def _spawn_specs(state: MeshState, addrs: list[str], env: dict | None, cwd: str | None,
                 workspace: str | None, version: str | None, python: str | None,
                 python_path: list[str]) -> list[dict[str, Any]]:
    """What the daemons are asked to run, one spec per proc."""
    hosts = [[h.addr, h.name] for h in state.launcher.hosts]
    shared_env = {
        "MONARCH_MESH_HOSTS": wire.compact_json(hosts),
        "MONARCH_MESH_PYTHON_PATH": os.pathsep.join(python_path),
        # What meshes spawned by actors in this proc inherit, with their {placeholders}
        # unexpanded (base64, so the daemon does not expand them for this node).
        "MONARCH_MESH_DEFAULTS": base64.b64encode(wire.compact_json({
            "python": python, "python_path": python_path, "workspace": workspace,
            "version": version}).encode()).decode(),
        # The job its procs' output is kept under on each node (`monarch-fs logs JOB`).
        "MONARCH_FS_JOB": f"{state.name}-{time.strftime('%m%d-%H%M%S')}-{os.urandom(2).hex()}",
    }
    options: dict[str, Any] = {}
    if cwd:
        options["cwd"] = cwd
    if workspace:
        options["workspace"] = workspace
        if version:
            options["version"] = version
    argv = [python or sys.executable, "-m", "monarch_fs.mesh.runtime"]
    # The token goes in `secrets`, which the daemon hands over through a pipe, never in an
    # environment (/proc/PID/environ); see daemon/node/procs.py.
    secrets = {"MONARCH_MESH_TOKEN": state.token.hex()}
    return [{"argv": argv, "secrets": secrets, "env": {
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
        "MONARCH_MESH_ADDR": addrs[proc.host],
        "MONARCH_MESH_NAME": state.name,
        "MONARCH_MESH_RANK": str(proc.rank),
        "MONARCH_MESH_WORLD_SIZE": str(len(state.procs)),
        "MONARCH_MESH_LOCAL_RANK": str(proc.local_rank),
        "MONARCH_MESH_HOST": str(proc.host),
        **shared_env,
    }, **options} for proc in state.procs]


async def _spawn_one(state: MeshState, proc: Proc, spec: dict[str, Any],
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


class ProcMesh(Shaped):
    """Procs running the actor runtime, `per_host` on each host; or a slice of them."""

    def __init__(self, state: MeshState, host_coords: tuple[int, ...] | None = None,
                 proc_coords: tuple[int, ...] | None = None) -> None:
        self._state = state
        self._per_host = state.per_host
        self._host_coords = host_coords or tuple(range(len(state.launcher.hosts)))
        self._proc_coords = proc_coords or tuple(range(state.per_host))

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def failure(self) -> Failure | None:
        """Why the mesh failed, once a proc of it has died."""
        return self._state.failure

    @property
    def pids(self) -> dict[int, tuple[str, int | None]]:
        """rank -> (host, pid), for the ranks of this view."""
        procs = self._state.procs
        return {r: (procs[r].info.addr, procs[r].pid) for r in self.ranks}

    def slice(self, host: Selector = None, proc: Selector = None) -> ProcMesh:
        hosts, procs = self._sliced(host, proc)
        return ProcMesh(self._state, hosts, procs)

    async def spawn_async(self, name: str, cls: type | str, *args: Any,
                          **kwargs: Any) -> ActorMesh:
        """Construct `cls(*args, **kwargs)` on every proc of this view, as actor `name`.
        `cls` is a class (procs import it by module and name) or "module:QualName" for code
        only the procs can import (e.g. pushed to the mount, found through python_path)."""
        return await run_async_api(self._state.trio_token, self._spawn, name, cls, args, kwargs)

    def spawn(self, name: str, cls: type | str, *args: Any, **kwargs: Any) -> ActorMesh:
        """spawn_async for synchronous code."""
        return run_sync_api(self._state.trio_token, "spawn", self._spawn, name, cls, args,
                            kwargs)

    async def _spawn(self, name: str, cls: type | str, args: tuple, kwargs: dict) -> ActorMesh:
        module, qualname, main = class_ref(cls)
        state = self._state
        state.check()
        if name in state.actors:
            raise ValueError(f"proc mesh {state.name!r} already has actors named {name!r}")
        pending = state.post_call(self.ranks, "spawn", name, "__init__",
                                  {"module": module, "qualname": qualname, "main": main},
                                  args, kwargs)
        state.actors.add(name)
        assert pending is not None
        await state.wait_call(pending)
        return ActorMesh(state, name, cls if isinstance(cls, type) else None,
                         self._host_coords, self._proc_coords)

    async def stop_async(self) -> None:
        """Stop every proc of the whole mesh (not only this slice): asked to exit, then killed."""
        await run_async_api(self._state.trio_token, self._state.stop)

    def stop(self) -> None:
        run_sync_api(self._state.trio_token, "stop", self._state.stop)

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self.sizes} ranks {self.ranks}>"
