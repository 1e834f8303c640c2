"""push --early paces the tail once the version is usable (daemon/client/tail_pace.py): at half
the rate the head went at, a lower --bwlimit kept, a small head left unpaced. The real Stream
and Pacer of a push of a scanned folder; the push itself is tests/test_early.py's."""

from __future__ import annotations

import time

import pytest
import trio

from monarch_fs.daemon.client.progress import Progress
from monarch_fs.daemon.client.stream import Pacer, Payload, Stream
from monarch_fs.daemon.client.tail_pace import TAIL_PACED_FROM, TAIL_SHARE, pace
from monarch_fs.daemon.wire import bulk
from monarch_fs.fs.scan import scan

MB = 1_000_000


@pytest.fixture
def stream(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    snap = trio.run(scan, tmp_path / "src")
    m = snap.manifest
    payload = Payload(m.chunk_ids(), m.id, m.objects(), snap.sources, snap.read_into)
    return Stream(payload, [], bulk.resolve_local("tcp"), 10, Progress(), head=[])


def test_the_tail_goes_at_half_the_rate_the_head_went_at(stream):
    pacer = Pacer()
    stream.bytes_sent = 300 * MB  # the head, sent in the 1.5 s since the stream started
    rate = pace(pacer, stream, time.monotonic() - 1.5)
    assert pacer.rate == rate
    assert TAIL_SHARE * 300 * MB / 1.6 < rate <= TAIL_SHARE * 300 * MB / 1.5


def test_a_lower_bwlimit_stays_and_a_small_head_is_not_paced(stream):
    limited = Pacer(10 * MB)
    stream.bytes_sent = 300 * MB
    assert pace(limited, stream, time.monotonic() - 1.5) == 10 * MB == limited.rate
    unpaced = Pacer()
    stream.bytes_sent = TAIL_PACED_FROM - 1
    assert pace(unpaced, stream, time.monotonic() - 1.5) == 0 == unpaced.rate
