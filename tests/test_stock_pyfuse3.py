"""What `pip install .` alone gives: a stock pyfuse3, without fs/pyfuse3.patch. Everything
works, with a round trip per open, and status says why.

`make test` builds an unpatched pyfuse3 into .venv/stock-pyfuse3; the daemons of this test
find it first on PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import mount_ops, tree

pytestmark = pytest.mark.mount

STOCK = Path(__file__).resolve().parent.parent / ".venv" / "stock-pyfuse3"


@pytest.fixture
def stock_pyfuse3(monkeypatch):
    if not (STOCK / ".built").exists():
        pytest.skip(f"no unpatched pyfuse3 in {STOCK} (`make test` builds it)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(STOCK), *filter(None, [os.environ.get("PYTHONPATH")])]))


def test_a_stock_pyfuse3_serves_every_version_with_open_round_trips(
        stock_pyfuse3, fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    assert c.status()[0]["fuse"] == "open per file (pyfuse3 without fs/pyfuse3.patch)"
    src = tmp_path / "ws"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_text("a1")
    (src / "big").write_bytes(os.urandom(5 << 20))  # two chunks, and past the backing size
    c.push(src)
    mnt = c.mnt(0) / "ws"
    assert tree(mnt) == tree(src)
    root = c.mnt(0)
    before = mount_ops(root).get("open", 0)
    assert (mnt / "d" / "a").read_text() == "a1"
    assert mount_ops(root)["open"] == before + 1  # every open is a request
    assert "ioctl" not in mount_ops(root)  # the stock build cannot count them
    (src / "d" / "a").write_text("a2, longer")
    c.push(src)
    assert (mnt / "d" / "a").read_text() == "a2, longer"
    assert tree(mnt) == tree(src)
