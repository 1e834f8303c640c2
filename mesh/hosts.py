"""Connections to the node daemons, each read by exactly one task.

A daemon sends Replies and Events on one channel in any order, and `Channel` allows one receiving
task at a time, so each connection gets one reader task that hands Replies and Errors to the
caller waiting on that request id, and Events to the handler of the proc they are about. Both the
actor mesh and `monarch-fs run` launch through this module.

A proc handler is a plain function `on_event(kind, data)`, called in the reader task (it must not
block) with kind "output" (data: stream, lines), "exit" (code, signal, stderr_tail) or "lost"
(reason: the daemon connection broke, so the proc's fate is unknown; the daemon kills its procs
when its controller goes away).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ..daemon.wire import identity
from ..daemon.wire import protocol as p
from ..daemon.wire.calls import Call, Calls
from ..daemon.wire.transport import (
    Channel,
    ConnectError,
    ConnectionLost,
    RemoteError,
    connect,
    parse_addr,
)
from .errors import MeshError, SpawnError
from .loop import service_nursery

OnEvent = Callable[[str, dict], None]
SEND_TIMEOUT = 30.0  # seconds a daemon may take to accept one request's bytes
# Seconds a daemon has to answer a kill. It answers at once when it can (it signals the process
# group and replies); one that does not is stopped or wedged, and must not hold a stop up.
KILL_TIMEOUT = 5.0


@dataclass(frozen=True)
class HostInfo:
    addr: str  # the daemon's host:port, as the host list names it
    name: str  # the node name the daemon reports (its hostname, or node-I in a local cluster)

    @property
    def host(self) -> str:
        """The address part, e.g. for MASTER_ADDR."""
        return parse_addr(self.addr)[0]

    def __str__(self) -> str:
        return f"{self.name} ({self.addr})" if self.name and self.name != self.addr else self.addr


class HostLink:
    """One authenticated connection to a node daemon and its reader task."""

    def __init__(self, chan: Channel, addr: str) -> None:
        self.chan = chan
        self.info = HostInfo(addr, str(chan.info.get("node") or addr))
        # The address this host reached us from is the one its procs can connect back to.
        self.local_host = chan.local_host
        self.lost: str | None = None
        self._calls: Calls[Call[dict]] = Calls()
        self._handlers: dict[int, OnEvent] = {}
        self._early: dict[int, list[tuple[str, dict]]] = {}  # events that beat their spawn reply

    async def run(self) -> None:
        """Read until the connection ends; then fail every waiter and tell every handler."""
        try:
            while True:
                msg = await self.chan.next_message()
                if isinstance(msg, p.Reply):
                    self._calls.settle(msg.id, msg.value)
                elif isinstance(msg, p.Error):
                    err = RemoteError(msg.message, msg.code, str(self.info))
                    if msg.id is None:
                        raise err
                    self._calls.fail(msg.id, err)
                elif isinstance(msg, p.Event):
                    self._event(msg)
        except (ConnectionLost, RemoteError, p.ProtocolError, trio.ClosedResourceError,
                trio.BrokenResourceError) as e:
            self.lost = f"lost the connection to the node daemon {self.info}: {e}"
        finally:
            lost = self.lost = self.lost or f"disconnected from the node daemon {self.info}"
            self._calls.fail_all(lambda call: MeshError(lost))
            handlers, self._handlers = self._handlers, {}
            for on_event in handlers.values():
                on_event("lost", {"reason": lost})

    def _event(self, msg: p.Event) -> None:
        proc = msg.data.get("proc")
        if not isinstance(proc, int):  # every proc event names its proc; ignore any other
            return
        handler = self._handlers.get(proc)
        if handler is None:
            self._early.setdefault(proc, []).append((msg.kind, msg.data))
            return
        if msg.kind == "exit":
            del self._handlers[proc]
        handler(msg.kind, msg.data)

    async def request(self, op: str, **args: object) -> dict:
        if self.lost:
            raise MeshError(self.lost)
        with self._calls.expecting(Call()) as call:
            try:
                # A send cut short by cancellation would leave half a frame and break the link
                # for every mesh that shares it, so the send is shielded (a request is small);
                # only the wait for the reply can be cancelled.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + SEND_TIMEOUT):
                    await self.chan.send(p.Request(op, args, call.id))
            except (ConnectionLost, trio.ClosedResourceError) as e:
                raise MeshError(f"{self.info}: {e}") from None
            return await call.result() or {}

    async def spawn(self, spec: dict, on_event: OnEvent) -> dict:
        """Start a proc (spec: argv, env, cwd, workspace, version); returns {"proc", "pid"}.
        From then on its events go to on_event, starting with any that beat the reply."""
        try:
            signed = await identity.sign(self.chan, "spawn", spec)  # if the node asks who
            reply = await self.request("spawn", **signed)
        except RemoteError as e:
            raise SpawnError(f"{self.info}: {e.message}") from None
        except identity.IdentityError as e:
            raise SpawnError(f"{self.info}: {e}") from None
        proc = reply["proc"]
        early = self._early.pop(proc, [])
        if self.lost:
            early.append(("lost", {"reason": self.lost}))
        elif not any(kind == "exit" for kind, _ in early):
            self._handlers[proc] = on_event
        for kind, data in early:
            on_event(kind, data)
        return reply

    async def kill(self, proc: int, sig: int = signal.SIGTERM,
                   timeout: float = KILL_TIMEOUT) -> bool:
        """Signal a proc's process group; a proc that already ended is not an error, nor is a
        lost connection (the daemon kills the procs of a controller that went away). False
        when the daemon did not answer within `timeout` seconds."""
        with trio.move_on_after(timeout):
            try:
                await self.request("kill", proc=proc, signal=int(sig))
            except (RemoteError, MeshError):
                pass
            return True
        return False

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.chan.stream)


class Launcher:
    """Where procs come from. The controller launches through its daemon links; an actor that
    spawns meshes launches through its controller (see runtime.py), with the same interface."""

    hosts: list[HostInfo]

    def listen_host(self, host: int) -> str:
        """An address of ours that procs on `host` can connect back to."""
        raise NotImplementedError

    async def spawn(self, host: int, spec: dict, on_event: OnEvent) -> dict:
        raise NotImplementedError

    async def kill(self, host: int, proc: int, sig: int = signal.SIGTERM,
                   timeout: float = KILL_TIMEOUT) -> bool:
        """Signal a proc's process group; False if its host did not answer within `timeout`."""
        raise NotImplementedError

    async def request(self, host: int, op: str, **args: object) -> dict:
        raise NotImplementedError


class HostSubset(Launcher):
    """Some hosts of another launcher, renumbered from 0 (a sliced HostMesh launches here)."""

    def __init__(self, base: Launcher, indices: tuple[int, ...]) -> None:
        self.base = base
        self.indices = indices
        self.hosts = [base.hosts[i] for i in indices]

    def listen_host(self, host: int) -> str:
        return self.base.listen_host(self.indices[host])

    async def spawn(self, host: int, spec: dict, on_event: OnEvent) -> dict:
        return await self.base.spawn(self.indices[host], spec, on_event)

    async def kill(self, host: int, proc: int, sig: int = signal.SIGTERM,
                   timeout: float = KILL_TIMEOUT) -> bool:
        return await self.base.kill(self.indices[host], proc, sig, timeout)

    async def request(self, host: int, op: str, **args: object) -> dict:
        return await self.base.request(self.indices[host], op, **args)


class Daemons(Launcher):
    """The controller's launcher: one HostLink per daemon."""

    def __init__(self, links: list[HostLink]) -> None:
        self.links = links
        self.hosts = [link.info for link in links]

    def listen_host(self, host: int) -> str:
        return self.links[host].local_host

    async def spawn(self, host: int, spec: dict, on_event: OnEvent) -> dict:
        return await self.links[host].spawn(spec, on_event)

    async def kill(self, host: int, proc: int, sig: int = signal.SIGTERM,
                   timeout: float = KILL_TIMEOUT) -> bool:
        return await self.links[host].kill(proc, sig, timeout)

    async def request(self, host: int, op: str, **args: object) -> dict:
        try:
            return await self.links[host].request(op, **args)
        except RemoteError as e:
            raise MeshError(f"{self.hosts[host]}: {e.message}") from None


@asynccontextmanager
async def open_daemons(addrs: list[str], token: bytes,
                       timeout: float = 10.0) -> AsyncIterator[Daemons]:
    """Connect to every daemon at once (one error naming every host that failed), run a reader
    per connection, and close them all on the way out, which makes each daemon stop the procs
    this controller started there."""
    chans: list[Channel | None] = [None] * len(addrs)
    errors: list[str] = []

    async def one(i: int, addr: str) -> None:
        try:
            # Spawn requests carry the mesh's secrets: always encrypted.
            chans[i] = await connect(addr, token, timeout=timeout, encrypt="on")
        except ConnectError as e:
            errors.append(str(e))

    async with trio.open_nursery() as nursery:
        for i, addr in enumerate(addrs):
            nursery.start_soon(one, i, addr)
    links = [HostLink(c, a) for c, a in zip(chans, addrs) if c is not None]
    if errors:
        for link in links:
            await link.aclose()
        raise MeshError("cannot reach every host: " + "; ".join(sorted(errors)))
    try:
        async with service_nursery() as nursery:
            for link in links:
                nursery.start_soon(link.run)
            yield Daemons(links)
    finally:
        with trio.CancelScope(shield=True):
            for link in links:
                await link.aclose()


async def workspace_version(launcher: Launcher, name: str) -> str:
    """The version of workspace `name` that host 0 serves now: pinned on every host, so all
    procs of a mesh run the same code even if a push lands while they start."""
    status = await launcher.request(0, "status")
    versions = status.get("workspaces", {}).get(name)
    if not versions:
        raise SpawnError(f"{launcher.hosts[0]}: no workspace {name!r}; push it first")
    return versions[0]

