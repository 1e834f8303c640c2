"""Every rank's output in SQL (daemon/node/logs.py, daemon/client/logs.py) and folded on the
controller (daemon/client/fold.py): real daemons, real processes, the real command line. After
a job where rank 2 printed 1,000 lines and died, `monarch-fs logs --rank 2` shows them in
order; identical lines of four ranks print once, and every one with --no-fold; another user's
output is refused under --identity munge."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import CLI_MODULE, mfs, terminate
from monarch_fs.daemon.client.fold import FoldedOutput, rank_ranges
from monarch_fs.daemon.node import logs as node_logs
from monarch_fs.daemon.node.logs import LogLines

# Each rank waits for every other to start (a file each), then does what argv says.
JOB = textwrap.dedent("""
    import os, sys, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, mode = sys.argv[1], sys.argv[2]
    open(f"{out}/{rank}.up", "w").close()
    while len([n for n in os.listdir(out) if n.endswith(".up")]) < world:
        time.sleep(0.01)
    if mode == "chatty":  # rank 2 prints 1,000 numbered lines and dies; the others wait
        if rank == 2:
            for i in range(1000):
                print(f"line {i:04d} of rank 2")
            print("rank 2 cannot go on", file=sys.stderr)
            sys.exit(4)
        time.sleep(60)
    elif mode == "ticks":  # rank 0 prints a numbered line every 0.1 s
        for i in range(60 if rank == 0 else 0):
            print(f"tick {i}", flush=True)
            time.sleep(0.1)
    elif mode == "same":  # every rank prints the same two lines, and one of its own
        print("epoch 3 done", flush=True)
        print(f"loss of rank {rank}", flush=True)
        print("all saved", flush=True)
""")


def run(c, tmp_path, mode: str, *args: str) -> tuple[object, str]:
    """`monarch-fs run --per-host 2 ARGS -- python job.py OUT MODE`: its result and job id."""
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / f"out-{mode}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    r = mfs("run", "--hosts", c.hostfile, "--token-file", c.token_file, "--per-host", "2",
            *args, "--", sys.executable, str(tmp_path / "job.py"), str(out), mode,
            check=False, timeout=90)
    m = re.search(r"monarch-fs logs (\S+) --rank", r.stderr)
    return r, m.group(1) if m else ""


def logs(c, *args: str, check: bool = True):
    return mfs("logs", "--hosts", c.hostfile, "--token-file", c.token_file, *args, check=check)


@pytest.mark.mount
def test_a_dead_rank_s_thousand_lines_come_back_in_order(cluster2, tmp_path):
    r, job = run(cluster2, tmp_path, "chatty")
    assert r.returncode == 4, r.stderr
    assert job, r.stderr  # the failure report names the job and the command
    assert f"monarch-fs repro {job} --rank 2" in r.stderr

    got = logs(cluster2, "--rank", "2")  # the newest job
    assert got.stderr.startswith(f"monarch-fs logs: job {job}"), got.stderr
    lines = got.stdout.splitlines()
    want = [f"[rank 2] line {i:04d} of rank 2" for i in range(1000)]
    # (stdout and stderr are two pipes: their lines keep their order within each)
    assert [ln for ln in lines if " of rank 2" in ln] == want
    assert len(lines) == 1001 and "[rank 2] rank 2 cannot go on" in lines

    # the same by its id, narrowed by a pattern and by time
    got = logs(cluster2, job, "--rank", "2", "--grep", r"line 09\d7")
    assert got.stdout.splitlines() == [f"[rank 2] line 09{i}7 of rank 2" for i in range(10)]
    assert logs(cluster2, job, "--since", "10m").stdout.count("\n") == 1001
    none = logs(cluster2, job, "--since", "2099-01-01T00:00", check=False)
    assert none.returncode == 1 and not none.stdout
    assert f"no lines of job {job} matching" in none.stderr

    # and in SQL, over both nodes: the other ranks printed nothing
    q = mfs("query", f"SELECT rank, count(*) AS n, max(stream) AS s FROM logs WHERE job = '{job}' "
            "GROUP BY rank", "--hosts", cluster2.hostfile, "--token-file", cluster2.token_file,
            "--json")
    rows = json.loads(q.stdout)["rows"]
    assert rows == [{"rank": 2, "n": 1001, "s": "stdout"}], rows

    bad = logs(cluster2, job, "--grep", "(", check=False)
    assert bad.returncode == 1 and "not a regular expression" in bad.stderr


@pytest.mark.mount
def test_identical_lines_of_many_ranks_print_once_unless_no_fold(cluster2, tmp_path):
    r, _ = run(cluster2, tmp_path, "same")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out.count("[ranks 0-3] epoch 3 done") == 1, r.stdout
    assert out.count("[ranks 0-3] all saved") == 1, r.stdout
    assert sorted(ln for ln in out if "loss" in ln) == [
        f"[rank {i}] loss of rank {i}" for i in range(4)]
    for i in range(4):  # each rank's lines in the order it printed them
        mine = [ln for ln in out if re.search(rf"\[ranks? ([0-9,-]*\b{i}\b|0-3)\]", ln)]
        assert [ln.split("] ", 1)[1] for ln in mine] == [
            "epoch 3 done", f"loss of rank {i}", "all saved"], out

    r, _ = run(cluster2, tmp_path, "same", "--no-fold")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert sorted(ln for ln in out if "epoch 3 done" in ln) == [
        f"[rank {i}] epoch 3 done" for i in range(4)]

    # read back afterwards, the same folding, by when each node read each line
    got = logs(cluster2)
    assert got.stdout.splitlines().count("[ranks 0-3] epoch 3 done") == 1, got.stdout
    got = logs(cluster2, "--no-fold")
    assert got.stdout.count("epoch 3 done") == 4


@pytest.mark.mount
def test_follow_prints_lines_as_the_nodes_record_them(cluster2, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "run", "--hosts", cluster2.hostfile, "--token-file",
         cluster2.token_file, "--", sys.executable, str(tmp_path / "job.py"), str(out),
         "ticks"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    follow = None
    try:
        assert job.stdout.readline() == "[rank 0] tick 0\n"
        follow = subprocess.Popen(
            [sys.executable, "-m", CLI_MODULE, "logs", "--follow", "--hosts",
             cluster2.hostfile, "--token-file", cluster2.token_file],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        while (line := follow.stdout.readline()) and line != "[rank 0] tick 59\n":
            seen.append(line.strip())
        assert line == "[rank 0] tick 59\n", seen  # printed after it started: it followed
        assert seen == [f"[rank 0] tick {i}" for i in range(59)]
        follow.send_signal(signal.SIGINT)  # how a user stops it
        assert follow.wait(10) == 0
        assert job.wait(30) == 0
    finally:
        for p in (follow, job):
            if p is not None:
                terminate(p)


def test_folding_keeps_each_rank_s_order():
    out = io.StringIO()
    now = [0.0]
    f = FoldedOutput(out, out, clock=lambda: now[0])
    f.lines(0, "stdout", ["a", "b"])
    f.lines(1, "stdout", ["b"])  # rank 1 printed b before its a: b must come first for it
    f.lines(1, "stdout", ["a"])
    now[0] = 0.2
    f.lines(2, "stderr", ["a"])  # another stream is another line
    now[0] = 1.0
    f.due()
    assert out.getvalue().splitlines() == ["[rank 0] a", "[ranks 0-1] b", "[rank 1] a",
                                           "[rank 2] a"]
    assert rank_ranges([7, 0, 1, 2, 4, 6]) == "0-2,4,6-7"


def test_lines_past_the_bound_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(node_logs, "MAX_PENDING_LINES", 5)

    class Proc:
        id, job, rank, restart, uid = 1, "j", 0, 0, 0

    held = LogLines("node-0")
    held.add(Proc(), "stdout", [str(i) for i in range(8)])
    rows, dropped = held.take()
    assert [r[-1] for r in rows] == ["0", "1", "2", "3", "4"] and dropped == 3


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged")
                    or not shutil.which("useradd"),
                    reason="needs root, munged (package munge) and useradd")
def test_another_user_s_output_is_refused_under_identity_munge(tmp_path):
    from test_identity import as_user, munge_nodes

    with munge_nodes(tmp_path, 1) as (daemons, munged, _, (a, b)):
        addr = daemons[0].addr
        out = as_user(a, munged, "run", "--hosts", addr, "--", "/usr/bin/python3", "-c",
                      "print('secret of A'); raise SystemExit(2)")
        assert out.returncode == 2, out.stderr
        job = re.search(r"monarch-fs logs (\S+) --rank", out.stderr).group(1)

        mine = as_user(a, munged, "logs", job, "--hosts", addr)
        assert mine.returncode == 0, mine.stderr
        assert mine.stdout == "[rank 0] secret of A\n"

        theirs = as_user(b, munged, "logs", job, "--hosts", addr)
        assert theirs.returncode == 1 and "secret of A" not in theirs.stdout
        assert f"{addr}: " in theirs.stderr, theirs.stderr  # names the node and the cause
        assert (f"job {job} ran as uid {a.pw.pw_uid}, not as you (uid {b.pw.pw_uid})"
                in theirs.stderr), theirs.stderr
        newest = as_user(b, munged, "logs", "--hosts", addr)  # B has no job of its own
        assert newest.returncode == 1 and "no node holds the output" in newest.stderr
        assert "secret of A" not in newest.stdout

        # nor through SQL: a user's view of the logs table holds their own lines only
        q = "SELECT count(*) AS n, group_concat(line) AS lines FROM logs"
        seen_by_b = as_user(b, munged, "query", "--json", q, "--hosts", addr)
        assert seen_by_b.returncode == 0, seen_by_b.stderr
        assert json.loads(seen_by_b.stdout)["rows"][0]["n"] == 0, seen_by_b.stdout
        seen_by_a = as_user(a, munged, "query", "--json", q, "--hosts", addr)
        assert "secret of A" in json.loads(seen_by_a.stdout)["rows"][0]["lines"], seen_by_a


async def test_the_logs_table_holds_the_events_bounds(tmp_path):
    """A chatty process's lines into a 1 MiB bound: the database stays within it, the newest
    lines are kept; and lines older than the age bound go."""
    import trio

    from monarch_fs.daemon.node.events import EventLog

    class Proc:
        id, job, rank, restart, uid = 1, "j", 0, 0, 0

    events = EventLog(tmp_path / "events.db", "node-0", max_bytes=1 << 20, interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        for batch in range(20):
            events.lines.add(Proc(), "stdout", [f"line {batch}-{i} " + "x" * 100
                                                for i in range(5000)])
            await events.flush()
        nursery.cancel_scope.cancel()
    answer = await events.query("SELECT count(*), min(id), (SELECT line FROM logs ORDER BY "
                                "id DESC LIMIT 1) FROM logs")
    await events.close()
    count, first, newest = answer.rows[0]
    assert (tmp_path / "events.db").stat().st_size <= 1 << 20
    assert 0 < count < 20_000 and first > 80_000 and newest.startswith("line 19-4999 ")

    aged = EventLog(tmp_path / "aged.db", "node-0", max_age=0.5, interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(aged.run)
        aged.lines.add(Proc(), "stdout", ["old"])
        await aged.flush()
        await trio.sleep(0.7)
        aged.lines.add(Proc(), "stderr", ["new"])
        await aged.flush()
        answer = await aged.query("SELECT stream, line FROM logs")
        nursery.cancel_scope.cancel()
    await aged.close()
    assert answer.rows == [["stderr", "new"]]


@pytest.mark.mount
@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")
def test_a_proc_mesh_s_output_is_kept_under_its_own_job(cluster2):
    from pathlib import Path

    from monarch_fs.mesh import HostMesh

    with HostMesh.connect(cluster2.hostfile, token_file=cluster2.token_file) as hosts:
        procs = hosts.spawn_procs(per_host=2, python_path=[str(Path(__file__).parent)])
        try:
            procs.spawn("victims", "mesh_actors:Victim").pid.call()
        finally:
            procs.stop()
    got = logs(cluster2)  # the newest job: the mesh's
    job = got.stderr.removeprefix("monarch-fs logs: job ").strip()
    assert re.fullmatch(r"procs-\d{4}-\d{6}-[0-9a-f]{4}", job), got.stderr
    assert sorted(got.stdout.splitlines()) == [
        f"[rank {r}] victim {r} says goodbye on stderr" for r in range(4)]
