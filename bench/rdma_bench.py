#!/usr/bin/env python3
"""RDMA-vs-TCP throughput of chunk transfer, for RDMA hosts (it runs the TCP half anywhere).

    .venv/bin/python -m bench.rdma_bench                       # both cases, on this host
    .venv/bin/python -m bench.rdma_bench --size-mb 1024 --json bench/results/rdma.json
    # across two hosts: on B               on A
    .venv/bin/python -m bench.rdma_bench --serve 0.0.0.0:7100 --token-file T
    .venv/bin/python -m bench.rdma_bench --peer B:7100 --token-file T --case pair

Two cases:

* pair: chunk transfer between two endpoints through the bulk interface (daemon/wire/bulk.py), the
  same code push and the node daemon use: 4 MiB incompressible chunks, `send_chunk` back to back,
  then `flush` (which waits until the receiver delivered every chunk). The receiver is a second
  process (`--serve`), on this host unless `--peer` names another one. Each transport the two
  ends share is measured: tcp always, rdma-rc (InfiniBand/RoCE) or rdma-srd (EFA) when both ends
  have a usable device.
* chain: a real `monarch-fs push --topology chain` of a generated tree to a 4-node local cluster
  (real daemons, FUSE mounts), with --transport tcp and with --transport rdma. Today only the
  dev box -> first node hop can be RDMA; nodes relay to each other over TCP (see README), so this
  measures what a chain push gains from RDMA as wired now.

Where RDMA is unavailable (no pyverbs, no device: these development VMs) the RDMA rows are
skipped with the reason, which is printed and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from monarch_fs.daemon.wire import bulk
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.addresses import parse_addr
from monarch_fs.daemon.wire.auth import load_token, write_new_token
from monarch_fs.daemon.wire.transport import ConnectionLost, accept, connect

MiB = 1 << 20
CHUNK = 4 * MiB
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the receiving end (--serve) -----------------------------------------------------------------


async def serve(listen: str, token: bytes, once: bool) -> None:
    local = bulk.resolve_local("auto")
    log(f"serving on {listen}: transport {local.kind} ({local.reason})")
    host, port = parse_addr(listen, listen=True)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    print(json.dumps({"port": bound}), flush=True)  # for the parent process

    async def session(stream: trio.SocketStream) -> None:
        chan = await accept(stream, token, local.info())
        delivered = 0

        async def deliver(cid: bytes, blob: bytes) -> None:
            nonlocal delivered
            delivered += 1

        rx = None
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    msg = await chan.receive()
                    if isinstance(msg, p.PutChunk):
                        await deliver(msg.cid, msg.blob)
                    elif msg.op == "bulk":
                        rx, value = bulk.accept_receiver(local, msg.args, deliver, nursery,
                                                         chan.conn.bulk_key)
                        await chan.send(p.Reply(msg.id, value))
                    elif msg.op == "flush":
                        err = None
                        if rx is not None:
                            err = await rx.wait_delivered(int(msg.args.get("bulk_chunks", 0)))
                        await chan.send(p.Reply(msg.id, {"delivered": delivered, "error": err}))
            except ConnectionLost:
                pass  # the sender hung up: the normal end of a session
            except Exception as e:
                log(f"session with {chan.peer} failed: {type(e).__name__}: {e}")
            finally:
                if rx is not None:
                    await rx.aclose()
                nursery.cancel_scope.cancel()
                await chan.aclose()

    async with trio.open_nursery() as nursery:
        async def handler(stream):
            await session(stream)
            if once:
                nursery.cancel_scope.cancel()

        nursery.start_soon(trio.serve_listeners, handler, listeners)


# ---- the sending end -----------------------------------------------------------------------------


async def send_run(peer: str, token: bytes, kind: str, local: bulk.LocalTransport,
                   blobs: list[bytes]) -> dict:
    chan = await connect(peer, token)
    async with chan:
        sender = await bulk.open_sender(chan, kind, local, chan.info)
        try:
            t0 = time.perf_counter()
            for i, blob in enumerate(blobs):
                await sender.send_chunk(i.to_bytes(16, "little"), blob)
            extra = await sender.flush()
            reply = await chan.request("flush", **extra)
            seconds = time.perf_counter() - t0
        finally:
            await sender.aclose()
    if reply.get("error") or reply.get("delivered", 0) < len(blobs):
        raise RuntimeError(f"{kind}: the receiver reports {reply}")
    size = sum(map(len, blobs))
    return {"case": "pair", "transport": kind, "bytes": size, "seconds": round(seconds, 4),
            "GBps": round(size / seconds / 1e9, 3)}


def pair_case(args: argparse.Namespace, token: bytes, token_file: str) -> list[dict]:
    n = max(1, args.size_mb * MiB // CHUNK)
    blobs = [os.urandom(CHUNK) for _ in range(n)]
    server = None
    peer = args.peer
    if peer is None:  # a receiver process on this host
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", "127.0.0.1:0", "--token-file", token_file],
            stdout=subprocess.PIPE, text=True)
        peer = f"127.0.0.1:{json.loads(server.stdout.readline())['port']}"
    rows = []
    try:
        local = bulk.resolve_local("auto")

        async def info() -> dict:
            async with await connect(peer, token) as chan:
                return chan.info

        peer_info = trio.run(info)
        kinds = ["tcp"]
        try:
            kinds.append(bulk.choose_transport("rdma", local.devices, peer_info.get("rdma"),
                                               local_why=local.why_none,
                                               peer_why=peer_info.get("transport_reason", ""))[0])
        except bulk.TransportUnavailable as e:
            rows.append({"case": "pair", "transport": "rdma", "skipped": str(e)})
        for kind in kinds:
            best = None
            for _ in range(args.repeat):
                row = trio.run(send_run, peer, token, kind, local, blobs)
                best = row if best is None or row["seconds"] < best["seconds"] else best
            rows.append(best)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    return rows


# ---- the 4-node chain (real daemons, real push) --------------------------------------------------


def chain_case(args: argparse.Namespace) -> list[dict]:
    from monarch_fs.daemon.client import cluster

    rows = []
    with tempfile.TemporaryDirectory(prefix="monarch-fs-rdma-bench-") as tmp:
        d = Path(tmp)
        src = d / "payload"
        src.mkdir()
        remaining, i = args.size_mb * MiB, 0
        while remaining > 0:
            size = min(remaining, 64 * MiB)
            (src / f"blob{i}.bin").write_bytes(os.urandom(size))
            remaining -= size
            i += 1
        env = {**os.environ, "MONARCH_FS_HOME": str(d / "home")}
        try:
            for transport in ("tcp", "rdma"):
                for _ in range(args.repeat):
                    cluster.down(d / "cluster")
                    shutil.rmtree(d / "cluster", ignore_errors=True)  # empty stores every run
                    hosts = cluster.up(args.nodes, d / "cluster")
                    cmd = [sys.executable, "-m", "monarch_fs.cli", "push", str(src),
                           "--hosts", ",".join(hosts), "--token-file",
                           str(d / "cluster" / "token"), "--topology", "chain", "--json",
                           "--no-cache", "--transport", transport]
                    t0 = time.perf_counter()
                    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    wall = time.perf_counter() - t0
                    if out.returncode != 0:
                        why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "?"
                        if transport != "rdma":  # only RDMA may be missing here
                            raise RuntimeError(f"push --transport {transport} exited "
                                               f"{out.returncode}: {out.stderr.strip()[-2000:]}")
                        rows.append({"case": f"chain-{args.nodes}", "transport": transport,
                                     "skipped": why})
                        break
                    res = json.loads(out.stdout)
                    payload = res["bytes"]
                    rows.append({"case": f"chain-{args.nodes}", "transport": res["transport"],
                                 "bytes": payload, "nodes": res["nodes"],
                                 "seconds": res["seconds"], "wall": round(wall, 3),
                                 "GBps": round(payload / res["seconds"] / 1e9, 3),
                                 "delivered_GBps": round(payload * res["nodes"]
                                                         / res["seconds"] / 1e9, 3)})
        finally:
            cluster.down(d / "cluster")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=["pair", "chain", "all"], default="all")
    ap.add_argument("--size-mb", type=int, default=256, help="payload per run (default 256)")
    ap.add_argument("--nodes", type=int, default=4, help="chain length (default 4)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the best is kept")
    ap.add_argument("--peer", metavar="HOST:PORT", help="a --serve receiver on another host")
    ap.add_argument("--serve", metavar="HOST:PORT", help="be the receiving end")
    ap.add_argument("--once", action="store_true", help="--serve: stop after one session")
    ap.add_argument("--token-file", metavar="F")
    ap.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = ap.parse_args()

    token_file = args.token_file
    if token_file is None:
        token_file = os.path.join(tempfile.mkdtemp(prefix="rdma-bench-"), "token")
        write_new_token(token_file)
    token = load_token(token_file)
    if args.serve:
        trio.run(serve, args.serve, token, args.once)
        return 0

    rows: list[dict] = []
    if args.case in ("pair", "all"):
        rows += pair_case(args, token, token_file)
    if args.case in ("chain", "all"):
        rows += chain_case(args)
    print(f"{'case':10} {'transport':10} {'MiB':>6} {'seconds':>8} {'GB/s':>7}  note")
    for r in rows:
        if "skipped" in r:
            print(f"{r['case']:10} {r['transport']:10} {'':>6} {'':>8} {'':>7}  "
                  f"skipped: {r['skipped']}")
        else:
            note = (f"{r['nodes']} nodes, {r['delivered_GBps']} GB/s delivered in all"
                    if "nodes" in r else "")
            print(f"{r['case']:10} {r['transport']:10} {r['bytes'] // MiB:>6} "
                  f"{r['seconds']:>8.3f} {r['GBps']:>7.3f}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "host": os.uname().nodename},
                                              indent=1))
    if args.token_file is None:
        shutil.rmtree(os.path.dirname(token_file), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
