"""How the snapshot filesystem is mounted: the mount options, the mode (root or unprivileged)
they follow from, and the kernel's readahead window.

Kept out of the filesystem itself (fs/fuse_ops.py): the daemon applies them around
`pyfuse3.init`, and they concern the kernel's view of the mount, not any request.
"""

from __future__ import annotations

import logging
import os
import pwd
from dataclasses import dataclass

import pyfuse3

log = logging.getLogger(__name__)

FUSE_CONF = "/etc/fuse.conf"


def user_allow_other(conf: str = FUSE_CONF) -> bool:
    """Whether `conf` lets a normal user mount with allow_other (a `user_allow_other` line):
    fusermount3 refuses the option otherwise."""
    try:
        with open(conf, encoding="utf-8", errors="replace") as f:
            return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class MountMode:
    """The options to mount with, and what `monarch-fs status` says of them."""

    options: frozenset[str]
    root: bool
    description: str  # "root", or "unprivileged (user alice; fusermount3; ...)"

    @property
    def allow_other(self) -> bool:
        return "allow_other" in self.options


def mount_mode(allow_other: bool | None = None, conf: str = FUSE_CONF) -> MountMode:
    """Read-only, named monarch-fs, each file's own mode enforced. As root the mount is open to
    every user; a normal user mounts through fusermount3, with allow_other only where `conf`
    permits it (or never, with allow_other=False). allow_other=True where it is not permitted
    is checked (and refused) by mount_check.check_allow_other, not here."""
    opts = set(pyfuse3.default_options)
    # default_permissions (pyfuse3's default, kept explicit): the kernel applies each file's
    # own mode and owner, so a file pushed 0600 is only for the daemon's user.
    opts |= {"default_permissions", "ro", "fsname=monarch-fs", "subtype=monarch-fs", "nosuid",
             "nodev"}
    uid = os.geteuid()
    if uid == 0:
        if allow_other is not False:
            opts.add("allow_other")  # every user on the node reads the snapshot
        return MountMode(frozenset(opts), True,
                         "root" if allow_other is not False else "root (no allow_other)")
    permitted = user_allow_other(conf)
    if allow_other is True or (allow_other is None and permitted):
        opts.add("allow_other")
        others = f"other users read: user_allow_other in {conf}"
    elif allow_other is False:
        others = "other users cannot read: --allow-other no"
    else:
        others = f"other users cannot read: no user_allow_other in {conf}"
    return MountMode(frozenset(opts), False,
                     f"unprivileged (user {user_name(uid)}; fusermount3; {others})")


def mount_options() -> set[str]:
    """The options mount_mode() gives this user by default."""
    return set(mount_mode().options)


def set_readahead(mountpoint: str, kb: int = 4096) -> bool:
    """Widen the kernel's readahead window for the mount (root only: /sys/class/bdi is root's).

    With the default 128 KiB window a sequential reader costs one FUSE request, and a trip
    through Python, per 128 KiB; a wider window lets the kernel send 1 MiB requests.
    """
    if os.geteuid() != 0:
        log.debug("readahead for %s left at the kernel's default: not root", mountpoint)
        return False
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
