"""Host lists: `host:port,host:port`, `@hostfile` (one per line, `#` comments), or
$MONARCH_FS_HOSTS; with none of them, this SLURM job's daemons (`monarch-fs slurm up` in the job
named by $SLURM_JOB_ID), else the local cluster that `monarch-fs cluster up` started."""

from __future__ import annotations

from pathlib import Path

from ...settings import settings
from ..wire.addresses import parse_addr
from ..wire.auth import resolve_token


class HostsError(ValueError):
    pass


def default_hosts_file() -> Path:
    from .cluster import default_cluster_dir  # (cluster and slurm: not a push's cost)

    return default_cluster_dir() / "hosts"


def resolve_target(spec: str | None, token_file: str | None) -> tuple[list[str], str | None]:
    """The hosts, and the token file to use (None: the usual default), when --hosts is `spec`
    and --token-file `token_file`: a SLURM job's hosts come with that job's token, unless a
    token file is named (flag or $MONARCH_FS_TOKEN_FILE)."""
    if not spec and not settings.hosts:
        from .slurm import job_hosts_file

        job_hosts = job_hosts_file()
        if job_hosts is not None:
            if not token_file and not settings.token_file:
                token_file = str(job_hosts.with_name("token"))
            return parse_hosts(f"@{job_hosts}"), token_file
    return parse_hosts(spec), token_file


def target(spec: str | None, token_file: str | None) -> tuple[list[str], bytes]:
    """The hosts and token a client command talks to: --hosts and --token-file, else the
    environment's, else this SLURM job's (`slurm up`), else the local cluster's."""
    hosts, token_file = resolve_target(spec, token_file)
    return hosts, resolve_token(token_file)


def parse_hosts(spec: str | None) -> list[str]:
    if not spec:
        spec = settings.hosts
    if not spec:
        default = default_hosts_file()
        if not default.exists():
            raise HostsError("no hosts: pass --hosts host:port,... or @hostfile, set "
                             "$MONARCH_FS_HOSTS, run `monarch-fs slurm up` in a SLURM job, or "
                             "start a local cluster (monarch-fs cluster up)")
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
