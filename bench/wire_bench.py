"""The transport alone: 1 GiB of 4 MiB PutChunk frames over one authenticated Channel on
loopback (no source read, no scan, no store), beside the raw Python stream measured in the same
run (bench/limits.py). It separates what the wire costs from what the rest of a push costs:
`ingest_bench` times a whole push process, this only its frames.

Reports the rate and its ratio to the raw stream, each side's CPU seconds per GiB and the
receiver's minor page faults per GiB (a buffer grown and freed per chunk shows there first).

`--store`: the receiver is a node's ingest without the rest of a node: each chunk (distinct,
with its real id) is verified and written as a session does (daemon/node/writes.py), into a
Store under /work whose one large file object expects them (O_DIRECT), so its CPU per GiB is the
node's receive path alone, without the push process competing for the cores.

    python -m bench.wire_bench [--mib 1024] [--runs 3] [--encrypt auto|on] [--store]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from multiprocessing import get_context

import trio
import xxhash

from bench.limits import loopback_stream
from monarch_fs.daemon.node.writes import ChunkWrites
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.bulk import TcpBulkSender
from monarch_fs.daemon.wire.transport import accept, connect
from monarch_fs.fs.chunk import RAW
from monarch_fs.fs.store import Store

TOKEN = b"wire-bench-token-0123456789abcdef"
CHUNK = 4 << 20


def _usage() -> tuple[float, int]:
    """(CPU seconds, minor page faults) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _chunk(blob: bytearray, i: int) -> bytes:
    """Make `blob` (RAW, then CHUNK bytes) chunk number `i`: its id."""
    blob[1:9] = i.to_bytes(8, "little")
    return xxhash.xxh3_128_digest(memoryview(blob)[1:])


def _receiver(out, chunks: int, encrypt: str, ids: list[bytes] | None) -> None:
    """The node's half, in a process of its own: accept, then take `chunks` PutChunk frames
    (with `ids`: verify and store them, see the module docstring)."""
    async def main(store: Store | None) -> None:
        done = trio.Event()

        async def handler(stream: trio.SocketStream) -> None:
            chan = await accept(stream, TOKEN, {}, encrypt=encrypt)
            writes = None
            if store is not None and ids is not None:
                store.expect_file("f" * 32, len(ids) * CHUNK, ids, CHUNK)
                writes = ChunkWrites(store, raw=False, counters={"chunks_stored": 0},
                                     limiter=trio.CapacityLimiter(4))
            cpu, faults = _usage()
            got = 0
            async with trio.open_nursery() as nursery:
                while got < chunks:
                    msg = await chan.receive()
                    if isinstance(msg, p.PutChunk):
                        got += 1
                        if writes is not None:
                            await writes.start(nursery, msg)
                if writes is not None:
                    await writes.idle(nursery)
                    if writes.errors or writes.counters["chunks_stored"] != chunks:
                        raise RuntimeError(f"stored {writes.counters}: {writes.errors[:1]}")
            cpu2, faults2 = _usage()
            out.send((cpu2 - cpu, faults2 - faults))
            done.set()

        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            out.send(listeners[0].socket.getsockname()[1])
            nursery.start_soon(trio.serve_listeners, handler, listeners)
            await done.wait()
            nursery.cancel_scope.cancel()

    if ids is None:
        trio.run(main, None)
        return
    with tempfile.TemporaryDirectory(dir="/work") as tmp:
        store = Store(tmp)
        try:
            trio.run(main, store)
        finally:
            store.close()


def once(size: int, encrypt: str, store: bool = False) -> dict:
    """One transfer of `size` bytes: rate, both sides' CPU per GiB, receiver faults per GiB."""
    chunks = size // CHUNK
    blobs = [bytearray(bytes([RAW]) + os.urandom(CHUNK)) for _ in range(4)]
    ids = [_chunk(blobs[i % 4], i) for i in range(chunks)] if store else None
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, chunks, encrypt, ids))
    proc.start()
    try:
        port = parent.recv()

        async def send() -> tuple[float, float]:
            chan = await connect(f"127.0.0.1:{port}", TOKEN, encrypt=encrypt)
            sender = TcpBulkSender(chan)
            cpu = _usage()[0]
            t0 = time.perf_counter()
            for i in range(chunks):
                blob = blobs[i % 4]
                cid = _chunk(blob, i) if ids is not None else i.to_bytes(16, "little")
                await sender.send_chunks([(cid, memoryview(blob))])
            cpu2 = _usage()[0]
            return cpu2 - cpu, t0

        sender_cpu, t0 = trio.run(send)
        receiver_cpu, faults = parent.recv()
        seconds = time.perf_counter() - t0
    finally:
        proc.join(10)
    gib = size / (1 << 30)
    return {"MB_per_s": round(size / seconds / 1e6, 1),
            "sender_cpu_s_per_gib": round(sender_cpu / gib, 3),
            "receiver_cpu_s_per_gib": round(receiver_cpu / gib, 3),
            "receiver_faults_per_gib": round(faults / gib)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--encrypt", choices=["auto", "on"], default="auto")
    ap.add_argument("--store", action="store_true",
                    help="the receiver verifies and stores each chunk, as a node does")
    args = ap.parse_args()
    size = args.mib << 20
    for _ in range(args.runs):
        raw = loopback_stream(size)
        run = once(size, args.encrypt, args.store)
        print(json.dumps({**run, "encrypt": args.encrypt, "store": args.store,
                          "loopback_MB_per_s": round(raw / 1e6, 1),
                          "of_loopback": round(run["MB_per_s"] * 1e6 / raw, 3),
                          "load": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
