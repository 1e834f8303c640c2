"""Host lists: `host:port,host:port`, `@hostfile` (one per line, `#` comments), or
$MONARCH_FS_HOSTS; with none of them, the local cluster that `monarch-fs cluster up` started."""

from __future__ import annotations

from pathlib import Path

from ...settings import settings
from ..wire.addresses import parse_addr
from .cluster import default_cluster_dir


class HostsError(ValueError):
    pass


def default_hosts_file() -> Path:
    return default_cluster_dir() / "hosts"


def parse_hosts(spec: str | None) -> list[str]:
    if not spec:
        spec = settings.hosts
    if not spec:
        default = default_hosts_file()
        if not default.exists():
            raise HostsError("no hosts: pass --hosts host:port,... or @hostfile, set "
                             "$MONARCH_FS_HOSTS, or start a local cluster (monarch-fs cluster up)")
        spec = f"@{default}"
    if spec.startswith("@"):
        try:
            lines = Path(spec[1:]).read_text().splitlines()
        except OSError as e:
            raise HostsError(f"cannot read host file {spec[1:]}: {e.strerror}") from None
        items = [line.split("#", 1)[0].strip() for line in lines]
    else:
        items = [s.strip() for s in spec.split(",")]
    hosts = [h for h in items if h]
    if not hosts:
        raise HostsError(f"host list {spec!r} is empty")
    for h in hosts:
        try:
            parse_addr(h)
        except ValueError as e:
            raise HostsError(str(e)) from None
    if len(set(hosts)) != len(hosts):
        raise HostsError(f"host list {spec!r} names a host twice")
    return hosts
