"""The actor mesh on real daemons: real procs, real sockets, real signals; nothing mocked.

Every test checks (through /proc) that each process it started is gone when it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from helpers import mounted, wait_for
from monarch_fs.daemon.wire.protocol import Data
from monarch_fs.mesh import (
    ActorError,
    HostMesh,
    MeshError,
    SpawnError,
    SupervisionError,
    ValueMesh,
    wire,
)
from monarch_fs.mesh.message_buffers import MessageBuffers
from monarch_fs.mesh.owner import MESH_MAX_FRAME
from procwatch import Started
from rdma_helpers import channel_pair

TESTS = str(Path(__file__).parent)

pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")  # torch, no numpy


# ---- messages ----------------------------------------------------------------------------

@pytest.mark.slow
def test_wire_keeps_buffers_out_of_band_aligned_and_views_on_receipt():
    import torch

    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    msg = wire.encode({"op": "call", "call": 1}, {"t": t, "s": "text"}, has_body=True)
    assert len(msg.parts) == 4  # header, pickle, padding, the tensor's bytes
    assert msg.parts[3].nbytes == t.numel() * 8 and len(msg.parts[1]) < 400
    offset = 4 + 8 * len(msg.parts) + sum(len(p) for p in msg.parts[:3])
    assert offset % 64 == 0
    received = Data([memoryview(bytearray(p)) for p in msg.parts])  # as the protocol delivers
    assert wire.header(received) == {"op": "call", "call": 1}
    got = wire.body(received)
    assert got["s"] == "text" and torch.equal(got["t"], t)
    got["t"][0, 0] = 99.0  # a view on the received buffer: no copy was made
    assert torch.frombuffer(received.parts[3], dtype=torch.float64)[0].item() == 99.0


def test_wire_copy_snapshots_buffers_for_messages_sent_later():
    import torch

    t = torch.zeros(4)
    queued = wire.encode({"op": "call"}, t, has_body=True, copy=True)
    shared = wire.encode({"op": "call"}, t, has_body=True)
    t += 1
    assert torch.equal(wire.body(queued), torch.zeros(4))
    assert torch.equal(wire.body(shared), torch.ones(4))


def test_large_messages_land_in_memory_already_faulted_in_and_held_ones_stay_intact():
    """Weight sync sends a same-size tensor every step: from the third on, a 64 MiB message
    is received into the buffer of one the caller dropped (a fresh buffer paid a page fault
    per 4 KiB, most of a round trip), never into one whose tensor the caller still holds."""
    import resource

    import torch

    async def main() -> None:
        tx, rx = await channel_pair()
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        received = wire.messages(rx)

        async def round_trip(value: object) -> object:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.send, tx, wire.encode({"op": "call"}, value,
                                                              has_body=True))
                _, msg = await received.__anext__()
            return wire.body(msg)

        values = [torch.full((16 << 20,), float(i)) for i in range(3)]  # 64 MiB each
        mixed = {"odd": torch.arange(wire.PIECE // 4 + 3, dtype=torch.int32), "s": "x" * 999,
                 "t": torch.ones(5, dtype=torch.float64)}  # parts across piece boundaries
        got = await round_trip(mixed)
        assert got["s"] == mixed["s"] and all(
            torch.equal(got[k], mixed[k]) for k in ("odd", "t"))
        first = await round_trip(values[0])
        second = await round_trip(values[1])  # the first is held: another buffer
        del first
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        third = await round_trip(values[2])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        assert faults < 1000, f"{faults} page faults receiving 64 MiB (16384 in a new buffer)"
        assert torch.equal(second, values[1]) and torch.equal(third, values[2])
        assert third.data_ptr() % 64 == 0
        await received.aclose()

    trio.run(main)


def test_message_buffers_are_reused_only_when_nothing_views_them():
    pool = MessageBuffers(keep_bytes=64 << 20, keep=2)
    a = pool.take(8 << 20)
    b = pool.take(8 << 20)
    assert id(a.obj) != id(b.obj)  # `a` is held
    first = id(a.obj)
    del a
    c = pool.take(6 << 20)  # at least half the size: the free one
    assert id(c.obj) == first
    del c
    assert id(pool.take(1 << 20).obj) != first  # a small message does not pin a big buffer
    big = pool.take(100 << 20)  # over keep_bytes: made to measure, not kept
    assert pool.kept < (64 << 20) and big.nbytes == 100 << 20


def test_wire_refuses_headers_that_are_not_messages():
    for parts in ([], [b"not json"], [b"[1]"], [b'{"op": 3}']):
        with pytest.raises(wire.WireError):
            wire.header(Data(parts))


# ---- calls ---------------------------------------------------------------------------------

@pytest.mark.mount
def test_call_call_one_broadcast_and_slice_by_rank(procs):
    counters = procs.spawn("counter", "mesh_actors:Counter", 10)
    assert procs.sizes == {"hosts": 2, "procs": 2} and counters.ranks == [0, 1, 2, 3]
    got = counters.get.call().get()
    assert isinstance(got, ValueMesh) and got.ranks == [0, 1, 2, 3]
    assert [(r, v, h) for r, v, h, _ in got] == [
        (0, 10, "node-0"), (1, 10, "node-0"), (2, 10, "node-1"), (3, 10, "node-1")]
    assert len({pid for *_, pid in got}) == 4

    assert counters.incr.call(5).get() == [15, 15, 15, 15]
    second_host = counters.slice(host=1)
    assert second_host.ranks == [2, 3]
    assert second_host.incr.call(100).get().items() == [(2, 115), (3, 115)]
    firsts = counters.slice(proc=0)
    assert firsts.ranks == [0, 2]
    firsts.incr.broadcast(1000)  # no reply; the next call on the same actors comes after it
    one = counters.slice(host=1, proc=1)
    assert one.ranks == [3] and one.incr.call_one(0).get() == 115
    assert second_host.slice(proc=0).ranks == [2]  # positions are relative to the slice
    values = counters.incr.call(0).get()
    assert values[0] == 1015 and values[1] == 15 and values[2] == 1115 and values[3] == 115
    with pytest.raises(IndexError):
        values[7]
    with pytest.raises(ValueError, match="exactly one"):
        counters.incr.call_one().get()
    # Sync endpoints run on the actor's own thread: per-thread state lasts between calls.
    assert counters.thread.call().get() == counters.thread.call().get()
    with pytest.raises(IndexError):
        counters.slice(host=2)


@pytest.mark.mount
def test_only_endpoints_are_callable(procs):
    from mesh_actors import Counter

    counters = procs.spawn("c", Counter, 0)
    with pytest.raises(AttributeError, match="not an @endpoint"):
        counters.not_an_endpoint  # noqa: B018 (the lookup is what raises)
    untyped = procs.spawn("c2", "mesh_actors:Counter", 0)
    with pytest.raises(ActorError, match="not_an_endpoint is not an @endpoint"):
        untyped.not_an_endpoint.call().get()


@pytest.mark.mount
def test_endpoint_exception_names_actor_rank_host_and_remote_traceback(procs):
    counters = procs.spawn("counter", "mesh_actors:Counter", 0)
    with pytest.raises(ActorError) as info:
        counters.fail_on.call(2).get()
    e = info.value
    assert (e.actor, e.method, e.rank, e.exc_type) == ("counter", "fail_on", 2, "ValueError")
    assert "node-1" in e.host
    text = str(e)
    assert "counter.fail_on raised on rank 2 (node-1" in text
    assert "ValueError: rank 2 refuses" in text
    assert "mesh_actors.py" in text and "in fail_on" in text  # the remote traceback
    assert "trio" not in e.traceback  # the runtime's own frames are left out
    assert counters.fail_on.call(-1).get() == [0, 1, 2, 3]  # the actors live on


@pytest.mark.mount
def test_constructor_failure_is_reported_by_rank(procs):
    with pytest.raises(ActorError, match=r"bad.__init__ raised on rank 1 .*cannot start on rank"):
        procs.spawn("bad", "mesh_actors:BadInit")
    with pytest.raises(ActorError, match="No module named 'no_such_module'"):
        procs.spawn("missing", "no_such_module:Thing")


@pytest.mark.mount
def test_proc_that_exits_during_a_call_reports_its_exit_code(hosts, started):
    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS])
    started.add(*(pid for _, pid in procs.pids.values()))
    try:
        echo = procs.spawn("echo", "mesh_actors:Echo")
        with pytest.raises(SupervisionError, match="exited with code 3"):
            echo.echo.call(SystemExitOnUnpickle(3)).get()
    finally:
        procs.stop()


class SystemExitOnUnpickle:
    """Unpickling this in a proc ends the proc with `code` (a crash between two messages)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self):
        return os._exit, (self.code,)


@pytest.mark.mount
def test_tensors_round_trip(hosts, started):
    import torch

    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS])
    started.add(*(pid for _, pid in procs.pids.values()))
    try:
        echo = procs.slice(host=1).spawn("echo", "mesh_actors:Echo")
        for t in (torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.zeros(0, 3),
                  torch.tensor([True, False]), torch.ones(3, dtype=torch.bfloat16),
                  torch.arange(10)[::3], torch.tensor(7.5), torch.ones(2, requires_grad=True)):
            back = echo.echo.call_one(t).get()
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
            assert back.requires_grad == t.requires_grad
        big = torch.randn(4 * 1024 * 1024)  # 16 MiB
        assert torch.equal(echo.double.call_one(big).get(), big * 2)
    finally:
        procs.stop()


@pytest.mark.mount
def test_no_environ_shows_the_mesh_token_to_a_proc_or_what_it_starts(hosts, started):
    """Issue 16, finding 6: the mesh token reaches each proc through the daemon's secrets pipe,
    so neither the proc's environment block nor that of a process its actor starts holds it
    (nor anything of the daemon's own MONARCH_FS_* settings); the mesh works all the same."""
    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS], env={"JOB_SETTING": "on"})
    started.add(*(pid for _, pid in procs.pids.values()))
    token = procs._state.token.hex()
    try:
        results = procs.spawn("probe", "mesh_actors:EnvProbe").probe.call().get()
        for _, pid in procs.pids.values():  # as root, from outside, while they run
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            assert token.encode() not in raw and b"MONARCH_MESH_TOKEN" not in raw
        for r in results:
            env, gc = r["environ"], r["grandchild"]
            assert env["JOB_SETTING"] == "on" and env["MONARCH_MESH_NAME"] == "procs"
            assert {k for k in env if k.startswith("MONARCH_FS_")} == {
                "MONARCH_FS_MOUNT", "MONARCH_FS_SECRETS_FD", "MONARCH_FS_JOB"}, sorted(env)
            assert "MONARCH_MESH_TOKEN" not in env and token not in json.dumps(env)
            assert "MONARCH_FS_SECRETS_FD" not in r["os_environ"]  # read, closed, dropped
            assert token not in gc["environ"] and token not in gc["parent"]
            assert "MONARCH_FS_SECRETS_FD" not in gc["environ"]
    finally:
        procs.stop()


# ---- trio --------------------------------------------------------------------------------

@pytest.mark.mount
async def test_trio_code_uses_the_async_methods(cluster2, started):
    async with HostMesh.open(cluster2.hostfile, token_file=cluster2.token_file) as hosts:
        procs = await hosts.spawn_procs_async(per_host=1, python_path=[TESTS])
        started.add(*(pid for _, pid in procs.pids.values()))
        counters = await procs.spawn_async("counter", "mesh_actors:Counter", 1)
        async with trio.open_nursery() as nursery:  # calls from many tasks at once
            for _ in range(10):
                nursery.start_soon(counters.incr.call_async)
        assert await counters.incr.call_async(0) == [11, 11]
        assert (await counters.slice(host=0).get.call_one_async())[1] == 11
        counters.incr.broadcast(5)
        with pytest.raises(ActorError):  # raised as itself, not inside an ExceptionGroup
            await counters.fail_on.call_async(0)
        refused = counters.incr.call()  # posted: only waiting for it is refused
        with pytest.raises(RuntimeError, match="await future"):
            refused.get()  # the blocking form would deadlock this loop
        assert await refused == [17, 17]  # a future is awaited
        assert await counters.incr.call_async(0) == [17, 17]


# ---- launching -----------------------------------------------------------------------------

@pytest.mark.mount
def test_spawn_failures_name_the_host_and_cause(hosts, started):
    with pytest.raises(SpawnError, match="cannot start /no/such/python"):
        hosts.spawn_procs(per_host=1, python="/no/such/python")
    with pytest.raises(SpawnError, match="no workspace 'nope'"):
        hosts.spawn_procs(per_host=1, workspace="nope")
    # A proc that starts but dies before connecting back fails the spawn with its exit status.
    with pytest.raises(SupervisionError, match="exited with code 1"):
        hosts.spawn_procs(per_host=1, python="/bin/false")


@pytest.mark.mount
def test_actor_classes_from_pushed_code_at_a_pinned_version(cluster2, hosts, started, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "greeter.py").write_text(textwrap.dedent("""
        import os
        from monarch_fs.mesh import Actor, endpoint

        class Greeter(Actor):
            @endpoint
            def hello(self):
                data = open(os.path.join(os.path.dirname(__file__), "data.txt")).read()
                return f"{data} from rank {self.rank}", __file__
    """))
    (app / "data.txt").write_text("v1")
    cluster2.push(app)
    procs = hosts.spawn_procs(per_host=1, workspace="app", python_path=["{workspace}"])
    started.add(*(pid for _, pid in procs.pids.values()))
    try:
        greeters = procs.spawn("greeter", "greeter:Greeter")
        (app / "data.txt").write_text("v2")
        cluster2.push(app)  # a new version lands on every node while the procs run
        got = greeters.hello.call().get()
        for rank, (text, path) in got.items():
            assert text == f"v1 from rank {rank}"  # still the version they started with
            assert path.startswith(str(cluster2.mnt(rank) / ".versions" / "app"))
    finally:
        procs.stop()


# ---- supervision of meshes that actors own -----------------------------------------------

@pytest.mark.mount
@pytest.mark.parametrize("handle", [True, False])
def test_actor_supervises_the_mesh_it_owns(hosts, started, handle):
    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS], name="bosses")
    started.add(*(pid for _, pid in procs.pids.values()))
    try:
        boss = procs.slice(host=0).spawn("boss", "mesh_actors:Boss", handle)
        workers = boss.start.call_one().get()
        started.add(*workers)
        outcome = boss.kill_worker.call_one(1).get()
        assert outcome.startswith("SupervisionError") and "killed by SIGKILL" in outcome
        assert "worker dies now" in outcome  # the worker's stderr tail reached its owner
        if handle:
            seen = boss.seen_failures.call_one().get()
            assert len(seen) == 1 and "mesh 'workers'" in seen[0]
            assert boss.kill_worker.call_one(0).get().startswith("SupervisionError")
        else:  # unhandled: the boss's own mesh fails, and the cause reaches the controller
            with pytest.raises(SupervisionError) as info:
                boss.seen_failures.call_one().get()
            text = str(info.value)
            assert "actor 'boss' did not handle a failure of its mesh" in text
            assert "mesh 'workers'" in text and "killed by SIGKILL" in text
    finally:
        procs.stop()


# ---- controllers that go away ------------------------------------------------------------

CONTROLLER = """
import json, sys, time
sys.path.insert(0, {tests!r})
from monarch_fs.mesh import HostMesh

hosts = {make}
procs = hosts.spawn_procs(per_host=2, python_path=[{tests!r}])
counters = procs.spawn("c", "mesh_actors:Counter", 0)
assert counters.incr.call().get() == [1, 1, 1, 1]
print(json.dumps({{"pids": [pid for _, pid in procs.pids.values()],
                  "dir": str(hosts.cluster_dir)}}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
# else: end without close(): the atexit hook stops everything
"""


def _controller(tmp_path: Path, make: str, mode: str, started: Started):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER.format(tests=TESTS, make=make))
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                            text=True)
    started.add(proc.pid)
    info = json.loads(proc.stdout.readline())
    started.add(*info["pids"])
    started.add(proc.pid, tree=True)  # everything it started: procs, a local cluster, a reaper
    return proc, info


@pytest.mark.mount
def test_killed_controller_takes_its_procs_along(cluster2, tmp_path, started):
    make = f"HostMesh.connect({cluster2.hostfile!r}, token_file={cluster2.token_file!r})"
    proc, info = _controller(tmp_path, make, "sleep", started)
    proc.kill()
    proc.wait()
    assert not started.wait_gone(10), "the daemons did not stop the dead controller's procs"
    assert len(cluster2.status()) == 2  # the daemons themselves are fine


@pytest.mark.mount
@pytest.mark.parametrize("mode", ["sleep", "exit"])
def test_local_cluster_lives_as_long_as_its_script(tmp_path, started, mode):
    proc, info = _controller(tmp_path, "HostMesh.local(2)", mode, started)
    d = Path(info["dir"])
    assert (d / "node-1" / "mnt").is_dir()
    if mode == "sleep":
        proc.kill()  # SIGKILL: no atexit; the reaper cleans up
    assert proc.wait(30) == (-signal.SIGKILL if mode == "sleep" else 0)
    assert not started.wait_gone(20), "processes of the script outlived it"
    assert not d.exists() or not any(mounted(d / f"node-{i}" / "mnt") for i in range(2))
    wait_for(lambda: not d.exists(), 10, f"{d} to be removed")


@pytest.mark.mount
def test_closed_host_mesh_refuses_work(cluster2, started):
    hosts = HostMesh.connect(cluster2.hostfile, token_file=cluster2.token_file)
    procs = hosts.spawn_procs(per_host=1, python_path=[TESTS])
    started.add(*(pid for _, pid in procs.pids.values()))
    counters = procs.spawn("c", "mesh_actors:Counter", 0)
    hosts.close()
    hosts.close()  # idempotent
    assert not started.wait_gone(10)
    with pytest.raises((MeshError, RuntimeError)):
        counters.incr.call().get()


@pytest.mark.mount
def test_stopped_daemon_fails_the_mesh_and_takes_its_procs(fresh_cluster, started):
    cluster = fresh_cluster(2)
    with HostMesh.connect(cluster.hostfile, token_file=cluster.token_file) as hosts:
        procs = hosts.spawn_procs(per_host=1, python_path=[TESTS])
        started.add(*(pid for _, pid in procs.pids.values()))
        victims = procs.spawn("v", "mesh_actors:Victim")
        on_node_1 = Started()
        on_node_1.add(procs.pids[1][1])
        os.kill(cluster.pid(1), signal.SIGTERM)  # the daemon stops, and stops its procs
        with pytest.raises(SupervisionError) as info:
            victims.nap.call(60).get()
        assert info.value.failure.rank == 1 and "node-1" in info.value.failure.host
        # before the controller closes anything
        assert on_node_1.pids and not on_node_1.wait_gone(10)
    assert not started.wait_gone(10)
