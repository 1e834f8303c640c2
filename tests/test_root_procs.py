"""No process runs as root unless asked (issue 18): a root daemon refuses every spawn unless it
was started with --allow-root-procs, and the refusal reaches `run` and the mesh as one line
naming the host and the flag. And processes start from a clean environment: nothing of the
daemon's, nothing of the controller's, only what --env / spawn_procs(env=...) sets.

Real daemons, real mounts, the real command line; the daemons here run as root (the tests do).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from helpers import mfs, wait_for
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.node.procs import ProcessTable, SpawnRefused
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.identity import ROOT_PROCS_FLAG
from monarch_fs.daemon.wire.transport import RemoteError, connect
from monarch_fs.mesh import HostMesh, SpawnError
from procwatch import Started, descendants

TESTS = str(Path(__file__).parent)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon needs root")
pytestmark = [as_root, pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")]

# Prints the uid it runs as and its whole environment, as JSON.
PROBE = "import json, os; print(json.dumps({'uid': os.getuid(), 'env': dict(os.environ)}))"


@pytest.fixture
def started():
    s = Started()
    yield s
    s.assert_gone()


def run(daemon, *args: str, env: dict | None = None):
    return mfs("run", "--hosts", daemon.addr, "--token-file", daemon.token_file, *args,
               check=False, env=env, timeout=60)


def status(daemon, *args: str):
    return mfs("status", "--hosts", daemon.addr, "--token-file", daemon.token_file, *args)


def rank_output(stdout: str) -> list[dict]:
    return [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines()]


# ---- the process table on its own ---------------------------------------------------------------

async def test_a_root_process_table_refuses_unless_allowed_and_forks_nothing(tmp_path):
    events: list = []

    async def emit(kind: str, data: dict) -> None:
        events.append((kind, data))

    before = set(descendants(os.getpid()))  # what earlier tests left running (reapers...)
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery)  # the default: root processes refused
        with pytest.raises(SpawnRefused, match=ROOT_PROCS_FLAG):
            await table.spawn(object(), emit, {"argv": ["touch", str(tmp_path / "ran")]}, None)
        await table.stop_all()
    assert table.procs == {} and events == [] and not (tmp_path / "ran").exists()
    assert set(descendants(os.getpid())) <= before, "a refused spawn forked something"


# ---- a root daemon without the flag --------------------------------------------------------------

@pytest.mark.mount
def test_a_default_root_daemon_refuses_run_in_one_line_naming_host_and_flag(lone_daemon,
                                                                         tmp_path):
    d = lone_daemon()
    marker = tmp_path / "ran"
    r = run(d, "--per-host", "2", "--", "touch", str(marker))
    assert r.returncode == 1 and r.stdout == ""
    # `run` says which transport it chose first; then the refusal, one line.
    said = [line for line in r.stderr.splitlines()
            if not line.startswith("monarch-fs run: transport:")]
    assert said == [
        f"monarch-fs run: error: {d.dir.name} ({d.addr}): this daemon runs as root and starts "
        f"no process as root unless started with {ROOT_PROCS_FLAG} (a single-user cluster); "
        "or run the daemon as a normal user"], r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists() and descendants(d.pid) == []
    assert "processes: refused (this daemon runs as root" in d.log()


@pytest.mark.mount
def test_no_rank_ever_runs_as_root_by_default(lone_daemon, tmp_path, started):
    """Every way to launch through a default root daemon, `run` (any --per-host, restarts
    allowed), the mesh, and a bare spawn request, is refused: no process of the daemon ever
    runs, so none runs as uid 0."""
    d = lone_daemon()
    out = tmp_path / "uids"
    out.mkdir()
    job = f"import os; open('{out}/' + os.environ['RANK'], 'w').write(str(os.getuid()))"
    for per_host in ("1", "4"):
        r = run(d, "--per-host", per_host, "--max-restarts", "2", "--", sys.executable, "-c", job)
        assert r.returncode == 1 and ROOT_PROCS_FLAG in r.stderr, r.stderr
    with HostMesh.connect(d.addr, token_file=d.token_file) as hosts:
        with pytest.raises(SpawnError) as e:
            hosts.spawn_procs(per_host=2, python_path=[TESTS])
    assert f"{d.dir.name} ({d.addr}): this daemon runs as root" in str(e.value)
    assert "\n" not in str(e.value)

    async def bare_spawn() -> RemoteError:
        async with await connect(d.addr, load_token(Path(d.token_file))) as chan:
            with pytest.raises(RemoteError) as refused:
                await chan.request("spawn", argv=[sys.executable, "-c", job],
                                   env={"RANK": "bare"})
            return refused.value

    refused = trio.run(bare_spawn)
    assert refused.code == "refused" and ROOT_PROCS_FLAG in refused.message
    uids = {p.name: p.read_text() for p in out.iterdir()}
    assert uids == {}, f"ranks ran, as uids {uids}"
    assert descendants(d.pid) == []
    s = json.loads(status(d, "--json").stdout)[0]
    assert (s["root_procs"], s["procs_user"]) == (False, "")


@pytest.mark.mount
def test_status_says_whether_a_node_runs_root_processes(lone_daemon):
    refusing, allowing = lone_daemon(), lone_daemon(ROOT_PROCS_FLAG)
    [refused] = status(refusing).stdout.splitlines()  # one line per node
    [allowed] = status(allowing).stdout.splitlines()
    assert refused.startswith(refusing.addr), refused
    assert refused.endswith(f"  processes refused (root without {ROOT_PROCS_FLAG})"), refused
    assert allowed.endswith(f"  processes as root ({ROOT_PROCS_FLAG})"), allowed
    s = json.loads(status(allowing, "--json").stdout)[0]
    assert (s["root_procs"], s["procs_user"]) == (True, "root")


# ---- with the flag ------------------------------------------------------------------------------

@pytest.mark.mount
def test_with_the_flag_ranks_run_as_root(lone_daemon):
    d = lone_daemon(ROOT_PROCS_FLAG)
    r = run(d, "--per-host", "2", "--", sys.executable, "-c", PROBE)
    assert r.returncode == 0, r.stderr
    assert [o["uid"] for o in rank_output(r.stdout)] == [0, 0]
    assert f"processes: run as root ({ROOT_PROCS_FLAG})" in d.log()


@pytest.mark.mount
def test_run_env_arrives_and_nothing_of_the_daemon_or_the_shell_does(lone_daemon):
    d = lone_daemon(ROOT_PROCS_FLAG, env={"ONLY_IN_DAEMON": "daemon-secret",
                                          "MONARCH_FS_PROBE_SETTING": "daemon-setting"})
    r = run(d, "--env", "JOB_A=1", "--env", "JOB_B=x=y", "--env", "EMPTY=", "--",
            sys.executable, "-c", PROBE, env={"ONLY_IN_SHELL": "shell-secret"})
    assert r.returncode == 0, r.stderr
    [env] = [o["env"] for o in rank_output(r.stdout)]
    assert (env["JOB_A"], env["JOB_B"], env["EMPTY"]) == ("1", "x=y", "")
    for leak in ("ONLY_IN_DAEMON", "MONARCH_FS_PROBE_SETTING", "ONLY_IN_SHELL", "MONARCH_FS_HOME"):
        assert leak not in env, leak
    assert "daemon-secret" not in json.dumps(env) and "shell-secret" not in json.dumps(env)


@pytest.mark.mount
def test_mesh_env_arrives_and_nothing_of_the_daemon_does(lone_daemon, started):
    d = lone_daemon(ROOT_PROCS_FLAG, env={"ONLY_IN_DAEMON": "daemon-secret"})
    with HostMesh.connect(d.addr, token_file=d.token_file) as hosts:
        procs = hosts.spawn_procs(per_host=2, python_path=[TESTS],
                                  env={"JOB_SETTING": "on", "JOB_PATH": "{mount}/x"})
        started.add(*(pid for _, pid in procs.pids.values()))
        try:
            results = procs.spawn("probe", "mesh_actors:EnvProbe").probe.call().get()
        finally:
            procs.stop()
    assert len(list(results)) == 2
    for r in results:
        env = r["environ"]  # the block the kernel holds, as the daemon started the proc
        assert env["JOB_SETTING"] == "on" and env["JOB_PATH"] == f"{d.mnt}/x"
        assert "ONLY_IN_DAEMON" not in env and "daemon-secret" not in json.dumps(env)


# ---- the local cluster --------------------------------------------------------------------------

@pytest.mark.mount
def test_cluster_up_says_its_processes_run_as_root_and_can_refuse_them(tmp_path):
    allowing, refusing = tmp_path / "allowing", tmp_path / "refusing"
    try:
        up = mfs("cluster", "up", "--nodes", "1", "--dir", str(allowing))
        assert f"processes run as root: {ROOT_PROCS_FLAG} (local cluster)" in up.stdout
        up = mfs("cluster", "up", "--nodes", "1", "--dir", str(refusing), "--no-root-procs")
        assert f"processes are refused: the daemons run as root without {ROOT_PROCS_FLAG}" \
            in up.stdout
        for d, code in ((allowing, 0), (refusing, 1)):
            r = mfs("run", "--hosts", f"@{d / 'hosts'}", "--token-file", str(d / "token"),
                    "--", "true", check=False)
            assert r.returncode == code, r.stderr
        # A node started again (after it died) keeps its cluster's choice.
        for d, code in ((allowing, 0), (refusing, 1)):
            pid = int((d / "node-0" / "pid").read_text())
            os.kill(pid, signal.SIGTERM)  # the daemon `cluster up` started for this test
            wait_for(lambda d=d: not cluster_mod.running_node(d, 0), what="node-0 to stop")
            cluster_mod.restart_node(d, 0)
            r = mfs("run", "--hosts", f"@{d / 'hosts'}", "--token-file", str(d / "token"),
                    "--", "true", check=False)
            assert r.returncode == code, r.stderr
    finally:
        for d in (allowing, refusing):
            mfs("cluster", "down", "--dir", str(d), check=False)
