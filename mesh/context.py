"""Where the running code is, by Monarch's names: `current_rank()`, `context()`, `this_host()`,
`this_proc()`.

    class Trainer(Actor):
        @endpoint
        def neighbours(self):
            me = current_rank()                     # Point: {"hosts": 1, "gpus": 0}, .rank 2
            return self.peers.slice(**me).ping.call_one().get()

In a proc, the runtime registers its place (`enter_proc`) and the actor that handles a message
(`actor_scope`). In the controller there is no rank: `current_rank()` is the empty point.

`this_host()` is this machine as a host mesh: in an actor, the host its proc runs on (procs
spawned there are owned by the actor, as with `self.hosts`); in the controller, a local cluster
of one node started on first use and stopped at exit (monarch-fs launches procs through a node
daemon, so one must run). `this_proc()` is, unlike Monarch's, a proc of its own on this host,
started on first use: monarch-fs runs no actors inside the controller's process.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import MeshError
from .shape import Point

if TYPE_CHECKING:
    from .host_mesh import HostMesh
    from .proc_mesh import ProcMesh


@dataclass
class _Place:
    point: Point
    host: int  # index into the proc mesh's hosts


_place: _Place | None = None
_actor: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_fs_actor", default=None)
_local: dict[object, Any] = {}  # this_host()'s and this_proc()'s meshes
_lock = threading.Lock()


def enter_proc(point: Point, host: int) -> None:
    """The runtime says where this proc is in its mesh (once, at start)."""
    global _place
    _place = _Place(point, host)


@contextmanager
def actor_scope(actor: Any) -> Iterator[None]:
    """While an actor handles a message, in its task or on its thread."""
    token = _actor.set(actor)
    try:
        yield
    finally:
        _actor.reset(token)


@dataclass
class Context:
    """What `context()` returns: the actor handling the current message (None outside
    actors) and the rank of the proc it runs in."""

    actor_instance: Any
    message_rank: Point


def current_rank() -> Point:
    """This proc's coordinates in its proc mesh (dimension -> index; `.rank` is the linear
    rank), so `mesh.slice(**current_rank())` picks the actor beside you in another mesh of the
    same shape. The empty point in the controller."""
    return _place.point if _place is not None else Point({}, 0, {})


def context() -> Context:
    return Context(_actor.get(), current_rank())


def this_host() -> HostMesh:
    """This machine's host, as a host mesh (see the module's docstring)."""
    actor = _actor.get()
    if _place is not None:
        if actor is None:
            raise MeshError("this_host() in a proc works inside an actor's endpoint or "
                            "constructor (the meshes it spawns belong to that actor)")
        return actor.hosts.slice(hosts=_place.host)
    with _lock:
        hosts = _local.get("host")
        if hosts is None or not hosts._loop.running:
            from .host_mesh import HostMesh

            hosts = _local["host"] = HostMesh.local(1)
        return hosts


def this_proc() -> ProcMesh:
    """A proc of its own on this host, started on first use (see the module's docstring)."""
    hosts = this_host()
    with _lock:
        key = ("proc", id(hosts._launcher), id(_actor.get()))
        procs = _local.get(key)
        if procs is None or procs._state.stopping:
            procs = _local[key] = hosts.spawn_procs(per_host={"procs": 1}, name="this_proc")
        return procs
