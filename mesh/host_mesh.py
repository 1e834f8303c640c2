"""The hosts of a cluster, as a mesh to spawn procs on.

    hosts = HostMesh.connect("@hosts")      # daemons that run (same SPEC and token as push)
    hosts = HostMesh.local(2)               # or a local cluster for this script's lifetime
    procs = hosts.spawn_procs(per_host=2)
    ...
    hosts.close()                           # also on exit; stops every proc it started

In trio code: `async with HostMesh.open(spec) as hosts:` (or `open_local(n)`), and await the
`*_async` methods. Closing a host mesh stops its procs and closes its daemon connections, which
makes every daemon kill whatever this controller still runs there.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import trio

from ..daemon.client.hosts import resolve_target
from ..daemon.wire.auth import resolve_token
from .errors import MeshError
from .future import Done
from .hosts import HostInfo, HostSubset, Launcher, open_daemons
from .local import local_cluster
from .loop import BackgroundLoop, run_async_api, run_sync_api, service_nursery
from .mesh_ref import leave_loop, use_loop
from .mesh_state import MeshState, Output, Supervisor, print_output, report_unhandled
from .proc_mesh import ProcMesh, spawn_proc_mesh
from .shape import HOSTS, Selector, select


class HostMesh:
    """The daemons of a set of hosts, as one mesh to spawn procs on."""

    def __init__(self, launcher: Launcher, nursery: trio.Nursery, *,
                 supervisor: Supervisor = report_unhandled,
                 output: Output | None = print_output) -> None:
        self._launcher = launcher
        self._nursery = nursery
        self._supervisor = supervisor
        self._output = output
        self._token = trio.lowlevel.current_trio_token()
        self._meshes: list[MeshState] = []
        self._loop: BackgroundLoop | None = None
        self._closed = False
        self._defaults: dict = {}  # spawn_procs arguments left out (procs of actors inherit)
        self.cluster_dir: Path | None = None  # the local cluster's folder, for local()

    @property
    def hosts(self) -> list[HostInfo]:
        return list(self._launcher.hosts)

    @property
    def sizes(self) -> dict[str, int]:
        return {HOSTS: len(self._launcher.hosts)}

    extent = sizes

    def slice(self, hosts: Selector = None, host: Selector = None) -> HostMesh:
        """Some of these hosts, by position (an int, a slice or a list); procs spawned on the
        slice stop with this mesh."""
        picked = select(tuple(range(len(self))), hosts if host is None else host, HOSTS)
        view = object.__new__(HostMesh)
        view.__dict__.update(self.__dict__)  # the same loop, nursery, meshes and defaults
        view._launcher = HostSubset(self._launcher, picked)
        return view

    def __len__(self) -> int:
        return len(self._launcher.hosts)

    def __repr__(self) -> str:
        return f"<HostMesh {', '.join(map(str, self.hosts))}>"

    # ---- opening and closing --------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(cls, spec: str | None = None, *,
                   token_file: str | None = None) -> AsyncIterator[HostMesh]:
        """Connect to running daemons (SPEC and token resolved as for `monarch-fs push`: in a
        SLURM job after `monarch-fs slurm up`, that job's daemons)."""
        addrs, token_file = resolve_target(spec, token_file)
        async with cls._open(addrs, resolve_token(token_file)) as hosts:
            yield hosts

    @classmethod
    @asynccontextmanager
    async def open_local(cls, nodes: int = 2) -> AsyncIterator[HostMesh]:
        """Start a local cluster of `nodes` daemons, and stop it on the way out."""
        async with local_cluster(nodes) as (addrs, token, d):
            async with cls._open(addrs, token) as hosts:
                hosts.cluster_dir = d
                yield hosts

    @classmethod
    @asynccontextmanager
    async def _open(cls, addrs: list[str], token: bytes) -> AsyncIterator[HostMesh]:
        async with open_daemons(addrs, token) as daemons, service_nursery() as nursery:
            hosts = cls(daemons, nursery)
            use_loop(nursery)  # actor meshes that come back from actors are called from here
            try:
                yield hosts
            finally:
                leave_loop(nursery)
                await hosts._stop_all()

    @classmethod
    def connect(cls, spec: str | None = None, *, token_file: str | None = None) -> HostMesh:
        """open() for synchronous scripts: the mesh lives in a background trio loop."""
        return cls._in_background(lambda: cls.open(spec, token_file=token_file))

    @classmethod
    def local(cls, nodes: int = 2) -> HostMesh:
        """open_local() for synchronous scripts."""
        return cls._in_background(lambda: cls.open_local(nodes))

    @classmethod
    def _in_background(cls, make: Callable[[], AbstractAsyncContextManager[HostMesh]]) -> HostMesh:
        loop = BackgroundLoop()

        async def main(stop: trio.Event, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with make() as hosts:
                hosts._loop = loop
                task_status.started(hosts)
                await stop.wait()

        hosts = loop.start(main)
        atexit.register(hosts.close)
        return hosts

    def close(self) -> None:
        """Stop every proc this mesh started, close the daemon connections (and stop the local
        cluster). Idempotent; runs at exit if the script does not call it."""
        if self._loop is None:
            raise RuntimeError("close() is for meshes from connect()/local(); a mesh from "
                               "open() closes when its `async with` block ends")
        atexit.unregister(self.close)
        self._loop.stop()

    def shutdown(self) -> Done[None]:
        """close(), by Monarch's name (its `shutdown().get()` runs unchanged)."""
        self.close()
        return Done(None)

    def __enter__(self) -> HostMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _stop_all(self) -> None:
        self._closed = True
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for state in self._meshes:
                    nursery.start_soon(state.stop)

    # ---- procs ----------------------------------------------------------------------------

    async def spawn_procs_async(
        self, per_host: int | dict[str, int] = 1, *, name: str = "procs",
        env: dict[str, str] | None = None, cwd: str | None = None,
        workspace: str | None = None, version: str | None = None,
        python: str | None = None, python_path: Iterable[str] = (),
        connect_timeout: float = 60.0, call_timeout: float | None = None,
        hang_timeout: float | None = None, on_hang: str = "kill",
    ) -> ProcMesh:
        """Start `per_host` actor-runtime procs on every host (an int, or named dimensions
        such as {"gpus": 4}); returns once all are connected.

        workspace/version pin the procs to one published version of a pushed workspace
        (default: the version host 0 serves now, the same on every host); `{workspace}` and
        `{mount}` in env, cwd, python and python_path expand on each node. python is the
        interpreter (default: this one's path, e.g. use "{workspace}/bin/python" for a pushed
        venv); python_path entries go first on the procs' sys.path, so actor classes can come
        from pushed code. call_timeout is the default of every call's Future (None: wait as
        long as it takes). hang_timeout: when a call waits that many seconds for a rank, print
        and record the procs' stacks, then fail the mesh naming that rank (on_hang "kill") or
        let the call wait on ("wait"); see `monarch-fs stacks`.
        """
        return await run_async_api(self._token, self._spawn_procs, dict(
            per_host=per_host, name=name, env=env, cwd=cwd, workspace=workspace,
            version=version, python=python, python_path=list(python_path),
            connect_timeout=connect_timeout, call_timeout=call_timeout,
            hang_timeout=hang_timeout, on_hang=on_hang))

    def spawn_procs(self, per_host: int | dict[str, int] = 1, **kwargs) -> ProcMesh:
        """spawn_procs_async for synchronous code (same arguments)."""
        return run_sync_api(self._token, "spawn_procs",
                            functools.partial(self.spawn_procs_async, per_host, **kwargs))

    async def _spawn_procs(self, kwargs: dict) -> ProcMesh:
        if self._closed:
            raise MeshError("this host mesh is closed")
        for key in ("python", "python_path", "workspace"):
            if not kwargs[key] and self._defaults.get(key):
                kwargs[key] = self._defaults[key]
                if key == "workspace" and not kwargs["version"]:
                    kwargs["version"] = self._defaults.get("version")
        state = await spawn_proc_mesh(self._launcher, self._nursery, supervisor=self._supervisor,
                                      output=self._output, **kwargs)
        self._meshes.append(state)
        return ProcMesh(state)
