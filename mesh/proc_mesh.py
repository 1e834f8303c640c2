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
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

import trio

from ..daemon.wire.addresses import format_addr
from . import hang, wire
from .actor_mesh import ActorMesh, class_ref
from .errors import Failure, SpawnError
from .future import Done, Future
from .hosts import Launcher, workspace_version
from .launch import respawn_rank, spawn_one
from .loop import post_sync_api, run_async_api, run_sync_api
from .mesh_ref import register_owned
from .mesh_state import MeshState, Output, Supervisor, print_output, report_unhandled
from .owner import OwnerService
from .shape import Selector, Shaped, per_host_dims
from .unsupported import not_supported


async def spawn_proc_mesh(launcher: Launcher, nursery: trio.Nursery, *,
                          per_host: int | dict[str, int],
                          name: str = "procs", env: dict[str, str] | None = None,
                          cwd: str | None = None, workspace: str | None = None,
                          version: str | None = None, python: str | None = None,
                          python_path: Iterable[str] = (),
                          supervisor: Supervisor = report_unhandled,
                          output: Output | None = print_output,
                          connect_timeout: float = 60.0,
                          call_timeout: float | None = None, hang_timeout: float | None = None,
                          on_hang: str = "kill") -> MeshState:
    """Launch the runtimes and wait until every one has connected back; with `hang_timeout`,
    watch its calls for one that waits that long (hang.py)."""
    state = MeshState(name, launcher, per_host_dims(per_host), supervisor, output)
    state.call_timeout = call_timeout
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
        port = (await launcher.request(0, "free_port"))["port"]
        torchrun = torchrun_env(state, launcher.hosts[0].host, port)
        specs = state.specs = _spawn_specs(state, addrs, env, cwd, workspace, version,
                                           python, list(python_path), torchrun)
        errors: list[SpawnError] = []
        async with trio.open_nursery() as starting:
            for proc, spec in zip(state.procs, specs):
                starting.start_soon(spawn_one, state, proc, spec, errors)
        if errors:
            raise errors[0]
        await state.wait_connected(connect_timeout)
        register_owned(state.peer_token, state)  # a reference that comes back is ourselves
        if hang_timeout is not None:
            nursery.start_soon(hang.CallWatch(state, hang_timeout, on_hang).run)
    except BaseException:
        await state.stop()
        raise
    return state


def torchrun_env(state: MeshState, master_addr: str, port: int) -> list[dict[str, str]]:
    """Per proc, what torchrun would give it, so `init_process_group()` works inside actors:
    MASTER_ADDR is host 0's daemon address, MASTER_PORT a port its daemon found free."""
    return [{"RANK": str(proc.rank), "WORLD_SIZE": str(len(state.procs)),
             "LOCAL_RANK": str(proc.local_rank), "LOCAL_WORLD_SIZE": str(state.per_host),
             "GROUP_RANK": str(proc.host), "MASTER_ADDR": master_addr,
             "MASTER_PORT": str(port)} for proc in state.procs]


def _spawn_specs(state: MeshState, addrs: list[str], env: dict | None, cwd: str | None,
                 workspace: str | None, version: str | None, python: str | None,
                 python_path: list[str], torchrun: list[dict[str, str]]) -> list[dict[str, Any]]:
    """What the daemons are asked to run, one spec per proc."""
    hosts = [[h.addr, h.name] for h in state.launcher.hosts]
    shared_env = {
        "MONARCH_MESH_HOSTS": wire.compact_json(hosts),
        "MONARCH_MESH_PYTHON_PATH": os.pathsep.join(python_path),
        "MONARCH_MESH_DIMS": wire.compact_json(list(zip(state.dims, state.extent))),
        # What meshes spawned by actors in this proc inherit, with their {placeholders}
        # unexpanded (base64, so the daemon does not expand them for this node).
        "MONARCH_MESH_DEFAULTS": base64.b64encode(wire.compact_json({
            "python": python, "python_path": python_path, "workspace": workspace,
            "version": version}).encode()).decode(),
        # The job its procs' output is kept under on each node (`monarch-fs logs JOB`).
        "MONARCH_FS_JOB": state.job,
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
    secrets = {"MONARCH_MESH_TOKEN": state.token.hex(),
               "MONARCH_MESH_PEER_TOKEN": state.peer_token.hex()}
    return [{"argv": argv, "secrets": secrets, "env": {
        "PYTHONUNBUFFERED": "1",
        **torchrun[proc.rank],
        **(env or {}),
        "MONARCH_MESH_ADDR": addrs[proc.host],
        "MONARCH_MESH_NAME": state.name,
        "MONARCH_MESH_RANK": str(proc.rank),
        "MONARCH_MESH_WORLD_SIZE": str(len(state.procs)),
        "MONARCH_MESH_LOCAL_RANK": str(proc.local_rank),
        "MONARCH_MESH_HOST": str(proc.host),
        **shared_env,
    }, **options} for proc in state.procs]


class ProcMesh(Shaped):
    """Procs running the actor runtime, `per_host` on each host; or a slice of them."""

    def __init__(self, state: MeshState,
                 coords: tuple[tuple[int, ...], ...] | None = None) -> None:
        self._state = state
        self._init_shape(state.dims, state.extent, coords)

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def failure(self) -> Failure | None:
        """The first failure of a rank of this mesh (whichever view), if any."""
        return self._state.failure

    @property
    def failures(self) -> dict[int, Failure]:
        """rank -> why it is gone, for the ranks of this view that failed."""
        procs = self._state.procs
        return {r: f for r in self.ranks if (f := procs[r].failure) is not None}

    @property
    def call_timeout(self) -> float | None:
        """What a call's Future.get() and await wait at most by default (None: no limit),
        for every view of this mesh and its actor meshes."""
        return self._state.call_timeout

    @call_timeout.setter
    def call_timeout(self, seconds: float | None) -> None:
        self._state.call_timeout = seconds

    @property
    def pids(self) -> dict[int, tuple[str, int | None]]:
        """rank -> (host, pid), for the ranks of this view."""
        procs = self._state.procs
        return {r: (procs[r].info.addr, procs[r].pid) for r in self.ranks}

    def slice(self, **selectors: Selector) -> ProcMesh:
        """The procs at some coordinates, by dimension name: `slice(hosts=0, gpus=1)`."""
        return ProcMesh(self._state, self._sliced(selectors))

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
        state.check(self.ranks)
        if name in state.actors:
            raise ValueError(f"proc mesh {state.name!r} already has actors named {name!r}")
        fields = {"module": module, "qualname": qualname, "main": main}
        pending = state.post_call(self.ranks, "spawn", name, "__init__", fields, args, kwargs)
        state.actors.add(name)
        state.constructed.append((name, self.ranks, fields, args, kwargs))  # for respawn()
        constructed: Future[None] = Future(state, lambda _: None)
        constructed._set_posted(pending, None)
        await constructed  # within the mesh's call_timeout, if it has one
        return ActorMesh(state, name, cls if isinstance(cls, type) else None, self._coords)

    async def respawn_async(self, rank: int, timeout: float = 60.0) -> None:
        """Replace failed rank `rank` with a fresh proc, and construct there, with the same
        arguments, every actor that was on it (see launch.py)."""
        await run_async_api(self._state.trio_token, respawn_rank, self._state, rank, timeout)

    def respawn(self, rank: int, timeout: float = 60.0) -> None:
        run_sync_api(self._state.trio_token, "respawn", respawn_rank, self._state, rank,
                     timeout)

    async def stop_async(self) -> None:
        """Stop every proc of the whole mesh (not only this slice): asked to exit, then killed."""
        await run_async_api(self._state.trio_token, self._state.stop)

    def stop(self) -> Done[None]:
        """stop_async for synchronous code: returns once the procs are gone (the Done it
        returns lets Monarch's `procs.stop().get()` run unchanged)."""
        run_sync_api(self._state.trio_token, "stop", self._state.stop)
        return Done(None)

    def logging_option(self, stream_to_client: bool = True,
                       aggregate_window_sec: float | None = None,
                       level: int = logging.INFO) -> Future[None]:
        """What happens to the procs' output (Monarch's options; here output is forwarded by
        default): forward it to this controller or not, fold identical lines across ranks
        over a window of seconds, and the procs' logging level. A Future: the level is set
        on every proc of the mesh once it is done."""
        state = self._state
        set_level: Future[None] = Future(state, lambda _: None)

        def apply() -> None:
            state.output.configure(state.nursery, stream_to_client, aggregate_window_sec)
            ranks = [p.rank for p in state.procs if p.failure is None]
            pending = state.post_call(ranks, "log_level", "", "logging_option",
                                      {"level": int(level)}, (), {})
            set_level._set_posted(pending, None)

        post_sync_api(state.trio_token, apply)
        return set_level

    def activate(self) -> Any:
        not_supported("ProcMesh.activate", "tensor engine")

    rank_tensor = rank_tensors = activate

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self.sizes} ranks {self.ranks}>"
