"""Issue 18's "Done when": the sbatch script of docs/guides/slurm.md, submitted by a normal
user to a real 2-node SLURM cluster (tests/slurm.py), starts that user's daemons on both
nodes, pushes a real venv, and runs 2 x 2 ranks of the venv's console script as that user; when
the job ends, no daemon, mount or process is left.

The script is the page's, taken from it, with only what this machine makes different put in:
the `monarch-fs` command (this environment's python sits under /root, which the user cannot
enter: a wrapper runs it with the system's python3), 2 ranks per node (2 CPUs), and a mount
path per node (here the nodes share /tmp). The venv sits in the user's home, which node1 does
not see (an empty tmpfs covers it there, as on a cluster without a shared home), so node1 runs
the console script through the pushed workspace, exposed at the venv's own path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from users import SYSTEM_PYTHON, fuse_device_mode, system_python_reason, write_monarch_fs_command

import slurm as slurm_cluster  # tests/slurm.py
from doc_examples import block_run_elsewhere
from monarch_fs.daemon.client import slurm as slurm_mod
from monarch_fs.fs.mount_check import FUSE_DEVICE
from netns import NetnsUnsupported

REPO = Path(__file__).resolve().parent.parent

# A package with a console script, installed into the venv: what a user's training code is.
# (setup.py: Debian's venv has setuptools but not wheel, so pip installs it the legacy way.)
SETUP = """\
from setuptools import setup

setup(name="mypkg", version="0.1", packages=["mypkg"],
      entry_points={"console_scripts": ["train = mypkg.train:main"]})
"""

TRAIN = """\
import os, socket, subprocess, sys, time


def main():
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    print(f"rank={os.environ['RANK']}/{os.environ['WORLD_SIZE']} host={socket.gethostname()} "
          f"user={user} t={time.time():.3f} script={os.path.realpath(sys.argv[0])}", flush=True)
"""


def readme_script() -> str:
    """The sbatch script of docs/guides/slurm.md, as printed there."""
    script = block_run_elsewhere("docs/guides/slurm.md", "tests/test_slurm_e2e.py")
    assert script.startswith("#!/bin/sh\n#SBATCH"), script[:40]
    return script


def adapt(script: str, mfs: Path, mounts: str) -> str:
    """The page's script with this machine's differences, each replacement checked."""
    out = script
    for old, new in (
            ("MFS=$HOME/monarch-fs/.venv/bin/monarch-fs", f"MFS={mfs}"),
            ("$MFS slurm up ", f"$MFS slurm up --mount '{mounts}-{{job}}-{{node}}' "),
            ("--per-host 8", "--per-host 2")):
        assert out.count(old) == 1, f"the page's script no longer has {old!r}"
        out = out.replace(old, new)
    return out


def pids_of_uid(uid: int) -> list[int]:
    """Every process on the machine running as `uid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def cluster_daemons(cluster: slurm_cluster.SlurmCluster) -> set[int]:
    """The cluster's own processes: the daemons it started, and slurmctld's helper
    slurmscriptd (a child it forks at start)."""
    own = set(cluster.pids)
    for pid in cluster.namespace_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, ppid = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")"):].split()[2]
        if comm == "slurmscriptd" and int(ppid) in own:
            own.add(pid)
    return own


def describe(pids: list[int]) -> list[str]:
    """`PID UID: COMMAND` of each process still there."""
    out = []
    for pid in pids:
        try:
            uid = Path(f"/proc/{pid}").stat().st_uid
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        out.append(f"{pid} uid {uid}: {cmd.strip()}")
    return out


def host_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def user_env(user) -> dict[str, str]:
    """What a login shell of `user` would have: nothing of the test's (MONARCH_FS_HOME...)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": user.pw_dir, "USER": user.pw_name,
            "LOGNAME": user.pw_name, "SHELL": "/bin/sh", "LANG": "C.UTF-8"}


def run_as(user, argv: list[str], cwd: Path) -> None:
    out = subprocess.run(argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                         env=user_env(user),
                         cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(argv)}: {out.stdout}{out.stderr}"


def make_venv(user, venv: Path, src: Path) -> None:
    """A real venv, the user's, with mypkg (console script `train`) installed from `src`."""
    (src / "mypkg").mkdir(parents=True)
    (src / "setup.py").write_text(SETUP)
    (src / "mypkg" / "__init__.py").write_text("")
    (src / "mypkg" / "train.py").write_text(TRAIN)
    for p in [src, *src.rglob("*")]:
        os.chown(p, user.pw_uid, user.pw_gid)
    venv.parent.mkdir(parents=True)
    os.chown(venv.parent, user.pw_uid, user.pw_gid)
    run_as(user, [SYSTEM_PYTHON, "-m", "venv", str(venv)], cwd=Path(user.pw_dir))
    run_as(user, [str(venv / "bin" / "pip"), "install", "--quiet", "--no-deps",
                  "--no-build-isolation", "--no-index", str(src)], cwd=src)
    assert (venv / "bin" / "train").read_text().startswith(f"#!{venv}/bin/python")


def _why_not() -> str | None:
    reason = slurm_cluster.unsupported_reason()
    if reason is None and not os.path.exists(FUSE_DEVICE):
        reason = f"no {FUSE_DEVICE}"
    return reason or system_python_reason()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_the_readme_sbatch_script_as_a_user_on_two_nodes():
    try:
        with slurm_cluster.SlurmCluster(n_nodes=2) as cluster:
            run_readme_job(cluster)  # /dev/fuse's mode is restored by fuse_device_mode
    except NetnsUnsupported as e:
        pytest.skip(str(e))


def run_readme_job(cluster: slurm_cluster.SlurmCluster) -> None:
    user = cluster.ensure_user(f"mfse{cluster.id[-6:]}")
    home = Path(user.pw_dir)
    venv = home / "envs" / "train"  # the page's $HOME/envs/train
    make_venv(user, venv, home / "src" / "mypkg")
    cluster.node_hide(1, venv.parent)  # node1 has no shared home
    bin_dir = cluster.dir / "bin"
    bin_dir.mkdir(mode=0o755)
    mfs = write_monarch_fs_command(bin_dir / "monarch-fs")
    mounts = f"/tmp/{cluster.id}-mnt"
    script = home / "train.sbatch"
    script.write_text(adapt(readme_script(), mfs, mounts))
    os.chown(script, user.pw_uid, user.pw_gid)
    log = home / "train.out"

    with fuse_device_mode(0o666):  # Debian's default; this machine has 0600
        t0 = time.time()
        job = cluster.run_client(["sbatch", "--wait", "--parsable", f"--output={log}",
                                  str(script)], user=user.pw_name, timeout=300,
                                 env=user_env(user))
        t_end = time.time()
        out = log.read_text() if log.exists() else ""
        assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out}\n" + daemon_logs(home)
        job_id = job.stdout.strip().split(";")[0]

        # the daemons came up on both allocated nodes, on the nodes' addresses
        assert re.search(rf"job {job_id}: 2 daemons up in [\d.]+s on node0 node1", out), out
        up = re.findall(r"slurm up: \d/2 nodes mounted \((node\d) ([\d.]+):\d+\)", out)
        assert sorted(up) == list(zip(cluster.hostnames, cluster.addresses)), out
        assert re.search(rf"stopped the daemons of step {job_id}\.\d+ \(unmounted\)", out), out
        assert re.search(r"pushed train \w+ to 2 nodes", out), out
        assert "Traceback" not in out, out

        # 2 x 2 ranks of the venv's console script, each as the user who submitted the job
        ranks = re.findall(r"rank=(\d)/4 host=(node\d) user=(\S+) t=([\d.]+) script=(\S+)", out)
        assert sorted((h, r) for r, h, _, _, _ in ranks) == [
            ("node0", "0"), ("node0", "1"), ("node1", "2"), ("node1", "3")], out
        assert {u for _, _, u, _, _ in ranks} == {user.pw_name}, out
        for _, host, _, _, path in ranks:
            if host == "node1":  # no $HOME/envs there: the pushed venv, at its own path
                assert path == f"{mounts}-{job_id}-node1/train/bin/train", out
            else:  # the batch host is the dev box: its own venv
                assert path == f"{venv}/bin/train", out
        first = min(float(t) for _, _, _, t, _ in ranks)
        print(f"\nsbatch -> first rank running: {first - t0:.2f}s (sbatch --wait returned after "
              f"{t_end - t0:.2f}s)\n{out}")

        # the job has ended: no daemon, no mount, no process of the job or of the user left
        leftovers: dict[str, object] = {}
        deadline = time.monotonic() + 45
        while True:
            extra = sorted(set(cluster.namespace_pids()) - cluster_daemons(cluster))
            mounted = [m for m in host_mounts() if m.startswith(mounts)] + [
                f"node{i}:{m}" for i in range(2) for m in cluster.node_mounts(i)
                if m.startswith(mounts)]
            leftovers = {k: v for k, v in {
                "daemons": cluster.monarch_pids(),
                "mounts": mounted,
                "processes in the namespaces": describe(extra),
                f"processes of {user.pw_name}": describe(pids_of_uid(user.pw_uid)),
                "node folders": [p.name for p in Path("/tmp").iterdir()
                                 if p.name.startswith(f"{cluster.id}-mnt")],
            }.items() if v}
            if not leftovers or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not leftovers, f"left after the job: {leftovers}\n" + daemon_logs(home)


def daemon_logs(home: Path) -> str:
    logs = sorted((home / ".monarch-fs" / "slurm").glob("*/daemons.*"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)


# ---- without a cluster ------------------------------------------------------------------------


def test_the_nodes_run_the_command_that_ran_up(tmp_path, monkeypatch):
    """A console script or wrapper (sys.argv[0], by path or found on PATH) is what srun starts
    on every node; `python -m monarch_fs.cli` (argv[0] a .py file) is started the same way."""
    wrapper = write_monarch_fs_command(tmp_path / "monarch-fs")
    monkeypatch.setattr(sys, "argv", [str(wrapper), "slurm", "up"])
    assert slurm_mod.this_command() == [str(wrapper)]
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(sys, "argv", ["monarch-fs", "slurm", "up"])
    assert slurm_mod.this_command() == [str(wrapper)]
    assert slurm_mod.srun_argv(2, ["--mount", "/m"])[-5:] == [
        str(wrapper), "slurm", "node", "--mount", "/m"]
    cli_py = str(REPO / "monarch_fs" / "cli.py")
    monkeypatch.setattr(sys, "argv", [cli_py, "slurm", "up"])
    assert slurm_mod.this_command() == [sys.executable, "-m", "monarch_fs.cli"]


def test_the_wrapper_runs_monarch_fs_as_another_python_would():
    """The test's `monarch-fs` command works (here as root, with the system's python3)."""
    if system_python_reason():
        pytest.skip(str(system_python_reason()))
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        wrapper = write_monarch_fs_command(Path(d) / "monarch-fs")
        out = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 0 and "slurm" in out.stdout, out.stderr
