"""systemd's readiness protocol (sd_notify): a datagram of `KEY=VALUE` lines to the AF_UNIX
socket named by $NOTIFY_SOCKET, so a `Type=notify` unit (daemon/node/monarch-fs.service) is
started only once the mount is served. A few lines instead of a dependency on libsystemd."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("monarch_fs.daemon")


def notify(**fields: object) -> bool:
    """Send READY=1, STATUS=..., STOPPING=1 (as `notify(READY=1, STATUS="...")`) to systemd;
    False, quietly, when not run by it. A failure is logged, never fatal: the daemon serves
    either way."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":  # an abstract socket name
        addr = "\0" + addr[1:]
    message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message)
        return True
    except OSError as e:
        log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], e)
        return False
