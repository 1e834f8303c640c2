"""A tensor that other processes read directly, for weight sync (in the spirit of Monarch's
`RDMABuffer`): an endpoint returns a small handle, not the bytes, and each reader fetches the
bytes from the owner's proc itself, when it wants them, into a tensor of its own.

    class Trainer(Actor):
        @endpoint
        def weights(self):
            return TensorBuffer(self.flat)            # a handle: address, id, dtype, shape

    class Generator(Actor):
        @endpoint
        def sync(self, handle):
            handle.read_into(self.flat).get()         # straight from the trainer's proc

TCP now: the reader connects to the owner proc's listener for direct calls with the mesh's
peer token (the same HMAC handshake as every connection), and the bytes come back as one
message sent from the tensor's own memory (pieces over 256 MiB), copied once into `dst`. The
daemon's RDMA bulk channel would take this place where a device exists; there is none here.

A buffer lives in an actor's proc until `drop()` (or the proc's end); change the tensor in
place and the next read sees the new values. Create it inside an actor: a controller serves no
reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from typing import Any

import trio

from ..daemon.wire import protocol as p
from ..daemon.wire.transport import connect
from . import wire
from .asyncio_loop import in_asyncio
from .errors import MeshError
from .loop import _current_token, _in_loop
from .owner import MESH_MAX_FRAME

_buffers: dict[int, Any] = {}
_ids = itertools.count(1)
_home: dict[str, Any] = {}  # this proc's listener: addr, token, and its loop's trio token


def serve_here(addr: str, token: bytes, trio_token: trio.lowlevel.TrioToken) -> None:
    """The runtime says where this proc serves reads (once, at start)."""
    _home.update(addr=addr, token=token, trio_token=trio_token)


def read_reply(h: dict) -> p.Data:
    """The answer to a "buffer_read" (peer_service.py): the bytes, from the tensor's memory."""
    tensor = _buffers.get(h.get("id"))  # type: ignore[arg-type]
    if tensor is None:
        return wire.encode({"op": "error", "message": f"no buffer {h.get('id')} on this proc "
                                                      "(dropped, or its proc was replaced)"})
    return p.Data([wire.compact_json({"op": "buffer"}).encode(), wire._tensor_bytes(tensor)])


class TensorBuffer:
    """A handle to a CPU tensor of this actor's proc, that other processes read directly."""

    def __init__(self, tensor: Any) -> None:
        if not _home:
            raise MeshError("a TensorBuffer is created inside an actor: its proc serves the "
                            "reads (the controller serves none)")
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("a TensorBuffer holds a contiguous CPU tensor")
        self.id = next(_ids)
        _buffers[self.id] = t
        self.addr, self.token = _home["addr"], _home["token"]
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.nbytes = t.numel() * t.element_size()

    def drop(self) -> None:
        """Stop serving it (in the proc that created it)."""
        _buffers.pop(self.id, None)

    def __reduce__(self) -> tuple:
        return _handle, (self.addr, self.token, self.id, self.dtype, self.shape, self.nbytes)

    def read_into(self, dst: Any = None) -> Read:
        """Fetch the bytes into `dst` (a contiguous CPU tensor of as many bytes), or into a new
        tensor if None; `.get()` or `await` it for the tensor."""
        return Read(self, dst)

    def __repr__(self) -> str:
        return f"<TensorBuffer {self.id} {self.dtype} {list(self.shape)} at {self.addr}>"


def _handle(addr: str, token: bytes, bid: int, dtype: Any, shape: tuple,
            nbytes: int) -> TensorBuffer:
    handle = object.__new__(TensorBuffer)
    handle.addr, handle.token, handle.id = addr, token, bid
    handle.dtype, handle.shape, handle.nbytes = dtype, shape, nbytes
    return handle


async def _fetch(handle: TensorBuffer, dst: Any) -> Any:
    import torch

    chan = await connect(handle.addr, handle.token, encrypt="auto")
    chan.conn.max_frame = MESH_MAX_FRAME
    try:
        await wire.send(chan, wire.encode({"op": "buffer_read", "id": handle.id}))
        async for h, msg in wire.messages(chan):
            if h["op"] == "error":
                raise MeshError(f"reading {handle!r}: {h.get('message')}")
            if h["op"] == "buffer":
                src = torch.frombuffer(msg.parts[1], dtype=torch.uint8) if handle.nbytes else (
                    torch.empty(0, dtype=torch.uint8))
                if dst is None:
                    return src.view(handle.dtype).reshape(handle.shape)
                if not dst.is_contiguous() or dst.numel() * dst.element_size() != handle.nbytes:
                    raise ValueError(f"read_into needs a contiguous tensor of {handle.nbytes} "
                                     "bytes")
                dst.view(-1).view(torch.uint8).copy_(src)
                return dst
        raise MeshError(f"reading {handle!r}: its proc closed the connection")
    finally:
        await trio.aclose_forcefully(chan.stream)


class Read:
    """A read in progress: `get(timeout=)` from a sync endpoint or script with a mesh loop,
    `await` in an async endpoint."""

    def __init__(self, handle: TensorBuffer, dst: Any) -> None:
        self.handle, self.dst = handle, dst

    def _token(self) -> trio.lowlevel.TrioToken:
        token = _home.get("trio_token")
        if token is None:
            raise MeshError("TensorBuffer reads run in an actor's proc")
        return token

    def get(self, timeout: float | None = None) -> Any:
        token = self._token()
        if _current_token() is token:
            raise RuntimeError("read_into(...).get() blocks; in trio code use `await`")

        async def bounded() -> Any:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                return await _fetch(self.handle, self.dst)

        return _in_loop(trio.from_thread.run, token, bounded)

    def __await__(self) -> Generator[Any, None, Any]:
        return self._await().__await__()

    async def _await(self) -> Any:
        if _current_token() is not None:
            return await _fetch(self.handle, self.dst)
        if not in_asyncio():
            raise RuntimeError("await read_into(...) in an async endpoint, or use get()")
        import asyncio  # an asyncio task is running: it is imported

        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()

        def give(value: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if not answer.done():
                    answer.set_exception(error) if error else answer.set_result(value)
            loop.call_soon_threadsafe(settle)

        async def waiter() -> None:
            try:
                value = await _fetch(self.handle, self.dst)
            except Exception as e:
                give(None, e)
            else:
                give(value, None)

        self._token().run_sync_soon(trio.lowlevel.spawn_system_task, waiter)
        return await answer
