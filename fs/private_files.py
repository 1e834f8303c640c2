"""Files only the daemon's user may read, and replacing or naming them durably.

The store, the refs, the backing files and push's scan caches all hold the bytes or names of
pushed files whatever their modes: their folders are 0700 and their files 0600, whatever the
umask (the mount is the only way other users read content). One home for the few calls that
make that so, used by fs/ and the node's refs alike.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_FILE = 0o600


def private_dir(path: Path) -> None:
    """Create a folder only its owner may enter (0700), or make an existing one so (an older
    version made them 0755)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def fsync_dir(path: Path) -> None:
    """Make the names in a folder durable (files created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike[str], data: bytes, tmp: str | os.PathLike[str], *,
                 fsync: bool = False) -> None:
    """Replace `path` by a file holding `data` (mode 0600), written to `tmp` and renamed: a
    reader sees the old file or the new one, never half of one; on failure the old file stays.
    `fsync` makes the content durable before the rename (the caller fsyncs the folder)."""
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def untrusted(st: os.stat_result) -> str | None:
    """Why a folder (its lstat) is not one only this user controls, or None: a link, not a
    folder, another user's, or open to others (mode not 0700)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not this process's user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def own_private_dir(path: Path) -> None:
    """Make `path` a folder only this user may enter (0700), or take one that is so already.
    Under a shared /tmp, a name such as /tmp/monarch-fs-JOB can be made first by any user, who
    could then swap what is inside: such a folder, or a link there, is refused (lstat, no link
    followed) with a PermissionError naming its owner and mode, never adopted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask; nobody else can rename ours in /tmp
        return
    except FileExistsError:
        pass
    why = untrusted(os.lstat(path))
    if why is not None:
        raise PermissionError(f"{path} was there already and {why}: another user may have made "
                              "it first (its name is predictable); remove it, or use another "
                              "folder")
