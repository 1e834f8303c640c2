"""The streaming requests and their reply, sent by a push whose scan streams new chunks to
the node as it hashes them (before the manifest: daemon/client/scan_stream.py):

- `stream_file`: a window of a new large file's chunk ids. The node opens a provisional file
  object for `file` on its first window (fs/provisional.py) and learns where each id goes;
- `stream_chunks`: the chunk ids of a batch of small files, which go to the node's packs as
  any small file's do.

Either way the node answers which of the ids it lacks: the push sends those, and only those."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .replies import MalformedReply
from .requests import RequestError, from_hex

MAX_IDS = 1024  # chunk ids one window declares


def _int(args: dict, key: str) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"stream_file: {key} must be a count, not {value!r}")
    return value


def _ids(values: object) -> list[bytes] | None:
    """`values` as chunk ids, or None unless it is a list of 16-byte hex ids."""
    if not isinstance(values, list):
        return None
    ids = []
    for value in values:
        cid = from_hex(value)
        if cid is None or len(cid) != 16:
            return None
        ids.append(cid)
    return ids


def _asked(op: str, args: dict) -> list[bytes]:
    """A request's `ids`: 1 to MAX_IDS chunk ids, else RequestError."""
    ids = args.get("ids")
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_IDS:
        raise RequestError(f"{op}: ids must be a list of 1 to {MAX_IDS}")
    parsed = _ids(ids)
    if parsed is None:
        raise RequestError(f"{op}: every id must be 16 bytes of hex")
    return parsed


@dataclass(frozen=True)
class StreamFile:
    """Chunks `first`.. of the session's streamed file number `file` (of `size` bytes, in
    chunks of `chunk_size`) are `ids`."""

    op: ClassVar[str] = "stream_file"
    after_chunks: ClassVar[bool] = False
    file: int
    size: int
    chunk_size: int
    first: int
    ids: list[bytes]

    @classmethod
    def parse(cls, args: dict) -> StreamFile:
        return cls(_int(args, "file"), _int(args, "size"), _int(args, "chunk_size"),
                   _int(args, "first"), _asked(cls.op, args))

    def to_wire(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size, "chunk_size": self.chunk_size,
                "first": self.first, "ids": [i.hex() for i in self.ids]}


@dataclass(frozen=True)
class StreamChunks:
    """The chunks of a batch of small files the push is about to stream are `ids`."""

    op: ClassVar[str] = "stream_chunks"
    after_chunks: ClassVar[bool] = False
    ids: list[bytes]

    @classmethod
    def parse(cls, args: dict) -> StreamChunks:
        return cls(_asked(cls.op, args))

    def to_wire(self) -> dict[str, Any]:
        return {"ids": [i.hex() for i in self.ids]}


@dataclass(frozen=True)
class StreamFileReply:
    """The ids of the window (or batch) the node lacks, in its order."""

    op: ClassVar[str] = "stream_file"
    missing: list[bytes]

    def to_wire(self) -> dict[str, Any]:
        return {"missing": [i.hex() for i in self.missing]}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> StreamFileReply:
        parsed = _ids(value.get("missing")) if isinstance(value, Mapping) else None
        if parsed is None:
            raise MalformedReply("malformed stream_file reply: 'missing' must be a list of "
                                 "16-byte hex ids")
        return cls(parsed)
