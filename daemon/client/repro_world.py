"""`monarch-fs repro [JOB] --world`: every rank of a job at once on the dev box, as the cluster
ran them (repro.py does one rank): one copy of the version, each rank's recorded command and
environment, MASTER_ADDR 127.0.0.1 and one free MASTER_PORT for all, so torch.distributed
forms the same world here. Output is folded as `run` folds it. As `run` does, the first rank
that fails stops the others (SIGTERM, then SIGKILL after STOP_GRACE), and its exit status is
the command's."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import trio

from .fold import WINDOW, FoldedOutput
from .repro import (
    Launch,
    ReproError,
    free_port,
    leave,
    materialize,
    outcome,
    prepare,
    scratch,
)

STOP_GRACE = 5.0


async def run_world(launches: Sequence[Launch], *, token: bytes, store_dir: Path,
                    source: str | None, keep: bool, fold: bool, out: TextIO, err: TextIO
                    ) -> int:
    """Run every rank of `launches` here; the exit status (see the module docstring)."""
    versions = {(ln.workspace, ln.record.get("version")) for ln in launches}
    if len(versions) > 1:
        raise ReproError("--world: the ranks ran different versions: " + ", ".join(
            f"{w} {(v or '-')[:12]}" for w, v in sorted(versions, key=str)))
    first = launches[0]
    here = scratch(first.job)
    try:
        await materialize(first, here, token=token, store_dir=store_dir, source=source,
                          err=err)
        port = free_port()
        ready = {ln.rank: prepare(ln, here, port) for ln in launches}
        argv, _, _, differs = ready[first.rank]
        hosts = sorted({ln.node for ln in launches})
        err.write(f"monarch-fs repro: all {len(launches)} ranks of job {first.job} here (they "
                  f"ran on {', '.join(hosts)}): {' '.join(argv)}\n"
                  + "".join(f"  differs: {d}\n" for d in differs[1:]))
        err.flush()
        printer = FoldedOutput(out, err, fold=fold)
        world = _World(printer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(world.tick)
            async with trio.open_nursery() as ranks:
                for ln in launches:
                    a, cwd, env, _ = ready[ln.rank]
                    ranks.start_soon(world.rank, ln.rank, a, cwd, env)
            nursery.cancel_scope.cancel()
        printer.flush()
        status = 0
        for ln in launches:
            code = world.codes.get(ln.rank)
            if code is None:
                continue
            _, line = outcome(ln, code)
            err.write(f"monarch-fs repro: rank {ln.rank}: {line}\n")
        if world.failed is not None:
            status, _ = outcome(next(ln for ln in launches if ln.rank == world.failed),
                                world.codes[world.failed])
            err.write(f"monarch-fs repro: rank {world.failed} failed first\n")
        return status
    finally:
        leave(here, keep, err)


class _World:
    """The ranks running here, their output, and who failed first."""

    def __init__(self, printer: FoldedOutput) -> None:
        self.printer = printer
        self.procs: dict[int, trio.Process] = {}
        self.codes: dict[int, int] = {}
        self.failed: int | None = None

    async def tick(self) -> None:
        while True:
            await trio.sleep(WINDOW / 2)
            self.printer.due()

    async def rank(self, rank: int, argv: list[str], cwd: str, env: dict[str, str]) -> None:
        try:
            proc = await trio.lowlevel.open_process(argv, cwd=cwd, env=env,
                                                    stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)
        except OSError as e:
            raise ReproError(f"cannot start {argv[0]} in {cwd}: {e.strerror or e}") from None
        self.procs[rank] = proc
        assert proc.stdout is not None and proc.stderr is not None
        async with trio.open_nursery() as pumps:
            pumps.start_soon(self._pump, rank, "stdout", proc.stdout)
            pumps.start_soon(self._pump, rank, "stderr", proc.stderr)
            code = await proc.wait()
        self.codes[rank] = code
        if code != 0 and self.failed is None:
            self.failed = rank
            await self._stop_others(rank)

    async def _pump(self, rank: int, stream: str, pipe: trio.abc.ReceiveStream) -> None:
        pending = b""
        while data := await pipe.receive_some(65536):
            *lines, pending = (pending + data).split(b"\n")
            self.printer.lines(rank, stream, [ln.decode("utf-8", "replace") for ln in lines])
        if pending:
            self.printer.lines(rank, stream, [pending.decode("utf-8", "replace")])

    async def _stop_others(self, failed: int) -> None:
        others = [p for r, p in self.procs.items() if r != failed and p.returncode is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in others:
                if p.returncode is None:
                    p.send_signal(sig)
            with trio.move_on_after(STOP_GRACE):
                for p in others:
                    await p.wait()
