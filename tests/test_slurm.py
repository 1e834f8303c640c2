"""`monarch-fs slurm up` in a real SLURM job (tests/slurm.py: slurmctld and two slurmd, each node
a network namespace with its own hostname): the daemons come up on both allocated nodes, a push,
`status` and a 2 x 2 `run` use the job's hosts and token without being told, and when the job
ends (or is cancelled) no daemon, mount or node folder is left. And, without a cluster, how the
job's hosts become the default and what `slurm up` says outside a job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm as slurm_cluster  # tests/slurm.py
from monarch_fs.daemon.client import slurm as slurm_mod
from monarch_fs.daemon.client.hosts import resolve_target
from netns import NetnsUnsupported

REPO = Path(__file__).resolve().parent.parent
MONARCH_FS = Path(sys.executable).parent / "monarch-fs"

JOB = """\
#!/bin/sh
set -e
export MONARCH_FS_HOME={home}
echo "job started t=$(date +%s.%N)"
# the test's nodes share one filesystem: {{node}} keeps their mounts apart
{mfs} slurm up --mount '{mounts}-{{job}}-{{node}}'
{mfs} push {src} --name hello
{mfs} status
{mfs} run --per-host 2 --workspace hello -- {python} hello.py
"""

# up refused (a daemon option no daemon knows), then up, down: unmounted before the job ends
UP_DOWN = """\
#!/bin/sh
export MONARCH_FS_HOME={home}
M='{mounts}-{{job}}-{{node}}'
{mfs} slurm up --mount "$M" -- --no-such-option 2>&1 && exit 9
{mfs} slurm up --mount "$M" || exit 1
{mfs} status | wc -l | sed 's/^/status lines: /'
{mfs} slurm down || exit 2
grep -c " {mounts}-$SLURM_JOB_ID-" /proc/self/mountinfo | sed 's/^/mounts after down: /'
{mfs} status 2>&1 | sed 's/^/after down: /'
"""

# a job that never ends on its own: scancel ends it
CANCELLED = """\
#!/bin/sh
export MONARCH_FS_HOME={home}
{mfs} slurm up --mount '{mounts}-{{job}}-{{node}}' || exit 1
touch {marker}
sleep 600
"""

HELLO = """\
import os, socket, time
print(f"host={socket.gethostname()} rank={os.environ['RANK']}/{os.environ['WORLD_SIZE']} "
      f"t={time.time():.3f} cwd={os.getcwd()}", flush=True)
"""


def mounts_under(cluster, prefix: str) -> list[str]:
    """Mount points under `prefix` here and in each node's mount namespace (`ip netns exec`
    gives every node its own: a node's mounts do not show here)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for i in range(len(cluster.hostnames)):
        points += cluster.node_mounts(i)
    return [p for p in points if p.startswith(prefix)]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(slurm_cluster.unsupported_reason() is not None,
                    reason=slurm_cluster.unsupported_reason() or "")
def test_slurm_up_push_status_run_and_the_job_end_leaves_nothing():
    try:
        with slurm_cluster.SlurmCluster(n_nodes=2) as cluster:
            work = cluster.dir / "work"
            src = work / "hello"
            src.mkdir(parents=True)
            (src / "hello.py").write_text(HELLO)
            mounts = f"/tmp/{cluster.id}-mnt"
            script = work / "job.sh"
            script.write_text(JOB.format(home=work / "home", mfs=MONARCH_FS, mounts=mounts,
                                         src=src, python=sys.executable))
            log = work / "job.out"
            t0 = time.time()
            job = cluster.run_client(["sbatch", "--wait", "--parsable", "--nodes=2",
                                      f"--output={log}", str(script)], timeout=180)
            t_end = time.time()
            out = log.read_text() if log.exists() else ""
            assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out}\n" + tail_logs(work)
            job_id = job.stdout.strip().split(";")[0]

            # the daemons came up on both nodes, on the nodes' own addresses
            assert re.search(rf"job {job_id}: 2 daemons up in [\d.]+s on node0 node1", out), out
            hosts = (work / "home" / "slurm" / job_id / "hosts").read_text().split()
            assert [h.rsplit(":", 1)[0] for h in hosts] == cluster.addresses
            assert re.search(r"pushed hello \w+ to 2 nodes", out), out
            for addr in cluster.addresses:  # status: one line per node, serving hello
                assert re.search(rf"^{re.escape(addr)}:\d+\s+node\d\s+hello=", out, re.M), out
            ranks = re.findall(r"host=(node\d) rank=(\d)/4 t=([\d.]+) cwd=(\S+)", out)
            assert sorted((h, r) for h, r, _, _ in ranks) == [
                ("node0", "0"), ("node0", "1"), ("node1", "2"), ("node1", "3")], out
            for host, _, _, cwd in ranks:  # each rank ran the pushed file from its node's mount
                assert cwd.startswith(f"{mounts}-{job_id}-{host}/.versions/hello/"), cwd
            first_rank = min(float(t) for _, _, t, _ in ranks)
            started = float(re.findall(r"job started t=([\d.]+)", out)[0])
            print(f"\nsbatch -> first rank running: {first_rank - t0:.2f}s (sbatch -> job "
                  f"script started {started - t0:.2f}s, then up, push, run "
                  f"{first_rank - started:.2f}s; sbatch --wait returned after "
                  f"{t_end - t0:.2f}s)\n{out}")

            # the job has ended: SLURM stopped the daemons' step with SIGTERM; each daemon
            # unmounted and its node removed the mount point and the store
            all_gone(cluster, mounts, "the job", work)
            deadline = time.monotonic() + 10
            while leftovers := [p for p in Path("/tmp").iterdir()
                                if p.name.startswith(f"{cluster.id}-mnt")]:
                assert time.monotonic() < deadline, f"node folders left: {leftovers}"
                time.sleep(0.2)

            # a second job: a refused start, then up and down within the job
            script.write_text(UP_DOWN.format(home=work / "home", mfs=MONARCH_FS, mounts=mounts))
            log2 = work / "job2.out"
            job = cluster.run_client(["sbatch", "--wait", "--parsable", "--nodes=2",
                                      f"--output={log2}", str(script)], timeout=180)
            out = log2.read_text() if log2.exists() else ""
            print(out)
            assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out}\n" + tail_logs(work)
            refused = [line for line in out.splitlines() if "no-such-option" in line]
            assert len(refused) == 1 and refused[0].startswith("monarch-fs: error: node"), out
            assert "Traceback" not in out, out
            assert "status lines: 2" in out, out
            assert re.search(r"stopped the daemons of step \d+\.\d+ \(unmounted\)", out), out
            assert "mounts after down: 0" in out, out
            # the job's hosts are gone with its daemons: no stale default
            assert "after down: monarch-fs: error: no hosts" in out, out
            assert not cluster.monarch_pids()

            # a third job, cancelled while its daemons serve: scancel ends it, and with it
            # the daemons and their mounts
            marker = work / "up"
            script.write_text(CANCELLED.format(home=work / "home", mfs=MONARCH_FS,
                                               mounts=mounts, marker=marker))
            job = cluster.run_client(["sbatch", "--parsable", "--nodes=2",
                                      f"--output={work / 'job3.out'}", str(script)], timeout=60)
            assert job.returncode == 0, job.stderr
            job_id = job.stdout.strip().split(";")[0]
            deadline = time.monotonic() + 60
            while not marker.exists():
                assert time.monotonic() < deadline, "the daemons never came up\n" + tail_logs(work)
                time.sleep(0.2)
            assert len(mounts_under(cluster, f"{mounts}-{job_id}-")) == 2, tail_logs(work)
            assert cluster.monarch_pids()
            cancel = cluster.run_client(["scancel", job_id], timeout=60)
            assert cancel.returncode == 0, cancel.stderr
            all_gone(cluster, mounts, "scancel", work)
    except NetnsUnsupported as e:
        pytest.skip(str(e))


def all_gone(cluster, mounts: str, after: str, work: Path, timeout: float = 45) -> None:
    """Wait (bounded) until no monarch-fs process runs in the cluster and no mount is left."""
    deadline = time.monotonic() + timeout
    while cluster.monarch_pids() or mounts_under(cluster, mounts):
        assert time.monotonic() < deadline, (
            f"left after {after}: daemons {cluster.monarch_pids()}, mounts "
            f"{mounts_under(cluster, mounts)}\n" + tail_logs(work))
        time.sleep(0.2)


def tail_logs(work: Path) -> str:
    logs = sorted((work / "home" / "slurm").glob("*/daemons.*"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


# ---- without a cluster ------------------------------------------------------------------------


def test_up_outside_a_job_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["MONARCH_FS_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "monarch_fs.cli", "slurm", "up"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "monarch-fs: error: not inside a SLURM allocation ($SLURM_JOB_ID is not set): run it "
        "in an sbatch script or an salloc shell"]


def test_the_jobs_hosts_and_token_are_the_default_in_that_job(tmp_path, monkeypatch):
    for name in ("MONARCH_FS_HOSTS", "MONARCH_FS_TOKEN_FILE", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    job = tmp_path / "slurm" / "42"
    job.mkdir(parents=True)
    (job / "hosts").write_text("10.0.0.1:4000\n10.0.0.2:4001\n")
    (job / "token").write_text("t\n")

    assert resolve_target(None, None) == (["10.0.0.1:4000", "10.0.0.2:4001"],
                                          str(job / "token"))
    # a flag or the environment wins, for hosts and token alike
    assert resolve_target("h:1", None) == (["h:1"], None)
    assert resolve_target(None, "mine") == (["10.0.0.1:4000", "10.0.0.2:4001"], "mine")
    monkeypatch.setenv("MONARCH_FS_TOKEN_FILE", "/env/token")
    assert resolve_target(None, None)[1] is None  # resolve_token reads the variable
    monkeypatch.setenv("MONARCH_FS_HOSTS", "e:2")
    assert resolve_target(None, None) == (["e:2"], None)
    # another job (or no job) does not see them
    monkeypatch.delenv("MONARCH_FS_HOSTS")
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    assert slurm_mod.job_hosts_file() is None
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurm_mod.job_hosts_file() is None


def test_a_nodes_lines_parse_back_and_paths_expand():
    task = slurm_mod.NodeTask(rank=1, node="node1", job="7", step="7.0")
    assert slurm_mod._parse_line(task.ready_line("10.0.0.2:4000")) == (
        slurm_mod.READY, ["1", "node1", "7.0", "10.0.0.2:4000"])
    assert slurm_mod._parse_line(task.failed_line("cannot mount:\n  /dev/fuse")) == (
        slurm_mod.FAILED, ["1", "node1", "7.0", "cannot mount: /dev/fuse"])
    assert slurm_mod._parse_line("some other output") is None
    assert slurm_mod.expand("/tmp/m-{job}-{node}", "7", "n1") == "/tmp/m-7-n1"
    with pytest.raises(slurm_mod.SlurmError, match="only {job} and {node}"):
        slurm_mod.expand("/tmp/{user}", "7", "n1")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user's")
@pytest.mark.parametrize("planted", ["state folder", "mount link"])
def test_a_job_folder_another_user_made_first_is_refused(tmp_path, planted):
    """Issue 33, finding 8: /tmp/monarch-fs-JOB.state made first by another user (0777; job
    ids are predictable) was taken as the node's, who could then swap the token in it. The
    node refuses it (and a link at the mount's path), naming the node, the folder, its owner,
    and leaves it as it is."""
    shared = tmp_path / "tmp"  # a shared /tmp: sticky, anyone writes
    shared.mkdir()
    shared.chmod(0o1777)
    mount, state = shared / "monarch-fs-77", shared / "monarch-fs-77.state"
    if planted == "state folder":
        state.mkdir()
        state.chmod(0o777)
        (state / "token").write_text("the other user's\n")
        for p in (state, state / "token"):
            os.chown(p, 65534, 65534)
        why = f"{state} was there already and belongs to uid 65534"
    else:
        (shared / "elsewhere").mkdir()
        mount.symlink_to(shared / "elsewhere")
        os.lchown(mount, 65534, 65534)
        why = f"{mount} was there already and is a link"
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURMD_NODENAME": "n7",
           "SLURM_STEP_ID": "0"}
    out = subprocess.run([sys.executable, "-m", "monarch_fs.cli", "slurm", "node", "--mount",
                          str(shared / "monarch-fs-{job}")], input="a-token\n", env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout.startswith(f"{slurm_mod.FAILED} 0 n7 77.0 {why}"), out.stdout
    assert f"monarch-fs: error: n7: {why}" in out.stderr, out.stderr
    assert "another user may have made it first" in out.stderr
    if planted == "state folder":
        assert (state / "token").read_text() == "the other user's\n"
        assert os.stat(state).st_uid == 65534
    else:
        assert list((shared / "elsewhere").iterdir()) == []
