"""Why the daemon cannot mount, in one line that says what to change: found before trying where
it can be, else read from what libfuse and fusermount3 said when the mount failed.

Without this a normal user's daemon died with `RuntimeError: fuse_session_mount failed` under a
line of libfuse's own, which names neither /dev/fuse's mode nor /etc/fuse.conf.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pyfuse3

from .mount_options import FUSE_CONF, MountMode, user_allow_other, user_name

log = logging.getLogger(__name__)

FUSE_DEVICE = "/dev/fuse"
FUSERMOUNT = "fusermount3"


class MountError(Exception):
    """The daemon cannot mount: one line naming the host, the mount point, the cause and the
    fix."""

    def __init__(self, mountpoint: str | os.PathLike[str], cause: str) -> None:
        super().__init__(f"{socket.gethostname()}: cannot mount {os.fspath(mountpoint)}: {cause}")


def _owner(st: os.stat_result) -> str:
    import grp

    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{stat.filemode(st.st_mode)} {user_name(st.st_uid)}:{group}"


def check_device(mountpoint: Path, device: str = FUSE_DEVICE) -> None:
    """/dev/fuse exists and this user may open it for reading and writing."""
    try:
        st = os.stat(device)
    except FileNotFoundError:
        raise MountError(mountpoint, f"{device} does not exist: load the fuse module "
                         "(modprobe fuse), or in a container pass the device "
                         "(docker run --device /dev/fuse)") from None
    if not stat.S_ISCHR(st.st_mode):
        raise MountError(mountpoint, f"{device} is not a character device ({_owner(st)})")
    if not os.access(device, os.R_OK | os.W_OK):
        name = user_name(os.geteuid())
        raise MountError(mountpoint, f"{device} is {_owner(st)}, which user {name} cannot open: "
                         f"as root, chmod 0666 {device} (as Debian ships it), or give it a group "
                         f"of {name}'s (chgrp fuse {device}; chmod 0660 {device}; "
                         f"usermod -aG fuse {name})")


def fusermount_path() -> str | None:
    """The fusermount3 libfuse runs: its build's /usr/bin first, then $PATH."""
    if os.path.exists("/usr/bin/" + FUSERMOUNT):
        return "/usr/bin/" + FUSERMOUNT
    return shutil.which(FUSERMOUNT)


def check_fusermount(mountpoint: Path) -> None:
    """A normal user mounts through fusermount3, which must be there and setuid root."""
    if os.geteuid() == 0:
        return
    path = fusermount_path()
    if path is None:
        raise MountError(mountpoint, f"{FUSERMOUNT} is missing, and a normal user "
                         f"({user_name(os.geteuid())}) mounts through it: apt-get install fuse3")
    st = os.stat(path)
    if not (st.st_mode & stat.S_ISUID and st.st_uid == 0):
        raise MountError(mountpoint, f"{path} is {_owner(st)}, not setuid root, so it cannot "
                         f"mount for user {user_name(os.geteuid())}: as root, chown root {path}; "
                         f"chmod u+s {path} (as Debian ships it)")


def check_allow_other(mountpoint: Path, wanted: bool | None, conf: str = FUSE_CONF) -> None:
    """--allow-other yes as a normal user needs a user_allow_other line in /etc/fuse.conf."""
    if wanted is True and os.geteuid() != 0 and not user_allow_other(conf):
        name = user_name(os.geteuid())
        raise MountError(mountpoint, f"--allow-other yes, but {conf} has no user_allow_other "
                         f"line: add one (as root), or drop --allow-other yes (then only {name} "
                         "reads the mount)")


def _fstype(path: Path) -> str:
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                return fields[fields.index(b"-") + 1].decode(errors="replace")
    return "unknown"


def clear_stale_mount(mountpoint: Path) -> None:
    """A daemon killed with SIGKILL leaves its mount behind ("transport endpoint is not
    connected"); detach it so the new daemon can mount in its place. A live mount is left
    alone (check_mountpoint refuses it): it may be another daemon's. Asked with statfs, which
    the kernel always sends to the daemon: a stat may be answered from its attribute cache."""
    try:
        os.statvfs(mountpoint)
        return
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            return
    log.warning("detaching stale mount at %s", mountpoint)
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                   stderr=subprocess.DEVNULL)
    if os.path.ismount(mountpoint) and os.geteuid() == 0:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def check_mountpoint(mountpoint: Path) -> None:
    """The mount point is an empty folder this user may mount on, and not a mount already; a
    missing one is made (with its parents)."""
    clear_stale_mount(mountpoint)
    name = user_name(os.geteuid())
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        try:
            mountpoint.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MountError(mountpoint, f"it does not exist, and user {name} cannot make it "
                             f"({e.strerror}): make it (owned by {name}), or pick another "
                             "--mount") from None
        return
    except OSError as e:
        raise MountError(mountpoint, f"cannot stat it ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(mountpoint, f"it is not a folder ({_owner(st)}): pick a folder for "
                         "--mount")
    if os.path.ismount(mountpoint):
        raise MountError(mountpoint, f"it is already a mount point ({_fstype(mountpoint)}): "
                         f"stop what serves it, or unmount it (fusermount3 -u {mountpoint}), "
                         "or pick another --mount")
    try:
        entries = sorted(os.listdir(mountpoint))
    except OSError as e:
        raise MountError(mountpoint, f"user {name} cannot list it ({e.strerror}, "
                         f"{_owner(st)})") from None
    if entries:
        raise MountError(mountpoint, f"it is not empty ({len(entries)} entries, e.g. "
                         f"{entries[0]!r}), and the mount would hide them: empty it, or pick "
                         "another --mount")
    if os.geteuid() != 0 and not os.access(mountpoint, os.W_OK):
        raise MountError(mountpoint, f"user {name} may not write to it ({_owner(st)}), and "
                         f"fusermount3 mounts only there: chown {name} {mountpoint}, or pick "
                         "another --mount")


def check_mount(mountpoint: Path, allow_other: bool | None = None) -> None:
    """Everything that can be checked before mounting; MountError names the first problem."""
    check_device(mountpoint)
    check_fusermount(mountpoint)
    check_allow_other(mountpoint, allow_other)
    check_mountpoint(mountpoint)


def mount(ops: pyfuse3.Operations, mountpoint: Path, mode: MountMode) -> None:
    """pyfuse3.init, with a failure told as a MountError carrying what libfuse and fusermount3
    wrote to stderr meanwhile (caught there, so the daemon prints one line, not theirs too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 2)
        try:
            pyfuse3.init(ops, str(mountpoint), set(mode.options))
            failure: Exception | None = None
        except RuntimeError as e:
            failure = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        said.seek(0)
        text = said.read().decode(errors="replace").strip()
    if failure is None:
        if text:
            log.warning("mounting %s: %s", mountpoint, text)
        return
    raise MountError(mountpoint, explain(text, mode) or str(failure))


def explain(said: str, mode: MountMode) -> str:
    """libfuse's and fusermount3's lines about a failed mount, as one, with the fix where the
    message says enough to know it."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    cause = "; ".join(lines)
    if "user_allow_other" in cause:
        return f"{cause} (add a user_allow_other line to {FUSE_CONF}, or --allow-other no)"
    if "fusermount" in cause and ("No such file" in cause or "not found" in cause):
        return f"{cause} (apt-get install fuse3)"
    if "Permission denied" in cause and not mode.root:
        return (f"{cause} (check {FUSE_DEVICE}'s mode, and that user "
                f"{user_name(os.geteuid())} owns the mount point)")
    return cause
