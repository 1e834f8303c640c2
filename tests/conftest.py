"""Shared fixtures: real local clusters of real daemons with real FUSE mounts, driven through
the real command line. Every cluster a test starts is stopped, and its mounts checked gone.

Only fixtures and hooks live here; the helpers they are built from are in helpers.py, which
test modules import."""

from __future__ import annotations

from pathlib import Path

import pytest
from fillers import stop_fillers

from helpers import (
    Cluster,
    Daemon,
    start_cluster,
    start_daemon,
    stop_cluster,
    stop_daemon,
)
from opens import Opens
from procwatch import Started

# Fixtures that start daemons serving real FUSE mounts: a test using one must carry the `mount`
# marker, so that `-m "not mount"` never starts a mount (checked at collection).
MOUNT_FIXTURES = frozenset({"cluster2", "cluster3", "fresh_cluster", "lone_daemon"})


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if MOUNT_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("mount") is None]
    if unmarked:
        raise pytest.UsageError("tests that mount without the `mount` marker:\n  "
                                + "\n  ".join(unmarked))


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory, monkeypatch):
    """The CLI keeps a scan cache and a default cluster under $MONARCH_FS_HOME: never the
    user's own, in tests. The dev box store's fillers its pushes started, with this home or
    one of the test's own, are stopped after (the session's tests run one at a time)."""
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path_factory.mktemp("home")))
    yield
    stop_fillers(tmp_path_factory.getbasetemp())


@pytest.fixture
def small_packs(monkeypatch):
    """Daemons started in the test cut their store into 1 MiB packs (collection and
    compaction then happen at test sizes)."""
    monkeypatch.setenv("MONARCH_FS_PACK_MIB", "1")


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), 2)
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), 3)
    yield c
    stop_cluster(c)


@pytest.fixture
def fresh_cluster(tmp_path):
    """Start clusters of any size inside the test; all are stopped afterwards."""
    started: list[Cluster] = []

    def start(nodes: int = 2) -> Cluster:
        c = start_cluster(tmp_path / f"cluster{len(started)}", nodes)
        started.append(c)
        return c

    yield start
    for c in started:
        stop_cluster(c)


@pytest.fixture
def lone_daemon(tmp_path):
    """Start daemons on loopback with extra command-line flags; each is stopped (SIGTERM, by
    its pid) and its mount checked gone afterwards."""
    started: list[Daemon] = []

    def start(*flags: str, env: dict | None = None) -> Daemon:
        daemon = start_daemon(tmp_path / f"daemon{len(started)}", *flags, env=env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        stop_daemon(daemon)


@pytest.fixture
def started():
    """Processes the test started (procwatch.Started: add their pids), checked gone at its end.
    (test_run and test_mesh still define their own copy, which takes precedence there.)"""
    s = Started()
    yield s
    s.assert_gone()


@pytest.fixture
def opens():
    """opens(root): an Opens watching `root` (what anything opens below it), closed after the
    test."""
    made = []

    def watch(root: Path) -> Opens:
        made.append(Opens(root))
        return made[-1]

    yield watch
    for o in made:
        o.close()
