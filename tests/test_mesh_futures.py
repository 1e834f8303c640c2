"""Futures, timeouts, failures scoped to ranks and stopping actors, on real daemons and procs."""

from __future__ import annotations

import subprocess
import time

import pytest

from monarch_fs.mesh import ActorError, CallTimeout, MeshError, SupervisionError

pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


@pytest.mark.mount
def test_killed_rank_fails_only_the_calls_that_target_it(procs, started, capfd):
    victims = procs.spawn("victim", "mesh_actors:Victim")
    pids = victims.pid.call().get()
    others = victims.slice(host=0)
    start = time.monotonic()
    killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -KILL {pids[3]}"])
    started.add(killer.pid)
    elsewhere = others.nap.call(1.5)  # in flight on ranks 0 and 1 while rank 3 dies
    with pytest.raises(SupervisionError) as info:
        victims.nap.call(60).get()  # pending when rank 3 is killed
    killer.wait()
    assert time.monotonic() - start < 10  # not the 60 s nap: the death ends the call
    f = info.value.failure
    assert (f.rank, f.signal, f.pid) == (3, "SIGKILL", pids[3]) and "node-1" in f.host
    text = str(info.value)
    assert "rank 3" in text and "killed by SIGKILL" in text
    assert "victim 3 says goodbye on stderr" in text  # the tail of its stderr
    assert procs.failure is not None and procs.failure.rank == 3
    assert list(procs.failures) == [3] and procs.slice(host=0).failures == {}

    assert elsewhere.get(timeout=10) == [0, 1]  # a call without rank 3 is untouched
    start = time.monotonic()
    with pytest.raises(SupervisionError) as again:
        victims.pid.call().get()  # a later call to rank 3 fails at once, with the same cause
    assert time.monotonic() - start < 0.5
    assert again.value.failure.describe() == f.describe()
    # Slices without it keep working: the other procs of its host too.
    assert others.pid.call().get() == [pids[0], pids[1]]
    assert victims.slice(host=1, proc=0).pid.call_one().get() == pids[2]
    assert capfd.readouterr().err.count("proc rank 3 of mesh 'procs'") == 1  # reported once


@pytest.mark.mount
def test_stuck_endpoint_times_out_naming_ranks_and_what_they_run(procs):
    victims = procs.spawn("victim", "mesh_actors:Victim")
    stuck = victims.stall.call(2, 3.0)  # rank 2 naps 3 s; the others answer at once
    behind = victims.slice(host=1, proc=0).pid.call_one()  # queued behind the nap on rank 2
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        stuck.get(timeout=0.5)
    assert time.monotonic() - start < 1.0
    text = str(info.value)
    assert "victim.stall: no answer within 0.5s from 1 of 4 ranks" in text
    assert "rank 2 on node-1" in text and "rank 0" not in text and "still in flight" in text
    with pytest.raises(CallTimeout, match=r"rank 2 .*running victim.stall \(this call waits"):
        behind.get(timeout=0.2)
    assert not stuck.done
    assert stuck.get(timeout=10) == [0, 1, 2, 3]  # the call completed later
    assert stuck.done and stuck.result() == [0, 1, 2, 3] and stuck.exception() is None
    assert behind.get(timeout=5) == victims.slice(host=1, proc=0).pid.call_one().get()

    procs.call_timeout = 0.3  # the default of every call of this mesh
    try:
        start = time.monotonic()
        with pytest.raises(CallTimeout):
            victims.slice(host=0).stall.call(0, 2.0).get()
        assert time.monotonic() - start < 0.8
        assert isinstance(victims.fail_stall.call(1).exception(timeout=5), ActorError)
    finally:
        procs.call_timeout = None


@pytest.mark.mount
def test_stopped_actor_mesh_cleans_up_and_refuses_calls(procs, tmp_path):
    tidy = procs.spawn("tidy", "mesh_actors:Tidy", str(tmp_path))
    counters = procs.spawn("counter", "mesh_actors:Counter", 0)
    tidy.slice(host=0).stop().get(timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleanup-0", "cleanup-1"]
    with pytest.raises(MeshError, match="actor mesh 'tidy' of proc mesh 'procs' was stopped"):
        tidy.ping.call().get()
    assert tidy.slice(host=1).ping.call().get() == [2, 3]
    assert counters.incr.call().get() == [1, 1, 1, 1]  # other actors of those procs go on
    procs.stop()  # the remaining actors' __cleanup__ run before their procs exit
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"cleanup-{r}" for r in range(4)]


@pytest.mark.mount
def test_a_failed_rank_is_respawned_with_its_actors(procs, started):
    counters = procs.spawn("counter", "mesh_actors:Counter", 10)
    pids = counters.get.call().get()
    with pytest.raises(MeshError, match="is alive"):
        procs.respawn(3)
    counters.slice(hosts=1, procs=1).incr.call_one(5).get()
    killer = subprocess.Popen(["kill", "-KILL", str(pids[3][3])])
    killer.wait()
    with pytest.raises(SupervisionError):
        counters.get.call().get(timeout=30)
    procs.respawn(3)
    started.add(procs.pids[3][1])
    got = counters.get.call().get(timeout=30)
    assert [v for _, v, _, _ in got] == [10, 10, 10, 10]  # constructed again, with its args
    assert got[3][3] not in (pids[3][3], pids[2][3]) and got[3][2] == "node-1"
    assert got[0][3] == pids[0][3]  # the other ranks are the same procs
    assert counters.incr.call(1).get() == [11, 11, 11, 11]
