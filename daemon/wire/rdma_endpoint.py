"""One side of one RDMA bulk channel in verbs: the queue pair, its rings, the work requests
the engines (rdma_engines.py) ask for, and the completions fed back to them.

pyverbs is imported only when an RdmaEndpoint is made (rdma_devices.py has why). Environment
(optional, see monarch_fs/settings.py): MONARCH_FS_RDMA_GID_INDEX.
"""

from __future__ import annotations

import random
import socket
from typing import Any

from ...settings import settings
from .bulk_channel import BulkError
from .rdma_devices import efa_enums, enums
from .rdma_engines import (
    READ_DONE,
    RECV,
    RECV_IMM,
    SEND_DONE,
    Completion,
    ReadData,
    WriteData,
)
from .rdma_format import (
    HEADER_SIZE,
    MSG_SIZE,
    RC,
    SRD,
    BulkProtocolError,
    check_geometry,
    encode_credit,
)

SRD_QKEY = 0x11111111
POLL_BATCH = 64


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


class RdmaEndpoint:
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

