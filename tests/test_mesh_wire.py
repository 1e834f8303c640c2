"""How a mesh message's bytes travel: a large one's pieces are received straight into the
buffer it is rebuilt on, over encrypted and authenticated-only links alike (no copy out of a
frame buffer: that was a pass over every byte), and still checked."""

from __future__ import annotations

import pytest
import trio

from monarch_fs.daemon.wire.buffers import BufferPool
from monarch_fs.daemon.wire.protocol import Data
from monarch_fs.mesh import wire
from monarch_fs.mesh.owner import MESH_MAX_FRAME
from rdma_helpers import channel_pair

pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")  # torch, no numpy


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_large_messages_pieces_are_received_in_place(encrypt):
    import torch

    value = {"t": torch.arange(3 * wire.PIECE // 4 + 5, dtype=torch.int32), "s": "x" * 999,
             "u": torch.ones(7, dtype=torch.float64)}  # parts across piece boundaries

    async def main() -> None:
        tx, rx = await channel_pair(encrypt)
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        rx.conn._buffers = BufferPool()  # its own: the process's pool is every connection's
        assert tx.conn.encrypted is encrypt
        received = wire.messages(rx)
        for _ in range(2):  # the second lands in the first's buffer
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wire.send, tx, wire.encode({"op": "call"}, value,
                                                              has_body=True))
                _, msg = await received.__anext__()
            got = wire.body(msg)
            assert got["s"] == value["s"]
            assert torch.equal(got["t"], value["t"]) and torch.equal(got["u"], value["u"])
            assert got["t"].data_ptr() % 64 == 0
            del got, msg
        # Not one piece went through a frame buffer of the connection's.
        assert rx.conn._buffers._pool == []
        await received.aclose()

    trio.run(main)


def test_a_changed_piece_ends_the_connection():
    """A piece received in place is checked there: changed bytes are never handed on."""
    async def main() -> list:
        tx, rx = await channel_pair()
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        msg = wire.encode({"op": "call"}, b"y" * (3 * wire.PIECE), has_body=True)
        frames = [b"".join(bytes(p) for p in tx.conn.send_parts(piece))
                  for piece in wire._pieces(msg)]
        data = bytearray(b"".join(frames))
        data[len(frames[0]) + len(frames[1]) + 1000] ^= 1  # in the second piece's bytes
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tx.stream.send_all, data)
                got = [m async for m in wire.messages(rx)]
                nursery.cancel_scope.cancel()
        return got

    assert trio.run(main) == []  # the reader stopped; nothing was delivered


def test_pieces_carry_each_part_where_the_receiver_puts_it():
    parts = [b"h" * 10, b"p" * (wire.PIECE - 3), b"t" * (wire.PIECE + 70)]
    pieces = list(wire._pieces(Data(parts)))
    stream = b"".join(bytes(piece.parts[0]) for piece in pieces[1:])
    starts, size = wire._layout([len(p) for p in parts])
    assert len(stream) == size and all(len(piece.parts) == 1 for piece in pieces)
    assert all(s % 64 == 0 for s in starts)
    assert [stream[s:s + len(p)] for s, p in zip(starts, parts)] == parts
