"""How the snapshot filesystem is mounted: the mount options and the kernel's readahead window.

Kept out of the filesystem itself (fs/fuse_ops.py): the daemon applies them around
`pyfuse3.init`, and they concern the kernel's view of the mount, not any request.
"""

from __future__ import annotations

import logging
import os

import pyfuse3

log = logging.getLogger(__name__)


def mount_options() -> set[str]:
    """Read-only, named monarch-fs, each file's own mode enforced; open to every user as root."""
    opts = set(pyfuse3.default_options)
    # default_permissions (pyfuse3's default, kept explicit): the kernel applies each file's
    # own mode and owner, so a file pushed 0600 is only for the daemon's user.
    opts |= {"default_permissions", "ro", "fsname=monarch-fs", "subtype=monarch-fs", "nosuid",
             "nodev"}
    if os.getuid() == 0:
        opts.add("allow_other")  # every user on the node reads the snapshot
    return opts


def set_readahead(mountpoint: str, kb: int = 4096) -> bool:
    """Widen the kernel's readahead window for the mount (root only).

    With the default 128 KiB window a sequential reader costs one FUSE request, and a trip
    through Python, per 128 KiB; a wider window lets the kernel send 1 MiB requests.
    """
    target = os.fsencode(os.path.abspath(mountpoint))
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            dev = next(line.split()[2] for line in f if line.split()[4] == target)
        with open(f"/sys/class/bdi/{dev.decode()}/read_ahead_kb", "w") as f:
            f.write(str(kb))
        return True
    except (OSError, StopIteration) as e:
        log.debug("cannot set readahead for %s: %s", mountpoint, e)
        return False
