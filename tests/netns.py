"""Real hosts on one machine: network namespaces joined by a bandwidth-limited switch.

A `NetCluster` stands up, as root, what a small cluster looks like from the network's side:

    switch namespace: one Linux bridge "br0"
    node-I namespace: eth0 10.77.0.(10+I)/24 --veth-- port nI on the bridge
    dev-box namespace: eth0 10.77.0.2/24      --veth-- port dev on the bridge

Every link is limited to `rate` in both directions (a `tbf` qdisc on the node-side veth, which
shapes what the host sends, and on the switch-side veth, which shapes what it receives), so a
node that relays to two children really has to push twice its payload through one uplink, and
the dev box's egress is what crossed its link, as counted by the kernel.

Each node runs a real `monarch-fs daemon` inside its network namespace *and* its own private
mount namespace (`ip netns exec NS unshare --mount --propagation private ...`), so every node
mounts at the same path (/mnt/monarch-fs) as on a real cluster, and the host sees none of those
mounts. Tests read the mount the way a process on that node would: `nsenter --target PID --mount
--net` into the daemon's namespaces.

All names (namespaces) start with a short unique id, so parallel runs never clash; interfaces are
created directly inside the namespaces, so nothing is ever added to the host's own network.
Teardown stops every daemon this object started, by pid (SIGTERM, then SIGKILL), checks that no
process is left in its namespaces (a node's mount namespace, and with it the mount, disappears
with its last process), then deletes the bridge, the veths and the namespaces: also when the body
raised. Every wait is bounded.

The pieces that are not about monarch-fs (`Switch`: namespaces joined by one bridge, built and
deleted; `run_cmd`, `alive`, `wait_gone`, `stop_pids`) also serve the SLURM harness,
tests/slurm.py.

This module is a helper, not a test file: `from netns import NetCluster` from tests (pytest puts
tests/ on sys.path), or insert tests/ into sys.path from a bench script.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from monarch_fs import cli

CLI_MODULE = cli.__name__  # what `monarch-fs` runs (bench/ imports this file as tests.netns)

SUBNET = "10.77.0"
DEVBOX_ADDR = f"{SUBNET}.2"
FIRST_NODE_HOST = 10  # node I is SUBNET.(10 + I)
MAX_NODES = 240
PORT = 7000
MOUNT = "/mnt/monarch-fs"
IFACE = "eth0"  # the host-side end of a link, inside a node or the dev box
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
CMD_TIMEOUT = 30.0  # one ip/tc/cat command


class NetnsUnsupported(RuntimeError):
    """This machine (or user) cannot build namespaces; the message says why. Tests skip on it."""


class NetnsError(RuntimeError):
    """Something went wrong while building, using or tearing down a NetCluster."""


def unsupported_reason() -> str | None:
    """Why a NetCluster cannot run here, or None when it probably can (the real proof is
    building one: `ip netns add` may still be refused, e.g. inside an unprivileged container)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, tc, mounts in other namespaces)"
    missing = [t for t in ("ip", "tc", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (Debian: iproute2, util-linux)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    return None


def rate_bytes_per_second(rate: str) -> float:
    """'400mbit' -> 5e7. tc's units: bit/kbit/mbit/gbit are bits, bps/kbps/mbps/gbps bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"bad rate {rate!r}: expected e.g. 200mbit, 1gbit or 50mbps")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return value / 8 if m.group(3) == "bit" else value


def run_cmd(argv: list[str], timeout: float = CMD_TIMEOUT, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
    """Run one setup command; a failure names the command and what it printed."""
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)}: no answer after {timeout:g}s") from None
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip() if isinstance(proc.stderr, bytes) \
            else (proc.stderr or "").strip()
        raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}: {err}")
    return proc


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float, reap: dict[int, subprocess.Popen]) -> list[int]:
    """Wait up to `timeout` for `pids` to exit (reaping our children); the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in pids:
            if pid in reap:
                reap[pid].poll()
        left = [pid for pid in pids if alive(pid)]
        for pid in set(pids) - set(left):
            if pid in reap:  # exited since the poll above: a zombie until reaped
                reap[pid].wait()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def stop_pids(procs: dict[int, subprocess.Popen], timeout: float) -> list[int]:
    """SIGTERM each of `procs` (processes we started, by pid) while alive, SIGKILL whatever is
    left after `timeout`; the pids that survived even that."""
    for pid in procs:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
    left = wait_gone(list(procs), timeout, procs)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return wait_gone(left, timeout, procs)


class Switch:
    """Network namespaces joined by one Linux bridge: a switch namespace `{prefix}-sw` with
    "br0", and hosts added with `add_host` (eth0 inside the host, a veth port on the bridge).
    It records what it created, in creation order, so that `close` removes exactly that, in
    reverse. Interfaces are created inside the namespaces: nothing touches the host's network."""

    def __init__(self, prefix: str):
        self.name = f"{prefix}-sw"
        self.namespaces: list[str] = []
        self.links: list[tuple[str, str]] = []  # (namespace, interface)

    def build(self) -> None:
        self._add_netns(self.name)
        run_cmd(["ip", "-n", self.name, "link", "add", "br0", "type", "bridge"])
        self.links.append((self.name, "br0"))
        run_cmd(["ip", "-n", self.name, "link", "set", "br0", "up"])

    def _add_netns(self, name: str) -> None:
        try:
            run_cmd(["ip", "netns", "add", name])
        except NetnsError as e:
            if not self.namespaces:  # the very first one: the machine refuses
                raise NetnsUnsupported(f"cannot create a network namespace: {e}") from None
            raise
        self.namespaces.append(name)
        run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])

    def add_host(self, ns: str, port: str, addr: str) -> None:
        """A namespace `ns` linked to the bridge: eth0 with `addr`/24 inside it, `port` on the
        switch."""
        self._add_netns(ns)
        run_cmd(["ip", "-n", self.name, "link", "add", port, "type", "veth", "peer", "name",
                 IFACE, "netns", ns])
        self.links.append((self.name, port))
        run_cmd(["ip", "-n", self.name, "link", "set", port, "master", "br0", "up"])
        run_cmd(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE])
        run_cmd(["ip", "-n", ns, "link", "set", IFACE, "up"])

    def pids(self) -> list[int]:
        """Every process inside one of our namespaces."""
        pids: list[int] = []
        for ns in self.namespaces:
            out = run_cmd(["ip", "netns", "pids", ns], check=False)
            pids += [int(p) for p in out.stdout.split()]
        return pids

    def kill_all(self, timeout: float) -> list[str]:
        """Anything still inside our namespaces (e.g. a reader whose timeout fired and left a
        child) was started by our owner: these namespaces have names nobody else knows. SIGKILL
        it, so that the namespaces, and whatever hangs on their processes, really go away.
        Looks again after each round, since a process may have forked before it was killed."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            if time.monotonic() > deadline:
                return [f"process {pid} in our namespaces survived SIGKILL" for pid in pids]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            wait_gone(pids, max(0.0, deadline - time.monotonic()), {})
        return []

    def close(self) -> list[str]:
        """Delete links, then namespaces, in reverse creation order; report what could not be
        deleted rather than stopping at the first failure. Idempotent."""
        problems: list[str] = []
        if not self.namespaces:
            return problems
        for ns, dev in reversed(self.links):
            run_cmd(["ip", "-n", ns, "link", "del", dev], check=False)
        for ns in reversed(self.namespaces):
            try:
                run_cmd(["ip", "netns", "del", ns])
            except NetnsError as e:
                problems.append(str(e))
        existing = set(run_cmd(["ip", "netns", "list"], check=False).stdout.decode().split())
        problems += [f"namespace {ns}" for ns in self.namespaces if ns in existing]
        self.namespaces, self.links = [], []
        return problems


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log, for an error message ("" if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def report_leftovers(what: str, problems: list[str], raise_leftovers: bool) -> None:
    """Say what a teardown could not remove: an error when asked, else a line on stderr (a
    teardown after a failed body must not hide the body's own error)."""
    if not problems:
        return
    text = f"{what} teardown left: " + "; ".join(problems)
    if raise_leftovers:
        raise NetnsError(text)
    print(text, file=sys.stderr)


@dataclass
class Node:
    """One node: its namespace, address, daemon process and files."""

    index: int
    netns: str
    addr: str
    port: str  # its port's name on the bridge, in the switch namespace
    dir: Path | None = None  # set when the cluster starts (its workdir may not exist yet)
    proc: subprocess.Popen | None = None
    pid: int = 0  # the daemon's pid (as the daemon itself reported it)
    mntns: str = ""  # its mount namespace ("mnt:[inode]"), to prove at teardown it is gone

    @property
    def host(self) -> str:
        return f"{self.addr}:{PORT}"

    @property
    def log(self) -> Path:
        return self.dir / "log"


class Stood:
    """What a test stands up and must take down: entering runs `start()` (NetnsUnsupported
    first if `why_unsupported()` names a reason), and if that fails halfway `close()` removes
    what it made before the error goes on; leaving closes, and leftovers are an error only
    when the body itself succeeded."""

    def why_unsupported(self) -> str | None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def close(self, raise_leftovers: bool = False) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        reason = self.why_unsupported()
        if reason:
            raise NetnsUnsupported(reason)
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_leftovers=exc[0] is None)


class NetCluster(Stood):
    """`with NetCluster(4, rate="400mbit") as c:` four namespaced nodes, each with a daemon.

    rate:     every link's limit, each direction (tc units: 400mbit, 1gbit)
    burst:    tbf bucket size in bytes (default: 4 ms at `rate`, at least 128 KiB, so that a
              64 KiB GSO packet always fits and the limiter does not starve TCP)
    latency:  how long a packet may wait in a tbf queue before being dropped (sets the queue)
    workdir:  where node state (stores), logs and the token live (default: a fresh temp dir,
              removed afterwards). Put it on tmpfs to keep the shared disk out of a benchmark.
    daemon_args: more `monarch-fs daemon` flags. The daemons run as root, so they refuse to
              launch processes unless given --allow-root-procs: pass it only in a test that
              really launches processes through them (none of the pushes needs it).
    """

    def __init__(self, n: int, rate: str = "200mbit", *, burst: int | None = None,
                 latency: str = "50ms", workdir: str | os.PathLike[str] | None = None,
                 mount: str = MOUNT, start_timeout: float = START_TIMEOUT,
                 stop_timeout: float = STOP_TIMEOUT, daemon_args: list[str] | None = None,
                 keep_workdir: bool = False):
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"n must be between 1 and {MAX_NODES}")
        self.n = n
        self.rate = rate
        self.rate_bps = rate_bytes_per_second(rate)
        self.burst = burst or max(128 * 1024, int(self.rate_bps * 0.004))
        self.latency = latency
        self.mount = mount
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.daemon_args = list(daemon_args or [])
        self.id = f"mfs{secrets.token_hex(3)}"  # short: namespace names stay readable
        self._own_workdir = workdir is None
        self._keep_workdir = keep_workdir
        self.workdir = Path(workdir) if workdir else None  # made on entry, not before
        self.token_file = ""
        self._net = Switch(self.id)
        self.switch = self._net.name
        self.devbox = f"{self.id}-dev"
        self.nodes = [Node(i, f"{self.id}-n{i}", f"{SUBNET}.{FIRST_NODE_HOST + i}", f"p-n{i}")
                      for i in range(n)]
        self._closed = False

    # ---- the public surface -----------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        """The daemons' addresses, "10.77.0.X:7000", in node order (node 0 first)."""
        return [node.host for node in self.nodes]

    @property
    def namespaces(self) -> list[str]:
        """Every network namespace this cluster created (and will delete)."""
        return list(self._net.namespaces)

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes if node.pid]

    def run_devbox(self, argv: list[str], *, timeout: float = 600, check: bool = False,
                   text: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `argv` as a process on the dev box (its network namespace), e.g. the push CLI."""
        return self._exec(["ip", "netns", "exec", self.devbox, *argv], timeout, check, text, env)

    def push_argv(self, src: str | os.PathLike[str], *args: str) -> list[str]:
        """The `monarch-fs push` command line for this cluster (hosts and token filled in)."""
        return [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts",
                ",".join(self.hosts), "--token-file", self.token_file, *args]

    def run_on_node(self, i: int, argv: list[str], *, timeout: float = 120, check: bool = False,
                    text: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` as a process on node `i`: inside its daemon's network and mount
        namespaces, so it sees that node's /mnt/monarch-fs and network."""
        pid = self._daemon_pid(i)
        return self._exec(["nsenter", "--target", str(pid), "--mount", "--net", *argv],
                          timeout, check, text, None)

    def hide_on_node(self, i: int, path: str | os.PathLike[str]) -> None:
        """Mount an empty tmpfs over `path` in node `i`'s mount namespace only: what the dev
        box has there is gone from that node, as on a real cluster where the dev box's folders
        do not exist. Private to the node's namespace, it goes when the namespace does (with
        the daemon), and the host never sees it."""
        pid = self._daemon_pid(i)
        run_cmd(["nsenter", "--target", str(pid), "--mount", "mount", "-t", "tmpfs", "-o",
                 "mode=0755,size=16m", f"{self.id}-hide", str(path)])

    def read_on_node(self, i: int, path: str, *, timeout: float = 120) -> bytes:
        """The bytes of `path` as a process on node `i` reads them (e.g. through its mount)."""
        return self.run_on_node(i, ["cat", "--", path], timeout=timeout, check=True,
                                text=False).stdout

    def devbox_tx_bytes(self) -> int:
        """Bytes the dev box has sent on its link, by the kernel's interface counter (headers
        included: this is what crossed the wire, not what the client thinks it sent)."""
        out = run_cmd(["ip", "netns", "exec", self.devbox, "cat",
                    f"/sys/class/net/{IFACE}/statistics/tx_bytes"])
        return int(out.stdout)

    def node_counters(self, i: int) -> dict[str, int]:
        """Node `i`'s eth0 {rx_bytes, tx_bytes}, read from /proc/PID/net/dev of its daemon: no
        process is started, so it is cheap enough to sample while a push runs."""
        with open(f"/proc/{self._daemon_pid(i)}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == IFACE:
                    fields = rest.split()
                    return {"rx_bytes": int(fields[0]), "tx_bytes": int(fields[8])}
        raise NetnsError(f"node {i}: no {IFACE} in its namespace")

    def qdisc_stats(self) -> dict[str, dict]:
        """tc -s statistics of every shaped link end, {"node-0/up": {...}, "node-0/down": ...}:
        bytes, packets, drops, overlimits (the limiter was what held the link back) and the
        backlog left in the queue."""
        out = {}
        for label, ns, dev in self._shaped_links():
            raw = run_cmd(["tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", dev]).stdout
            for q in json.loads(raw or b"[]"):
                if q.get("kind") == "tbf":
                    out[label] = {k: q.get(k) for k in
                                  ("bytes", "packets", "drops", "overlimits", "backlog", "qlen")}
        return out

    # ---- life cycle -------------------------------------------------------------------------

    def why_unsupported(self) -> str | None:
        return unsupported_reason()

    def start(self) -> None:
        self._make_workdir()
        self._build_network()
        self._start_daemons()

    def close(self, raise_leftovers: bool = False) -> None:
        """Stop the daemons, then delete links and namespaces; idempotent. With
        raise_leftovers, anything that could not be removed is an error (else only reported
        on stderr, so it never hides the body's own exception)."""
        if self._closed:
            return
        self._closed = True
        problems = self._stop_daemons()
        problems += self._net.kill_all(self.stop_timeout)
        problems += self._check_mounts_gone()
        problems += self._net.close()
        if self._own_workdir and not self._keep_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        report_leftovers("NetCluster", problems, raise_leftovers)

    # ---- building ---------------------------------------------------------------------------

    def _make_workdir(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file = str(self.workdir / "token")
        for node in self.nodes:
            node.dir = self.workdir / f"node-{node.index}"

    def _build_network(self) -> None:
        """The switch with its bridge, then one shaped link per node and for the dev box."""
        self._net.build()
        self._add_host(self.devbox, "p-dev", DEVBOX_ADDR)
        for node in self.nodes:
            self._add_host(node.netns, node.port, node.addr)

    def _add_host(self, ns: str, port: str, addr: str) -> None:
        """A namespace linked to the bridge: eth0 inside it, `port` on the switch, both shaped."""
        self._net.add_host(ns, port, addr)
        for side_ns, dev in ((ns, IFACE), (self.switch, port)):
            run_cmd(["tc", "-n", side_ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                     self.rate, "burst", str(self.burst), "latency", self.latency])

    def _shaped_links(self) -> list[tuple[str, str, str]]:
        """(label, namespace, interface) of every tbf: `up` is what the host sends, `down` what
        the switch sends it."""
        ends = [("devbox", self.devbox, "p-dev")] + [(f"node-{n.index}", n.netns, n.port)
                                                 for n in self.nodes]
        out = []
        for label, ns, port in ends:
            out += [(f"{label}/up", ns, IFACE), (f"{label}/down", self.switch, port)]
        return out

    def _start_daemons(self) -> None:
        """Start every daemon at once (start-up is mostly imports), then wait for all."""
        from monarch_fs.daemon.wire.auth import write_new_token

        write_new_token(self.token_file)
        os.makedirs(self.mount, exist_ok=True)  # shared by every node's mount namespace
        for node in self.nodes:
            node.dir.mkdir(parents=True, exist_ok=True)
            (node.dir / "ready").unlink(missing_ok=True)  # a reused workdir's, not this daemon's
            with open(node.log, "ab") as logf:
                node.proc = subprocess.Popen(
                    ["ip", "netns", "exec", node.netns,
                     "unshare", "--mount", "--propagation", "private",
                     sys.executable, "-m", CLI_MODULE, "daemon",
                     "--listen", node.host, "--mount", self.mount,
                     "--state", str(node.dir / "state"), "--token-file", self.token_file,
                     "--ready-file", str(node.dir / "ready"), "--node-name", f"node-{node.index}",
                     *self.daemon_args],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        for node in self.nodes:
            node.pid = self._wait_ready(node, deadline)
            node.mntns = os.readlink(f"/proc/{node.pid}/ns/mnt")
            if node.mntns == os.readlink("/proc/self/ns/mnt"):
                raise NetnsError(f"node-{node.index}: daemon shares the host's mount namespace")

    def _wait_ready(self, node: Node, deadline: float) -> int:
        """The daemon's pid once it has mounted and listens. `ip netns exec` and `unshare`
        exec (no fork), so it is the pid we started; we check rather than assume."""
        ready = node.dir / "ready"
        while not ready.exists():
            if node.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with status {node.proc.returncode}"
                       if node.proc.returncode is not None
                       else f"not ready after {self.start_timeout:g}s")
                raise NetnsError(f"node-{node.index} daemon {why}; its log ends:\n"
                                 f"{tail(node.log)}")
            time.sleep(0.05)
        pid = json.loads(ready.read_text())["pid"]
        if pid != node.proc.pid:
            raise NetnsError(f"node-{node.index}: daemon reports pid {pid}, we started "
                             f"{node.proc.pid} (a wrapper forked?)")
        return pid

    def _daemon_pid(self, i: int) -> int:
        pid = self.nodes[i].pid
        if not pid:
            raise NetnsError(f"node {i} has no daemon running")
        return pid

    def _exec(self, argv, timeout, check, text, env) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=text, timeout=timeout,
                              env={**os.environ, **env} if env else None,
                              stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
        return proc

    # ---- teardown ---------------------------------------------------------------------------

    def _stop_daemons(self) -> list[str]:
        """SIGTERM every daemon we started (it unmounts on the way out), SIGKILL after
        stop_timeout. Only pids of processes this object started, and only while alive."""
        procs = {n.proc.pid: n.proc for n in self.nodes if n.proc is not None}
        left = stop_pids(procs, self.stop_timeout)
        for node in self.nodes:
            node.pid = 0
        return [f"daemon pid {pid} survived SIGKILL" for pid in left]

    def _check_mounts_gone(self) -> list[str]:
        """A node's FUSE mount lives only in its private mount namespace, which the kernel
        frees with its last process: prove no process is left in any of them."""
        ours = {n.mntns for n in self.nodes if n.mntns}
        users = []
        for entry in os.listdir("/proc") if ours else ():
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/mnt") in ours:
                        users.append(entry)
                except OSError:
                    pass  # exited meanwhile
        return [f"process {pid} still in a node's mount namespace" for pid in users]
