"""Bulk channels: how chunk payloads travel, separately from the control channel.

The control channel is always the authenticated TCP `Channel` (handshake, QueryMissing, relay
setup, flush, prepare, commit). Chunk payloads go through a bulk channel of one of these kinds:

* ``tcp``: PutChunk frames on the control channel itself (`TcpBulkSender`,
  `TcpBulkReceiver`). Always available, ordered with the control messages.
* ``rdma-rc``: InfiniBand or RoCE; one-sided RDMA WRITE WITH IMMEDIATE into a ring the
  receiver registered (rdma.py).
* ``rdma-srd``: AWS EFA; SRD queue pairs, the receiver pulls with RDMA READ (rdma.py).

An RDMA channel is set up over the control channel: the sender sends Request("bulk", kind,
qp info, ring geometry), the node answers with its own queue-pair info. Because RDMA data and
TCP control messages are not ordered with each other, `BulkSender.flush()` returns the
arguments the control channel's "flush" request must carry ({"bulk_chunks": n}); the node
answers that request only after its receiver delivered n chunks.

Which kind is used is decided by `choose_transport(requested, local_devices, peer_devices)`:
``--transport tcp`` never probes for RDMA; ``auto`` uses RDMA when both ends have a usable device
on a common fabric, and otherwise TCP, saying why once; ``rdma`` without a device is an error.
pyverbs is imported only when a device is probed or an RDMA channel is opened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from . import protocol as p
from .bulk_channel import (
    BATCH_BYTES,
    BATCH_CHUNKS,
    BulkError,
    BulkReceiver,
    BulkRefused,
    BulkSender,
    Deliver,
)
from .frames import MAX_BATCH_CHUNKS
from .rdma_format import RC, SRD, TCP

# The channel interface is bulk_channel.py's (so rdma.py needs nothing of this module); callers
# find it here, beside the kinds.
__all__ = ["BATCH_BYTES", "BATCH_CHUNKS", "BulkError", "BulkReceiver", "BulkRefused", "BulkSender",
           "Deliver", "LocalTransport", "SMALL_CHUNK", "TRANSPORTS", "TcpBulkReceiver",
           "TcpBulkSender", "TransportUnavailable", "accept_receiver", "choose_for_peer",
           "choose_transport", "close_peer", "device_mode", "fallback_line", "frames_for",
           "grouped", "log_choices", "match_devices", "open_sender", "resolve_local"]

log = logging.getLogger("monarch_fs.transport")

TRANSPORTS = ("auto", "tcp", "rdma")

class TransportUnavailable(ValueError):
    """The transport asked for cannot be used (e.g. --transport rdma on a host without a
    device). A ValueError, so the command line reports it as `monarch-fs: error: ...`."""


# ---- TCP: PutChunk frames on the control channel ------------------------------------------------


# A chunk this small travels with its neighbours in one PutChunks frame (a frame each cost more
# than the bytes: see protocol.PutChunks); larger ones get a PutChunk frame each, received in
# place (and written from there: connection.py).
SMALL_CHUNK = 64 * 1024
_GROUP_BYTES = 1 << 20


def frames_for(batch: Sequence[tuple[bytes, bytes | memoryview]]) -> list[p.Message]:
    """The messages that carry `batch`, in its order: runs of small chunks grouped."""
    return grouped([p.PutChunk(cid, blob) for cid, blob in batch])


def grouped(chunks: Sequence[p.PutChunk]) -> list[p.Message]:
    """frames_for() of PutChunk messages: a large one goes as it is (with its seal, if it
    came with one: chunk_seals.py), runs of small ones grouped."""
    out: list[p.Message] = []
    group: list[p.PutChunk] = []
    size = 0
    for msg in chunks:
        blob = msg.blob
        if len(blob) >= SMALL_CHUNK:
            if group:
                out.append(p.PutChunks(tuple(group)))
                group, size = [], 0
            out.append(msg)
            continue
        group.append(msg)
        size += len(blob)
        if size >= _GROUP_BYTES or len(group) >= MAX_BATCH_CHUNKS:
            out.append(p.PutChunks(tuple(group)))
            group, size = [], 0
    if len(group) == 1:
        out.append(group[0])
    elif group:
        out.append(p.PutChunks(tuple(group)))
    return out


class TcpBulkSender(BulkSender):
    """The PutChunk-over-Channel path: frames share the control connection, so they are
    ordered with the control messages and flush needs no extra arguments."""

    kind = TCP

    def __init__(self, chan) -> None:
        super().__init__()
        self.chan = chan

    async def send_chunk(self, cid: bytes, blob: bytes | memoryview) -> None:
        await self.send_chunks([(cid, blob)])

    async def send_chunks(self, batch: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        await self.send_puts([p.PutChunk(cid, blob) for cid, blob in batch])

    async def send_puts(self, batch: Sequence[p.PutChunk]) -> None:
        await self.chan.send_many(grouped(batch))
        self.chunks_sent += len(batch)
        self.bytes_sent += sum(len(msg.blob) for msg in batch)

    async def flush(self) -> dict:
        return {}

    def describe(self) -> dict:
        return {**super().describe(), "peer": self.chan.peer}


class TcpBulkReceiver(BulkReceiver):
    """The receiving end of PutChunk frames for a connection that carries nothing else but a
    final Request("flush") (benchmarks and tests; the node daemon reads PutChunk frames in its
    session loop, interleaved with requests, and delivers them the same way)."""

    kind = TCP

    def __init__(self, chan, deliver: Deliver) -> None:
        super().__init__(deliver)
        self.chan = chan

    async def run(self) -> None:
        from .transport import ConnectionLost

        try:
            while True:
                msg = await self.chan.receive()
                if isinstance(msg, p.PutChunk):
                    await self._delivered(msg.cid, msg.blob)
                elif isinstance(msg, p.PutChunks):
                    for one in msg.chunks:
                        await self._delivered(one.cid, one.blob)
                elif isinstance(msg, p.Request) and msg.op == "flush":
                    await self.chan.send(p.Reply(msg.id, {"delivered": self.chunks_delivered}))
                else:
                    raise p.ProtocolError(f"unexpected {type(msg).__name__} on a bulk channel")
        except ConnectionLost:
            return
        except (p.ProtocolError, trio.BrokenResourceError) as e:
            self._fail(str(e))


# ---- choosing a transport ---------------------------------------------------------------------


def device_mode(dev: dict) -> tuple[str | None, str]:
    """(RDMA mode this device supports, or None and why not)."""
    name = dev.get("name", "?")
    if not dev.get("active", False):
        return None, f"{name} port {dev.get('port', 1)} is {dev.get('state', 'not active')}"
    kind = dev.get("kind")
    if kind in ("ib", "roce"):
        return RC, ""
    if kind == "efa":
        if not dev.get("rdma_read"):
            return None, f"{name}: this EFA device does not advertise RDMA read"
        return SRD, ""
    if kind == "iwarp":
        return None, (f"{name}: iWARP (siw) has no RDMA WRITE with immediate and needs rdma_cm "
                      "to connect; not supported")
    return None, f"{name}: unknown kind of RDMA device {kind!r}"


def _usable(devices: Sequence[dict] | None) -> tuple[list[dict], str]:
    good: list[dict] = []
    why: list[str] = []
    for d in devices or ():
        mode, reason = device_mode(d)
        if mode:
            good.append(d)
        else:
            why.append(reason)
    return good, "; ".join(why)


def match_devices(local: Sequence[dict], peer: Sequence[dict] | None
                  ) -> tuple[str, dict, dict] | None:
    """(mode, local device, peer device) for the first pair on a common fabric."""
    return _pair(_usable(local)[0], _usable(peer)[0])


def _pair(mine: list[dict], theirs: list[dict]) -> tuple[str, dict, dict] | None:
    """match_devices() on devices already known to be usable."""
    for a in mine:
        mode = device_mode(a)[0]
        for b in theirs:
            if mode is not None and a["kind"] == b["kind"]:  # ib-ib, roce-roce (RC); efa-efa (SRD)
                return mode, a, b
    return None


def choose_transport(requested: str, local_devices: Sequence[dict],
                     peer_devices: Sequence[dict] | None, *, local_why: str = "",
                     peer_why: str = "") -> tuple[str, str]:
    """(kind, reason): "tcp", "rdma-rc" or "rdma-srd", and why.

    `local_devices` are this host's RDMA devices (`local_why` says why there are none),
    `peer_devices` what the peer advertised in its Welcome (None: it offers no RDMA, `peer_why`
    says why). `auto` falls back to TCP; `rdma` raises TransportUnavailable instead."""
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown transport {requested!r}: use one of {', '.join(TRANSPORTS)}")
    if requested == "tcp":
        return TCP, "--transport tcp"
    mine, mine_why = _usable(local_devices)
    theirs, theirs_why = _usable(peer_devices)
    found = _pair(mine, theirs)
    if found:
        mode, a, b = found
        return mode, f"{a['kind']} {a['name']} to the peer's {b['name']}"
    if not mine:
        reason = f"no RDMA device on this host ({mine_why or local_why or 'none found'})"
    elif not theirs:
        reason = f"the peer offers no RDMA ({theirs_why or peer_why or 'no device'})"
    else:
        reason = ("no common RDMA fabric (this host: "
                  + ", ".join(f"{d['kind']} {d['name']}" for d in mine) + "; the peer: "
                  + ", ".join(f"{d['kind']} {d['name']}" for d in theirs) + ")")
    if requested == "rdma":
        raise TransportUnavailable(f"--transport rdma: {reason}")
    return TCP, reason


@dataclass
class LocalTransport:
    """What this host offers: the setting asked for, the kind in use and why, usable devices."""

    requested: str = "auto"
    kind: str = TCP  # "tcp" or "rdma"
    reason: str = "default"
    devices: list[dict] = field(default_factory=list)  # usable RDMA devices
    why_none: str = ""  # why `devices` is empty

    def info(self) -> dict:
        """For the Welcome info and the status reply."""
        out: dict = {"transport": self.kind, "transport_reason": self.reason}
        if self.kind == "rdma":
            out["rdma"] = [{k: d[k] for k in ("name", "kind", "port", "active", "rdma_read")
                            if k in d}
                           for d in self.devices]
        return out


def resolve_local(requested: str = "auto", *, probe: Callable[[], tuple[list[dict], str]] | None
                  = None, where: str = "this host") -> LocalTransport:
    """This host's transport for `--transport requested`. `rdma` without a usable device raises
    TransportUnavailable ("no RDMA device on `where` (why)"); `auto` falls back to TCP and says
    why in `reason`."""
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown transport {requested!r}: use one of {', '.join(TRANSPORTS)}")
    if requested == "tcp":
        return LocalTransport(requested, TCP, "--transport tcp")
    if probe is None:
        from .rdma_devices import probe_devices

        probe = probe_devices
    devices, why = probe()
    good, bad = _usable(devices)
    if good:
        names = ", ".join(f"{d['kind']} {d['name']}" for d in good)
        return LocalTransport(requested, "rdma", f"RDMA device {names}", good)
    why = why or bad or "none found"
    if requested == "rdma":
        raise TransportUnavailable(f"--transport rdma: no RDMA device on {where} ({why})")
    return LocalTransport(requested, TCP, f"auto: no RDMA device on {where} ({why})", [], why)


def choose_for_peer(local: LocalTransport, requested: str, peer_info: dict) -> tuple[str, str]:
    """choose_transport() for a connected peer, from its Welcome info."""
    return choose_transport(
        requested, local.devices, peer_info.get("rdma"),
        local_why=local.why_none or ("--transport tcp" if local.kind == TCP else ""),
        peer_why=peer_info.get("transport_reason", "it does not advertise a transport"))


def fallback_line(choices: dict[str, tuple[str, str]], requested: str
                  ) -> tuple[int, str] | None:
    """The one line that says which peers fell back to TCP under `auto` and why, and its log
    level: a warning when RDMA was available somewhere (a surprise worth showing), otherwise
    info. None when nothing fell back (or the transport was not `auto`). `choices` maps a peer's
    name to choose_for_peer()'s (kind, reason)."""
    fell = {addr: why for addr, (kind, why) in choices.items()
            if kind == TCP and requested == "auto"}
    if not fell:
        return None
    reasons = sorted(set(fell.values()))
    level = (logging.INFO if all(r.startswith("no RDMA device on this host") for r in reasons)
             else logging.WARNING)
    who = f"all {len(fell)} nodes" if len(fell) == len(choices) else ", ".join(sorted(fell))
    return level, f"transport: tcp to {who} (RDMA not used: {'; '.join(reasons)})"


def log_choices(choices: dict[str, tuple[str, str]], requested: str) -> None:
    """Log fallback_line(), if any (push does; `run` prints it on its own stderr instead)."""
    line = fallback_line(choices, requested)
    if line is not None:
        log.log(line[0], "%s", line[1])


# ---- opening channels ---------------------------------------------------------------------------


async def open_sender(chan, kind: str, local: LocalTransport | None = None,
                      peer_info: dict | None = None) -> BulkSender:
    """A bulk sender of `kind` to the peer on `chan` (RDMA: set up over `chan`)."""
    if kind == TCP:
        return TcpBulkSender(chan)
    if kind not in (RC, SRD):
        raise ValueError(f"unknown bulk kind {kind!r}")
    found = match_devices(local.devices if local else [], (peer_info or {}).get("rdma"))
    if found is None or found[0] != kind:
        raise BulkRefused(f"no {kind} device pair with the peer")
    from . import rdma

    return await rdma.RdmaSender.connect(chan, kind, found[1])


async def close_peer(sender: BulkSender | None, chan) -> None:
    """Close a peer's bulk sender, then its control channel (either may be None), even while
    the caller is being cancelled."""
    if sender is not None:
        with trio.CancelScope(shield=True):
            await sender.aclose()
    if chan is not None:
        with trio.CancelScope(shield=True):
            await chan.aclose()


def accept_receiver(local: LocalTransport, args: dict, deliver: Deliver,
                    nursery: trio.Nursery, key: bytes) -> tuple[BulkReceiver, dict]:
    """The node's side of Request("bulk"): a running receiver and the reply to send. `key` is
    the control session's bulk key (chunks that bypass its frames are sealed with it)."""
    kind = args.get("kind")
    if local.kind != "rdma":
        raise BulkRefused(f"this node does not offer RDMA ({local.reason})")
    dev = next((d for d in local.devices
                if (device_mode(d)[0] == kind and (not args.get("device_kind")
                                                   or d["kind"] == args["device_kind"]))), None)
    if dev is None or not isinstance(kind, str):
        raise BulkRefused(f"this node has no {kind!r} device")
    from . import rdma

    rx = rdma.RdmaReceiver.accept(kind, dev, args, deliver, key)
    nursery.start_soon(rx.run)
    return rx, rx.reply()
