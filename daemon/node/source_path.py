"""A workspace exposed at its source's absolute path on a node (push --at-source).

A venv's console scripts start with `#!/dev/box/path/venv/bin/python` and its pyvenv.cfg names
that path too, so they run on a node only if that path leads to the pushed copy there. The
node makes it: a symlink at the source path pointing at MOUNT/NAME (the current version),
missing parent folders created (0755). It does so with the rights of the user it acts for
(source_links.py runs these functions as that user), so the kernel refuses what that user
could not do, and what it makes is that user's.

What is already there stays: a file, a folder or a link that is not this workspace's (another
workspace's link, one a user made) is left as is, and the push gets a warning naming the path.
The one quiet case is the source folder itself (same device and inode as on the dev box: a
node on the dev box's own machine), where scripts resolve already.

The walk from / goes folder by folder through descriptors, never following a link it did not
check: a link on the way is followed only if root or the daemon's user owns it (the rule of
the kernel's protected_symlinks), and where it leads is checked like the path itself
(requests.check_source_path); a link anyone else made could otherwise steer a root daemon's
mkdir and symlink into /etc. The blocking calls run on a worker thread (the callers').
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from ..wire.requests import check_source_path

MAX_HOPS = 40  # links followed on one walk, as the kernel allows
FOLDER_MODE = 0o755


class NotExposed(Exception):
    """This node leaves the path alone; the message says why (a warning, not a failure)."""


def check_outside(source: str, mount: Path, state: Path | None = None) -> None:
    """Refuse (ValueError) a source path inside this node's mount or state folder, or one
    that holds them: a link there would loop or shadow the node's own files."""
    for own, what in ((mount, "mount"), (state, "state folder")):
        if own is None:
            continue
        own_s = str(own)
        if source == own_s or source.startswith(own_s + "/") or own_s.startswith(source + "/"):
            raise ValueError(f"source path {source!r} overlaps this node's {what} {own_s}")


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def _open_parent(path: str, create: bool, made: list[str] | None = None
                 ) -> tuple[int, str, str]:
    """Open the folder that holds `path`'s last name (creating missing folders if `create`,
    their real paths appended to `made`), following only trusted links: (descriptor, leaf name,
    the real path). NotExposed if the walk cannot or must not go on; FileNotFoundError if a
    folder is missing and not `create`."""
    hops = 0
    parts = path.split("/")[1:]
    while True:
        fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
        real: list[str] = []
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(name, FOLDER_MODE, dir_fd=fd)
                    if made is not None:
                        made.append("/" + "/".join([*real, name]))
                    new = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                  dir_fd=fd)
                    try:
                        os.fchmod(new, FOLDER_MODE)  # whatever the umask
                    finally:
                        os.close(new)
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                here = "/" + "/".join([*real, name])
                if stat.S_ISLNK(st.st_mode):
                    if not _trusted(st):
                        raise NotExposed(f"{here} is a link owned by uid {st.st_uid} (not root "
                                         "or the daemon's user): not followed")
                    hops += 1
                    if hops > MAX_HOPS:
                        raise NotExposed(f"{here}: too many levels of links")
                    target = os.readlink(name, dir_fd=fd)
                    base = "/" + "/".join(real)
                    resolved = os.path.normpath(os.path.join(base, target,
                                                             *parts[i + 1:]))
                    try:
                        check_source_path(resolved)
                    except ValueError as e:
                        raise NotExposed(f"{here} is a link: the path leads to {resolved}; "
                                         f"{e}") from None
                    parts = resolved.split("/")[1:]
                    break  # walk the resolved path again from /
                if not stat.S_ISDIR(st.st_mode):
                    raise NotExposed(f"{here} is not a folder on this node")
                nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nfd
                real.append(name)
            else:
                return fd, parts[-1], "/" + "/".join(parts)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _same(fd: int, leaf: str, source_id: str) -> bool:
    """Whether `leaf` leads to the folder whose "DEV:INO" is `source_id`."""
    try:
        st = os.stat(leaf, dir_fd=fd)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and source_id == f"{st.st_dev}:{st.st_ino}"


def expose(source: str, target: str, source_id: str | None,
           claimed_by: Callable[[str], str | None], made: list[str] | None = None
           ) -> str | None:
    """Make `source` lead to `target` (MOUNT/NAME): None when it does (or is the source folder
    itself, `source_id` "DEV:INO"), else the warning saying why not. `claimed_by(target)` names
    the workspace that owns an existing link into the mount, None for a stale one (replaced).
    The folders it makes are appended to `made` (so that `rm` can remove them)."""
    try:
        fd, leaf, real = _open_parent(source, create=True, made=made)
    except NotExposed as e:
        return f"not exposed at {source}: {e}"
    except OSError as e:
        return f"not exposed at {source}: {e.strerror or e} ({e.filename or source})"
    shown = real if real == source else f"{source} (on this node {real})"
    try:
        try:
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            os.symlink(target, leaf, dir_fd=fd)
            return None
        if stat.S_ISLNK(st.st_mode):
            now = os.readlink(leaf, dir_fd=fd)
            if now == target:
                return None
            mount = os.path.dirname(target)
            if now.startswith(mount + "/") and _trusted(st):
                owner = claimed_by(now)
                if owner is not None:
                    return (f"not exposed at {shown}: it leads to workspace {owner!r} "
                            "(pushed from this path too); left as is")
                tmp = f".{leaf}.monarch-fs-{os.getpid()}"  # replace a stale link atomically
                try:
                    os.unlink(tmp, dir_fd=fd)
                except FileNotFoundError:
                    pass
                os.symlink(target, tmp, dir_fd=fd)
                os.rename(tmp, leaf, src_dir_fd=fd, dst_dir_fd=fd)
                return None
            if source_id is not None and _same(fd, leaf, source_id):
                return None  # a link to the source folder itself, as on the dev box
            return f"not exposed at {shown}: a link to {now} is there; left as is"
        if source_id is not None and _same(fd, leaf, source_id):
            return None  # the source folder itself: this node shares the dev box's disk
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
        return f"not exposed at {shown}: {kind} is there; left as is"
    except OSError as e:
        return f"not exposed at {shown}: {e.strerror or e}"
    finally:
        os.close(fd)


def leads_to(source: str, target: str) -> bool:
    """Whether the link at `source` leads to `target` already (a look, nothing made)."""
    try:
        fd, leaf, _ = _open_parent(source, create=False)
    except (OSError, NotExposed):
        return False
    try:
        return os.readlink(leaf, dir_fd=fd) == target
    except OSError:
        return False
    finally:
        os.close(fd)


def withdraw(source: str, target: str) -> str | None:
    """Remove the link at `source` if it still leads to `target` (the folders made for it:
    remove_folders). None, or a warning saying what failed."""
    try:
        fd, leaf, _ = _open_parent(source, create=False)
    except (FileNotFoundError, NotExposed):
        return None  # nothing of ours can be there
    except OSError as e:
        return f"link at {source} not removed: {e.strerror or e}"
    try:
        if os.readlink(leaf, dir_fd=fd) == target:
            os.unlink(leaf, dir_fd=fd)
        return None
    except (FileNotFoundError, OSError) as e:
        if isinstance(e, FileNotFoundError) or e.errno == 22:  # EINVAL: not a link
            return None
        return f"link at {source} not removed: {e.strerror or e}"
    finally:
        os.close(fd)



def remove_folders(folders: list[str]) -> None:
    """Remove the folders expose made (its `made`), deepest first, each only if it is empty
    now: one another workspace or the user put something in stays."""
    for folder in sorted(folders, key=lambda f: f.count("/"), reverse=True):
        try:
            fd, leaf, _ = _open_parent(folder, create=False)
        except (OSError, NotExposed):
            continue
        try:
            os.rmdir(leaf, dir_fd=fd)
        except OSError:
            pass  # not empty, gone, or not ours to remove
        finally:
            os.close(fd)
