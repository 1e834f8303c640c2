"""Names from Monarch's `monarch.actor` that have no meaning here, so that a ported program
imports cleanly and fails, where it uses one, with an error that says what and why."""

from __future__ import annotations

from typing import Any, NoReturn

from .errors import MeshError


class NotSupported(MeshError, NotImplementedError):
    """A Monarch feature monarch_fs.mesh does not have."""


_WHY = {
    "tensor engine": "monarch_fs.mesh has no tensor engine (distributed tensors, rref, "
                     "activate()); move tensors through endpoints",
    "ports": "endpoints answer by returning a value; use stream() for several answers",
    "jobs": "monarch_fs.mesh runs on node daemons: use HostMesh.connect(spec) or "
            "`monarch-fs slurm up`, not Monarch's job launchers (Kubernetes, attach, workers)",
    "debugger": "no remote debugger: an endpoint's exception comes back as ActorError with "
                "its traceback",
    "telemetry": "the node daemons record telemetry (`monarch-fs query`), not Monarch's meters",
}


def not_supported(feature: str, kind: str) -> NoReturn:
    raise NotSupported(f"{feature} is not supported by monarch_fs.mesh: {_WHY[kind]}")


class _Stub:
    """Importable; using it raises NotSupported."""

    def __init__(self, name: str, kind: str) -> None:
        self._name, self._kind = name, kind

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        not_supported(self._name, self._kind)

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        not_supported(f"{self._name}.{attr}", self._kind)

    def __repr__(self) -> str:
        return f"<not supported: {self._name}>"


STUBS = {name: _Stub(name, kind) for name, kind in (
    ("Accumulator", "ports"), ("Channel", "ports"), ("Port", "ports"),
    ("PortReceiver", "ports"), ("send", "ports"), ("as_endpoint", "ports"),
    ("concurrent_endpoint", "ports"), ("debug_controller", "debugger"),
    ("get_or_spawn_controller", "jobs"), ("hosts_from_config", "jobs"),
    ("run_worker_loop_forever", "jobs"), ("attach_to_workers", "jobs"), ("attach", "jobs"),
    ("enable_transport", "jobs"), ("ChannelTransport", "jobs"), ("default_bootstrap_cmd", "jobs"),
    ("get_meter", "telemetry"), ("span", "telemetry"), ("traced", "telemetry"),
)}
