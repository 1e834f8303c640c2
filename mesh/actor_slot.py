"""One actor in a proc and its mailbox: its messages handled one at a time, in order; async
endpoints on the proc's asyncio loop (asyncio_loop.py), sync ones on the actor's own thread
(actor_thread.py).

A sync endpoint's call is handed to that thread and not waited for: the thread unpickles the
arguments, runs the endpoint, and writes its answer onto the owner's link itself
(link_writer.py), so neither the loop nor the thread waits for the other on a call's way
through (that hand-back cost a proc under load ~0.6 ms a call, most of `call()` on all 4's
lag behind Monarch's). Calls queued on the thread keep their order; any other message (an
async endpoint, a failure to supervise, a stop) waits for the thread's queue to drain first.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from ..daemon.wire import protocol as p
from . import wire
from .actor_mesh import is_endpoint
from .actor_thread import ActorThread
from .asyncio_loop import AsyncioLoop
from .calls import error_message
from .context import actor_scope
from .errors import Failure, MeshError
from .hosts import HostInfo

Reply = Callable[[p.Data], Awaitable[None]]  # where an actor's answer goes


class Host(Protocol):
    """What a slot needs of its proc's runtime (runtime.py, which holds the slots)."""

    rank: int
    world_size: int
    local_rank: int
    host: int
    hosts: list[HostInfo]
    actors: dict[str, Slot]
    aio: AsyncioLoop

    async def send(self, header: dict) -> None: ...

    async def post(self, msg: p.Data) -> None: ...

    def post_from_thread(self, msg: p.Data, reply_to: Reply) -> None: ...

    def host_mesh_for(self, slot: Slot) -> Callable[[], Any]: ...

_INTERNAL = (str(Path(trio.__file__).parent), str(Path(inspect.__file__).parent / "asyncio"),
             __file__, str(Path(__file__).parent / "asyncio_loop.py"))


def _user_traceback(e: BaseException) -> str:
    """The traceback of an endpoint's exception without the runtime's and trio's frames."""
    te = traceback.TracebackException.from_exception(e)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not f.filename.startswith(_INTERNAL)
         and "/outcome/" not in f.filename])
    return "".join(te.format())


def _import_main(path: str) -> Any:
    """The controller's script as module __mp_main__ (its `if __name__ == "__main__":` block
    does not run), also registered as __main__ so pickles that name __main__ find it."""
    mod = sys.modules.get("__mp_main__")
    if mod is None:
        spec = importlib.util.spec_from_file_location("__mp_main__", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the controller's script {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = mod
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules["__mp_main__"]
            raise
    sys.modules["__main__"] = mod
    return mod


def resolve_class(module: str, qualname: str, main: str | None) -> type:
    mod = _import_main(main) if module == "__main__" and main else importlib.import_module(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{module}:{qualname} is not a class")
    return obj


class Slot:
    """One actor in this proc and its mailbox."""

    def __init__(self, runtime: Host, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.instance: Any = None
        self.thread = ActorThread(f"actor {name}")
        # Unbounded on purpose: the runtime's one reader feeds every mailbox and also delivers
        # the owner's replies, which an actor may be waiting on (a mesh it spawns launches
        # through the owner). A reader blocked on a full mailbox would never deliver the reply
        # that lets that mailbox drain. The failures of the actor's own meshes also arrive here,
        # from a supervisor callback that cannot await. What bounds the queue is the caller:
        # every call waits for its reply, except broadcasts, which are fire-and-forget by design.
        self.mailbox, self._inbox = trio.open_memory_channel[tuple[dict, Any, Reply]](math.inf)
        self.finished = trio.Event()

    async def run(self) -> None:
        queued = False  # sync calls handed to the thread and maybe not finished
        try:
            async for h, payload, reply in self._inbox:
                op = h["op"]
                fn = self._sync_endpoint(h) if op == "call" else None
                if fn is not None:
                    self.thread.submit(self._on_thread(h, reply, fn, payload))
                    queued = True
                    del payload
                    continue
                if queued:  # what follows runs after the calls already on the thread
                    await self.thread.run(lambda: None)
                    queued = False
                if op == "spawn":
                    await self._answer(h, reply, "__init__", self._construct, h, payload)
                elif op == "call":
                    await self._answer(h, reply, h.get("method", "?"), self._call, h, payload)
                elif op == "supervise":
                    await self._supervise(payload)
                elif op == "stop_actor":  # after every message it already had
                    await self._answer(h, reply, "__cleanup__", self._cleanup)
                    self.runtime.actors.pop(self.name, None)
                    break
                del payload  # its buffer may take the next large message (message_buffers.py)
        finally:
            self.finished.set()

    def _sync_endpoint(self, h: dict) -> Callable[..., Any] | None:
        """The bound sync endpoint a call names; None if it is async or not an endpoint
        (the loop's path runs those, and says what is wrong)."""
        method = h.get("method", "")
        if self.instance is None or not is_endpoint(getattr(type(self.instance), method, None)):
            return None
        fn = getattr(self.instance, method)
        return None if inspect.iscoroutinefunction(fn) else fn

    def _on_thread(self, h: dict, reply_to: Reply, fn: Callable[..., Any],
                   payload: p.Data) -> Callable[[], None]:
        """A sync endpoint's whole call, to run on the actor's thread: arguments, the call,
        and its answer (or, for a broadcast that raised, the failure report)."""
        cid, actor, method = h.get("call"), self.instance, h.get("method", "?")
        rt = self.runtime

        def call() -> None:
            nonlocal payload
            try:
                args, kwargs = wire.body(payload)
                payload = None  # type: ignore[assignment]  # its buffer may be reused
                with actor_scope(actor):
                    value = fn(*args, **kwargs)
                del args, kwargs
                answer = wire.encode({"op": "result", "call": cid}, value, has_body=True)
            except Exception as e:
                if cid is None:
                    rt.post_from_thread(wire.encode(self._failure(method, e)), rt.post)
                    return
                answer = error_message(cid, self.name, method, type(e).__qualname__, str(e),
                                       _user_traceback(e))
            if cid is not None:
                rt.post_from_thread(answer, reply_to)

        return call

    def _failure(self, method: str, e: Exception) -> dict:
        """The report of a broadcast that raised: no caller to tell, so it goes up."""
        return {"op": "failure", "actor": self.name, "description":
                f"{self.name}.{method} (broadcast) raised on rank {self.runtime.rank}: "
                f"{type(e).__qualname__}: {e}\n{_user_traceback(e)}"}

    async def _cleanup(self) -> None:
        """Run the actor's `__cleanup__`, if it has one (and was constructed)."""
        cleanup = getattr(self.instance, "__cleanup__", None)
        self.instance = None
        if cleanup is not None:
            await self._run(cleanup, (), {})

    async def _answer(self, h: dict, reply_to: Reply, method: str, fn: Any,
                      *args: Any) -> None:
        """Run fn and answer the caller through `reply_to` (the owner's connection, or the
        direct connection of the proc that called)."""
        cid = h.get("call")
        try:
            value = await fn(*args)
            reply = wire.encode({"op": "result", "call": cid}, value, has_body=True)
        except Exception as e:
            if cid is None:  # a broadcast has no caller to tell: the failure goes up instead
                await self.runtime.send(self._failure(method, e))
                return
            await reply_to(error_message(cid, self.name, method, type(e).__qualname__, str(e),
                                         _user_traceback(e)))
            return
        if cid is not None:
            await reply_to(reply)

    async def _construct(self, h: dict, payload: p.Data) -> None:
        cls = resolve_class(h["module"], h["qualname"], h.get("main"))
        args, kwargs = wire.body(payload)
        rt = self.runtime
        obj = object.__new__(cls) if cls.__new__ is object.__new__ else cls.__new__(
            cls, *args, **kwargs)
        for attr, value in (("rank", rt.rank), ("world_size", rt.world_size),
                            ("local_rank", rt.local_rank), ("host", rt.hosts[rt.host]),
                            ("name", self.name), ("_mesh_hosts", rt.host_mesh_for(self))):
            setattr(obj, attr, value)
        self.instance = obj  # context() names it while its __init__ runs
        try:
            await self._run(obj.__init__, args, kwargs)
        except BaseException:
            self.instance = None
            raise

    async def _call(self, h: dict, payload: p.Data) -> Any:
        method = h.get("method", "")
        if self.instance is None:
            raise MeshError(f"actor {self.name!r} was not constructed on this proc")
        if not is_endpoint(getattr(type(self.instance), method, None)):
            raise AttributeError(f"{type(self.instance).__qualname__}.{method} is not an "
                                 "@endpoint")
        args, kwargs = wire.body(payload)
        return await self._run(getattr(self.instance, method), args, kwargs)

    async def _supervise(self, failure: Failure) -> None:
        handler = getattr(self.instance, "__supervise__", None)
        note = ""
        handled = False
        if handler is not None:
            try:
                handled = bool(await self._run(handler, (failure,), {}))
            except Exception as e:
                note = f" (its __supervise__ raised {type(e).__qualname__}: {e})"
        if not handled:
            await self.runtime.send({"op": "failure", "actor": self.name,
                               "description": failure.describe() + note})

    async def _run(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """Await an async callable here; run a sync one on the actor's own thread, where it
        may block (and may use the synchronous mesh API)."""
        actor = self.instance
        if inspect.iscoroutinefunction(fn):
            async def on_asyncio() -> Any:
                with actor_scope(actor):
                    return await fn(*args, **kwargs)

            return await self.runtime.aio.run(on_asyncio)

        def in_scope() -> Any:
            with actor_scope(actor):
                return fn(*args, **kwargs)

        return await self.thread.run(in_scope)


