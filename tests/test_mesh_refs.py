"""Actor meshes passed as arguments: actors call actors directly, over connections
authenticated like the rest, on real daemons and procs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import trio

from monarch_fs.daemon.wire.transport import ConnectError, connect
from monarch_fs.mesh import ActorMesh

TESTS = str(Path(__file__).parent)
pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


@pytest.mark.mount
def test_an_actor_mesh_passed_to_actors_is_called_from_there(procs):
    buffers = procs.slice(hosts=1).spawn("buffer", "mesh_actors:Buffer")
    producers = procs.slice(hosts=0).spawn("producer", "mesh_actors:Producer")
    drawn = next(buffers._state.calls.ids)  # the controller's calls on these procs so far
    chose = producers.produce.call(buffers, 4).get(timeout=60)
    # One more: the produce call itself; none of the 8 adds to the buffers went through here.
    assert next(buffers._state.calls.ids) == drawn + 2
    assert sorted(r for ranks in chose for r in ranks) == [2, 2, 2, 2, 3, 3, 3, 3]  # balanced
    assert producers.produce_async.call(buffers).get(timeout=60) == [[2, 3], [2, 3]]
    contents = buffers.contents.call().get()
    got = sorted(map(str, contents[2] + contents[3]))
    assert got == sorted(map(str, [(p, i) for p in (0, 1) for i in range(4)]
                                  + [("async", 0), ("async", 1)] * 2))
    # A reference that comes back to the owner is the owner's own mesh again.
    back = producers.slice(procs=0).keep.call_one(buffers.slice(procs=1)).get()
    assert isinstance(back, ActorMesh) and back._state is buffers._state
    assert back.ranks == [3] and back.add.call_one("from controller").get() == 3


@pytest.mark.mount
def test_direct_connections_need_the_peer_token(procs):
    buffers = procs.spawn("buffer", "mesh_actors:Buffer")
    ref = buffers._state.mesh_ref()
    assert ref.token != procs._state.token  # not the owner's token: a holder cannot pose as a proc

    async def knock() -> None:
        with pytest.raises(ConnectError):
            await connect(ref.addrs[0], os.urandom(32), timeout=5)
        chan = await connect(ref.addrs[0], ref.token, timeout=5)
        await trio.aclose_forcefully(chan.stream)

    trio.run(knock)


@pytest.mark.mount
def test_a_dead_rank_fails_the_direct_calls_that_target_it(procs, started):
    buffers = procs.slice(hosts=1).spawn("buffer", "mesh_actors:Buffer")
    producer = procs.slice(hosts=0, procs=0).spawn("producer", "mesh_actors:Producer")
    producer.keep.call_one(buffers).get(timeout=30)
    assert producer.try_add.call_one().get(timeout=30) == "no error"
    os.kill(buffers.slice(procs=1).pid.call_one().get(), signal.SIGKILL)  # rank 3
    start = time.monotonic()
    outcome = producer.try_add.call_one().get(timeout=30)
    assert time.monotonic() - start < 10
    assert outcome.startswith("SupervisionError") and "rank 3" in outcome


@pytest.mark.mount
def test_a_tensor_buffer_is_read_directly_from_its_owner(procs):
    from monarch_fs.mesh import MeshError, TensorBuffer

    n = 1 << 20
    owner = procs.slice(hosts=0, procs=0).spawn("owner", "mesh_actors:WeightOwner", n)
    readers = procs.slice(hosts=1).spawn("reader", "mesh_actors:WeightReader", n)
    handle = owner.share.call_one().get(timeout=30)
    assert isinstance(handle, TensorBuffer) and handle.nbytes == 4 * n  # a handle, not bytes
    total = float(sum(range(n)))
    assert readers.pull.call(handle).get(timeout=60) == [total, total]
    owner.step.call_one().get()
    assert readers.pull_async.call(handle).get(timeout=60) == [total + n, total + n]
    owner.drop.call_one().get()
    errors = readers.pull_error.call(handle).get(timeout=60)
    assert all("no buffer" in e for e in errors), errors
    with pytest.raises(MeshError, match="created inside an actor"):
        TensorBuffer(__import__("torch").zeros(1))
