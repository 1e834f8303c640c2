"""The daemon's process table on its own (daemon/procs.py): output, exits, and no orphans."""

from __future__ import annotations

import os
import signal
import sys

import trio
import trio._core._thread_cache as thread_cache

from monarch_fs.daemon.procs import ProcessTable
from procwatch import Started


class Owner:
    """Collects what a process table reports to the controller that owns the procs."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.exited = trio.Event()

    async def emit(self, kind: str, data: dict) -> None:
        self.events.append((kind, data))
        if kind == "exit":
            self.exited.set()

    def lines(self, stream: str) -> list[str]:
        return [line for kind, d in self.events if kind == "output" and d["stream"] == stream
                for line in d["lines"]]


async def test_output_then_exit_with_stderr_tail(tmp_path):
    owner = Owner()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery)
        code = "import sys; print('out 1'); print('err 1', file=sys.stderr); print('no newline', end=''); sys.exit(4)"
        await table.spawn(owner, owner.emit, {"argv": [sys.executable, "-c", code],
                                              "env": {"WHERE": "{mount}"}}, None)
        with trio.fail_after(10):
            await owner.exited.wait()
        await table.stop_all()
    assert owner.lines("stdout") == ["out 1", "no newline"]
    assert owner.events[-1] == ("exit", {"proc": 1, "code": 4, "signal": None,
                                         "stderr_tail": ["err 1"]})


async def test_procs_outlive_idle_worker_threads(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG fires when the *thread* that forked exits. Forking from a trio worker
    thread killed every proc once that thread retired (after 10 s idle; 0.1 s here)."""
    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.1)
    owner, started = Owner(), Started()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery)
        reply = await table.spawn(owner, owner.emit, {"argv": ["sleep", "30"]}, None)
        started.add(reply["pid"])
        await trio.to_thread.run_sync(lambda: None)  # a worker thread, which then idles out
        await trio.sleep(1.0)
        assert started.alive() == [reply["pid"]] and not owner.exited.is_set()
        await table.stop_all()
    assert owner.events[-1][1]["signal"] == "SIGTERM"
    assert not started.alive()


async def test_exit_is_reported_even_if_an_escaped_grandchild_holds_the_pipes(tmp_path):
    owner, started = Owner(), Started()
    script = "setsid sh -c 'echo $$; exec sleep 30' & sleep 0.2; exit 5"  # leaves its group
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery)
        reply = await table.spawn(owner, owner.emit, {"argv": ["sh", "-c", script]}, None)
        started.add(reply["pid"])
        with trio.fail_after(10):
            await owner.exited.wait()
        await table.stop_all()
    assert owner.events[-1][1]["code"] == 5
    grandchild = int(owner.lines("stdout")[0])
    os.kill(grandchild, signal.SIGKILL)  # it escaped the group: not ours to leave behind
    assert not started.wait_gone(5)
