"""Which frames may flow, in which state of a session, from which side: the rules the
connection's state machine (connection.py) holds each frame sent and received to."""

from __future__ import annotations

import enum

from .frames import FrameType


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"  # the receive side is finished: EOF or a protocol error


# What may flow once both sides are authenticated; Event and Want only go server -> client
# (a node asks the peer that streams to it for chunks: protocol.Want).
_DATA = {FrameType.REQUEST, FrameType.REPLY, FrameType.QUERY_MISSING, FrameType.MISSING_IDS,
         FrameType.PUT_CHUNK, FrameType.PUT_CHUNKS, FrameType.DATA,
         FrameType.SEALED_CHUNK}  # fmt: skip
_READY_FROM = {Role.CLIENT: _DATA, Role.SERVER: _DATA | {FrameType.EVENT, FrameType.WANT}}


def may_send(ftype: FrameType, role: Role, state: State, sent: set[FrameType],
             have_peer_nonce: bool) -> bool:
    """Whether `role` may send `ftype` now (an ERROR and a closed session are the caller's);
    `sent`: the handshake frames it has sent."""
    server = role is Role.SERVER
    if ftype in sent:
        return False
    if ftype is FrameType.HELLO:
        return server and state is State.HANDSHAKE
    if ftype is FrameType.AUTH:
        return not server and have_peer_nonce
    if ftype is FrameType.WELCOME:
        return server and state is State.READY
    welcomed = FrameType.WELCOME in sent if server else True
    return state is State.READY and welcomed and ftype in _READY_FROM[role]


def may_receive(ftype: FrameType, role: Role, state: State, sent: set[FrameType],
                have_peer_nonce: bool) -> bool:
    """Whether `role` may receive `ftype` from its peer now (an ERROR is always let in)."""
    server = role is Role.SERVER
    if state is State.READY:
        return ftype in _READY_FROM[Role.CLIENT if server else Role.SERVER]
    if state is State.CLOSED:
        return False
    if server:
        return ftype is FrameType.AUTH and FrameType.HELLO in sent
    if ftype is FrameType.HELLO:
        return not have_peer_nonce
    return ftype is FrameType.WELCOME and FrameType.AUTH in sent
