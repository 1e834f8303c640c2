"""Helper processes that share a push's small files: several streams per link.

One Python process sends at one core at most, and a tree of small files costs it per file, not
per byte (an open, a read, a close, a frame: the torch venv's 42k files under 256 KiB are most
of its CPU). So a push that sends many of them to nodes hands a share to helper processes, each
on a connection of its own to each root, and sends the rest, the manifest and every large file
itself (a large file's chunks are written in place once the manifest is loaded: the push's own
session places them). A helper reads its files, checks each against its id, sends them raw,
asks every root to flush (they are stored before its answer), and says which it could not send.

A helper that fails costs nothing but time: the push sends what it did not (its whole share,
unless it said which), before its own flush, so no commit can find a chunk missing because a
helper died. Only for star plans over raw TCP links (no relay below a root, no codec on the
link, no RDMA channel), without --early or --bwlimit: the cases the push's own stream covers
alone otherwise.

Runs as `python -m monarch_fs.daemon.client.send_helpers`, its job pickled on its stdin
(the token travels there, never on a command line), its progress and result on its stdout.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import trio

from ... import collector
from ...fs.backing import MIN_SIZE
from ...fs.chunk import RAW, chunk_id
from ...fs.snapshot import Source, read_ahead
from ..wire import bulk
from ..wire.replies import FlushReply
from ..wire.transport import connect

HELP_FROM = 4096  # small chunks a push sends before a helper pays for its start (~0.2 CPU-s)
MOST = 3  # helpers of one push at most
AHEAD = 2  # batches handed to a helper and not yet sent: one it sends, one it reads next
_BATCH_BYTES = 1 << 20
_BATCH_CHUNKS = 256
_LENGTH = struct.Struct("<I")  # before each pickle on a helper's stdin

Item = tuple[bytes, bytes, int, int, int]  # (id, path, offset, length, mask of roots lacking it)


def how_many(asked: int | None) -> int:
    """Helpers a push may start: `asked` (push --helpers), else one per core beyond the
    first, up to MOST."""
    if asked is not None:
        return max(0, asked)
    return min(MOST, (os.cpu_count() or 1) - 1)


def small_files(order: list[bytes], sources: Mapping[bytes, Source]
                ) -> tuple[list[bytes], list[bytes]]:
    """(`order` but its whole small files, those small files in order) when there are
    HELP_FROM of them, else (`order`, []). A helper takes whole small files only (a chunk at
    offset 0 shorter than MIN_SIZE): a large file's chunks, even its tail, wait for their
    place in the push's own session."""
    small = []
    for cid in order:
        src = sources.get(cid)
        if src is not None and src.offset == 0 and src.length < MIN_SIZE:
            small.append(cid)
    if len(small) < HELP_FROM:
        return order, []
    taken = set(small)
    return [c for c in order if c not in taken], small


class Pool:
    """Small files the push and its helpers take in turns, a batch at a time, in order (a
    folder's files together): whoever is free takes the next, so a helper that the machine
    starves of CPU takes less, and the push more."""

    def __init__(self, ids: list[bytes], sources: Mapping[bytes, Source],
                 wants: dict[str, set[bytes]]) -> None:
        self.ids = iter(ids)  # the push's encoders take from it too (stream.py)
        self.sources = sources
        self.wants = list(wants.values())
        self.started = trio.Event()  # every helper has connected, or ended (run_all)

    def take(self) -> list[Item]:
        """The next batch for a helper ([] when none is left)."""
        batch: list[Item] = []
        size = 0
        for cid in self.ids:
            src = self.sources[cid]
            mask = sum(1 << n for n, wanted in enumerate(self.wants) if cid in wanted)
            batch.append((cid, src.path, src.offset, src.length, mask))
            size += src.length
            if size >= _BATCH_BYTES or len(batch) >= _BATCH_CHUNKS:
                break
        return batch


def _frame(value: object) -> bytes:
    data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


class HelperFailed(Exception):
    """A helper ended without sending its share (which the push sends itself); why."""

    def __init__(self, why: str, unsent: list[bytes]) -> None:
        super().__init__(why)
        self.unsent = unsent


async def run(pool: Pool, roots: list[str], token: bytes, encrypt: str, timeout: float,
              version: bytes, sent: Callable[[int, int], None],
              started: Callable[[], None]) -> list[bytes]:
    """Run one helper until the pool is empty and the roots have stored what it sent,
    `sent(bytes, chunks)` told as it goes, `started()` once it has connected; the ids it was
    handed and did not send (those it could not read as scanned). HelperFailed with all it
    was handed if it failed: its connections are gone, and what they carried is sent again,
    which a node takes as a chunk it has."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    handed: list[bytes] = []
    credit = trio.Semaphore(AHEAD)
    result: dict | None = None
    said = b""  # its last other line: why it failed (a traceback's last)

    async def feed() -> None:
        async with stdin:
            await stdin.send_all(_frame({"roots": roots, "token": token, "encrypt": encrypt,
                                         "timeout": timeout, "version": version.hex()}))
            while True:
                await credit.acquire()
                batch = pool.take()
                if not batch:
                    return  # its end of input: it flushes and says what it did not send
                handed.extend(item[0] for item in batch)
                await stdin.send_all(_frame(batch))

    async def read() -> None:
        nonlocal result, said
        pending = b""
        async for data in stdout:
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                kind, _, rest = line.partition(b" ")
                if kind == b"ready":
                    started()
                elif kind == b"sent":
                    size, chunks = map(int, rest.split())
                    credit.release()
                    sent(size, chunks)
                elif kind == b"done":
                    result = json.loads(rest)
                elif line.strip():
                    said = line.strip()
        nursery.cancel_scope.cancel()  # it ended: feed nothing more (it may wait for credit)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            try:
                await feed()
            except trio.BrokenResourceError:
                pass  # it died: its exit status says so below
        await proc.wait()
    finally:
        if proc.returncode is None:  # cancelled: it is ours to stop
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
    if proc.returncode != 0 or result is None:
        why = said.decode(errors="replace") or f"exit status {proc.returncode}"
        raise HelperFailed(why, handed)
    return [bytes.fromhex(c) for c in result["unsent"]]


async def run_all(n: int, pool: Pool, roots: list[str], token: bytes, encrypt: str,
                  timeout: float, version: bytes, sent: Callable[[int, int], None],
                  unsent: list[bytes]) -> list[str]:
    """`n` helpers `run` on `pool` until it is empty, what they did not send added to
    `unsent`; a warning for each that failed."""
    warnings: list[str] = []
    starting = n

    def started() -> None:
        nonlocal starting
        starting -= 1
        if starting == 0:
            pool.started.set()

    async def one() -> None:
        up = False

        def ready() -> None:
            nonlocal up
            up = True
            started()

        try:
            unsent.extend(await run(pool, roots, token, encrypt, timeout, version, sent, ready))
        except HelperFailed as e:
            unsent.extend(e.unsent)
            warnings.append(f"a send helper failed ({e}): the push sent its "
                            f"{len(e.unsent)} chunks itself")
        finally:
            if not up:
                started()

    if n == 0:
        pool.started.set()
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return warnings


# ---- the helper process --------------------------------------------------------------------


def _read(batch: Sequence[Item], unsent: list[bytes]
          ) -> list[tuple[bytes, bytearray, int]]:
    """Each chunk of `batch` read raw (its codec byte first) and checked against its id; one
    that does not read as scanned goes to `unsent` (the push sends it, and says why)."""
    fds = [read_ahead(path, offset, length) for _, path, offset, length, _ in batch]
    out = []
    for (cid, _, offset, length, mask), fd in zip(batch, fds):
        if fd is None:
            unsent.append(cid)
            continue
        buf = bytearray(1 + length)
        try:
            got = os.preadv(fd, [memoryview(buf)[1:]], offset)
        except OSError:
            got = -1
        finally:
            os.close(fd)
        buf[0] = RAW
        if got != length or chunk_id(memoryview(buf)[1:]) != cid:
            unsent.append(cid)
            continue
        out.append((cid, buf, mask))
    return out


async def _frames(stream: trio.lowlevel.FdStream) -> AsyncIterator[Any]:
    """The pickles on this helper's stdin, as they come."""
    pending = bytearray()
    while True:
        if len(pending) >= _LENGTH.size:
            end = _LENGTH.size + _LENGTH.unpack_from(pending)[0]
            if len(pending) >= end:
                yield pickle.loads(pending[_LENGTH.size:end])
                del pending[:end]
                continue
        data = await stream.receive_some()
        if not data:
            return
        pending += data


async def _send() -> list[bytes]:
    unsent: list[bytes] = []
    frames = _frames(trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())))
    job: dict = await anext(frames)
    timeout = job["timeout"]
    chans = [await connect(addr, job["token"], encrypt=job["encrypt"], timeout=timeout)
             for addr in job["roots"]]
    print("ready", flush=True)
    try:
        async for batch in frames:
            got = _read(batch, unsent)
            size = copies = 0
            for i, chan in enumerate(chans):
                mine = [(cid, memoryview(buf)) for cid, buf, mask in got if mask >> i & 1]
                if mine:
                    with trio.fail_after(timeout):
                        await chan.send_many(bulk.frames_for(mine))
                    size += sum(len(buf) - 1 for _, buf in mine)
                    copies += len(mine)
            print("sent", size, copies, flush=True)
        for chan in chans:
            with trio.fail_after(timeout):
                reply = await chan.request("flush", version=job["version"])
            failed = FlushReply.from_wire(reply).failed
            if failed:
                raise RuntimeError(f"{chan.peer}: {next(iter(failed.values()))}")
    finally:
        for chan in chans:
            await chan.aclose()
    return unsent


def main() -> None:
    collector.settle()
    unsent = trio.run(_send)
    print("done", json.dumps({"unsent": [c.hex() for c in unsent]}), flush=True)


if __name__ == "__main__":
    main()
