"""A real SLURM cluster on one machine, for tests: real `slurmctld` and `slurmd`, real MUNGE.

`with SlurmCluster(n_nodes=2) as c:` stands up, as root:

    munged:          a fresh key and socket of this cluster's own (the machine's munge service,
                     if any, is never used), in the host's namespaces: clients and daemons reach
                     it through its socket file, whatever their network namespace
    switch netns:    one bridge "br0" (netns.Switch, shared with the fan-out harness)
    ctl netns:       10.78.0.2, slurmctld, with hostname "ctl" (its own UTS namespace)
    node-I netns:    10.78.0.(10+I), slurmd -N nodeI, with hostname "nodeI"

So jobs see what they would see on a cluster: `srun hostname` prints node0, node1..., each step
runs in its node's network namespace, as the user who submitted it (slurmd is root and switches
user, checked by MUNGE credentials). Clients (srun, sbatch, squeue, scontrol, sinfo) run in the
controller's namespace through `run_client`, optionally as a non-root user made by
`ensure_user`. Entering returns once every node is idle.

Every file (slurm.conf and cgroup.conf side by side, state, spool, pid and log files, the munge
key and socket) lives in a fresh folder of the cluster's own, and every name (namespaces) starts
with a short unique id, so parallel clusters never clash. The fixed ports (6817, 6818) are free
by construction: each daemon listens inside a namespace that nothing else uses.

Teardown, also when the body or the start-up raised, stops by pid what this object started
(slurmd, slurmctld: SIGTERM, then SIGKILL), then kills whatever is still inside its namespaces
(slurmstepd, job steps, clients whose timeout fired), then munged, deletes the namespaces and
the users it created, and removes its folder. Every wait is bounded.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from users import UserError, create_user, delete_user

from netns import (
    NetnsError,
    Stood,
    Switch,
    report_leftovers,
    run_cmd,
    stop_pids,
    tail,
)

SUBNET = "10.78.0"
CTL_ADDR = f"{SUBNET}.2"
FIRST_NODE_HOST = 10  # node I is SUBNET.(10 + I)
CTL_HOST = "ctl"
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
CPUS_PER_NODE = 2
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
CLIENT_TIMEOUT = 120.0
TOOLS = ("ip", "unshare", "nsenter", "runuser", "useradd", "userdel", "munged", "munge",
         "unmunge", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")

# Debian 12's slurm 22.05 on a machine without systemd: no accounting, no cgroup confinement
# (proctrack/linuxproc tracks a step's processes by parentage), nodes return to service on
# registration. {placeholders} are filled per cluster.
SLURM_CONF = """\
ClusterName=mfstest
SlurmctldHost={ctl_host}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# slurmd loads a cgroup plugin even with proctrack/linuxproc, and its autodetection fails on a
# hybrid (v1 + v2) hierarchy: name v1 and do not let it mount anything.
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
"""


def unsupported_reason() -> str | None:
    """Why a SlurmCluster cannot run here, or None when it probably can."""
    if sys.platform != "linux":
        return "a SLURM cluster in namespaces needs Linux"
    if os.geteuid() != 0:
        return "a SLURM cluster in namespaces needs root (ip netns, slurmd, useradd)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"missing tools: {', '.join(missing)} (Debian: slurmctld slurmd slurm-client "
                "munge iproute2 util-linux passwd)")
    return None


class SlurmCluster(Stood):
    """A controller and `n_nodes` nodes, each a network namespace with a hostname of its own."""

    def __init__(self, n_nodes: int = 2, *, start_timeout: float = START_TIMEOUT,
                 stop_timeout: float = STOP_TIMEOUT):
        if not 1 <= n_nodes <= 200:
            raise ValueError("n_nodes must be between 1 and 200")
        self.n_nodes = n_nodes
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.id = f"slm{secrets.token_hex(3)}"
        self.hostnames = [f"node{i}" for i in range(n_nodes)]
        self.addresses = [f"{SUBNET}.{FIRST_NODE_HOST + i}" for i in range(n_nodes)]
        self.ctl_netns = f"{self.id}-ctl"
        self.node_netns = [f"{self.id}-n{i}" for i in range(n_nodes)]
        self.dir = Path()  # made on entry
        self._net = Switch(self.id)
        # what this cluster started, by name: munged, slurmctld, slurmd-node0...
        self._daemons: dict[str, subprocess.Popen] = {}
        self._users: list[str] = []  # the users ensure_user created (and teardown deletes)
        self._closed = False

    # ---- what tests use ---------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        """slurm.conf (cgroup.conf sits next to it): SLURM_CONF for a client."""
        return self.dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "socket"

    @property
    def namespaces(self) -> list[str]:
        """Every network namespace this cluster created (and will delete)."""
        return list(self._net.namespaces)

    @property
    def pids(self) -> list[int]:
        """The daemons this cluster started: munged, slurmctld, then one slurmd per node."""
        return [p.pid for p in self._daemons.values()]

    def namespace_pids(self) -> list[int]:
        """Every process inside this cluster's namespaces: its slurm daemons, slurmstepd, job
        steps, running clients."""
        return self._net.pids()

    def run_client(self, argv: list[str], user: str | None = None, *,
                   timeout: float = CLIENT_TIMEOUT, check: bool = False,
                   cwd: str | os.PathLike[str] | None = None,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client (srun, sbatch, squeue, scontrol...) in the controller's network
        namespace with this cluster's SLURM_CONF; as `user` (through runuser) when given. It
        starts in `cwd`: by default the user's home, or the cluster's folder for root (a job
        step starts in its client's folder). `env` replaces the test's environment (which
        sbatch and srun hand on to the job) when given."""
        env = {k: v for k, v in (os.environ if env is None else env).items()
               if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        prefix = ["ip", "netns", "exec", self.ctl_netns]
        if user is not None:
            # runuser keeps the environment but for HOME, SHELL, USER and LOGNAME; `env` makes
            # sure of the one variable that matters.
            prefix += [shutil.which("runuser") or "runuser", "-u", user, "--", "env",
                       f"SLURM_CONF={self.conf}"]
            home = pwd.getpwnam(user).pw_dir
            cwd = cwd or (home if os.path.isdir(home) else None)
        return self._exec([*prefix, *argv], timeout, check, env=env, cwd=cwd or self.dir)

    def node_exec(self, i: int, argv: list[str], *, timeout: float = CLIENT_TIMEOUT,
                  check: bool = False) -> subprocess.CompletedProcess:
        """Run `argv` on node `i`, as root: in its network and UTS namespaces (those of its
        slurmd), so it sees the node's address and hostname."""
        slurmd = self._daemons[f"slurmd-{self.hostnames[i]}"]
        return self._exec(["nsenter", "--target", str(slurmd.pid), "--net", "--uts", *argv],
                          timeout, check)

    def node_hide(self, i: int, path: str | os.PathLike[str]) -> None:
        """Cover the folder `path` with an empty tmpfs (1777) in node `i`'s mount namespace
        (its slurmd's, which every job step there inherits), so that node does not see what
        the host and the other nodes see there, as a node without a shared home. It goes with
        the namespace when the node's slurmd stops."""
        slurmd = self._daemons[f"slurmd-{self.hostnames[i]}"]
        self._exec(["nsenter", "--target", str(slurmd.pid), "--mount", "mount", "-t", "tmpfs",
                    "-o", "mode=1777,size=64m", f"{self.id}-hide", str(path)],
                   CLIENT_TIMEOUT, True)

    def monarch_pids(self) -> list[int]:
        """The monarch-fs processes (daemons, clients) running in the cluster's namespaces."""
        found = []
        for pid in self.namespace_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"monarch_fs" in cmdline or b"monarch-fs" in cmdline:
                found.append(pid)
        return found

    def node_mounts(self, i: int) -> list[str]:
        """The mount points node `i`'s mount namespace has (its slurmd's mountinfo)."""
        slurmd = self._daemons[f"slurmd-{self.hostnames[i]}"]
        with open(f"/proc/{slurmd.pid}/mountinfo") as f:
            return [line.split()[4] for line in f]

    def node_states(self) -> dict[str, str]:
        """{hostname: state} as `sinfo` reports it ("idle", "alloc", "down*"...)."""
        out = self.run_client(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
        if out.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout: float = START_TIMEOUT) -> dict[str, str]:
        """Wait until `sinfo` shows every node idle; the states. A daemon that exits, or the
        timeout, is an error that shows the states and the logs' last lines."""
        deadline = time.monotonic() + timeout
        want = dict.fromkeys(self.hostnames, "idle")
        while (states := self.node_states()) != want:
            dead = [f"{name} exited {p.returncode}" for name, p in self._daemons.items()
                    if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = ", ".join(dead) or f"not all idle after {timeout:g}s"
                raise NetnsError(f"SLURM cluster: {why}; sinfo says {states}\n{self.logs()}")
            time.sleep(0.2)
        return states

    def ensure_user(self, name: str) -> pwd.struct_passwd:
        """A local user `name`: created (no password, home in this cluster's folder, 0755) if
        missing, and then deleted at teardown; an existing user is used as it is and kept."""
        if self.dir == Path() or self._closed:
            raise NetnsError("ensure_user: the cluster is not running")
        try:
            entry, made = create_user(name, self.dir / "home" / name)
        except UserError as e:
            raise NetnsError(str(e)) from None
        if made:
            self._users.append(name)
        return entry

    def logs(self, lines: int = 10) -> str:
        """The last lines of every daemon's output (in the foreground, each also copies its log
        there), for an error message."""
        return "\n".join(f"--- {name}\n{tail(self.dir / 'log' / f'{name}.out', lines)}"
                         for name in self._daemons)

    # ---- life cycle -------------------------------------------------------------------------

    def why_unsupported(self) -> str | None:
        return unsupported_reason()

    def start(self) -> None:
        self._make_dir()
        self._start_munged()
        self._net.build()
        self._net.add_host(self.ctl_netns, "p-ctl", CTL_ADDR)
        for i, ns in enumerate(self.node_netns):
            self._net.add_host(ns, f"p-n{i}", self.addresses[i])
        self._start_in(self.ctl_netns, CTL_HOST, "slurmctld",
                       ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for ns, host in zip(self.node_netns, self.hostnames):
            self._start_in(ns, host, f"slurmd-{host}",
                           ["slurmd", "-D", "-f", str(self.conf), "-N", host])
        self.wait_idle(self.start_timeout)

    def close(self, raise_leftovers: bool = False) -> None:
        """Stop everything this cluster started and delete what it made; idempotent. With
        raise_leftovers, anything left is an error (else only printed on stderr, so it never
        hides the body's own exception)."""
        if self._closed:
            return
        self._closed = True
        # the slurmds first (no new job step starts), then the controller; then whatever is
        # left in our namespaces (slurmstepd, steps, clients); munged last, which all of them use
        names = {p.pid: name for name, p in self._daemons.items()}
        problems = []
        for group in ([n for n in self._daemons if n.startswith("slurmd-")], ["slurmctld"]):
            procs = {self._daemons[n].pid: self._daemons[n] for n in group if n in self._daemons}
            problems += [f"{names[pid]} (pid {pid}) survived SIGKILL"
                         for pid in stop_pids(procs, self.stop_timeout)]
        problems += self._net.kill_all(self.stop_timeout)
        if "munged" in self._daemons:
            munged = self._daemons["munged"]
            problems += [f"munged (pid {pid}) survived SIGKILL"
                         for pid in stop_pids({munged.pid: munged}, self.stop_timeout)]
        problems += self._net.close()
        problems += [p for p in map(delete_user, self._users) if p]
        self._users = []
        if self.dir != Path():
            shutil.rmtree(self.dir, ignore_errors=True)
        report_leftovers("SlurmCluster", problems, raise_leftovers)

    # ---- building ---------------------------------------------------------------------------

    def _make_dir(self) -> None:
        """The cluster's folder: readable by everyone (a client running as a test user reads
        slurm.conf), but the munge key and the controller's state stay root's."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        self.dir.chmod(0o755)
        for sub, mode in (("etc", 0o755), ("munge", 0o711), ("state", 0o700), ("spool", 0o755),
                          ("run", 0o755), ("log", 0o755), ("home", 0o755)):
            (self.dir / sub).mkdir(mode=mode)
            (self.dir / sub).chmod(mode)  # mkdir's mode is masked by the umask
        nodes = "\n".join(f"NodeName={h} NodeAddr={a} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                          for h, a in zip(self.hostnames, self.addresses))
        self.conf.write_text(SLURM_CONF.format(
            ctl_host=CTL_HOST, ctl_addr=CTL_ADDR, ctld_port=SLURMCTLD_PORT,
            slurmd_port=SLURMD_PORT, munge_socket=self.munge_socket, dir=self.dir, nodes=nodes))
        (self.conf.parent / "cgroup.conf").write_text(CGROUP_CONF)

    def _start_munged(self) -> None:
        """munged in the foreground (its pid is the one we started) with a fresh 128-byte key;
        ready once a credential it encodes decodes."""
        m = self.dir / "munge"
        fd = os.open(m / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(128))
        munged = self._spawn(
            "munged", ["munged", "--foreground", "--force", f"--key-file={m / 'munge.key'}",
             f"--socket={self.munge_socket}", f"--pid-file={m / 'munged.pid'}",
             f"--seed-file={m / 'munged.seed'}"])  # its log: stderr, in the foreground
        deadline = time.monotonic() + self.start_timeout
        while True:
            cred = run_cmd(["munge", "-S", str(self.munge_socket), "-n"], check=False)
            if cred.returncode == 0 and run_cmd(["unmunge", "-S", str(self.munge_socket)],
                                                check=False, input=cred.stdout).returncode == 0:
                return
            if munged.poll() is not None or time.monotonic() > deadline:
                raise NetnsError(f"munged did not start: {cred.stderr.decode().strip()}\n"
                                 f"{self.logs()}")
            time.sleep(0.05)

    def _start_in(self, ns: str, hostname: str, name: str, argv: list[str]) -> None:
        """`argv` in network namespace `ns` and a UTS namespace of its own named `hostname`.
        ip netns exec, unshare (no --fork) and sh all exec: the pid we get is the daemon's."""
        self._spawn(name, ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                           'hostname "$0" && exec "$@"', hostname, *argv])

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start a daemon in the foreground (so that its pid is the one we started), its output
        in log/NAME.out, and remember it for teardown."""
        with open(self.dir / "log" / f"{name}.out", "ab") as f:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons[name] = proc
        return proc

    @staticmethod
    def _exec(argv: list[str], timeout: float, check: bool, **kw) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, **kw)
        except subprocess.TimeoutExpired:
            raise NetnsError(f"{' '.join(argv)}: no answer after {timeout:g}s") from None
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
        return proc

