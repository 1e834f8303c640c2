"""The handshake's frames: a mutual HMAC challenge-response, so the token never crosses the wire.

    server -> Hello(version, server_nonce)
    client -> Auth(version, client_nonce, encrypt?,
                   HMAC(token, "monarch-fs client" + sn + cn + encrypt?))
    server -> Welcome(HMAC(token, "monarch-fs server" + cn + sn + encrypted), encrypted,
                      info)   [sealed]

From the Welcome on, every frame in either direction is sealed (seal.py): a GCM tag under a
key derived from the token and both nonces, one key per direction, the frame's sequence number
as nonce; a frame that fails its check ends the session (AuthError). The payloads are also
encrypted when the client asked for it or the server requires it; that choice is inside both
MACs, so a man in the middle cannot strip it.

These functions build and check the three frames; which side may send which, and when, is the
Connection's (connection.py).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .frames import VERSION, Buffer, FrameType, check_version, frame, json_payload, parse_json
from .protocol import PROTOCOL_VERSION, AuthError, ProtocolError

NONCE_SIZE = 32
MAC_SIZE = 32
_CLIENT_LABEL = b"monarch-fs client"
_SERVER_LABEL = b"monarch-fs server"
_FLAGS = struct.Struct("<B")  # AUTH: what the client asks for; WELCOME: what was agreed
_ENCRYPT = 1


def _mac(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


def _flags(encrypt: bool) -> bytes:
    return _FLAGS.pack(_ENCRYPT if encrypt else 0)


def hello_frame(server_nonce: bytes) -> list[Buffer]:
    return frame(FrameType.HELLO, VERSION.pack(PROTOCOL_VERSION), server_nonce)


def auth_frame(token: bytes, server_nonce: bytes, client_nonce: bytes,
               encrypt: bool) -> list[Buffer]:
    flags = _flags(encrypt)
    mac = _mac(token, _CLIENT_LABEL, server_nonce, client_nonce + flags)
    return frame(FrameType.AUTH, VERSION.pack(PROTOCOL_VERSION), client_nonce, flags, mac)


def welcome_frame(token: bytes, client_nonce: bytes, server_nonce: bytes, encrypted: bool,
                  info: dict) -> list[Buffer]:
    flags = _flags(encrypted)
    mac = _mac(token, _SERVER_LABEL, client_nonce, server_nonce + flags)
    return frame(FrameType.WELCOME, mac, flags, json_payload(info))


def parse_hello(p: bytes) -> bytes:
    """The server's nonce."""
    check_version(FrameType.HELLO, p)
    if len(p) != VERSION.size + NONCE_SIZE:
        raise ProtocolError("HELLO frame has the wrong size")
    return p[VERSION.size :]


def parse_auth(token: bytes, server_nonce: bytes, p: bytes) -> tuple[bytes, bytes, bool]:
    """(client nonce, its MAC, whether the client asks for encryption); AuthError for a MAC
    made without the token."""
    check_version(FrameType.AUTH, p)
    if len(p) != VERSION.size + NONCE_SIZE + _FLAGS.size + MAC_SIZE:
        raise ProtocolError("AUTH frame has the wrong size")
    nonce = p[VERSION.size : VERSION.size + NONCE_SIZE]
    flags, mac = p[-MAC_SIZE - _FLAGS.size : -MAC_SIZE], p[-MAC_SIZE:]
    want = _mac(token, _CLIENT_LABEL, server_nonce, nonce + flags)
    if not hmac.compare_digest(mac, want):
        raise AuthError("authentication failed: wrong token")
    return nonce, mac, bool(flags[0] & _ENCRYPT)


def parse_welcome(token: bytes, client_nonce: bytes, server_nonce: bytes, p: bytes,
                  want_encrypt: bool) -> tuple[bytes, bool, dict]:
    """(the server's MAC, whether the session is encrypted, the server's info); AuthError for a
    server without the token, or one that would not encrypt when we asked it to."""
    if len(p) < MAC_SIZE + _FLAGS.size:
        raise ProtocolError("WELCOME frame too short")
    mac, flags = p[:MAC_SIZE], p[MAC_SIZE : MAC_SIZE + _FLAGS.size]
    want = _mac(token, _SERVER_LABEL, client_nonce, server_nonce + flags)
    if not hmac.compare_digest(mac, want):
        raise AuthError("server failed to prove it knows the token")
    encrypted = bool(flags[0] & _ENCRYPT)
    if want_encrypt and not encrypted:
        raise AuthError("the server did not agree to encrypt the session")
    info = parse_json(FrameType.WELCOME, p[MAC_SIZE + _FLAGS.size :], {})
    return mac, encrypted, info
