"""What a node's process starts with (procs.py starts it): the user it runs as, its clean
environment, its secrets on a pipe, and SIGKILL should the daemon die. The module docstring of
procs.py says what a process gets and why."""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import signal
from collections.abc import Callable
from dataclasses import dataclass

from ..wire.identity import ROOT_PROCS_FLAG, Identity

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1

BASE_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR")  # and LC_*, from the daemon
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SECRETS_FD_ENV = "MONARCH_FS_SECRETS_FD"
ROOT_REFUSED = (f"this daemon runs as root and starts no process as root unless started with "
                f"{ROOT_PROCS_FLAG} (a single-user cluster); or run the daemon as a normal user")
MAX_SECRETS = 4096  # bytes of JSON: PIPE_BUF, which any pipe takes in one write without waiting


def base_env(uid: int | None = None) -> dict[str, str]:
    """The environment every process starts from (see the module docstring): a few settings of
    the daemon's, and the identity of user `uid` (default: the daemon's)."""
    env = {k: v for k, v in os.environ.items() if k in BASE_ENV or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    try:
        pw = pwd.getpwuid(os.getuid() if uid is None else uid)
    except KeyError:  # no entry (a container's arbitrary uid): what the daemon was given
        env.update({k: os.environ[k] for k in ("HOME", "USER", "LOGNAME", "SHELL")
                    if k in os.environ})
    else:
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name,
                   SHELL=pw.pw_shell or "/bin/sh")
    return env


def secrets_pipe(secrets: dict[str, str]) -> int:
    """A pipe holding `secrets` as JSON, its write end closed: the read end, for the child."""
    data = json.dumps(secrets).encode()
    if len(data) > MAX_SECRETS:
        raise SpawnRefused(f"spawn: secrets take {len(data)} bytes, more than {MAX_SECRETS}")
    r, w = os.pipe()
    try:
        os.write(w, data)  # at most PIPE_BUF bytes: all of it, at once
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def read_secrets() -> dict[str, str]:
    """In a spawned process: the secrets its spawn request carried ({} if none). Reads them from
    the inherited pipe, closes it and removes MONARCH_FS_SECRETS_FD from os.environ, so call it
    first thing: until then, a process this one starts could inherit the descriptor."""
    fd_text = os.environ.pop(SECRETS_FD_ENV, None)
    if fd_text is None:
        return {}
    fd = int(fd_text)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks))


def die_with_parent(parent: int, enter: str | None = None) -> Callable[[], None]:
    """What the child does between fork and exec, after Popen switched its user: ask for
    SIGKILL when the daemon dies (after the switch, which clears that setting), and enter
    `enter` as that user."""
    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the daemon died before prctl took effect
            os._exit(1)
        if enter is not None:
            os.chdir(enter)

    return preexec


@dataclass(frozen=True)
class RunAs:
    """The user a process runs as (--identity munge): who, and the groups it gets."""

    uid: int
    gid: int
    name: str
    home: str
    groups: list[int]

    @classmethod
    def of(cls, who: Identity, allow_root: bool) -> RunAs:
        """The user `who` names, or SpawnRefused saying why this daemon cannot run as it."""
        if who.uid == 0 and not allow_root:
            raise SpawnRefused(f"the MUNGE credential is root's (uid 0): this daemon starts no "
                               f"process as root unless started with {ROOT_PROCS_FLAG}")
        me = os.geteuid()
        if me != 0 and who.uid != me:
            raise SpawnRefused(f"this daemon runs as uid {me} and can start processes only as "
                               f"itself, not as uid {who.uid}: run it as root to act for "
                               "each user")
        try:
            pw = pwd.getpwuid(who.uid)
        except KeyError:
            raise SpawnRefused(f"uid {who.uid} (the MUNGE credential's) has no entry in this "
                               "node's password database: add the user on every node") from None
        return cls(who.uid, who.gid, pw.pw_name, pw.pw_dir,
                   os.getgrouplist(pw.pw_name, who.gid))


class SpawnRefused(Exception):
    pass


def procs_user(allow_root: bool) -> str:
    """The user this daemon's processes run as, or "" when it refuses them all (it runs as
    root without ROOT_PROCS_FLAG)."""
    uid = os.geteuid()
    if uid == 0 and not allow_root:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a container's arbitrary uid
        return str(uid)
