"""The SLURM test harness (tests/slurm.py) itself: a real slurmctld and two real slurmd, each in
a network namespace with its own hostname, run a step on both nodes, and a batch job as a
non-root user; afterwards no process, namespace or user of the cluster is left. Skipped when not
root or when SLURM or MUNGE is not installed (Debian: slurmctld slurmd slurm-client munge)."""

from __future__ import annotations

import pwd
import subprocess
import time

import pytest

from netns import NetnsUnsupported, alive
from slurm import SlurmCluster, unsupported_reason

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(unsupported_reason() is not None,
                                 reason=unsupported_reason() or "")]

JOB = """\
#!/bin/sh
echo "$(id -un) $SLURM_JOB_NODELIST" > {out}
"""


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_for_process(cluster: SlurmCluster, name: str, timeout: float = 30) -> None:
    """Until a process called `name` runs in one of the cluster's namespaces."""
    deadline = time.monotonic() + timeout
    while name not in [comm(pid) for pid in cluster.namespace_pids()]:
        assert time.monotonic() < deadline, f"no {name} process after {timeout:g}s"
        time.sleep(0.1)


def test_two_nodes_run_steps_and_batch_jobs_and_leave_nothing():
    try:
        with SlurmCluster(n_nodes=2) as cluster:
            assert cluster.wait_idle() == {"node0": "idle", "node1": "idle"}

            out = cluster.run_client(["srun", "-N2", "--ntasks-per-node=1", "hostname"],
                                     check=True)
            assert sorted(out.stdout.split()) == ["node0", "node1"]

            # a batch job on both nodes, as a user who is not root, writing into its home
            user = cluster.ensure_user(f"{cluster.id}u")
            result = f"{user.pw_dir}/result"
            script = f"{user.pw_dir}/job.sh"
            with open(script, "w") as f:
                f.write(JOB.format(out=result))
            cluster.run_client(["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1",
                                f"--output={user.pw_dir}/slurm-%j.out", script],
                               user=user.pw_name, check=True, timeout=60)
            with open(result) as f:
                assert f.read().split() == [user.pw_name, "node[0-1]"]

            # a job still running at teardown: its slurmstepd and sleep must go too
            job = cluster.run_client(["sbatch", "--parsable", "--nodes=1", "--wrap",
                                      "sleep 600"], user=user.pw_name, check=True)
            assert job.stdout.strip().isdigit()
            wait_for_process(cluster, "sleep")
            pids = cluster.pids + cluster.namespace_pids()
            assert {"slurmstepd", "sleep"} <= {comm(pid) for pid in pids}
            namespaces = cluster.namespaces
            folder = cluster.dir
            assert len(namespaces) == 4  # switch, controller, 2 nodes
    except NetnsUnsupported as e:
        pytest.skip(str(e))

    assert [pid for pid in pids if alive(pid)] == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert set(namespaces).isdisjoint(listed)
    with pytest.raises(KeyError):
        pwd.getpwnam(user.pw_name)
    assert not folder.exists()


def test_a_start_that_fails_leaves_nothing(monkeypatch):
    def fail(self, timeout):
        raise RuntimeError("injected: no node came up")

    monkeypatch.setattr(SlurmCluster, "wait_idle", fail)  # after every daemon has started
    cluster = SlurmCluster(n_nodes=2)
    with pytest.raises(RuntimeError, match="injected"):
        try:
            with cluster:
                pass
        except NetnsUnsupported as e:
            pytest.skip(str(e))
    assert len(cluster.pids) == 4  # munged, slurmctld, 2 slurmd: all started, all stopped
    assert [pid for pid in cluster.pids if alive(pid)] == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert not [ns for ns in listed if ns.startswith(cluster.id)]
    assert not cluster.dir.exists()
