"""What an actor's code finds around it in a proc: the torchrun environment (a gloo all-reduce
inside an actor mesh) and asyncio for async endpoints; on real daemons and procs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

TESTS = str(Path(__file__).parent)
pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


@pytest.mark.mount
def test_torchrun_environment_and_gloo_all_reduce_inside_actors(procs):
    trainers = procs.spawn("trainer", "mesh_actors:Trainer")
    envs = trainers.env.call().get(timeout=30)
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and next(iter(ports)).isdigit()
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {
        ("4", "2", "127.0.0.1")}
    assert trainers.all_reduce.call().get(timeout=120) == [10.0] * 4  # 1 + 2 + 3 + 4


# What only a controller, or an actor that spawns meshes, uses: a proc imports none of it to
# start (four procs on two cores wait for each other's imports before the first call).
CONTROLLER_SIDE = ["monarch_fs.mesh.host_mesh", "monarch_fs.mesh.proc_mesh",
                   "monarch_fs.mesh.hang", "monarch_fs.daemon.client.stacks",
                   "monarch_fs.daemon.node.procs", "sqlite3", "asyncio"]


@pytest.mark.mount
def test_a_proc_imports_the_controllers_side_only_when_an_actor_uses_it(procs):
    one = procs.slice(hosts=0, procs=0).spawn("imports", "mesh_actors:Imports")
    assert one.loaded.call_one(CONTROLLER_SIDE).get(timeout=30) == []
    assert one.host_count.call_one().get(timeout=30) == 2  # self.hosts, made on first use
    assert "monarch_fs.mesh.host_mesh" in one.loaded.call_one(CONTROLLER_SIDE).get(timeout=30)


@pytest.mark.mount
def test_a_procs_link_to_an_owner_on_this_host_is_authenticated_not_encrypted(procs):
    """The push's policy (addresses.encrypts "auto"): a link that stays on loopback is sealed
    with a tag per frame but not encrypted, which cost a pass over every byte of a tensor."""
    links = [proc.chan.conn for proc in procs._state.procs]
    assert [(c.encrypted, c.bulk_key is not None) for c in links] == [(False, True)] * 4


@pytest.mark.mount
def test_async_endpoints_run_on_asyncio(procs):
    users = procs.slice(hosts=0).spawn("user", "mesh_actors:AsyncUser")
    assert users.pipeline.call(5).get(timeout=30) == [
        {"total": 10, "executor": 7, "rank": 0}, {"total": 10, "executor": 7, "rank": 1}]
    # An async endpoint awaits mesh calls on asyncio too (actors calling actors).
    buffers = procs.slice(hosts=1).spawn("buffer", "mesh_actors:Buffer")
    producers = procs.slice(hosts=0).spawn("producer", "mesh_actors:Producer")
    assert producers.produce_async.call(buffers).get(timeout=30) == [[2, 3], [2, 3]]


@pytest.mark.mount
def test_a_2_gib_tensor_round_trip(hosts, started):
    import torch

    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS], name="big")
    started.add(*(pid for _, pid in procs.pids.values()))
    try:
        echo = procs.slice(hosts=1).spawn("echo", "mesh_actors:Echo")
        big = torch.arange((2 << 30) // 8, dtype=torch.int64)  # 2 GiB: over any frame's size
        small = torch.ones(3)
        back = echo.echo.call_one({"big": big, "small": small}).get(timeout=300)
        assert back["big"].shape == big.shape and torch.equal(back["big"], big)
        assert torch.equal(back["small"], small)
        assert back["big"].data_ptr() % 64 == 0  # rebuilt in place, aligned
    finally:
        procs.stop()


@pytest.mark.mount
def test_a_closed_stdout_loses_output_not_the_mesh(procs, monkeypatch):
    """The ranks' output is printed in the mesh's loop: a script whose stdout is closed (or
    piped to a reader that left) loses those lines, and its mesh keeps answering."""
    import io
    import sys

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    chatter = procs.spawn("chatter", "mesh_actors:Chatter")
    chatter.chatter.call("a").get(timeout=30)
    time.sleep(1.5)  # the output reaches the controller and is printed (or not)
    chatter.chatter.call("b").get(timeout=30)
    assert len(procs.pids) == 4


@pytest.mark.mount
def test_log_control_forwards_folds_and_sets_the_level(procs, capfd):
    import logging

    chatter = procs.spawn("chatter", "mesh_actors:Chatter")

    def output_of(tag: str) -> tuple[str, str]:
        chatter.chatter.call(tag).get(timeout=30)
        time.sleep(1.5)  # output travels through the daemons; a fold waits for its window
        got = capfd.readouterr()
        return got.out, got.err

    out, _ = output_of("a")  # the default: every line, prefixed with its rank
    assert out.count("same line a") == 4 and "[rank 2] same line a" in out
    procs.logging_option(aggregate_window_sec=0.5, level=logging.INFO).get(timeout=30)
    out, err = output_of("b")
    assert "[procs ranks 0-3, 4 lines] same line b" in out and out.count("same line b") == 1
    assert "[rank 1] rank 1 alone b" in out  # a line of one rank keeps its prefix
    assert "info line b rank 3" in err and "debug line b" not in err
    procs.logging_option(level=logging.DEBUG).get(timeout=30)
    out, err = output_of("c")
    assert out.count("same line c") == 4 and "debug line c rank 0" in err
    procs.logging_option(stream_to_client=False, level=logging.WARNING).get(timeout=30)
    out, err = output_of("d")
    assert "line d" not in out + err
    with pytest.raises(ValueError, match="needs stream_to_client=True"):
        procs.logging_option(stream_to_client=False, aggregate_window_sec=1)
