"""The `read_chunks` request and its reply: chunks of a version a node serves, in their stored
form, for `monarch-fs repro` to write that version on the dev box when neither the dev box
store nor the source folder has them (daemon/client/repro.py)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .replies import MalformedReply
from .requests import RequestError, check_workspace_name, from_hex

MAX_IDS = 1024  # chunk ids one request asks for
MAX_REPLY_BYTES = 32 << 20  # of blobs one reply carries; the client asks again for the rest


@dataclass(frozen=True)
class ReadChunks:
    """Chunks `ids` of version `version` of workspace `workspace`."""

    op: ClassVar[str] = "read_chunks"
    after_chunks: ClassVar[bool] = False
    workspace: str
    version: bytes
    ids: list[bytes]

    @classmethod
    def parse(cls, args: dict) -> ReadChunks:
        workspace, ids = args.get("workspace"), args.get("ids")
        if not isinstance(workspace, str):
            raise RequestError("read_chunks: workspace must be a name")
        check_workspace_name(workspace)
        version = from_hex(args.get("version"))
        if version is None or len(version) != 16:
            raise RequestError("read_chunks: version must be 16 bytes of hex")
        if not isinstance(ids, list) or len(ids) > MAX_IDS:
            raise RequestError(f"read_chunks: ids must be a list of at most {MAX_IDS}")
        parsed = [from_hex(i) for i in ids]
        if not all(p is not None and len(p) == 16 for p in parsed):
            raise RequestError("read_chunks: every id must be 16 bytes of hex")
        return cls(workspace, version, [p for p in parsed if p is not None])

    def to_wire(self) -> dict[str, Any]:
        return {"workspace": self.workspace, "version": self.version.hex(),
                "ids": [i.hex() for i in self.ids]}


@dataclass(frozen=True)
class ChunksReply:
    """Per id asked, its blob (codec byte and payload), or None: not here, or past the
    reply's size (ask again)."""

    op: ClassVar[str] = "read_chunks"
    blobs: list[bytes | None]

    def to_wire(self) -> dict[str, Any]:
        return {"blobs": [None if b is None else base64.b64encode(b).decode()
                          for b in self.blobs]}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> ChunksReply:
        if not isinstance(value, Mapping):
            raise MalformedReply("malformed read_chunks reply: expected an object")
        blobs = value.get("blobs")
        if not isinstance(blobs, list) or not all(b is None or isinstance(b, str)
                                                  for b in blobs):
            raise MalformedReply("malformed read_chunks reply: 'blobs' must be a list of "
                                 "strings or nulls")
        try:
            return cls([None if b is None else base64.b64decode(b, validate=True)
                        for b in blobs])
        except ValueError:
            raise MalformedReply("malformed read_chunks reply: a blob is not base64") from None
