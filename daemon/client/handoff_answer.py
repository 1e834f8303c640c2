"""The watch's side of a hand-off (handoff.py): a `push --watch` takes the one-shot pushes that
are its own on a unix socket, wakes its wait for changes, and answers each once the next push
ends, with what the one-shot command would have printed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import trio

from . import handoff
from .push_result import PushResult

# judge(request): None if a handed-off push (handoff.py's request) is not this watch's, else
# how to answer it: report(the push's PushResult, or the exception it failed with) -> the reply
# (what the one-shot command would have printed, and its exit code).
Report = Callable[[PushResult | BaseException], dict]
Judge = Callable[[dict], Report | None]

class Asked:
    """A one-shot push handed to this watch, waiting for the next push to end."""

    def __init__(self, report: Report):
        self.report = report
        self.reply: dict | None = None
        self.done = trio.Event()

    def answer(self, outcome: PushResult | BaseException | None) -> None:
        if outcome is None:
            outcome = RuntimeError("the watch has not pushed yet")
        self.reply = self.report(outcome)
        self.done.set()


async def serve_handoffs(judge: Judge, waiting: list[Asked], wake: Path, *,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
    """Take one-shot pushes on a socket in handoff.sockets() until cancelled (then remove it).
    Each asks whether it is this watch's push (judge), wakes the watch (by writing `wake`,
    which its watcher sees), then waits for the next push to end."""
    path = handoff.own_sockets() / f"{os.getpid()}.sock"
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        sock.listen(16)
        listener = trio.SocketListener(sock)

        async def one(stream: trio.SocketStream) -> None:
            async with stream:
                if handoff.peer_uid(stream.socket) != os.geteuid():
                    return  # only this user's pushes are taken (and told anything)
                try:
                    with trio.fail_after(handoff.ASK_TIMEOUT):
                        line = await _read_line(stream)
                    report = judge(json.loads(line))
                except (ValueError, trio.TooSlowError, OSError, trio.BrokenResourceError):
                    return
                try:
                    await stream.send_all(json.dumps({"mine": report is not None}).encode()
                                          + b"\n")
                    if report is None:
                        return
                    asked = Asked(report)
                    waiting.append(asked)
                    try:
                        wake.write_bytes(b"")
                    except OSError:
                        pass  # seen at the wait's next look (watch.py's POLL_MS)
                    await asked.done.wait()
                    await stream.send_all(json.dumps(asked.reply).encode() + b"\n")
                except (OSError, trio.BrokenResourceError):
                    return  # the one-shot command went away (Ctrl-C): the push still ran

        task_status.started()
        await trio.serve_listeners(one, [listener])
    finally:
        sock.close()
        path.unlink(missing_ok=True)


async def _read_line(stream: trio.SocketStream, limit: int = 1 << 20) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        data = await stream.receive_some(65536)
        if not data or len(buf) > limit:
            raise ValueError("no request line")
        buf += data
    return buf
