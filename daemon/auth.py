"""Cluster token files. Every node and client of a cluster shares one secret token; it is only
ever used as an HMAC key (see protocol.py), so it never crosses the wire.

An empty token (b"") means "no token": the handshake still runs, with an empty key, so a cluster
without a token file works on a trusted network, and both sides must agree on that too.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_ENV = "MONARCH_FS_TOKEN_FILE"
HOME_ENV = "MONARCH_FS_HOME"


class TokenError(Exception):
    """A token file is missing, empty or unreadable."""


def home_dir() -> Path:
    """$MONARCH_FS_HOME, else ~/.monarch-fs: the local cluster, its token, the scan caches."""
    return Path(os.environ.get(HOME_ENV, "~/.monarch-fs")).expanduser()


def default_token_file() -> Path:
    return home_dir() / "cluster" / "token"


def load_token(path: str | os.PathLike[str]) -> bytes:
    """The token in `path`, without surrounding whitespace."""
    p = Path(path).expanduser()
    try:
        token = p.read_bytes().strip()
    except FileNotFoundError:
        raise TokenError(f"token file {p} does not exist") from None
    except IsADirectoryError:
        raise TokenError(f"token file {p} is a directory") from None
    except OSError as e:
        raise TokenError(f"cannot read token file {p}: {e.strerror or e}") from None
    if not token:
        raise TokenError(f"token file {p} is empty")
    return token


def write_new_token(path: str | os.PathLike[str]) -> bytes:
    """Write a fresh random token to `path` (mode 0600, atomically, replacing any old one) and
    return it as load_token() will read it back."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(32).encode()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # regardless of the umask
            os.write(fd, token + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return token


def resolve_token(cli_value: str | None) -> bytes:
    """The token to use: from --token-file, else $MONARCH_FS_TOKEN_FILE, else the default file
    if it exists, else b"" (no token). A named file that cannot be read is an error."""
    if cli_value:
        return load_token(cli_value)
    env = os.environ.get(TOKEN_ENV)
    if env:
        return load_token(env)
    default = default_token_file()
    if default.exists():
        return load_token(default)
    return b""
