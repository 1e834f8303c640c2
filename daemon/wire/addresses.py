"""Node addresses as users write them ("host:port", "[v6-address]:port"), and which links are
loopback: what decides whether a session is encrypted under the "auto" policy."""

from __future__ import annotations

import ipaddress

ENCRYPT_POLICIES = ("auto", "on", "off")


def parse_addr(addr: str, *, listen: bool = False) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6-address]:port"; port 0 only to listen."""
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {addr!r}: expected [ipv6-address]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep:
            raise ValueError(f"bad address {addr!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"bad address {addr!r}: write IPv6 addresses as [address]:port")
    if not host:
        raise ValueError(f"bad address {addr!r}: missing host")
    if not port_text.isdigit() or not (0 if listen else 1) <= int(port_text) < 65536:
        raise ValueError(f"bad address {addr!r}: port must be a number from 1 to 65535")
    return host, int(port_text)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def encrypts(policy: str, host: str) -> bool:
    """Whether a session with `host` is encrypted under `policy` ("auto": links that leave
    this machine are, loopback is not; every session is authenticated either way). A client
    asks for it, a server requires it; one side is enough."""
    if policy not in ENCRYPT_POLICIES:
        raise ValueError(f"encryption policy must be one of {', '.join(ENCRYPT_POLICIES)}")
    return policy == "on" or (policy == "auto" and not is_loopback(host))
