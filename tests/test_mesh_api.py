"""Monarch's actor API shape on real daemons and procs: named dimensions, current_rank(),
context(), this_host() in an actor, choose, stream, and clear errors for what has no meaning."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from monarch_fs.mesh import NotSupported, endpoint
from monarch_fs.mesh.shape import per_host_dims

TESTS = str(Path(__file__).parent)

pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


@pytest.fixture
def gpus(hosts, started):
    """2 hosts x {"gpus": 2}."""
    p = hosts.spawn_procs(per_host={"gpus": 2}, python_path=[TESTS], name="gpus")
    started.add(*(pid for _, pid in p.pids.values()))
    yield p
    p.stop()


@pytest.mark.mount
def test_named_dimensions_current_rank_and_context(gpus):
    assert gpus.sizes == gpus.extent == {"hosts": 2, "gpus": 2}
    where = gpus.spawn("where", "mesh_actors:Where")
    got = where.where.call().get(timeout=30)
    assert got[3] == ({"hosts": 1, "gpus": 1}, 3, {"hosts": 2, "gpus": 2}, True, "where",
                      "node-1")
    assert [g[0] for g in got] == [{"hosts": h, "gpus": g} for h in (0, 1) for g in (0, 1)]
    assert where.where_async.call().get()[2] == ({"hosts": 1, "gpus": 0}, True)
    assert where.slice(gpus=1).ranks == [1, 3] and where.slice(hosts=1).ranks == [2, 3]
    assert where.slice(**got[2][0]).ranks == [2]  # slice(**current_rank()) from an actor
    assert gpus.slice(gpus=0).spawn("w0", "mesh_actors:Where").ranks == [0, 2]
    with pytest.raises(ValueError, match="no dimension 'gpu' in this mesh .*hosts, gpus"):
        where.slice(gpu=0)
    with pytest.raises(ValueError, match="per_host dimension 'gpus' must be at least 1"):
        per_host_dims({"gpus": 0})


@pytest.mark.mount
def test_choose_balances_and_stream_answers_in_arrival_order(gpus):
    where = gpus.spawn("where", "mesh_actors:Where")
    chosen = collections.Counter(where.where.choose().get(timeout=30)[1] for _ in range(8))
    assert chosen == {0: 2, 1: 2, 2: 2, 3: 2}  # one at a time: every rank takes its turn
    busy = where.slice(hosts=0).later.call(0.5)  # ranks 0 and 1 busy for a while
    assert {where.where.choose().get(timeout=30)[1] for _ in range(4)} <= {2, 3}
    busy.get(timeout=30)
    # rank r answers after (4 - r) x 0.3 s: the stream yields rank 3 first
    assert [f.get(timeout=30) for f in where.later.stream(0.3)] == [3, 2, 1, 0]


@pytest.mark.mount
def test_this_host_in_an_actor_spawns_beside_it(gpus):
    where = gpus.slice(hosts=1, gpus=0).spawn("where", "mesh_actors:Where")
    sizes, inner = where.on_this_host.call_one().get(timeout=60)
    assert sizes == {"hosts": 1, "gpus": 1}
    assert inner[0] == {"hosts": 0, "gpus": 0} and inner[5] == "node-1"  # the actor's host


@pytest.mark.mount
def test_monarch_style_stop_returns_a_future(gpus):
    where = gpus.spawn("where", "mesh_actors:Where")
    assert where.stop().get(timeout=30) is None
    assert gpus.stop().get() is None and gpus.stop().result() is None  # stopped; idempotent


@pytest.mark.mount
def test_what_has_no_meaning_here_is_refused_by_name(gpus):
    from monarch_fs.mesh import Channel, get_or_spawn_controller

    with pytest.raises(NotSupported, match="ProcMesh.activate is not supported .*tensor engine"):
        gpus.activate()
    with pytest.raises(NotSupported, match="Channel.open is not supported"):
        Channel.open()
    with pytest.raises(NotSupported, match="Kubernetes"):
        get_or_spawn_controller("x", object)
    with pytest.raises(NotSupported, match="explicit_response_port"):
        endpoint(explicit_response_port=True)
    with pytest.raises(ImportError):
        from monarch_fs.mesh import no_such_name  # noqa: F401
