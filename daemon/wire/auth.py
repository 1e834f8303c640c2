"""Cluster token files. Every node and client of a cluster shares one secret token; it is only
ever used as an HMAC key (see handshake.py), so it never crosses the wire.

There is no tokenless mode: a daemon without a credential would run anything for anyone who
can reach its port (root, for every local user, on loopback). resolve_token() is the one place
that finds the credential, for daemons and clients alike; it raises NoToken, saying how to make
one, when there is none. (The user identity a real cluster brings, MUNGE, is meant to be
resolved there too, as a second kind of credential.)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ...settings import settings


class TokenError(Exception):
    """A token file is missing, empty or unreadable."""


class NoToken(TokenError):
    """No token was named and the default token file does not exist."""


NO_TOKEN_HELP = ("pass --token-file F or set $MONARCH_FS_TOKEN_FILE; `monarch-fs token new F` "
                 "makes one (`monarch-fs cluster up` writes {default} for a local cluster)")


def home_dir() -> Path:
    """$MONARCH_FS_HOME, else ~/.monarch-fs: the local cluster, its token, the scan caches."""
    return settings.home


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


def write_new_token(path: str | os.PathLike[str], *, replace: bool = True) -> bytes:
    """Write a fresh random token to `path` (mode 0600, atomically) and return it as
    load_token() will read it back. An existing file is replaced, or with replace=False kept
    (TokenError): a new token locks out every daemon and client that holds the old one."""
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
        if replace:
            os.replace(tmp, p)
        else:  # link() never overwrites: no window in which another writer's token is lost
            try:
                os.link(tmp, p)
            except FileExistsError:
                raise TokenError(f"token file {p} already exists") from None
            finally:
                tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return token


def resolve_token(cli_value: str | None) -> bytes:
    """The token to use, for a daemon or a client: from --token-file, else
    $MONARCH_FS_TOKEN_FILE, else the default file. A named file that cannot be read is an
    error (TokenError); no token anywhere is NoToken, whose message says how to make one."""
    if cli_value:
        return load_token(cli_value)
    if settings.token_file:
        return load_token(settings.token_file)
    default = default_token_file()
    try:
        os.stat(default)
    except (FileNotFoundError, NotADirectoryError):
        raise NoToken("no token: " + NO_TOKEN_HELP.format(default=default)) from None
    except OSError:
        pass  # e.g. a folder we may not search: load_token() says so
    return load_token(default)
