"""RDMA devices through pyverbs: the lazy import, its enums under either API, and the probe of
this host's ports that decides whether RDMA is offered at all.

pyverbs is imported here only when a device is probed or a channel opened, never at import
time, so the rest of monarch-fs runs without it. Both pyverbs APIs are supported: rdma-core 44
(Debian 12's python3-pyverbs: flat names in `pyverbs.enums`) and pyverbs >= 59 from PyPI (enum
classes in `pyverbs.libibverbs_enums`); `Enums` looks a name up in whichever exists.

Environment (optional, see monarch_fs/settings.py): MONARCH_FS_RDMA_DEVICE (device name).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ...settings import settings

AMAZON_VENDOR_ID = 0x1D0F
_NO_PYVERBS = "pyverbs not installed"
_NO_DEVICES = "ibv_get_device_list is empty"


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


def _import(name: str) -> ModuleType | None:
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

