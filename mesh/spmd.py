"""SPMD launch (`monarch-fs run`): one command on every proc, supervised, restarted as a group.

Every proc gets the environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR = the first host's address, MASTER_PORT = a port free on it right now,
TORCHELASTIC_RESTART_COUNT), so `torch.distributed.init_process_group()` works unchanged. Each
output line comes back prefixed with its rank; identical lines of many ranks are folded into one
(`[ranks 0-63] epoch 3 done`, daemon/client/fold.py) unless `--no-fold`. Every rank also gets
MONARCH_FS_JOB, the job's id, under which each node keeps its output (`monarch-fs logs JOB`) and
what it started (`monarch-fs repro JOB --rank R`).

When a rank fails (non-zero exit, a signal, or its host becomes unreachable) the first failure is
reported (rank, host, cause, the tail of its stderr), the other ranks are stopped (SIGTERM, then
SIGKILL after a grace period; a host whose daemon does not answer within a few seconds is named
with what may still run there, and not waited for: rank_stop.py) and, while restarts remain, the
whole group starts again with a fresh MASTER_PORT. A rank that exits 0 early is not a failure:
the job is done when all have.

Exit status: 0 when every rank exited 0; otherwise that of the first failing rank of the last
attempt: its exit code, or 128 + the signal number if a signal killed it (as a shell reports
it); 1 if the job could not be launched at all (unreachable host, unknown workspace, bad
command) or a host was lost.

Transport (`--transport auto|tcp|rdma`): chosen exactly as `push` chooses it, per host, with
daemon/wire/bulk.py's `choose_for_peer()` between this controller and each host's daemon (what the
daemon advertised in its Welcome). `rdma` where the controller or a host has no usable device
fails before anything is launched, naming the host; `auto` falls back to TCP with one line saying
why (`bulk.fallback_line()`); `tcp` never probes. What the choice carries, plainly: `run` moves no
bulk payloads at all. The controller only exchanges control messages with the daemons (spawn,
kill, output lines, exit reports), and those always stay on the TCP channel; the ranks exchange
their own data (torch.distributed, NCCL, gloo), which monarch-fs neither sees nor routes. So the
choice is made visible instead: every rank gets MONARCH_FS_TRANSPORT (tcp, rdma-rc or rdma-srd:
what monarch-fs found between the controller and that rank's host), and the run's summary line
names it. (The actor mesh, mesh/proc_mesh.py, sends tensors as out-of-band pickle buffers, but
inside DATA frames on its TCP connections, not through a bulk channel; it has no --transport.)
"""

from __future__ import annotations

import signal as signals
import sys
from dataclasses import dataclass, field
from typing import TextIO

import trio

from ..daemon.client.fold import WINDOW, FoldedOutput
from ..daemon.wire import bulk
from ..daemon.wire.jobs import JOB_ENV, new_job_name
from . import hang
from .errors import MeshError, SpawnError
from .hosts import Daemons, HostInfo, open_daemons, workspace_version
from .rank_stop import Started, stop_ranks

EXIT_STATUS_LOST = 1
# Seconds a daemon has to answer each request of a launch: a free port, the workspace's version,
# a rank's start (an exec, a MUNGE credential). One that answers nothing must not hold run up.
LAUNCH_TIMEOUT = 30.0


@dataclass
class RankFailure:
    rank: int
    host: HostInfo
    code: int | None = None
    signal: str | None = None
    reason: str = ""  # when there is no exit status: the host was lost
    stderr_tail: list[str] = field(default_factory=list)

    def cause(self) -> str:
        if self.signal:
            return f"killed by {self.signal}"
        if self.code is not None:
            return f"exit code {self.code}"
        return self.reason

    def exit_status(self) -> int:
        if self.signal:
            try:
                return 128 + signals.Signals[self.signal].value
            except KeyError:
                return EXIT_STATUS_LOST
        return self.code if self.code else EXIT_STATUS_LOST


@dataclass
class Job:
    """What `monarch-fs run` launches: one command, per_host ranks per host, restarts allowed."""

    argv: list[str]
    per_host: int
    cwd: str | None = None
    workspace: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    transport: str = "auto"  # --transport: auto, tcp or rdma
    hang_timeout: float | None = None  # --hang-timeout: seconds of silence that are a hang
    on_hang: str = "kill"  # --on-hang: kill or wait (hang.py)
    id: str = field(default_factory=new_job_name)  # every rank's MONARCH_FS_JOB
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    fold: bool = True  # --no-fold: every rank's every line
    # The stops of ranks under way (each shielded, bounded): a Ctrl-C ends them at once
    # (run_until_interrupted).
    stops: set[trio.CancelScope] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.output = FoldedOutput(self.out, self.err, fold=self.fold)

    def say(self, text: str) -> None:
        self.output.flush()  # what the ranks printed before this comes first
        print(f"monarch-fs run: {text}", file=self.err, flush=True)


class _Attempt:
    """One launch of every rank, until all exit 0 or the first one fails."""

    def __init__(self, job: Job, daemons: Daemons, transports: list[str]) -> None:
        self.job = job
        self.daemons = daemons
        self.transports = transports  # per host: tcp, rdma-rc or rdma-srd
        self.world = job.per_host * len(daemons.hosts)
        job.output.fold = job.fold and self.world > 1  # one rank: nothing to wait for
        self.procs: dict[int, Started] = {}  # rank -> its host, daemon's proc id and pid
        self.exited: set[int] = set()
        self.failure: RankFailure | None = None
        self.stopping = False
        self.silent: list[str] = []  # a line per host that did not answer the stop
        self.spawn_errors: list[MeshError] = []
        self.changed = trio.Event()
        self.hang = None if job.hang_timeout is None else hang.HangWatch(
            job.id, job.hang_timeout, job.on_hang, daemons, job.err, self._hung)

    def _hung(self, rank: int | None, why: str) -> None:
        if self.failure is None and not self.stopping:
            host = self.daemons.hosts[self._host(rank or 0)]
            self.failure = RankFailure(rank or 0, host, reason=why)
            self.changed.set()

    def _host(self, rank: int) -> int:
        return rank // self.job.per_host

    def on_event(self, rank: int, kind: str, data: dict) -> None:
        if kind == "output":
            if self.hang is not None:
                self.hang.heard()
            self.job.output.lines(rank, str(data.get("stream")), data.get("lines", []))
            return
        if kind not in ("exit", "lost"):
            return
        self.exited.add(rank)
        failed = kind == "lost" or data.get("code") != 0 or data.get("signal")
        if failed and self.failure is None and not self.stopping:
            self.failure = RankFailure(
                rank, self.daemons.hosts[self._host(rank)], data.get("code"), data.get("signal"),
                data.get("reason", ""), list(data.get("stderr_tail") or []))
        self.changed.set()

    async def _wait(self, done) -> None:
        while not done():
            self.changed = trio.Event()
            with trio.move_on_after(WINDOW / 2):
                await self.changed.wait()
            self.job.output.due()  # folded lines whose window passed

    async def run(self, restart: int) -> RankFailure | None:
        job, daemons = self.job, self.daemons
        master = daemons.hosts[0].host
        with trio.move_on_after(LAUNCH_TIMEOUT) as late:
            port = (await daemons.request(0, "free_port"))["port"]
            version = await workspace_version(daemons, job.workspace) if job.workspace else None
        if late.cancelled_caught:
            raise MeshError(f"{daemons.hosts[0]}: did not answer within {LAUNCH_TIMEOUT:g} s "
                            "(its daemon is stopped or stuck)")
        try:
            async with trio.open_nursery() as nursery:
                for rank in range(self.world):
                    env = {
                        "PYTHONUNBUFFERED": "1", **job.env,
                        "RANK": str(rank), "WORLD_SIZE": str(self.world),
                        "LOCAL_RANK": str(rank % job.per_host),
                        "LOCAL_WORLD_SIZE": str(job.per_host),
                        "GROUP_RANK": str(self._host(rank)), "MASTER_ADDR": master,
                        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(restart),
                        "MONARCH_FS_TRANSPORT": self.transports[self._host(rank)],
                        JOB_ENV: job.id,
                    }
                    spec: dict = {"argv": job.argv, "env": env}
                    if job.cwd or job.workspace:
                        spec["cwd"] = job.cwd or "{workspace}"
                    if job.workspace:
                        spec.update(workspace=job.workspace, version=version)
                    nursery.start_soon(self._spawn, rank, spec)
            if self.spawn_errors:
                raise self.spawn_errors[0]
            async with hang.watching(self.hang):
                await self._wait(lambda: self.failure is not None
                                 or len(self.exited) == self.world)
            if self.failure is not None:
                self._report(restart)
        finally:
            with trio.CancelScope(shield=True) as stopping:
                job.stops.add(stopping)
                try:
                    await self.stop()
                finally:
                    job.stops.discard(stopping)
        return self.failure

    def _report(self, restart: int) -> None:
        f, job = self.failure, self.job
        assert f is not None
        job.say(f"rank {f.rank} on {f.host} failed: {f.cause()} "
                f"(attempt {restart + 1} of {job.max_restarts + 1})")
        if f.stderr_tail:
            job.err.write("  its stderr ended with:\n" + "".join(
                f"    {line}\n" for line in f.stderr_tail))
        job.err.write(f"  all its output: monarch-fs logs {job.id} --rank {f.rank}; run it "
                      f"here: monarch-fs repro {job.id} --rank {f.rank}\n")
        job.err.flush()

    async def _spawn(self, rank: int, spec: dict) -> None:
        host = self._host(rank)
        try:
            # Shielded: once asked, we must learn the proc id so that stop() can kill it; but
            # bounded: a daemon that answers nothing must not hold the run up (what it may
            # start meanwhile, it kills when this run's connection goes).
            with trio.CancelScope(shield=True,
                                  deadline=trio.current_time() + LAUNCH_TIMEOUT) as scope:
                reply = await self.daemons.spawn(
                    host, spec, lambda kind, data: self.on_event(rank, kind, data))
        except MeshError as e:
            self.spawn_errors.append(e)
            return
        if scope.cancelled_caught:
            self.spawn_errors.append(SpawnError(
                f"{self.daemons.hosts[host]}: did not answer the start of rank {rank} within "
                f"{LAUNCH_TIMEOUT:g} s (its daemon is stopped or stuck)"))
            return
        self.procs[rank] = Started(host, reply["proc"], reply.get("pid"))

    async def stop(self) -> None:
        """Stop the ranks still running (rank_stop.py: bounded, whatever the daemons do)."""
        self.stopping = True
        running = {r: s for r, s in self.procs.items() if r not in self.exited}
        if not running:
            return
        if self.failure is not None:
            other = "the other " if self.failure.rank not in running else ""
            self.job.say(f"stopping {other}{len(running)} ranks")
        self.silent = await stop_ranks(self.daemons, running, self.exited, self._wait)
        for line in self.silent:
            self.job.say(line)


async def run_until_interrupted(addrs: list[str], token: bytes, job: Job,
                                local: bulk.LocalTransport | None = None) -> int:
    """run_job for the CLI, where Ctrl-C is a cancellation, not a KeyboardInterrupt raised
    wherever the code happens to be (trio raises it at any bytecode of code it does not
    protect: raised as a nursery opened, it corrupted trio's own state, once in tens of runs of
    tests/test_run_stop.py). A Ctrl-C cancels the job, whose ranks are then stopped as after a
    failure (bounded: rank_stop.py), and ends a stop under way; KeyboardInterrupt once the job
    is over (the CLI says "interrupted", 130)."""
    interrupted = False
    with trio.open_signal_receiver(signals.SIGINT) as ctrl_c:
        async with trio.open_nursery() as nursery:

            async def listen() -> None:
                nonlocal interrupted
                async for _ in ctrl_c:
                    interrupted = True
                    nursery.cancel_scope.cancel()
                    for stop in list(job.stops):
                        stop.cancel()

            nursery.start_soon(listen)
            code = await run_job(addrs, token, job, local)
            nursery.cancel_scope.cancel()  # done: stop listening
    if interrupted:
        raise KeyboardInterrupt
    return code


def choose_transports(daemons: Daemons, job: Job, local: bulk.LocalTransport) -> list[str]:
    """The bulk transport kind per host, by bulk.choose_for_peer() (the one decision push uses)
    from what each daemon advertised. `rdma` that some host cannot do raises
    TransportUnavailable naming every such host; under `auto` the one fallback line is said."""
    choices: dict[str, tuple[str, str]] = {}
    refused: list[str] = []
    for info, link in zip(daemons.hosts, daemons.links):
        try:
            choices[str(info)] = bulk.choose_for_peer(local, job.transport, link.chan.info)
        except bulk.TransportUnavailable as e:
            refused.append(f"{info}: {str(e).removeprefix('--transport rdma: ')}")
    if refused:
        raise bulk.TransportUnavailable("--transport rdma: " + "; ".join(refused))
    line = bulk.fallback_line(choices, job.transport)
    if line is not None:
        job.say(line[1])
    return [choices[str(info)][0] for info in daemons.hosts]


async def run_job(addrs: list[str], token: bytes, job: Job,
                  local: bulk.LocalTransport | None = None) -> int:
    """Run the job until it succeeds or its restarts are used up; the exit status.

    `local` is this controller's bulk.resolve_local(job.transport) (resolved here if not
    given; the CLI resolves it first, so `--transport rdma` without a local device fails
    before connecting). bulk.TransportUnavailable propagates, raised before any rank starts."""
    if local is None:
        local = bulk.resolve_local(job.transport)
    try:
        async with open_daemons(addrs, token) as daemons:
            kinds = choose_transports(daemons, job, local)
            summary = "transport " + ",".join(sorted(set(kinds)))
            world = job.per_host * len(daemons.hosts)
            restart = 0
            while True:
                attempt = _Attempt(job, daemons, kinds)
                failure = await attempt.run(restart)
                if failure is None:
                    job.say(f"all {world} ranks exited 0" +
                            (f" (after {restart} restarts)" if restart else "") +
                            f"; {summary}")
                    return 0
                if restart >= job.max_restarts:
                    break
                if attempt.silent:  # its ranks there may still run: not a group to restart
                    job.say("not restarting: a host did not answer the stop")
                    break
                job.say(f"restarting all {world} ranks ({job.max_restarts - restart} restarts "
                        "left)")
                restart += 1
            job.say(f"giving up: exit status {failure.exit_status()}; {summary}")
            return failure.exit_status()
    except MeshError as e:
        job.say(f"error: {e}")
        return EXIT_STATUS_LOST
    except BaseExceptionGroup as group:  # Ctrl-C while in a nursery (the starts, the stop)
        if group.split(KeyboardInterrupt)[1] is None:
            raise KeyboardInterrupt from None  # as itself: the CLI says "interrupted", 130
        raise
