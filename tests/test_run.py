"""`monarch-fs run`: SPMD launch on real daemons, through the real command line.

Every test checks (through /proc) that each rank it started is gone when it ends.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import CLI_MODULE, job_files, mfs
from procwatch import Started
from rdma_helpers import host_has_rdma  # noqa: F401 (the skipif condition below names it)

pytestmark = pytest.mark.mount


@pytest.fixture
def started():
    s = Started()
    yield s
    s.assert_gone()


# A job for every test: each rank records its pid, then does what argv says.
JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    rank = int(os.environ["RANK"])
    out, mode = sys.argv[1], sys.argv[2]
    with open(f"{out}/{rank}.tmp", "w") as f:  # a rank killed while writing leaves no .pid
        f.write(str(os.getpid()))
    os.rename(f"{out}/{rank}.tmp", f"{out}/{rank}.pid")
    def everyone_started():
        world = int(os.environ["WORLD_SIZE"])
        while len([n for n in os.listdir(out) if n.endswith(".pid")]) < world:
            time.sleep(0.02)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "MONARCH_FS_MOUNT",
            "MONARCH_FS_TRANSPORT")
    if mode == "env":
        print(json.dumps({k: os.environ.get(k) for k in keys}))
        print(f"line two of rank {rank}")
    elif mode == "fail":  # rank 1 fails once everyone runs; the others would sleep a minute
        everyone_started()
        if rank == 1:
            print(f"rank {rank} gives up", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(60)
    elif mode == "signal":
        everyone_started()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif mode == "once":  # rank 2 fails on the first attempt only (a marker file remembers)
        marker = f"{out}/failed-once"
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"])
        if rank == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            print("first attempt fails", file=sys.stderr)
            sys.exit(7)
    elif mode == "always":
        sys.exit(5 if rank == 3 else 0)
    elif mode == "sleep":
        time.sleep(60)
""")


@pytest.fixture
def job(tmp_path):
    return job_files(tmp_path, JOB)


def run(cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return mfs("run", "--hosts", cluster.hostfile, "--token-file", cluster.token_file, *args,
               check=False, timeout=timeout)


def run_ranks(cluster, job, started, mode: str, *args: str) -> subprocess.CompletedProcess:
    """`monarch-fs run ARGS -- python job.py OUT MODE`; every rank it started is watched."""
    script, out = job
    r = run(cluster, *args, "--", sys.executable, str(script), str(out), mode)
    started.add(*pids(out), match=str(script))
    return r


def pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("*.pid"))]


def by_rank(stdout: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        assert line.startswith("[rank "), line
        rank, text = line[6:].split("] ", 1)
        lines.setdefault(int(rank), []).append(text)
    return lines


def test_every_rank_gets_torchrun_env_and_prefixed_output(cluster2, job, started):
    _, out = job
    r = run_ranks(cluster2, job, started, "env", "--per-host", "2", "--cwd", str(out))
    assert r.returncode == 0, r.stderr
    lines = by_rank(r.stdout)
    assert sorted(lines) == [0, 1, 2, 3]
    ports = set()
    for rank, (env, two) in sorted(lines.items()):
        env = json.loads(env)
        assert two == f"line two of rank {rank}"
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["MASTER_ADDR"] == cluster2.hosts[0].rsplit(":", 1)[0]
        assert env["MONARCH_FS_MOUNT"] == str(cluster2.mnt(rank // 2))
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert "all 4 ranks exited 0" in r.stderr


def test_first_failure_is_reported_and_the_others_are_stopped(cluster2, job, started):
    _, out = job
    t = time.monotonic()
    r = run_ranks(cluster2, job, started, "fail", "--per-host", "2")
    assert time.monotonic() - t < 30  # not the others' 60 s sleep
    assert r.returncode == 3, r.stderr  # the failing rank's exit code
    assert f"rank 1 on node-0 ({cluster2.hosts[0]}) failed: exit code 3" in r.stderr
    assert "its stderr ended with:\n    rank 1 gives up" in r.stderr
    assert "stopping the other 3 ranks" in r.stderr
    assert "[rank 1] rank 1 gives up" in r.stderr  # streamed live too
    assert len(pids(out)) == 4


def test_a_signal_gives_128_plus_its_number(cluster2, job, started):
    r = run_ranks(cluster2, job, started, "signal", "--per-host", "2")
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "rank 0 on node-0" in r.stderr and "killed by SIGKILL" in r.stderr


def test_max_restarts_restarts_the_whole_group(cluster2, job, started):
    r = run_ranks(cluster2, job, started, "once", "--per-host", "2", "--max-restarts", "2",
                  "--no-fold")  # a line per rank (tests/test_logs.py: folded)
    assert r.returncode == 0, r.stderr
    assert "rank 2 on node-1" in r.stderr and "exit code 7 (attempt 1 of 3)" in r.stderr
    assert "first attempt fails" in r.stderr
    assert "restarting all 4 ranks (2 restarts left)" in r.stderr
    assert "all 4 ranks exited 0 (after 1 restarts)" in r.stderr
    second = [line for line in r.stdout.splitlines() if line.endswith("attempt 1")]
    assert sorted(second) == [f"[rank {i}] attempt 1" for i in range(4)]


def test_restarts_run_out(cluster2, job, started):
    r = run_ranks(cluster2, job, started, "always", "--per-host", "2", "--max-restarts", "1")
    assert r.returncode == 5, r.stderr
    assert "(attempt 2 of 2)" in r.stderr and "giving up: exit status 5" in r.stderr


def test_launch_errors(cluster2, job):
    r = run(cluster2, "--workspace", "nope", "--", "true")
    assert r.returncode == 1 and "no workspace 'nope'" in r.stderr
    r = run(cluster2, "--", "/no/such/program")
    assert r.returncode == 1 and "cannot start /no/such/program" in r.stderr
    r = run(cluster2)
    assert r.returncode == 2 and "run needs a command" in r.stderr


def test_killed_launcher_takes_its_ranks_along(cluster2, job, started):
    script, out = job
    proc = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "run", "--hosts", cluster2.hostfile,
         "--token-file", cluster2.token_file, "--per-host", "2", "--", sys.executable,
         str(script), str(out), "sleep"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started.add(proc.pid)
    deadline = time.monotonic() + 30
    while len(pids(out)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    started.add(*pids(out), match=str(script))
    assert len(started.alive()) == 5
    proc.kill()
    proc.wait()
    assert not started.wait_gone(10), "ranks outlived the killed `monarch-fs run`"


def test_ranks_start_from_a_clean_environment_plus_run_env(fresh_cluster, monkeypatch):
    """Issue 16, finding 6: a rank gets none of its daemon's environment ($MONARCH_FS_HOME leads
    to the cluster token), only the documented base, what `run` sets, and --env."""
    monkeypatch.setenv("DAEMON_ONLY", "must not leak")
    c = fresh_cluster(1)
    daemon_env = Path(f"/proc/{c.pid(0)}/environ").read_bytes()
    assert b"DAEMON_ONLY=" in daemon_env and b"MONARCH_FS_HOME=" in daemon_env  # to leak
    show = "import json; print(json.dumps(open('/proc/self/environ').read().split('\\0')))"
    r = run(c, "--env", "EXTRA=a=b", "--env", "EMPTY=", "--", sys.executable, "-c", show)
    assert r.returncode == 0, r.stderr
    env = dict(kv.split("=", 1) for kv in json.loads(by_rank(r.stdout)[0][0]) if kv)
    assert env["EXTRA"] == "a=b" and env["EMPTY"] == "" and env["RANK"] == "0"
    assert "DAEMON_ONLY" not in env and "MONARCH_FS_HOME" not in env
    assert {k for k in env if k.startswith("MONARCH_FS_")} == {"MONARCH_FS_MOUNT",
                                                               "MONARCH_FS_TRANSPORT",
                                                               "MONARCH_FS_JOB"}
    bad = run(c, "--env", "NOVALUE", "--", "true")
    assert bad.returncode == 1
    assert bad.stderr.strip() == "monarch-fs: error: --env 'NOVALUE': expected NAME=VALUE"


# ---- torch -------------------------------------------------------------------------------

TRAIN = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": t.tolist(),
                      "torch": torch.__file__, "pid": os.getpid()}), flush=True)
    dist.destroy_process_group()
""").replace("import os\n", "import json, os\n", 1)


@pytest.fixture(scope="module")
def venv_pushed(cluster2):
    """This test venv (torch included), pushed once to every node as workspace "env"."""
    cluster2.push(Path(sys.prefix), "--name", "env", "--exclude", "__pycache__")
    return cluster2


def test_gloo_all_reduce_with_torch_from_the_pushed_venv(venv_pushed, tmp_path, started):
    cluster = venv_pushed
    (tmp_path / "train.py").write_text(TRAIN)
    r = run(cluster, "--per-host", "2", "--workspace", "env", "--cwd", str(tmp_path), "--",
            "{workspace}/bin/python", "train.py", timeout=180)
    results = {}
    for line in r.stdout.splitlines():
        rank, text = line[6:].split("] ", 1)
        results[int(rank)] = json.loads(text)
    started.add(*(res["pid"] for res in results.values()), match="train.py")
    assert r.returncode == 0, r.stderr
    assert sorted(results) == [0, 1, 2, 3]
    version = cluster.status()[0]["workspaces"]["env"][0]
    for rank, res in results.items():
        assert res["rank"] == rank and res["world"] == 4
        assert res["sum"] == [1.0 + 2 + 3 + 4, 10.0 * (0 + 1 + 2 + 3)]
        pinned = cluster.mnt(rank // 2) / ".versions" / "env" / version
        assert res["torch"].startswith(str(pinned) + "/"), res["torch"]  # torch came off the mount


def test_killed_daemon_fails_the_job_and_leaves_no_rank(fresh_cluster, job, started):
    """SIGKILL one node's daemon mid-job: its ranks die with it (PR_SET_PDEATHSIG), `run`
    reports the lost host, stops the other ranks and exits 1."""
    cluster = fresh_cluster(2)
    script, out = job
    proc = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "run", "--hosts", cluster.hostfile,
         "--token-file", cluster.token_file, "--per-host", "2", "--", sys.executable,
         str(script), str(out), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    started.add(proc.pid)
    deadline = time.monotonic() + 30
    while len(pids(out)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    started.add(*pids(out), match=str(script))
    os.kill(cluster.pid(1), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1, stderr
    assert "node-1" in stderr and "lost the connection to the node daemon" in stderr
    assert not started.wait_gone(10)


# ---- --transport ---------------------------------------------------------------------------


no_rdma_here = pytest.mark.skipif("host_has_rdma()",
                                  reason="this host has an RDMA device: no fallback to observe")


@no_rdma_here
def test_transport_rdma_without_a_device_fails_naming_the_host_and_launches_nothing(cluster2, job):
    script, out = job
    r = run(cluster2, "--per-host", "2", "--transport", "rdma", "--", sys.executable,
            str(script), str(out), "env")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert lines[0].startswith("monarch-fs: error: --transport rdma: no RDMA device on the "
                               f"controller {socket.gethostname()} ("), lines[0]
    assert pids(out) == []  # no rank ran


@no_rdma_here
def test_transport_auto_falls_back_to_tcp_with_one_line(cluster2, job, started):
    r = run_ranks(cluster2, job, started, "env", "--per-host", "2", "--transport", "auto")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "transport" in line]
    assert len(said) == 2, r.stderr  # the fallback line, and the summary
    assert said[0].startswith("monarch-fs run: transport: tcp to all 2 nodes (RDMA not used: "
                              "no RDMA device on this host ("), said[0]
    assert said[1] == "monarch-fs run: all 4 ranks exited 0; transport tcp"
    envs = {rank: json.loads(lines[0]) for rank, lines in by_rank(r.stdout).items()}
    assert sorted(envs) == [0, 1, 2, 3]
    assert {e["MONARCH_FS_TRANSPORT"] for e in envs.values()} == {"tcp"}


def test_transport_tcp_runs_silently(cluster2, job, started):
    r = run_ranks(cluster2, job, started, "env", "--transport", "tcp")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["monarch-fs run: all 2 ranks exited 0; transport tcp"]
    envs = [json.loads(lines[0]) for lines in by_rank(r.stdout).values()]
    assert [e["MONARCH_FS_TRANSPORT"] for e in envs] == ["tcp", "tcp"]


@no_rdma_here
async def test_transport_rdma_refused_by_the_hosts_names_them_and_launches_nothing(
        cluster2, job, started):
    """The host side of the check, in process: a controller that has a (pretend) RDMA device,
    against the cluster's daemons, which offer none. `rdma` names every host and starts no
    rank; `auto` runs over TCP and says once why (a warning-level surprise: RDMA was available
    on this side)."""
    from monarch_fs.daemon.wire import bulk
    from monarch_fs.daemon.wire.auth import load_token
    from monarch_fs.mesh.spmd import Job, run_job

    script, out = job
    local = bulk.LocalTransport("rdma", "rdma", "a pretend device",
                                [{"name": "mlx5_0", "kind": "ib", "port": 1, "active": True}])
    token = load_token(cluster2.token_file)

    def make(transport: str) -> Job:
        return Job([sys.executable, str(script), str(out), "env"], per_host=1,
                   transport=transport, out=io.StringIO(), err=io.StringIO())

    refused = make("rdma")
    with pytest.raises(bulk.TransportUnavailable) as e:
        await run_job(cluster2.hosts, token, refused, local)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--transport rdma: node-0 ("), msg
    for i, addr in enumerate(cluster2.hosts):
        assert f"node-{i} ({addr}): the peer offers no RDMA (auto: no RDMA device" in msg
    assert pids(out) == [] and refused.out.getvalue() == ""

    auto = make("auto")
    assert await run_job(cluster2.hosts, token, auto, local) == 0
    started.add(*pids(out), match=str(script))
    said = auto.err.getvalue().splitlines()
    assert said[0].startswith("monarch-fs run: transport: tcp to all 2 nodes (RDMA not used: "
                              "the peer offers no RDMA (auto: no RDMA device on this host ("), said
    assert sum("RDMA not used" in line for line in said) == 1
    assert said[-1] == "monarch-fs run: all 2 ranks exited 0; transport tcp"


def test_transport_rdma_where_every_host_has_a_device(fresh_cluster, job, started, tmp_path,
                                                      monkeypatch):
    """Daemons and controller that find an RoCE device: the fake verbs (tests/fake_pyverbs.py)
    installed in every process they start, through a sitecustomize.py on PYTHONPATH. `rdma`
    launches and every rank sees rdma-rc; `auto` picks it without a fallback line. The fake's
    fabric cannot carry bytes between processes, and none need to: `run` moves no bulk data, it
    only chooses and reports (see mesh/spmd.py)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import fake_pyverbs\nfake_pyverbs.install_from_env()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MONARCH_FS_FAKE_PYVERBS", json.dumps([{"name": "rxe0", "link": "eth"}]))
    c = fresh_cluster(2)
    assert [n["transport"] for n in c.status()] == ["rdma", "rdma"]
    for transport in ("rdma", "auto"):
        r = run_ranks(c, job, started, "env", "--per-host", "2", "--transport", transport)
        assert r.returncode == 0, r.stderr
        assert r.stderr.splitlines() == ["monarch-fs run: all 4 ranks exited 0; transport rdma-rc"]
        envs = [json.loads(lines[0]) for lines in by_rank(r.stdout).values()]
        assert [e["MONARCH_FS_TRANSPORT"] for e in envs] == ["rdma-rc"] * 4
