"""`monarch-fs stacks` and `run --hang-timeout`: py-spy dumps of every rank of a running job,
taken by each node's real daemon, folded across ranks; through the real command line against
real processes. Every rank a test starts is checked gone at its end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from stack_actors import Loader

from helpers import CLI_MODULE, job_files, mfs, wait_for
from monarch_fs.mesh import HostMesh, SupervisionError
from procwatch import Started, descendants

pytestmark = pytest.mark.mount

# Rank 3 blocks in load_batch; the others wait for it in wait_for_batch. Each rank records its
# pid once it got there, and prints one line first (a hang is silence after it).
JOB = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    out = sys.argv[1]
    quiet = float(sys.argv[2]) if len(sys.argv) > 2 else 0

    def load_batch():
        time.sleep(600)

    def wait_for_batch():
        while True:
            time.sleep(0.05)

    print(f"rank {rank} ready", flush=True)
    if quiet:  # silent for a while, then done: a job that only looked hung
        time.sleep(quiet)
        print(f"rank {rank} done", flush=True)
        sys.exit(0)
    with open(f"{out}/{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(f"{out}/{rank}.tmp", f"{out}/{rank}.pid")
    if rank == 3:
        load_batch()
    else:
        wait_for_batch()
""")


@pytest.fixture
def job(tmp_path):
    return job_files(tmp_path, JOB)


def target(cluster) -> list[str]:
    return ["--hosts", cluster.hostfile, "--token-file", cluster.token_file]


def rank_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("*.pid"))]


def start_job(cluster, job, started, *args: str) -> subprocess.Popen:
    """`monarch-fs run --per-host 2 ARGS -- python job.py OUT` in the background, once every
    rank reached its blocking call."""
    script, out = job
    proc = subprocess.Popen([sys.executable, "-m", CLI_MODULE, "run", *target(cluster),
                             "--per-host", "2", *args, "--", sys.executable, str(script),
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    started.add(proc.pid)
    wait_for(lambda: len(rank_pids(out)) == 4, 60, "every rank to block")
    started.add(*rank_pids(out), match=str(script))
    return proc


def stop_job(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # by its pid: the daemons stop its ranks
    proc.communicate(timeout=30)


def test_stacks_names_the_odd_rank_folded_against_the_others(cluster2, job, started):
    proc = start_job(cluster2, job, started)
    try:
        t = time.monotonic()
        r = mfs("stacks", *target(cluster2), check=False)
        seconds = time.monotonic() - t
        assert r.returncode == 0, r.stderr
        assert seconds < 2.0, f"stacks took {seconds:.2f} s"
        lines = r.stdout.splitlines()
        assert lines[0].startswith("job run-") and "4 ranks on 2 nodes" in lines[0]
        assert lines[1].startswith("ranks 0-2: wait_for_batch (job.py:")
        assert " | rank 3: load_batch (job.py:" in lines[1]
        assert "ranks 0-2 (node-0, node-1):" in lines and "rank 3 (node-1):" in lines

        j = json.loads(mfs("stacks", *target(cluster2), "--json").stdout)
        assert [g["ranks"] for g in j["groups"]] == [[0, 1, 2], [3]]
        assert j["groups"][1]["threads"][0]["frames"][0]["name"] == "load_batch"
        assert sorted(r["rank"] for r in j["ranks"]) == [0, 1, 2, 3] and j["errors"] == []
        assert {r["pid"] for r in j["ranks"]} == set(rank_pids(job[1]))

        # a node that cannot be reached is one line; the others' ranks still come back
        with socket.socket() as closed:  # bound, not listening: connections are refused
            closed.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{closed.getsockname()[1]}"
            r = mfs("stacks", "--hosts", ",".join([*cluster2.hosts, dead]), "--token-file",
                    cluster2.token_file, check=False)
        assert r.returncode == 1
        assert r.stdout.splitlines()[1] == lines[1]
        assert [x for x in r.stdout.splitlines() if "no stacks" in x] == [
            x for x in r.stdout.splitlines() if x.startswith(f"{dead}: no stacks: ")], r.stdout

        # the same job by name, with native frames; every dump is in the nodes' stacks table
        native = mfs("stacks", j["job"], "--native", *target(cluster2))
        assert "time_sleep (libpython" in native.stdout or "clock_nanosleep" in native.stdout
        assert native.stdout.splitlines()[1] == lines[1]
        q = mfs("query", *target(cluster2), "--json", "SELECT rank, top, native FROM stacks "
                f"WHERE job = '{j['job']}' AND native = 0 AND hang IS NULL")
        rows = json.loads(q.stdout)["rows"]
        assert sorted(row["rank"] for row in rows) == sorted([0, 1, 2, 3] * 3)  # three dumps
        assert {row["top"].split(" ")[0] for row in rows if row["rank"] == 3} == {"load_batch"}
    finally:
        stop_job(proc)


def test_hang_timeout_reports_every_rank_and_fails_the_job(cluster2, job, started):
    script, out = job
    t = time.monotonic()
    r = mfs("run", *target(cluster2), "--per-host", "2", "--hang-timeout", "3", "--",
            sys.executable, str(script), str(out), check=False, timeout=60)
    seconds = time.monotonic() - t
    started.add(*rank_pids(out), match=str(script))
    assert r.returncode != 0
    assert seconds < 8.0, f"run took {seconds:.1f} s"
    err = r.stderr
    assert "hang: no rank printed anything for 3 s" in err
    assert "ranks 0-2: wait_for_batch (job.py:" in err and "| rank 3: load_batch (job.py:" in err
    assert "rank 3 on node-1" in err and "failed: hung" in err
    job_name = err.split("the stacks of job ", 1)[1].split(":", 1)[0]
    q = mfs("query", *target(cluster2), "--json",
            "SELECT host, text, detail FROM events WHERE kind = 'job.hang'")
    hangs = [row for row in json.loads(q.stdout)["rows"]
             if json.loads(row["detail"])["job"] == job_name]
    assert len(hangs) == 2  # one per node, each with its own ranks' stacks
    assert any("rank 3: load_batch" in row["text"] for row in hangs)


def test_a_hang_restarts_the_group_while_restarts_remain(cluster2, job, started):
    script, out = job
    r = mfs("run", *target(cluster2), "--per-host", "1", "--hang-timeout", "2",
            "--max-restarts", "1", "--", sys.executable, str(script), str(out), check=False,
            timeout=60)
    started.add(*rank_pids(out), match=str(script))
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("hang: no rank printed anything for 2 s") == 2  # once per attempt
    assert "(attempt 1 of 2)" in r.stderr and "(attempt 2 of 2)" in r.stderr
    assert "restarting all 2 ranks (1 restarts left)" in r.stderr
    assert "ranks 0-1: wait_for_batch (job.py:" in r.stderr


def test_on_hang_wait_lets_a_quiet_job_finish(cluster2, job):
    script, out = job
    r = mfs("run", *target(cluster2), "--per-host", "1", "--hang-timeout", "1",
            "--on-hang", "wait", "--", sys.executable, str(script), str(out), "3",
            check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "hang: no rank printed anything for 1 s" in r.stderr
    assert "--on-hang wait: letting it run" in r.stderr
    assert r.stderr.count("hang: no rank printed") == 1  # once per silence
    assert "[rank 1] rank 1 done" in r.stdout


@pytest.mark.slow
def test_ranks_waiting_in_a_torch_collective_fold_against_the_one_that_never_came(cluster2,
                                                                                   tmp_path):
    """The demo's job: rank 3 never reaches gloo's all_reduce, where the others wait. (Silence
    counts from the start: 15 s covers four torch imports on two busy cores.)"""
    script = Path(__file__).parent / "allreduce_job.py"
    r = mfs("run", *target(cluster2), "--per-host", "2", "--hang-timeout", "15", "--cwd",
            str(tmp_path), "--", sys.executable, str(script), "--hang", "3", check=False,
            timeout=120)
    assert r.returncode == 1, r.stderr
    assert ("ranks 0-2: all_reduce (torch/distributed/distributed_c10d.py:" in r.stderr
            and "| rank 3: load_batch (allreduce_job.py:" in r.stderr), r.stderr
    assert "rank 3 on node-1" in r.stderr and "its stack differs from the other 3" in r.stderr


def test_the_summary_names_the_function_where_the_ranks_part_ways():
    from monarch_fs.daemon.client.stacks import Group, headline
    from monarch_fs.daemon.wire.stacks import Frame, Thread

    def group(ranks, *frames):
        t = Thread("MainThread", 1, False, tuple(Frame(*f) for f in frames))
        return Group(ranks, ["node-0"], (t,), t)

    waiting = group([0, 1, 2, 4, 5, 6, 7], ("all_reduce", "torch/distributed_c10d.py", 3252),
                    ("wrapper", "torch/c10d_logger.py", 83), ("main", "train.py", 45),
                    ("<module>", "train.py", 57))
    reading = group([3], ("read", "io.py", 5), ("load_batch", "train.py", 27),
                    ("main", "train.py", 43), ("<module>", "train.py", 57))
    assert headline([waiting, reading]) == ("ranks 0-2,4-7: all_reduce "
                                            "(torch/distributed_c10d.py:3252) | "
                                            "rank 3: read (io.py:5) in load_batch")
    assert headline([waiting]) == "ranks 0-2,4-7: all_reduce (torch/distributed_c10d.py:3252)"


def test_no_job_and_an_unknown_job_are_said(cluster2):
    r = mfs("stacks", *target(cluster2), check=False)
    assert r.returncode == 1 and "no job runs on any node" in r.stderr
    r = mfs("stacks", "run-nothere", *target(cluster2), check=False)
    assert r.returncode == 1 and "job run-nothere runs on no node" in r.stderr


def test_a_rank_py_spy_cannot_read_is_one_line_per_node(cluster2, started):
    sleep = shutil.which("sleep")
    proc = subprocess.Popen([sys.executable, "-m", CLI_MODULE, "run", *target(cluster2),
                             "--per-host", "2", "--", sleep, "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.add(proc.pid)

    def ranks() -> list[int]:
        s = Started()
        s.add(*(p for i in (0, 1) for p in descendants(cluster2.pid(i))), match=f"{sleep} 600")
        return s.alive()

    try:
        wait_for(lambda: len(ranks()) == 4, 30, "the ranks")
        started.add(*ranks())
        r = mfs("stacks", *target(cluster2), check=False)
        assert r.returncode == 1
        lines = [x for x in r.stdout.splitlines() if "cannot dump" in x]
        assert [x.split(":")[0] for x in lines] == ["node-0", "node-1"], r.stdout
        assert "cannot dump ranks 0-1" in lines[0] and "cannot dump ranks 2-3" in lines[1]
        assert all("not a Python process" in x for x in lines), lines
    finally:
        stop_job(proc)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged") or not shutil.which("useradd"),
                    reason="needs root, munged (package munge) and useradd")
def test_another_users_processes_are_refused_under_munge(tmp_path):
    from test_identity import as_user, munge_nodes
    from users import CLI

    code = "import time\ndef a_waits():\n    time.sleep(600)\nprint('ready', flush=True)\na_waits()"
    with munge_nodes(tmp_path, 1) as (daemons, munged, _forger, (a, b)):
        daemon = daemons[0]
        proc = subprocess.Popen(
            [*CLI, "run", "--hosts", daemon.addr, "--", "/usr/bin/python3", "-c", code],
            user=a.pw.pw_uid, group=a.pw.pw_gid, extra_groups=[], cwd=a.home, text=True,
            env={**a.env(), "MONARCH_FS_MUNGE_SOCKET": str(munged.socket),
                 "MONARCH_FS_TOKEN_FILE": str(a.home / "token")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == "[rank 0] ready", proc.stderr.read()
            mine = as_user(a, munged, "stacks", "--hosts", daemon.addr, "--json")
            assert mine.returncode == 0, mine.stderr
            j = json.loads(mine.stdout)
            assert j["groups"][0]["threads"][0]["frames"][0]["name"] == "a_waits"

            theirs = as_user(b, munged, "stacks", j["job"], "--hosts", daemon.addr)
            assert theirs.returncode == 1
            assert (f"job {j['job']} runs here as uid {a.pw.pw_uid}, not as you (uid "
                    f"{b.pw.pw_uid})") in theirs.stderr, theirs.stderr
            assert "a_waits" not in theirs.stdout + theirs.stderr
            none = as_user(b, munged, "stacks", "--hosts", daemon.addr)
            assert none.returncode == 1 and "no job runs on any node" in none.stderr
            # nor through SQL: the stacks table, where A's dump was recorded, shows a user
            # their own rows only (root all)
            sql = "SELECT count(*) AS n, group_concat(stack) AS s FROM stacks"
            seen_by_b = as_user(b, munged, "query", "--json", sql, "--hosts", daemon.addr)
            assert seen_by_b.returncode == 0, seen_by_b.stderr
            assert json.loads(seen_by_b.stdout)["rows"][0]["n"] == 0, seen_by_b.stdout
            seen_by_a = as_user(a, munged, "query", "--json", sql, "--hosts", daemon.addr)
            assert "a_waits" in json.loads(seen_by_a.stdout)["rows"][0]["s"], seen_by_a.stdout
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)


def test_a_proc_mesh_call_that_hangs_fails_naming_the_rank_with_every_stack(cluster2, started,
                                                                           capfd):
    tests = str(Path(__file__).parent)
    with HostMesh.connect(cluster2.hostfile, token_file=cluster2.token_file) as hosts:
        procs = hosts.spawn_procs(per_host=2, python_path=[tests], name="stuck",
                                  hang_timeout=2)
        started.add(*(pid for _, pid in procs.pids.values()))
        try:
            loaders = procs.spawn("loader", Loader)
            t = time.monotonic()
            with pytest.raises(SupervisionError, match=r"proc rank 3 of mesh 'stuck'.*hung: "
                               r"call loader.step waited 2 s for ranks 0-3; its stack differs"):
                loaders.step.call().get()
            assert time.monotonic() - t < 6
        finally:
            procs.stop()
    err = capfd.readouterr().err
    assert "hang: call loader.step waited 2 s for ranks 0-3; the stacks of proc mesh 'stuck'" \
        in err
    assert "ranks 0-2: wait_for_batch (stack_actors.py:" in err
    assert "| rank 3: load_batch (stack_actors.py:" in err
    q = mfs("query", *target(cluster2), "--json",
            "SELECT rank, top FROM stacks WHERE job LIKE 'stuck-%' AND hang IS NOT NULL")
    tops = {row["rank"]: row["top"] for row in json.loads(q.stdout)["rows"]}
    assert sorted(tops) == [0, 1, 2, 3]  # the main thread's: the runtime's loop


# A rank that makes itself non-dumpable (PR_SET_DUMPABLE 0, as setuid programs and some
# sandboxes are): without CAP_SYS_PTRACE, not even its own user may read its memory.
UNDUMPABLE = textwrap.dedent("""
    import ctypes, os, time
    def sealed():
        time.sleep(600)
    def open_book():
        time.sleep(600)
    if os.environ["RANK"] == "0":
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    print("ready", flush=True)
    sealed() if os.environ["RANK"] == "0" else open_book()
""")


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="needs root (a test user's daemon) and useradd")
def test_a_daemon_without_ptrace_rights_says_why_in_one_line(tmp_path, started):
    from users import LocalUser

    user = LocalUser()
    try:
        with user.daemon(user.home / "mnt") as addr:
            where = ["--hosts", addr, "--token-file", str(user.home / "token")]
            job = subprocess.Popen([sys.executable, "-m", CLI_MODULE, "run", *where,
                                    "--per-host", "2", "--no-fold", "--",
                                    "/usr/bin/python3", "-c", UNDUMPABLE],
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            started.add(job.pid)
            try:
                assert [job.stdout.readline() for _ in range(2)] != ["", ""]
                time.sleep(0.2)  # both ranks printed (or one printed twice: checked below)
                r = mfs("stacks", *where, check=False)
                assert r.returncode == 1
                failed = [x for x in r.stdout.splitlines() if "cannot dump" in x]
                assert len(failed) == 1 and failed[0].startswith(
                    "unpriv: cannot dump rank 0 (pid "), r.stdout
                assert failed[0].endswith(
                    "py-spy may not read its memory: ptrace refused (another user's "
                    "process, a non-dumpable one, or kernel.yama.ptrace_scope above 0): the "
                    "daemon needs CAP_SYS_PTRACE, e.g. run it as root"), failed[0]
                assert "rank 1: open_book (<string>:" in r.stdout  # the other still came
            finally:
                stop_job(job)
    finally:
        user.close()
