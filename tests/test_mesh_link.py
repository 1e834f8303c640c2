"""How messages go onto a mesh link (mesh/link_writer.py): an actor's thread writes its answer
itself, without the proc's loop; the loop, threads and the writer task keep one order on the
link (its frames' seals count them); and an actor's sync calls, handed to its thread without
the loop waiting for them, still run in order with everything else it receives."""

from __future__ import annotations

import threading

import pytest
import trio

from monarch_fs.mesh import ActorError, wire
from monarch_fs.mesh.outbox import Outbox
from monarch_fs.mesh.owner import MESH_MAX_FRAME
from rdma_helpers import channel_pair

pytest_plugins = ["mesh_fixtures"]  # hosts, started, procs
pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")


def test_an_actor_thread_writes_its_answer_while_the_loop_is_busy():
    async def main() -> tuple[list[bool], list[int]]:
        tx, rx = await channel_pair()
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        outbox = Outbox()
        sent: list[bool] = []
        done = threading.Event()

        def answer() -> None:  # an actor's thread, answering two calls
            for i in range(2):
                sent.append(outbox.send_now(wire.encode({"op": "result", "i": i})))
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.writer, tx)
            await trio.sleep(0.01)
            trio.lowlevel.start_thread_soon(answer, lambda _: None)
            # The loop is blocked (no task, no wakeup runs) until the answers are out:
            # before, an answer went through the loop and this would wait forever.
            assert done.wait(10), "the actor's thread needed the loop to answer"
            got = [h["i"] async for h, _ in _take(rx, 2)]
            outbox.close()
            await outbox.flushed.wait()
        return sent, got

    sent, got = trio.run(main)
    assert sent == [True, True] and got == [0, 1]


def test_loop_threads_and_writer_keep_one_order_and_pieces_stay_whole():
    async def main() -> list[tuple[str, int]]:
        tx, rx = await channel_pair()
        tx.conn.max_frame = rx.conn.max_frame = MESH_MAX_FRAME
        outbox = Outbox()
        big = b"x" * (2 * wire.PIECE + 7)  # pieces: nothing may come between them
        token = trio.lowlevel.current_trio_token()

        def thread(name: str) -> None:
            for i in range(40):
                msg = wire.encode({"op": "m", "who": name, "i": i}, i)
                if not outbox.send_now(msg):  # something queued ahead: through the loop
                    trio.from_thread.run(outbox.post, msg, trio_token=token)

        async def loop_poster() -> None:
            for i in range(40):
                await outbox.post(wire.encode({"op": "m", "who": "loop", "i": i},
                                              big if i % 10 == 0 else i))

        got: list[tuple[str, int]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbox.writer, tx)
            await trio.sleep(0.01)
            nursery.start_soon(loop_poster)
            for name in ("a", "b"):
                nursery.start_soon(trio.to_thread.run_sync, thread, name)
            async for h, msg in _take(rx, 120):  # a seal out of order would end the link
                assert wire.body(msg) == (big if h["who"] == "loop" and h["i"] % 10 == 0
                                          else h["i"])
                got.append((h["who"], h["i"]))
            outbox.close()
            await outbox.flushed.wait()
        return got

    got = trio.run(main)
    for who in ("a", "b", "loop"):
        assert [i for w, i in got if w == who] == list(range(40))


async def _take(rx, n: int):
    count = 0
    async for h, msg in wire.messages(rx):
        yield h, msg
        count += 1
        if count == n:
            return


@pytest.mark.mount
def test_sync_calls_queued_on_the_actor_thread_keep_their_order(procs):
    counters = procs.spawn("counter", "mesh_actors:Counter", 0)
    one = counters.slice(host=0, proc=0)
    futures = []
    for i in range(50):  # sync calls are handed on without the loop waiting for each
        one.incr.broadcast(1)
        futures.append(one.incr.call_one(0))
        if i % 10 == 9:  # an async endpoint runs after every sync call before it
            assert one.get.call_one().get(timeout=30)[1] == i + 1
    assert [f.get(timeout=30) for f in futures] == list(range(1, 51))
    with pytest.raises(ActorError, match="rank 1 refuses") as err:
        counters.fail_on.call(1).get(timeout=30)  # an error answered from the thread
    assert "mesh_actors.py" in err.value.traceback and "actor_slot" not in err.value.traceback
    assert counters.incr.call(0).get(timeout=30) == [50, 0, 0, 0]
