"""Whether chunks cross one link zstd-compressed or raw: measured, per root of a push's plan.

Compression pays where the link is slower than the codec. A compressed chunk costs its node a
decompression (to verify it, ~1.3 GiB/s here) and saves the link about half its bytes on Python
trees, so zstd wins while  link rate < decompression rate x bytes saved. A loopback link is
faster than that without asking; another link is timed with two probe requests, one small and
one of PROBE_BYTES padding, on the push's own session (so encryption counts), bounded by
PROBE_TIMEOUT. The codec's rate is measured once per process on a text-like sample (this
folder's Python sources).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import trio

from ...fs.chunk import chunk_id, decode, encode
from ..wire.addresses import is_loopback, parse_addr
from ..wire.transport import Channel

POLICIES = ("auto", "on", "off")
PROBE_BYTES = 4 << 20
PROBE_TIMEOUT = 3.0
SAVED = 0.5  # share of bytes zstd saves on a Python environment (a torch venv: ~0.55)


@dataclass
class LinkChoice:
    """One link's compression, as `push --json` reports it under `links`."""

    host: str
    compression: str  # "zstd" or "none"
    rate_mib_s: float | None  # the link's measured rate; None when not probed
    why: str

    def to_json(self) -> dict:
        return asdict(self)


@cache
def codec_rate() -> float:
    """zstd level-1 decompression plus the id check, bytes per second, on this machine."""
    sample = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
    data = (sample * (1 + (4 << 20) // len(sample)))[:4 << 20]
    blob, cid = encode(data), chunk_id(data)
    t0 = time.perf_counter()
    for _ in range(3):
        decode(cid, blob)
    return 3 * len(data) / max(time.perf_counter() - t0, 1e-6)


async def probe(chan: Channel) -> float:
    """The link's rate, bytes per second: a PROBE_BYTES request's time less a small one's."""
    from ..wire.process_calls import ProbeReply  # only off loopback: not every push's import

    pad = "x" * PROBE_BYTES
    t0 = time.perf_counter()
    ProbeReply.from_wire(await chan.request("probe", pad=""))
    t1 = time.perf_counter()
    ProbeReply.from_wire(await chan.request("probe", pad=pad))
    t2 = time.perf_counter()
    return PROBE_BYTES / max((t2 - t1) - (t1 - t0), 1e-6)


async def choose(policy: str, host: str, chan: Channel) -> LinkChoice:
    """The compression for the link to `host` under `policy` (auto, on, off)."""
    if policy == "on":
        return LinkChoice(host, "zstd", None, "--compress on")
    if policy == "off":
        return LinkChoice(host, "none", None, "--compress off")
    if is_loopback(parse_addr(host)[0]):
        return LinkChoice(host, "none", None, "loopback: faster than decompressing")
    codec = codec_rate()
    try:
        with trio.fail_after(PROBE_TIMEOUT):
            rate = await probe(chan)
    except trio.TooSlowError:
        return LinkChoice(host, "zstd", None,
                          f"probe of {PROBE_BYTES >> 20} MiB took over {PROBE_TIMEOUT:g}s")
    except Exception as e:  # a node too old to answer probes: compress, as before
        return LinkChoice(host, "zstd", None, f"probe failed ({e})")
    mib = round(rate / (1 << 20), 1)
    limit = codec * SAVED / (1 << 20)
    if rate < codec * SAVED:
        return LinkChoice(host, "zstd", mib, f"link {mib:g} MiB/s < {limit:.0f} MiB/s "
                                             "(decompression rate x bytes saved)")
    return LinkChoice(host, "none", mib, f"link {mib:g} MiB/s >= {limit:.0f} MiB/s "
                                         "(decompression rate x bytes saved)")
