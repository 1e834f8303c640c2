"""Fixtures the mesh tests share: a host mesh on the module's 2-node cluster, a check that
every process a test started is gone, and 2 x 2 procs that import tests/mesh_actors.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from monarch_fs.mesh import HostMesh
from procwatch import Started

TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def hosts(cluster2):
    with HostMesh.connect(cluster2.hostfile, token_file=cluster2.token_file) as h:
        yield h


@pytest.fixture
def started():
    s = Started()
    yield s
    s.assert_gone()


@pytest.fixture
def procs(hosts, started):
    """2 hosts x 2 procs, stopped after the test."""
    p = hosts.spawn_procs(per_host=2, python_path=[TESTS])
    started.add(*(pid for _, pid in p.pids.values()))
    yield p
    p.stop()
