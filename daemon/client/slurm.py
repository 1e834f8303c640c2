"""SLURM allocations: `monarch-fs slurm up` starts one daemon per allocated node through `srun`
and returns once every node is mounted; `push`, `status` and `run` then default to the job's
hosts and token; the daemons stop and unmount when the job ends (SLURM sends SIGTERM to its
steps) or at `monarch-fs slurm down`.

Nothing assumes a filesystem shared between nodes. On the host that runs `up` (the batch host,
or the salloc shell's), in $MONARCH_FS_HOME/slurm/JOBID/ (0700):

    token        a fresh token for this job (0600); it reaches the daemons on srun's stdin
                 (`--input=all`), never through an environment or a shared file
    daemons.out  the daemons' stdout as srun forwards it: one line each, ready or failed
    daemons.log  their logs (stderr, 0600: a log names every process a daemon starts)
    step         JOBID.STEPID of the daemons' step, for `down` (scancel --signal=TERM)
    hosts        one ADDR:PORT per node in task order, written once every node is ready

On each node (node-local, removed when the daemon stops): the mount (`--mount`, default
/tmp/monarch-fs-{job}) and the state folder (`--state`, default MOUNT.state), which also holds
the token the node read. A daemon listens on the address its node uses to reach the host that
ran srun (SLURM_LAUNCH_NODE_IPADDR), on a port the kernel picks, so two jobs sharing a node
never clash, and node names need not resolve.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...fs.private_files import own_private_dir
from ..wire.auth import home_dir, write_new_token

READY = "monarch-fs-ready"
FAILED = "monarch-fs-failed"
UP_TIMEOUT = 120.0
DOWN_TIMEOUT = 60.0  # SLURM's KillWait is 30 s by default: a daemon is SIGKILLed after that
DEFAULT_MOUNT = "/tmp/monarch-fs-{job}"


class SlurmError(Exception):
    pass


def job_id() -> str | None:
    """The allocation this shell runs in (sbatch, salloc, srun), or None."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or None


def job_dir(job: str) -> Path:
    return home_dir() / "slurm" / job


def job_hosts_file() -> Path | None:
    """The hosts file of this allocation's daemons, when `slurm up` ran in it (here)."""
    job = job_id()
    if job is None:
        return None
    hosts = job_dir(job) / "hosts"
    return hosts if hosts.exists() else None


def expand(template: str, job: str, node: str) -> str:
    """{job} and {node} in a --mount or --state path (a node's folders are node-local; {node}
    tells them apart where nodes share a filesystem, as in the tests)."""
    try:
        return template.format(job=job, node=node)
    except (KeyError, IndexError, ValueError) as e:
        raise SlurmError(f"{template!r}: only {{job}} and {{node}} may appear in braces "
                         f"({e})") from None


# ---- on the host that runs `up` -------------------------------------------------------------


@dataclass
class Ready:
    rank: int
    node: str
    addr: str


@dataclass
class UpResult:
    job: str
    dir: Path
    step: str | None = None  # JOBID.STEPID, once a node has reported
    nodes: list[Ready] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hosts_file(self) -> Path:
        return self.dir / "hosts"


def this_command() -> list[str]:
    """The command that started this `monarch-fs`, for the nodes to run: the console script
    (or a wrapper that sets sys.argv[0] to itself) by its absolute path, so a user's own
    install, venv or wrapper starts the daemons too; else this interpreter with -m."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and os.sep not in argv0:
        argv0 = shutil.which(argv0) or ""
    if (argv0 and not argv0.endswith(".py") and os.path.isfile(argv0)
            and os.access(argv0, os.X_OK)):
        return [os.path.abspath(argv0)]
    return [sys.executable, "-m", "monarch_fs.cli"]


def srun_argv(n_nodes: int, node_args: list[str]) -> list[str]:
    """One task per allocated node, alongside whatever else the job runs (--overlap), with
    stdin (the token) sent to every task."""
    return ["srun", f"--nodes={n_nodes}", f"--ntasks={n_nodes}", "--ntasks-per-node=1",
            "--overlap", "--input=all", "--kill-on-bad-exit=0", "--job-name=monarch-fs",
            *this_command(), "slurm", "node", *node_args]


def _parse_line(line: str) -> tuple[str, list[str]] | None:
    """(kind, [rank, node, step, rest]) of a READY or FAILED line; None for anything else."""
    parts = line.split(None, 4)
    if len(parts) == 5 and parts[0] in (READY, FAILED) and parts[1].isdigit():
        return parts[0], parts[1:]
    return None


def _last_line(path: Path) -> str:
    try:
        lines = [s.strip() for s in path.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def up(node_args: list[str], *, timeout: float = UP_TIMEOUT,
       on_ready: Callable[[int, int, Ready], None] | None = None) -> UpResult:
    """Start the daemons of this allocation and wait until each reports ready; the hosts file
    is written only then. Any node that fails (or the timeout) stops them all again and is an
    error naming the node and cause."""
    job = job_id()
    if job is None:
        raise SlurmError("not inside a SLURM allocation ($SLURM_JOB_ID is not set): run it in "
                         "an sbatch script or an salloc shell")
    n = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
    if n < 1:
        raise SlurmError(f"job {job}: $SLURM_JOB_NUM_NODES is not set")
    d = job_dir(job)
    try:  # never another user's, in a shared MONARCH_FS_HOME: the job's token goes there
        own_private_dir(d)
    except PermissionError as e:
        raise SlurmError(str(e)) from None
    if (d / "step").exists() and (d / "hosts").exists():
        raise SlurmError(f"job {job}: the daemons are already up (hosts in {d / 'hosts'}); "
                         "`monarch-fs slurm down` stops them")
    for name in ("hosts", "step", "daemons.out"):
        (d / name).unlink(missing_ok=True)
    write_new_token(d / "token")
    start = time.monotonic()
    log_fd = os.open(d / "daemons.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(log_fd, 0o600)
    with open(d / "token", "rb") as token, open(d / "daemons.out", "wb") as out:
        # its own session: a Ctrl-C in the salloc shell does not reach it; the job's end does
        srun = subprocess.Popen(srun_argv(n, node_args), stdin=token, stdout=out,
                                stderr=log_fd, start_new_session=True)
    os.close(log_fd)
    result = UpResult(job, d)
    try:
        _wait_ready(srun, n, result, timeout, on_ready)
    except BaseException:
        _stop_step(job, result.step or _find_step(job), srun)
        raise
    result.nodes.sort(key=lambda r: r.rank)
    result.seconds = time.monotonic() - start
    (d / "step").write_text(f"{result.step}\n")
    tmp = d / "hosts.tmp"
    tmp.write_text("".join(f"{r.addr}\n" for r in result.nodes))
    os.replace(tmp, d / "hosts")
    return result


def _wait_ready(srun: subprocess.Popen, n: int, result: UpResult, timeout: float,
                on_ready: Callable[[int, int, Ready], None] | None) -> None:
    deadline = time.monotonic() + timeout
    out = result.dir / "daemons.out"
    seen: set[int] = set()
    while len(seen) < n:
        exited = srun.poll()
        for line in out.read_text(errors="replace").splitlines():
            parsed = _parse_line(line)
            if parsed is None:
                continue
            kind, (rank_s, node, step, rest) = parsed
            result.step = step
            if kind == FAILED:
                raise SlurmError(f"{node}: {rest} (log: {result.dir / 'daemons.log'})")
            rank = int(rank_s)
            if rank not in seen:
                seen.add(rank)
                ready = Ready(rank, node, rest.strip())
                result.nodes.append(ready)
                if on_ready:
                    on_ready(len(seen), n, ready)
        if len(seen) == n:
            return
        if exited is not None:
            cause = _last_line(result.dir / "daemons.log") or "no output"
            raise SlurmError(f"srun exited with status {exited} before every node was ready "
                             f"({len(seen)}/{n}): {cause} (log: {result.dir / 'daemons.log'})")
        if time.monotonic() > deadline:
            missing = n - len(seen)
            raise SlurmError(f"{missing} of {n} nodes not ready after {timeout:g}s "
                             f"(log: {result.dir / 'daemons.log'})")
        time.sleep(0.05)


def _stop_step(job: str, step: str | None, srun: subprocess.Popen | None) -> None:
    """SIGTERM the daemons' step, so every daemon unmounts (SIGTERM to srun itself would make
    it kill the step with SIGKILL, leaving the mounts behind); then wait for srun."""
    if step:
        subprocess.run(["scancel", "--signal=TERM", step], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif srun is not None:  # no step id yet: nothing was reported ready
        srun.terminate()
    if srun is not None:
        try:
            srun.wait(DOWN_TIMEOUT)
        except subprocess.TimeoutExpired:
            srun.kill()
            srun.wait()


def down(timeout: float = DOWN_TIMEOUT) -> str | None:
    """Stop this allocation's daemons (they unmount) and forget its hosts; the step stopped,
    or None when none was up. Returns once the step is gone from squeue, or after `timeout`."""
    job = job_id()
    if job is None:
        raise SlurmError("not inside a SLURM allocation ($SLURM_JOB_ID is not set)")
    d = job_dir(job)
    try:
        step = (d / "step").read_text().strip()
    except FileNotFoundError:
        return None
    _stop_step(job, step, None)
    deadline = time.monotonic() + timeout
    while _step_running(step):
        if time.monotonic() > deadline:
            raise SlurmError(f"step {step} still runs {timeout:g}s after SIGTERM")
        time.sleep(0.1)
    for name in ("hosts", "step", "token"):
        (d / name).unlink(missing_ok=True)
    return step


def _find_step(job: str) -> str | None:
    """The daemons' step, found by its name, before any daemon has said which it is."""
    out = subprocess.run(["squeue", "--noheader", "--steps", "--jobs", job, "--format=%i %j"],
                         capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        step, _, name = line.strip().partition(" ")
        if name.strip() == "monarch-fs":
            return step
    return None


def _step_running(step: str) -> bool:
    out = subprocess.run(["squeue", "--noheader", "--steps", step, "--format=%i"],
                         capture_output=True, text=True, check=False)
    return out.returncode == 0 and step in out.stdout.split()


# ---- on each node (the srun task) -----------------------------------------------------------


@dataclass
class NodeTask:
    """Who this srun task is: its rank in the step, node name, job and step."""

    rank: int
    node: str
    job: str
    step: str

    @classmethod
    def from_env(cls) -> NodeTask:
        env = os.environ
        job = job_id()
        if job is None or "SLURM_PROCID" not in env:
            raise SlurmError("`monarch-fs slurm node` runs as an srun task (`slurm up` starts "
                             "it)")
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        return cls(int(env["SLURM_PROCID"]), node, job, f"{job}.{env.get('SLURM_STEP_ID', '0')}")

    def ready_line(self, addr: str) -> str:
        return f"{READY} {self.rank} {self.node} {self.step} {addr}"

    def failed_line(self, cause: str) -> str:
        return f"{FAILED} {self.rank} {self.node} {self.step} {' '.join(cause.split())}"


def node_address() -> str:
    """The address this node uses to reach the host that ran srun: the one the other nodes
    and the client reach it at (node names need not resolve, and may resolve to loopback).
    A UDP connect only picks the route; it sends nothing."""
    launcher = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or os.environ.get(
        "SLURM_SRUN_COMM_HOST")
    candidates = []
    if launcher:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((launcher, 9))
                candidates.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for addr in candidates:
        if not addr.startswith("127.") and addr != "0.0.0.0":
            return addr
    raise SlurmError(f"cannot tell this node's address: no route to the launch host "
                     f"{launcher or '(SLURM_LAUNCH_NODE_IPADDR unset)'}, and the hostname "
                     f"{socket.gethostname()} resolves to {candidates or 'nothing'}")


def prepare_node(task: NodeTask, mount_t: str, state_t: str | None,
                 token: bytes) -> tuple[Path, Path, Path]:
    """The node's mount and state folders, and its token file (0600, inside the state). Each
    folder is made fresh (0700) or must already be this user's alone: under a shared /tmp,
    another user could make /tmp/monarch-fs-JOB.state first (job ids are predictable) and swap
    the token inside (SlurmError, naming owner and mode)."""
    if not token.strip():
        raise SlurmError("no token on stdin (run `monarch-fs slurm up`, which sends it)")
    mount = Path(expand(mount_t, task.job, task.node))
    state = Path(expand(state_t, task.job, task.node)) if state_t else Path(f"{mount}.state")
    for folder in (mount, state):  # made fresh, or already this user's alone (issue 33, 8)
        try:
            own_private_dir(folder)
        except PermissionError as e:
            raise SlurmError(str(e)) from None
    token_file = state / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token.strip() + b"\n")
    return mount, state, token_file


def remove_node_dirs(mount: Path, state: Path) -> None:
    """The job is over: its store goes with it (a mount still there is left alone)."""

    if not os.path.ismount(mount):
        try:
            mount.rmdir()
        except OSError:
            pass
    shutil.rmtree(state, ignore_errors=True)
