"""A fake pyverbs for driving daemon/wire/rdma.py (and rdma_endpoint.py, rdma_devices.py)
without hardware.

It implements the slice of the pyverbs API those modules use, with the signatures of rdma-core's
pyverbs (checked against rdma-core 44 and pyverbs 59), over an in-process fabric: memory regions
are bytearrays at fake addresses, RDMA WRITE/READ copy between them (checking rkeys and bounds),
a SEND or WRITE WITH IMM consumes a posted receive at the target or fails loudly (an RNR on real
hardware), and completions queue up on CQs. SRD CQs hand completions back in a random order.
A queue pair put in `Fabric.broken` fails its sends as a QP whose link went down does.

What this proves: rdma.py's driving of the state machines (offsets, immediates, receive
accounting, credits, polling, closing). What it cannot prove: that real pyverbs and a real NIC
behave as this fake does; tests/test_rdma_hw.py covers that on RDMA hosts.
"""

from __future__ import annotations

import random
import sys
import types
from enum import IntEnum

# Values fixed by the verbs ABI (infiniband/verbs.h, efadv.h).
FLAT = dict(
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4,
    IBV_QPT_RC=2, IBV_QPT_DRIVER=0xFF, IBV_QP_EX_WITH_RDMA_WRITE=1,
    IBV_QP_EX_WITH_RDMA_READ=1 << 3, IBV_QP_EX_WITH_SEND=1 << 4,
    IBV_QP_INIT_ATTR_PD=1, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS=1 << 10, IBV_SEND_SIGNALED=2,
    IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WR_SEND=2, IBV_WC_SUCCESS=0,
    IBV_WC_WR_FLUSH_ERR=5, IBV_WC_REM_ACCESS_ERR=10, IBV_WC_RETRY_EXC_ERR=12, IBV_WC_SEND=0,
    IBV_WC_RDMA_WRITE=1, IBV_WC_RDMA_READ=2,
    IBV_WC_RECV=128, IBV_WC_RECV_RDMA_WITH_IMM=129, IBV_TRANSPORT_IB=0, IBV_TRANSPORT_IWARP=1,
    IBV_LINK_LAYER_INFINIBAND=1, IBV_LINK_LAYER_ETHERNET=2, IBV_PORT_ACTIVE=4,
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1=0, IBV_GID_TYPE_SYSFS_ROCE_V2=1,
)
EFA_FLAT = dict(EFADV_DEVICE_ATTR_CAPS_RDMA_READ=1, EFADV_QP_DRIVER_TYPE_SRD=0)


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    pass


class RNR(AssertionError):
    """A SEND or WRITE WITH IMM found no receive posted: the driver's accounting is wrong."""


class Fabric:
    def __init__(self, devices: list[dict], seed: int = 0):
        self.devices = devices  # {"name", "link": ib/eth, "efa": bool, "transport"}
        self.rnd = random.Random(seed)
        self.mrs: dict[int, MR] = {}
        self.qps: dict[int, object] = {}
        self.next_addr = 0x10000000
        self.next_qpn = 100
        self.ops = 0
        # QPs whose link is down: their next send completes with a retry-exceeded error and
        # every later one is flushed, as a real QP in the error state does; nothing arrives.
        self.broken: set[int] = set()

    def mr_at(self, addr: int, length: int, key: int, remote: bool, access: int) -> tuple:
        for mr in self.mrs.values():
            if mr.buf <= addr and addr + length <= mr.buf + mr.length:
                if mr.closed:
                    raise AssertionError("access to a closed MR")
                want = mr.rkey if remote else mr.lkey
                if key != want:
                    raise AssertionError(f"wrong {'r' if remote else 'l'}key {key} for {want}")
                if remote and not mr.access & access:
                    raise AssertionError("the MR was not registered for that remote access")
                return mr, addr - mr.buf
        raise AssertionError(f"no MR covers [{addr:#x}, +{length})")


FABRIC: Fabric | None = None


class _CM:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


class Device:
    def __init__(self, d: dict):
        self.name = d["name"].encode()
        self.transport_type = FLAT["IBV_TRANSPORT_IWARP"] if d.get("iwarp") else 0
        self.node_type = 1
        self.guid = 0
        self.index = 0


def get_device_list():
    if not FABRIC.devices:
        raise PyverbsRDMAError("Failed to get devices list")
    return [Device(d) for d in FABRIC.devices]


class Context(_CM):
    def __init__(self, name=""):
        self.dev = next(d for d in FABRIC.devices if d["name"] == name)
        self.name = name
        self.children = []
        self.closed = False

    def query_device(self):
        return types.SimpleNamespace(vendor_id=0x1D0F if self.dev.get("efa") else 0x15B3,
                                     phys_port_cnt=1)

    def query_port(self, port):
        assert port == 1
        return types.SimpleNamespace(
            state=FLAT["IBV_PORT_ACTIVE"] if self.dev.get("active", True) else 1, lid=7,
            active_mtu=3, gid_tbl_len=2,
            link_layer=FLAT["IBV_LINK_LAYER_ETHERNET"] if self.dev.get("link") == "eth"
            else FLAT["IBV_LINK_LAYER_INFINIBAND"])

    def query_gid(self, port, index):
        return GID("0000:0000:0000:0000:0000:ffff:0a00:0001" if index else
                   "fe80:0000:0000:0000:0202:c9ff:fe00:0001")

    def query_gid_type(self, port, index):
        return FLAT["IBV_GID_TYPE_SYSFS_ROCE_V2"] if index else 0

    def close(self):
        for c in self.children:
            c.close()
        self.closed = True


class EfaContext(Context):
    def query_efa_device(self):
        return types.SimpleNamespace(device_caps=1 if self.dev.get("rdma_read") else 0)


class PD(_CM):
    def __init__(self, ctx):
        self.ctx = ctx
        ctx.children.append(self)

    def close(self):
        pass


class WC:
    def __init__(self, wr_id, opcode, status=0, imm_data=0, byte_len=0):
        self.wr_id, self.opcode, self.status = wr_id, opcode, status
        self.imm_data, self.byte_len, self.vendor_err = imm_data, byte_len, 0


class CQ(_CM):
    def __init__(self, ctx, cqe, cq_context, channel, comp_vector):
        self.cqe, self.queue, self.shuffle, self.closed = cqe, [], False, False
        ctx.children.append(self)

    def push(self, wc):
        self.queue.append(wc)
        assert len(self.queue) <= self.cqe, "CQ overrun"

    def poll(self, num_entries=1):
        if self.closed:
            raise AssertionError("poll on a closed CQ")
        if self.shuffle:
            FABRIC.rnd.shuffle(self.queue)
        out, self.queue = self.queue[:num_entries], self.queue[num_entries:]
        return len(out), out

    def close(self):
        self.closed = True


class MR(_CM):
    def __init__(self, creator, length=0, access=0, address=None, implicit=False, **kwargs):
        f = FABRIC
        self.length, self.access, self.data = length, access, bytearray(length)
        self.buf = f.next_addr
        f.next_addr += length + 0x1000
        self.lkey, self.rkey = self.buf & 0xFFFF | 1, (self.buf >> 4) & 0xFFFFF | 2
        self.closed = False
        f.mrs[self.buf] = self
        creator.ctx.children.append(self)

    def write(self, data, length, offset=0):
        assert isinstance(data, bytes), "pyverbs MR.write takes bytes"
        assert not self.closed and 0 <= offset and offset + length <= self.length
        self.data[offset : offset + length] = data[:length]

    def read(self, length, offset):
        assert not self.closed and 0 <= offset and offset + length <= self.length
        return bytes(self.data[offset : offset + length])

    def close(self):
        self.closed = True


class GID:
    def __init__(self, val=None):
        self.gid = val

    def __str__(self):
        return self.gid


class GlobalRoute:
    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        assert isinstance(dgid, GID)
        self.dgid, self.sgid_index = dgid, sgid_index


class AHAttr:
    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1,
                 gr=None):
        assert gr is None or isinstance(gr, GlobalRoute)
        self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr


class AH:
    def __init__(self, pd, **kwargs):
        assert set(kwargs) == {"attr"} and isinstance(kwargs["attr"], AHAttr)
        self.attr = kwargs["attr"]


class SGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id=0, opcode=FLAT["IBV_WR_SEND"], num_sge=0, imm_data=0, sg=None,
                 send_flags=FLAT["IBV_SEND_SIGNALED"], next_wr=None):
        if num_sge < 1 or sg is None:
            raise PyverbsError("A WR needs at least one SGE")
        self.wr_id, self.opcode, self.sg, self.imm_data = wr_id, opcode, sg, imm_data
        self.send_flags, self.rkey, self.raddr = send_flags, None, None

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.raddr = rkey, addr


class RecvWR:
    def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None):
        assert num_sge == len(sg or [])
        self.wr_id, self.sg = wr_id, sg or []


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1,
                 max_inline_data=0):
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr


class QPInitAttr:
    def __init__(self, qp_type=FLAT["IBV_QPT_RC"], qp_context=None, scq=None, rcq=None, srq=None,
                 cap=None, sq_sig_all=0):
        self.qp_type, self.scq, self.rcq, self.cap = qp_type, scq, rcq, cap


class QPInitAttrEx(QPInitAttr):
    def __init__(self, qp_type=None, qp_context=None, scq=None, rcq=None, srq=None, cap=None,
                 sq_sig_all=0, comp_mask=0, pd=None, xrcd=None, create_flags=0,
                 max_tso_header=0, source_qpn=0, hash_conf=None, ind_table=None,
                 send_ops_flags=0):
        super().__init__(qp_type, qp_context, scq, rcq, srq, cap, sq_sig_all)
        self.send_ops_flags, self.comp_mask, self.pd = send_ops_flags, comp_mask, pd


class QPAttr:
    def __init__(self, qp_state=0, cur_qp_state=0, port_num=1, **kw):
        self.port_num = port_num
        self.qp_access_flags = 0


class _QPBase(_CM):
    srd = False

    def __init__(self, ctx, init):
        f = FABRIC
        self.qp_num = f.next_qpn
        f.next_qpn += 1
        f.qps[self.qp_num] = self
        self.scq, self.rcq, self.cap = init.scq, init.rcq, init.cap
        self.recvs: list[RecvWR] = []
        self.state, self.remote, self.closed = "INIT", None, False
        ctx.children.append(self)
        if self.srd:
            init.scq.shuffle = init.rcq.shuffle = True

    def post_recv(self, wr, bad_wr):
        assert not self.closed
        self.recvs.append(wr)
        assert len(self.recvs) <= self.cap.max_recv_wr, "receive queue overflow"

    def to_rts(self, attr):
        self.state = "RTS"
        self.attr = attr
        if not self.srd:
            self.remote = attr.dest_qp_num
            assert attr.ah_attr is not None and attr.path_mtu

    def _peer(self, qpn):
        peer = FABRIC.qps[qpn]
        assert peer.state == "RTS" and self.state == "RTS"
        return peer

    def _fail_if_broken(self, wr_id) -> bool:
        if self.qp_num not in FABRIC.broken:
            return False
        status = "IBV_WC_WR_FLUSH_ERR" if self.state == "ERR" else "IBV_WC_RETRY_EXC_ERR"
        self.state = "ERR"
        self.scq.push(WC(wr_id, FLAT["IBV_WC_SEND"], status=FLAT[status]))
        return True

    def _deliver_send(self, peer, data, wr_id, opcode_local, imm=None):
        if not peer.recvs:
            raise RNR(f"QP {peer.qp_num}: a message arrived with no receive posted")
        r = peer.recvs.pop(0)
        if imm is None:
            rs = r.sg[0]
            assert len(data) <= rs.length, "message larger than the receive buffer"
            mr, off = FABRIC.mr_at(rs.addr, len(data), rs.lkey, False, 0)
            mr.data[off : off + len(data)] = data
            peer.rcq.push(WC(r.wr_id, FLAT["IBV_WC_RECV"], byte_len=len(data)))
        else:
            peer.rcq.push(WC(r.wr_id, FLAT["IBV_WC_RECV_RDMA_WITH_IMM"], imm_data=imm,
                             byte_len=len(data)))
        self.scq.push(WC(wr_id, opcode_local))

    def close(self):
        self.closed = True
        FABRIC.qps.pop(self.qp_num, None)


class QP(_QPBase):
    def __init__(self, creator, init_attr, qp_attr=None):
        super().__init__(creator.ctx, init_attr)
        self.access = qp_attr.qp_access_flags if qp_attr else 0

    def post_send(self, wr, bad_wr):
        assert not self.closed
        FABRIC.ops += 1
        if self._fail_if_broken(wr.wr_id):
            return
        peer = self._peer(self.remote)
        sge = wr.sg[0]
        mr, off = FABRIC.mr_at(sge.addr, sge.length, sge.lkey, False, 0)
        data = bytes(mr.data[off : off + sge.length])
        if wr.opcode == FLAT["IBV_WR_RDMA_WRITE_WITH_IMM"]:
            assert peer.attr.qp_access_flags & FLAT["IBV_ACCESS_REMOTE_WRITE"]
            rmr, roff = FABRIC.mr_at(wr.raddr, len(data), wr.rkey, True,
                                     FLAT["IBV_ACCESS_REMOTE_WRITE"])
            rmr.data[roff : roff + len(data)] = data
            self._deliver_send(peer, data, wr.wr_id, FLAT["IBV_WC_RDMA_WRITE"], wr.imm_data)
        elif wr.opcode == FLAT["IBV_WR_SEND"]:
            self._deliver_send(peer, data, wr.wr_id, FLAT["IBV_WC_SEND"])
        else:
            raise AssertionError(f"unexpected opcode {wr.opcode}")


class EfaQPInitAttr:
    def __init__(self):
        self.driver_qp_type = None


class SRDQPEx(_QPBase):
    srd = True

    def __init__(self, ctx, attr_ex, efa_init_attr):
        assert efa_init_attr.driver_qp_type == EFA_FLAT["EFADV_QP_DRIVER_TYPE_SRD"]
        assert attr_ex.comp_mask & FLAT["IBV_QP_INIT_ATTR_SEND_OPS_FLAGS"]
        super().__init__(ctx, attr_ex)
        self.ops_allowed = attr_ex.send_ops_flags
        self._wr = None

    def wr_start(self):
        self._wr = {}

    wr_id = property(lambda s: s._wr["id"], lambda s, v: s._wr.__setitem__("id", v))
    wr_flags = property(lambda s: s._wr["flags"], lambda s, v: s._wr.__setitem__("flags", v))

    def wr_send(self):
        assert self.ops_allowed & FLAT["IBV_QP_EX_WITH_SEND"]
        self._wr["op"] = "send"

    def wr_rdma_read(self, rkey, remote_addr):
        assert self.ops_allowed & FLAT["IBV_QP_EX_WITH_RDMA_READ"]
        self._wr.update(op="read", rkey=rkey, raddr=remote_addr)

    def wr_set_ud_addr(self, ah, remote_qpn, remote_qkey):
        assert isinstance(ah, AH)
        self._wr.update(qpn=remote_qpn, qkey=remote_qkey)

    def wr_set_sge(self, sge):
        self._wr["sge"] = sge

    def wr_complete(self):
        assert not self.closed
        FABRIC.ops += 1
        w, self._wr = self._wr, None
        if self._fail_if_broken(w["id"]):
            return
        peer = self._peer(w["qpn"])
        sge = w["sge"]
        mr, off = FABRIC.mr_at(sge.addr, sge.length, sge.lkey, False, 0)
        if w["op"] == "send":
            self._deliver_send(peer, bytes(mr.data[off : off + sge.length]), w["id"],
                               FLAT["IBV_WC_SEND"])
        else:
            rmr, roff = FABRIC.mr_at(w["raddr"], sge.length, w["rkey"], True,
                                     FLAT["IBV_ACCESS_REMOTE_READ"])
            mr.data[off : off + sge.length] = rmr.data[roff : roff + sge.length]
            self.scq.push(WC(w["id"], FLAT["IBV_WC_RDMA_READ"]))


def install(monkeypatch, devices: list[dict], *, layout: str = "44", seed: int = 0) -> Fabric:
    """Put the fake in sys.modules (rdma-core 44's flat `pyverbs.enums`, or pyverbs 59's enum
    classes in `pyverbs.libibverbs_enums`) and reset rdma_devices.py's caches."""
    global FABRIC
    FABRIC = Fabric(devices, seed)
    mods = {}

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m
        return m

    mod("pyverbs")
    if layout == "44":
        mod("pyverbs.enums", **FLAT)
    else:  # 59: one IntEnum per C enum (grouped coarsely here; the shim does not care)
        groups: dict[str, dict] = {}
        for k, v in FLAT.items():
            groups.setdefault("ibv_" + k.split("_")[1].lower(), {})[k] = v
        mod("pyverbs.libibverbs_enums",
            **{g: IntEnum(g, members) for g, members in groups.items()})
    mod("pyverbs.device", Context=Context, get_device_list=get_device_list)
    mod("pyverbs.pd", PD=PD)
    mod("pyverbs.cq", CQ=CQ)
    mod("pyverbs.mr", MR=MR)
    mod("pyverbs.qp", QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr,
        QPInitAttrEx=QPInitAttrEx)
    mod("pyverbs.wr", SGE=SGE, SendWR=SendWR, RecvWR=RecvWR)
    mod("pyverbs.addr", AH=AH, AHAttr=AHAttr, GID=GID, GlobalRoute=GlobalRoute)
    mod("pyverbs.pyverbs_error", PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError)
    mod("pyverbs.providers")
    mod("pyverbs.providers.efa")
    mod("pyverbs.providers.efa.efa_enums", **EFA_FLAT)
    mod("pyverbs.providers.efa.efadv", EfaContext=EfaContext, SRDQPEx=SRDQPEx,
        EfaQPInitAttr=EfaQPInitAttr)
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    from monarch_fs.daemon.wire import rdma_devices

    for attr in ("_enums", "_efa_enums", "_probed"):
        monkeypatch.setattr(rdma_devices, attr, None)
    return FABRIC


class _Setter:
    """monkeypatch's setitem/delitem/setattr without undo, for a whole process."""

    @staticmethod
    def setitem(d, key, value):
        d[key] = value

    @staticmethod
    def delitem(d, key):
        del d[key]

    @staticmethod
    def setattr(obj, name, value):
        setattr(obj, name, value)


ENV = "MONARCH_FS_FAKE_PYVERBS"


def install_from_env() -> None:
    """In a child process (a daemon, `monarch-fs run`): install the fake for the whole process
    if $MONARCH_FS_FAKE_PYVERBS holds a JSON list of devices. Called from the sitecustomize.py
    that tests write (see test_run.py); the fabric is this process's own, so it can make a host
    look RDMA-capable, but no bytes can cross processes through it."""
    import json
    import os

    spec = os.environ.get(ENV)
    if spec:
        install(_Setter, json.loads(spec))
