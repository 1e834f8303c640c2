"""A proc's messages to its owner (mesh/outbox.py) arrive in the order they were posted,
whether they went through the writer or straight from the poster, and a large message's pieces
are never split by another message."""

from __future__ import annotations

import trio

from monarch_fs.mesh import wire
from monarch_fs.mesh.outbox import Outbox
from monarch_fs.mesh.owner import MESH_MAX_FRAME
from rdma_helpers import channel_pair


def test_posts_arrive_in_order_and_pieces_stay_together():
    async def main() -> list[int]:
        tx, rx = await channel_pair()
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        outbox = Outbox()
        big = b"x" * (3 * wire.PIECE + 5)  # goes as pieces
        got: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.writer, tx)
            await trio.sleep(0.01)

            async def post(i: int) -> None:
                await outbox.post(wire.encode({"op": "m", "i": i}, big if i % 4 == 0 else i))

            async def poster() -> None:  # a large post returns once queued: what follows
                for i in range(24):          # is posted while its pieces are on their way
                    await post(i)

            nursery.start_soon(poster)
            async for h, msg in wire.messages(rx):
                got.append(h["i"])
                assert wire.body(msg) == (big if h["i"] % 4 == 0 else h["i"])
                if len(got) == 24:
                    break
            outbox.close()
            await outbox.flushed.wait()
        return got

    assert trio.run(main) == list(range(24))
