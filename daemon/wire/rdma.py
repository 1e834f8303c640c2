"""RDMA bulk channels through pyverbs: RC queue pairs (InfiniBand, RoCE) and SRD (AWS EFA).

pyverbs is imported here only when a device is probed or a channel opened, never at import
time, so the rest of monarch-fs runs without it. Both pyverbs APIs are supported: rdma-core 44
(Debian 12's python3-pyverbs: flat names in `pyverbs.enums`) and pyverbs >= 59 from PyPI (enum
classes in `pyverbs.libibverbs_enums`); `Enums` looks a name up in whichever exists.

The protocol itself (ring, credits, reordering, the completion state machines) lives in
rdma_logic.py and is tested without hardware; this module only creates the verbs resources,
posts the work requests those state machines ask for and feeds them the completions.

Completions are polled without blocking trio: `CQ.poll()` never blocks, and an empty poll sleeps
on the trio loop with a short backoff (rdma_logic.Backoff). A completion channel would let us
`trio.lowlevel.wait_readable()` its fd instead, but pyverbs' CompChannel does not expose the fd
(rdma-core 44 through 59), and a thread blocked in `get_cq_event()` cannot be cancelled.

Environment (all optional, see monarch_fs/settings.py): MONARCH_FS_RDMA_DEVICE (device name),
MONARCH_FS_RDMA_GID_INDEX, MONARCH_FS_RDMA_SLOTS, MONARCH_FS_RDMA_SLOT_SIZE (ring geometry a
sender proposes).
"""

from __future__ import annotations

import logging
import random
import socket
from typing import Any

import trio

from ...settings import settings
from .bulk import BulkError, BulkReceiver, BulkSender, Deliver
from .rdma_logic import (
    HEADER_SIZE,
    MSG_SIZE,
    RC,
    READ_DONE,
    RECV,
    RECV_IMM,
    SEND_DONE,
    SRD,
    Backoff,
    BulkProtocolError,
    Completion,
    PostRecv,
    ReadData,
    ReceiverEngine,
    SenderEngine,
    WriteData,
    check_geometry,
    decode_credit,
    encode_credit,
)
from .seal import ChunkSealer, SealError

log = logging.getLogger("monarch_fs.rdma")

AMAZON_VENDOR_ID = 0x1D0F
SRD_QKEY = 0x11111111
POLL_BATCH = 64
_NO_PYVERBS = "pyverbs not installed"
_NO_DEVICES = "ibv_get_device_list is empty"


# ---- pyverbs, imported lazily, either API --------------------------------------------------------


class Enums:
    """Flat `IBV_*` names over either pyverbs enum layout: module attributes (rdma-core 44's
    `pyverbs.enums`, also provider enum modules) or members of enum classes (pyverbs >= 59's
    `pyverbs.libibverbs_enums`, e.g. `ibv_wr_opcode.IBV_WR_RDMA_WRITE_WITH_IMM`)."""

    # Members of anonymous enums in pyverbs >= 59's .pxd files; if a build does not export them,
    # their values are fixed by the C headers (verbs.h, efadv.h).
    ABI = {"IBV_LINK_LAYER_ETHERNET": 2, "EFADV_DEVICE_ATTR_CAPS_RDMA_READ": 1,
           "EFADV_QP_DRIVER_TYPE_SRD": 0}

    def __init__(self, modules: list[Any]):
        if not modules:
            raise ImportError("no pyverbs enum module")
        self._modules = modules
        self._cache: dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._cache[name]
        except KeyError:
            pass
        for m in self._modules:
            value = getattr(m, name, None)
            if value is None:
                for attr in list(vars(m).values()):
                    members = getattr(attr, "__members__", None)
                    if isinstance(members, dict) or hasattr(members, "get"):
                        if members and name in members:
                            value = members[name]
                            break
            if value is not None:
                self._cache[name] = int(value)
                return self._cache[name]
        if name in self.ABI:
            return self.ABI[name]
        raise AttributeError(f"pyverbs has no enum {name}")


def _import(name: str) -> Any | None:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_enums: Enums | None = None
_efa_enums: Enums | None = None


def enums() -> Enums:
    """The libibverbs enums; ImportError if pyverbs is missing."""
    global _enums
    if _enums is None:
        mods = [m for m in (_import("pyverbs.libibverbs_enums"), _import("pyverbs.enums")) if m]
        _enums = Enums(mods)
    return _enums


def efa_enums() -> Enums:
    global _efa_enums
    if _efa_enums is None:
        _efa_enums = Enums([m for m in (_import("pyverbs.providers.efa.efa_enums"),) if m])
    return _efa_enums


def pyverbs_available() -> tuple[bool, str]:
    try:
        import pyverbs.device  # noqa: F401

        enums()
    except ImportError:
        return False, _NO_PYVERBS
    return True, ""


# ---- devices ------------------------------------------------------------------------------------


def _device_list() -> tuple[list[Any], str]:
    ok, why = pyverbs_available()
    if not ok:
        return [], why
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devices = d.get_device_list()
    except PyverbsError:  # raised when the kernel has no RDMA support at all
        devices = []
    return list(devices), "" if devices else _NO_DEVICES


_probed: tuple[list[dict], str] | None = None


def probe_devices(refresh: bool = False) -> tuple[list[dict], str]:
    """Every RDMA port on this host as a descriptor (name, kind: ib/roce/efa/iwarp, port, active,
    state, rdma_read for EFA), and why the list is empty when it is. Probed once per process."""
    global _probed
    if _probed is None or refresh:
        _probed = _probe()
    return [dict(d) for d in _probed[0]], _probed[1]


def _probe() -> tuple[list[dict], str]:
    devices, why = _device_list()
    if not devices:
        return [], why
    wanted = settings.rdma_device
    out = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        if wanted and name != wanted:
            continue
        try:
            out.extend(_describe(name, dev))
        except Exception as e:  # one broken device must not hide the others
            out.append({"name": name, "kind": "?", "port": 1, "active": False,
                        "state": f"cannot be opened ({e})"})
    if not out:
        return [], f"no device named {wanted!r}" if wanted else _NO_DEVICES
    return out, ""


def _describe(name: str, dev: Any) -> list[dict]:
    from pyverbs.device import Context

    E = enums()
    out = []
    with Context(name=name) as ctx:
        attr = ctx.query_device()
        efa = attr.vendor_id == AMAZON_VENDOR_ID
        rdma_read = False
        if efa:
            rdma_read = _efa_rdma_read(name)
        for port in range(1, attr.phys_port_cnt + 1):
            pa = ctx.query_port(port)
            if efa:
                kind = "efa"
            elif dev.transport_type == E.IBV_TRANSPORT_IWARP:
                kind = "iwarp"
            elif pa.link_layer == E.IBV_LINK_LAYER_ETHERNET:
                kind = "roce"
            else:
                kind = "ib"
            active = pa.state == E.IBV_PORT_ACTIVE
            d = {"name": name, "kind": kind, "port": port, "active": active,
                 "state": "active" if active else f"not active (state {pa.state})"}
            if efa:
                d["rdma_read"] = rdma_read
            out.append(d)
    return out


def _efa_rdma_read(name: str) -> bool:
    try:
        from pyverbs.providers.efa.efadv import EfaContext

        with EfaContext(name=name) as ctx:
            caps = ctx.query_efa_device().device_caps
        return bool(caps & efa_enums().EFADV_DEVICE_ATTR_CAPS_RDMA_READ)
    except Exception:
        return False


# ---- one queue pair with its ring --------------------------------------------------------------


def _geometry() -> tuple[int, int]:
    slots, size = settings.rdma_slots, settings.rdma_slot_size
    check_geometry(slots, size)
    return slots, size


def _pick_gid(ctx: Any, port: int, kind: str) -> int:
    if (index := settings.rdma_gid_index) is not None:
        return index
    if kind != "roce":
        return 0
    E = enums()
    best = None
    for idx in range(ctx.query_port(port).gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port, idx))
        except Exception:
            continue
        if not gid.strip("0:"):
            continue
        try:  # RoCE v2 (routable, UDP) first; IPv4-mapped addresses (::ffff:a.b.c.d) first
            v2 = ctx.query_gid_type(port, idx) == E.IBV_GID_TYPE_SYSFS_ROCE_V2
        except Exception:
            v2 = False
        score = (v2, gid.startswith("0000:0000:0000:0000:0000:ffff"))
        if best is None or score > best[0]:
            best = (score, idx)
    return best[1] if best else 0


class Endpoint:
    """Verbs resources of one side of one bulk channel: context, PD, CQ, QP, the data ring MR
    (`slots` x `slot_size`) and a small-message MR (`slots` receive buffers, then `slots` send
    buffers of MSG_SIZE bytes)."""

    def __init__(self, mode: str, dev: dict, slots: int, slot_size: int, *, receiver: bool):
        from pyverbs.addr import GID  # noqa: F401  (fail early if pyverbs is half there)
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr, QPInitAttrEx

        E = enums()
        check_geometry(slots, slot_size)
        self.mode, self.dev, self.slots, self.slot_size = mode, dev, slots, slot_size
        self.port = int(dev.get("port", 1))
        self.receiver = receiver
        self.ah = None
        self.peer: dict = {}
        self._msg_next = 0
        if mode == SRD:
            from pyverbs.providers.efa.efadv import EfaContext

            self.ctx = EfaContext(name=dev["name"])
        else:
            self.ctx = Context(name=dev["name"])
        try:
            self.pd = PD(self.ctx)
            depth = 4 * slots + 16
            self.cq = CQ(self.ctx, depth, None, None, 0)
            access = E.IBV_ACCESS_LOCAL_WRITE
            if mode == RC and receiver:
                access |= E.IBV_ACCESS_REMOTE_WRITE  # the sender writes into our ring
            if mode == SRD and not receiver:
                access |= E.IBV_ACCESS_REMOTE_READ  # the receiver reads from our ring
            self.ring = MR(self.pd, slots * slot_size, access)
            self.msgs = MR(self.pd, 2 * slots * MSG_SIZE, E.IBV_ACCESS_LOCAL_WRITE)
            cap = QPCap(max_send_wr=2 * slots + 8, max_recv_wr=slots + 8, max_send_sge=1,
                        max_recv_sge=1)
            pa = self.ctx.query_port(self.port)
            self.lid = pa.lid
            self.mtu = int(pa.active_mtu)
            self.gid_index = _pick_gid(self.ctx, self.port, dev.get("kind", ""))
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
            self.psn = random.getrandbits(24)
            if mode == RC:
                attr = QPAttr(port_num=self.port)
                attr.qp_access_flags = access
                init = QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
                self.qp = QP(self.pd, init, attr)  # returned in INIT for RC
            else:
                from pyverbs.providers.efa.efadv import EfaQPInitAttr, SRDQPEx

                ops = (E.IBV_QP_EX_WITH_SEND | E.IBV_QP_EX_WITH_RDMA_READ)
                init = QPInitAttrEx(cap=cap, qp_type=E.IBV_QPT_DRIVER, scq=self.cq, rcq=self.cq,
                                    pd=self.pd, send_ops_flags=ops,
                                    comp_mask=(E.IBV_QP_INIT_ATTR_PD
                                               | E.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS))
                efa_init = EfaQPInitAttr()
                efa_init.driver_qp_type = efa_enums().EFADV_QP_DRIVER_TYPE_SRD
                self.qp = SRDQPEx(self.ctx, init, efa_init)
        except BaseException:
            self.close()
            raise

    # -- connection -----------------------------------------------------------------------

    def info(self) -> dict:
        """What the peer needs to reach us (sent over the control channel)."""
        return {"gid": self.gid, "lid": self.lid, "qpn": self.qp.qp_num, "psn": self.psn,
                "rkey": self.ring.rkey, "addr": self.ring.buf, "mtu": self.mtu,
                "slots": self.slots, "slot_size": self.slot_size}

    def connect(self, peer: dict) -> None:
        """Move our QP to RTS towards `peer` (its info())."""
        from pyverbs.addr import AH, GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        E = enums()
        for key in ("gid", "lid", "qpn", "psn", "rkey", "addr", "mtu"):
            if key not in peer:
                raise BulkProtocolError(f"peer's queue-pair info lacks {key!r}")
        self.peer = peer
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index)
        is_global = 1 if (self.dev.get("kind") != "ib" or peer["gid"].strip("0:")) else 0
        ah_attr = AHAttr(port_num=self.port, is_global=is_global, gr=gr, dlid=int(peer["lid"]))
        attr = QPAttr(port_num=self.port)
        if self.mode == RC:
            attr.path_mtu = min(self.mtu, int(peer["mtu"]))
            attr.dest_qp_num = int(peer["qpn"])
            attr.rq_psn = int(peer["psn"])  # what the peer sends with
            attr.sq_psn = self.psn
            attr.max_dest_rd_atomic = 1
            attr.max_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.ah_attr = ah_attr
            attr.qp_access_flags = (E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
                                    if self.receiver else E.IBV_ACCESS_LOCAL_WRITE)
            self.qp.to_rts(attr)
        else:
            attr.qkey = SRD_QKEY
            attr.pkey_index = 0
            attr.sq_psn = self.psn
            self.qp.to_rts(attr)
            self.ah = AH(self.pd, attr=ah_attr)

    # -- work requests --------------------------------------------------------------------

    def _live(self) -> None:
        """Never touch a closed verbs object: that would be a NULL dereference in C."""
        if self.ctx is None:
            raise BulkError("the RDMA channel is closed")

    def _sge(self, mr: Any, offset: int, length: int) -> Any:
        from pyverbs.wr import SGE

        self._live()
        return SGE(mr.buf + offset, length, mr.lkey)

    def post_recv(self, buf: int) -> None:
        """Receive buffer `buf` (0..slots-1) of the small-message MR."""
        from pyverbs.wr import RecvWR

        self.qp.post_recv(RecvWR(wr_id=buf, num_sge=1,
                                 sg=[self._sge(self.msgs, buf * MSG_SIZE, MSG_SIZE)]), None)

    def write_slot(self, slot: int, header: bytes, payload: memoryview) -> None:
        self._live()
        base = slot * self.slot_size
        self.ring.write(header, len(header), base)
        if len(payload):
            data = payload.tobytes() if isinstance(payload, memoryview) else bytes(payload)
            self.ring.write(data, len(data), base + HEADER_SIZE)

    def read_slot(self, slot: int, offset: int, length: int) -> bytes:
        self._live()
        if length == 0:
            return b""
        return self.ring.read(length, slot * self.slot_size + offset)

    def read_msg(self, buf: int) -> bytes:
        self._live()
        return self.msgs.read(MSG_SIZE, buf * MSG_SIZE)

    def _send_ex(self, wr_id: int, op: str, sge: Any, rkey: int = 0, raddr: int = 0) -> None:
        """SRD: the extended post-send API (ibv_wr_*), the only one with RDMA READ on SRD."""
        E = enums()
        qp = self.qp
        qp.wr_start()
        qp.wr_id = wr_id
        qp.wr_flags = E.IBV_SEND_SIGNALED
        if op == "read":
            qp.wr_rdma_read(rkey, raddr)
        else:
            qp.wr_send()
        qp.wr_set_ud_addr(self.ah, int(self.peer["qpn"]), SRD_QKEY)
        qp.wr_set_sge(sge)
        qp.wr_complete()

    def post_data(self, w: WriteData) -> None:
        """Sender: the fragment is in local slot w.slot; RC writes it to the peer's slot with
        the slot index as immediate, SRD announces it by sending its header."""
        E = enums()
        length = HEADER_SIZE + len(w.payload)
        if self.mode == RC:
            from pyverbs.wr import SendWR

            wr = SendWR(wr_id=w.fseq, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                        sg=[self._sge(self.ring, w.slot * self.slot_size, length)],
                        send_flags=E.IBV_SEND_SIGNALED)
            wr.imm_data = socket.htonl(w.slot)
            wr.set_wr_rdma(int(self.peer["rkey"]),
                           int(self.peer["addr"]) + w.slot * self.slot_size)
            self.qp.post_send(wr, None)
        else:
            self._send_ex(w.fseq, "send",
                          self._sge(self.ring, w.slot * self.slot_size, HEADER_SIZE))

    def post_read(self, r: ReadData) -> None:
        """SRD receiver: pull the payload of the sender's slot into ours."""
        off = r.slot * self.slot_size + HEADER_SIZE
        self._send_ex(r.fseq, "read", self._sge(self.ring, off, max(r.length, 1)),
                      int(self.peer["rkey"]), int(self.peer["addr"]) + off)

    def post_credit(self, released: int) -> None:
        """A small SEND carrying the cumulative count of released fragments."""
        E = enums()
        buf = self.slots + self._msg_next % self.slots  # the send half of the message MR
        self._msg_next += 1
        data = encode_credit(released)
        self.msgs.write(data, len(data), buf * MSG_SIZE)
        sge = self._sge(self.msgs, buf * MSG_SIZE, MSG_SIZE)
        if self.mode == RC:
            from pyverbs.wr import SendWR

            self.qp.post_send(SendWR(wr_id=(1 << 63) | buf, opcode=E.IBV_WR_SEND, num_sge=1,
                                     sg=[sge], send_flags=E.IBV_SEND_SIGNALED), None)
        else:
            self._send_ex((1 << 63) | buf, "send", sge)

    # -- completions ----------------------------------------------------------------------

    def poll(self, batch: int = POLL_BATCH) -> list[Completion]:
        self._live()
        E = enums()
        _, wcs = self.cq.poll(batch)
        out = []
        for wc in wcs:
            if wc.status != E.IBV_WC_SUCCESS:
                out.append(Completion("error", wc.wr_id, ok=False,
                                      error=f"status {wc.status} (vendor error {wc.vendor_err})"))
            elif wc.opcode == E.IBV_WC_RECV_RDMA_WITH_IMM:
                out.append(Completion(RECV_IMM, wc.wr_id, imm=socket.ntohl(wc.imm_data),
                                      byte_len=wc.byte_len))
            elif wc.opcode == E.IBV_WC_RECV:
                out.append(Completion(RECV, wc.wr_id, byte_len=wc.byte_len))
            elif wc.opcode == E.IBV_WC_RDMA_READ:
                out.append(Completion(READ_DONE, wc.wr_id))
            else:  # IBV_WC_SEND, IBV_WC_RDMA_WRITE
                out.append(Completion(SEND_DONE, wc.wr_id))
        return out

    def close(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx is not None:
            ctx.close()  # pyverbs closes the AH, QP, MRs, CQ and PD that hang off it first


# ---- the bulk channels ---------------------------------------------------------------------------


class RdmaSender(BulkSender):
    """Sends chunks over one queue pair. No background task: send_chunk() and flush() poll the
    CQ themselves (credits, completions) while they wait, yielding to trio between polls."""

    def __init__(self, ep: Endpoint, engine: SenderEngine, peer: str, sealer: ChunkSealer):
        super().__init__()
        self.kind = ep.mode
        self.ep = ep
        self.engine = engine
        self.peer = peer
        # RDMA bytes bypass the session's sealed frames: each chunk carries its own seal.
        self._sealer = sealer
        self._backoff = Backoff()
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, chan: Any, mode: str, dev: dict) -> RdmaSender:
        """Create our queue pair and ring, trade queue-pair info over `chan`, go to RTS."""
        from pyverbs.pyverbs_error import PyverbsError

        try:
            return await cls._connect(chan, mode, dev)
        except (PyverbsError, BulkProtocolError) as e:
            raise BulkError(f"rdma setup with {chan.peer} failed: {e}") from e

    @classmethod
    async def _connect(cls, chan: Any, mode: str, dev: dict) -> RdmaSender:
        slots, size = _geometry()
        ep = Endpoint(mode, dev, slots, size, receiver=False)
        try:
            for buf in range(slots):  # credit messages may arrive as soon as the peer is up
                ep.post_recv(buf)
            reply = await chan.request("bulk", kind=mode, device_kind=dev["kind"], qp=ep.info(),
                                       slots=slots, slot_size=size)
            peer = reply.get("qp")
            if not isinstance(peer, dict):
                raise BulkProtocolError("bulk reply carries no queue-pair info")
            ep.connect(peer)
        except BaseException:
            ep.close()
            raise
        log.info("bulk %s channel to %s (%s)", mode, chan.peer, dev["name"])
        return cls(ep, SenderEngine(mode, slots, size), chan.peer, ChunkSealer(chan.conn.bulk_key))

    def _check(self) -> None:
        # Not prefixed with the peer: push and the relay report it under the node's address.
        if self.engine.error:
            raise BulkError(f"rdma: {self.engine.error}")

    def _post(self) -> None:
        for w in self.engine.work():
            self.ep.write_slot(w.slot, w.header, w.payload)
            self.ep.post_data(w)

    def _poll(self) -> int:
        cs = self.ep.poll()
        for c in cs:
            if c.kind == RECV and c.ok:
                self.engine.on_credit(decode_credit(self.ep.read_msg(c.wr_id)))
            for r in self.engine.on_completion(c):
                self.ep.post_recv(r.buf)
        return len(cs)

    async def _pump(self, done) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            while True:
                self._check()
                self._post()
                if done():
                    return
                if self._poll():
                    self._backoff.reset()
                    continue
                delay = self._backoff.next_delay()
                await (trio.sleep(delay) if delay else trio.lowlevel.checkpoint())
        except (PyverbsError, BulkProtocolError) as e:
            self.engine.error = self.engine.error or str(e)
            self._check()

    async def send_chunk(self, cid: bytes, blob: bytes) -> None:
        async with self._lock:
            self._check()
            self.engine.submit(cid, b"".join((blob, self._sealer.seal(cid, blob))))
            await self._pump(lambda: self.engine.queued == 0)  # all posted; may be in flight
            self.chunks_sent += 1
            self.bytes_sent += len(blob)

    async def flush(self) -> dict:
        async with self._lock:
            await self._pump(lambda: self.engine.idle)
            return {"bulk_chunks": self.engine.chunks_submitted}

    async def aclose(self) -> None:
        self.ep.close()

    def describe(self) -> dict:
        return {**super().describe(), "peer": self.peer, "device": self.ep.dev.get("name")}


class RdmaReceiver(BulkReceiver):
    """Receives chunks over one queue pair; run() polls the CQ and delivers in order."""

    def __init__(self, ep: Endpoint, engine: ReceiverEngine, deliver: Deliver):
        super().__init__(deliver)
        self.kind = ep.mode
        self.ep = ep
        self.engine = engine
        self._backoff = Backoff()
        self._closed = False
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._started = False

    @classmethod
    def accept(cls, mode: str, dev: dict, args: dict, deliver: Deliver,
               key: bytes) -> RdmaReceiver:
        """`key`: the control session's bulk key, which every chunk's seal must verify under."""
        opener = ChunkSealer(key)

        async def checked(cid: bytes, sealed: bytes) -> None:
            try:
                blob = opener.open(cid, sealed)
            except SealError as e:
                raise BulkProtocolError(str(e)) from None
            await deliver(cid, blob)

        peer = args.get("qp")
        slots, size = args.get("slots"), args.get("slot_size")
        check_geometry(slots, size)
        if not isinstance(peer, dict):
            raise BulkProtocolError("bulk request carries no queue-pair info")
        ep = Endpoint(mode, dev, slots, size, receiver=True)
        try:
            for buf in range(slots):
                ep.post_recv(buf)
            ep.connect(peer)
        except BaseException:
            ep.close()
            raise
        engine = ReceiverEngine(mode, slots, size, ep.read_slot)
        return cls(ep, engine, checked)

    def reply(self) -> dict:
        return {"qp": self.ep.info()}

    async def run(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        self._started = True
        try:
            with self._scope:
                await self._loop()
        except (PyverbsError, BulkProtocolError, BulkError) as e:
            if not self._closed:
                self._fail(str(e))
        finally:
            self._done.set()

    async def _loop(self) -> None:
        ep, engine = self.ep, self.engine
        while not self._closed:
            cs = ep.poll()
            if not cs:
                delay = self._backoff.next_delay()
                await (trio.sleep(delay) if delay else trio.lowlevel.checkpoint())
                continue
            self._backoff.reset()
            for c in cs:
                msg = ep.read_msg(c.wr_id) if c.kind == RECV and c.ok else b""
                work, chunks = engine.on_completion(c, msg)
                if engine.error:
                    raise BulkProtocolError(engine.error)
                for w in work:
                    if isinstance(w, PostRecv):
                        ep.post_recv(w.buf)
                    else:
                        ep.post_read(w)
                for cid, blob in chunks:
                    await self._delivered(cid, blob)  # may wait: the sender waits for credit
            credit = engine.credit()
            if credit is not None:
                ep.post_credit(credit.released)

    async def aclose(self) -> None:
        """Stop run() first (it may be mid-delivery), then free the verbs resources."""
        self._closed = True
        self._scope.cancel()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                if self._started:
                    await self._done.wait()
        self.ep.close()
