"""`monarch-fs run` stopping ranks while a host's daemon does not answer (it is stopped with
SIGSTOP, as a wedged daemon answers nothing): run exits within its bound, with the failed
rank's status, naming that host and the ranks and PIDs left there (mesh/rank_stop.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager

import pytest

from helpers import CLI_MODULE, job_files, wait_for
from monarch_fs.mesh.hosts import KILL_TIMEOUT
from procwatch import Started

pytestmark = pytest.mark.mount

# Every rank records its pid; rank 1 (node-0) fails once the file `go` exists, the others sleep.
JOB = textwrap.dedent("""
    import os, sys, time
    rank, out = int(os.environ["RANK"]), sys.argv[1]
    open(f"{out}/{rank}.pid", "w").write(str(os.getpid()))
    if rank == 1:
        while not os.path.exists(f"{out}/go"):
            time.sleep(0.02)
        sys.exit(3)
    time.sleep(60)
""")


@pytest.fixture
def started():
    s = Started()
    yield s
    s.assert_gone()


@contextmanager
def stopped(pid: int):
    """SIGSTOP a daemon this test started (by its pid); SIGCONT it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def start_run(cluster, tmp_path, started: Started,
              *args: str) -> tuple[subprocess.Popen, dict[int, int]]:
    """`monarch-fs run --per-host 2 ARGS` of JOB, once all four ranks run: the run and their
    pids."""
    script, out = job_files(tmp_path, JOB)
    run = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "run", "--hosts", cluster.hostfile, "--token-file",
         cluster.token_file, "--per-host", "2", *args, "--", sys.executable, str(script),
         str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.add(run.pid)
    wait_for(lambda: len(list(out.glob("*.pid"))) == 4 or run.poll() is not None, 30,
             "the ranks to start")
    pids = {int(p.stem): int(p.read_text()) for p in out.glob("*.pid")}
    started.add(*pids.values(), match=str(script))
    assert len(pids) == 4, run.communicate()

    def answered() -> bool:  # each daemon logs a start just before it sends its reply
        logs = [(cluster.dir / f"node-{i}" / "log").read_text(errors="replace") for i in (0, 1)]
        return all(f"(pid {pid}" in logs[rank // 2] for rank, pid in pids.items())

    wait_for(answered, 10, "the daemons to answer every start")
    time.sleep(0.1)
    return run, pids


def test_a_failed_rank_ends_the_run_while_another_hosts_daemon_does_not_answer(
        fresh_cluster, tmp_path, started):
    c = fresh_cluster(2)
    run, pids = start_run(c, tmp_path, started, "--max-restarts", "1")
    with stopped(c.pid(1)):
        t = time.monotonic()
        (tmp_path / "out" / "go").touch()  # rank 1 fails; ranks 2 and 3 are node-1's
        try:
            _, err = run.communicate(timeout=KILL_TIMEOUT + 20)
        except subprocess.TimeoutExpired:
            run.kill()
            _, err = run.communicate()
            pytest.fail(f"run still stopping its ranks after {KILL_TIMEOUT + 20:g} s:\n{err}")
        took = time.monotonic() - t
    assert run.returncode == 3, err  # the failed rank's exit code, as before
    assert "rank 1 on node-0" in err and "exit code 3" in err
    assert "stopping the other 3 ranks" in err
    assert (f"node-1 ({c.hosts[1]}) did not answer the stop within {KILL_TIMEOUT:g} s" in err
            and f"rank 2 (pid {pids[2]}), rank 3 (pid {pids[3]})" in err), err
    assert "not restarting: a host did not answer the stop" in err  # node-1 may run them
    assert KILL_TIMEOUT - 1 < took < KILL_TIMEOUT + 10, (took, err)  # the bound, once
    # node-1's daemon, running again, finds the run gone and stops what it left there
    assert not started.wait_gone(15), "ranks outlived the run"


def test_ctrl_c_ends_a_stop_that_waits_for_a_daemon(fresh_cluster, tmp_path, started):
    c = fresh_cluster(2)
    run, _ = start_run(c, tmp_path, started)
    with stopped(c.pid(1)):
        (tmp_path / "out" / "go").touch()
        assert run.stderr is not None
        while "stopping the other 3 ranks" not in (line := run.stderr.readline()):
            assert line, "run ended before it stopped the ranks"
        t = time.monotonic()
        run.send_signal(signal.SIGINT)  # started by this test: signalled by pid
        _, err = run.communicate(timeout=KILL_TIMEOUT + 20)
        took = time.monotonic() - t
    assert run.returncode == 130, err
    assert took < KILL_TIMEOUT - 2, took  # not the daemon's bound
    assert not started.wait_gone(15), "ranks outlived the run"


def test_ctrl_c_while_ranks_run_stops_them_and_exits_130_again_and_again(
        fresh_cluster, tmp_path, started):
    # Ctrl-C is a cancellation (spmd.run_until_interrupted), so wherever it lands the ranks
    # are stopped and the run says "interrupted": never a traceback of trio's own state.
    c = fresh_cluster(2)
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        run, _ = start_run(c, tmp_path / str(attempt), started)
        time.sleep(0.05 * attempt)  # a little later into the run each time
        run.send_signal(signal.SIGINT)  # started by this test: signalled by pid
        _, err = run.communicate(timeout=KILL_TIMEOUT + 20)
        assert run.returncode == 130, err
        assert "monarch-fs: interrupted" in err and "Traceback" not in err, err
        assert not started.wait_gone(15), "ranks outlived the run"
