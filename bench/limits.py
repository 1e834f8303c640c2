"""The machine's limits for the data path, measured in plain Python in the same run as the
figures they bound (a ratio against last week's limit means nothing on a shared VM):

- one TCP stream over loopback: 4 MiB `sendall` in one process, `recv_into` a preallocated
  buffer in another (the most one Python stream can move);
- a plain-Python push pipeline (`push_pipeline`): a file read in 4 MiB pieces, each hashed
  (xxh3_128) and sent with its id over loopback; the receiver hashes each piece again, checks
  it against the id and writes it into a file in the page cache. What a push could do with the
  same primitives and nothing else (no scan, framing, seal, store or publish);
- O_DIRECT writes of 4 MiB and an fsync (a node writing content once, durably, at its best);
- buffered writes of 4 MiB into the page cache (what a node's write costs without O_DIRECT);
- AES-256-GCM, sealing only (GMAC) and encrypting 4 MiB buffers; xxh3_128 of 4 MiB;
- a node's CPU per GB at its plainest (`node_floor`): receive, check a GMAC tag, hash and write
  with O_DIRECT each 4 MiB piece, and for a relay hop send it on too.

    python -m bench.limits            # JSON, best of 3 and the range of each
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

MiB = 1 << 20
BLOCK = 4 * MiB
ALIGN = 4096  # a page: O_DIRECT's alignment


def _receiver(port_out, total: int) -> None:  # the other process of loopback_stream
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_out.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    got = 0
    while got < total:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()
    srv.close()


def loopback_stream(size: int = 1 << 30) -> float:
    """Bytes a second one Python TCP stream moves over loopback (sendall / recv_into)."""
    ctx = get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, size))
    proc.start()
    try:
        port = parent.recv()
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = os.urandom(BLOCK)
        t0 = time.perf_counter()
        for _ in range(size // BLOCK):
            s.sendall(data)
        s.recv(1)
        seconds = time.perf_counter() - t0
        s.close()
    finally:
        proc.join(10)
    return size / seconds


def _pipeline_receiver(port_out, directory: str) -> None:  # the node of push_pipeline
    import xxhash

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_out.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    head = bytearray(8 + ID)
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    fd, path = tempfile.mkstemp(dir=directory, prefix="limits-pipeline.")
    try:
        while _recv_exactly(conn, memoryview(head)):
            n = int.from_bytes(head[:8], "little")
            if not n or not _recv_exactly(conn, view[:n]):
                break
            if xxhash.xxh3_128_digest(view[:n]) != head[8:]:
                raise ValueError("push_pipeline: a piece does not match its id")
            os.write(fd, view[:n])
        port_out.send(time.process_time())  # before the answer: the sender waits for both
        conn.sendall(b"k")
    finally:
        os.close(fd)
        os.unlink(path)
        conn.close()
        srv.close()


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


ID = 16  # an xxh3_128 digest


def push_pipeline(source: Path, directory: Path) -> dict[str, float]:
    """A plain-Python push of `source` (see the module docstring): one read and one hash per
    byte on each side, one loopback stream, the receiver's writes buffered; the sender starts
    with the file in the page cache, as a push of it does. Its bytes a second, and each side's
    CPU seconds per GB (steadier than the rate on a shared machine)."""
    import xxhash

    ctx = get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pipeline_receiver, args=(child, str(directory)))
    proc.start()
    try:
        port = parent.recv()
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        size = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        with open(source, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                piece = view[:n]
                s.sendall(n.to_bytes(8, "little") + xxhash.xxh3_128_digest(piece))
                s.sendall(piece)
                size += n
        s.sendall(bytes(8 + ID))  # the end
        if s.recv(1) != b"k":
            raise ConnectionError("push_pipeline: the receiver failed (see its traceback)")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        receiver_cpu = parent.recv()
        s.close()
    finally:
        proc.join(10)
    gb = size / 1e9
    return {"bytes_per_s": size / seconds, "sender_cpu_s_per_gb": cpu / gb,
            "receiver_cpu_s_per_gb": receiver_cpu / gb}


def direct_write(directory: Path, size: int = 1 << 30) -> float:
    """Bytes a second written with O_DIRECT (4 MiB writes) and made durable by an fsync."""
    buf = mmap.mmap(-1, BLOCK)
    buf.write(os.urandom(BLOCK))
    path = directory / "limits-direct.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(size // BLOCK):
            os.write(fd, buf)
        os.fsync(fd)
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
        buf.close()


def page_cache_write(directory: Path, size: int = 1 << 30) -> float:
    """Bytes a second written into the page cache (buffered 4 MiB writes, no fsync)."""
    data = os.urandom(BLOCK)
    path = directory / "limits-buffered.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(size // BLOCK):
            os.write(fd, data)
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()


def crypto_rates(rounds: int = 64) -> dict[str, float]:
    """AES-256-GCM over 4 MiB: tag only (the bytes as associated data) and encrypting; xxh3."""
    import xxhash
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    data = os.urandom(BLOCK)
    out = bytearray(BLOCK + 16)
    nonce = bytes(12)
    rates = {}
    t0 = time.perf_counter()
    for _ in range(rounds):
        aead.encrypt(nonce, b"", data)
    rates["gmac"] = rounds * BLOCK / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(rounds):
        aead.encrypt_into(nonce, data, None, out)
    rates["aes_gcm"] = rounds * BLOCK / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(rounds):
        xxhash.xxh3_128_digest(data)
    rates["xxh3"] = rounds * BLOCK / (time.perf_counter() - t0)
    return rates


def measure(directory: Path | None = None, runs: int = 3, size: int = 1 << 30) -> dict:
    """Each limit's best of `runs` and its range, in bytes a second."""
    directory = Path(directory or tempfile.gettempdir())
    samples: dict[str, list[float]] = {}
    source = directory / "limits-source.bin"
    with open(source, "wb") as f:
        for _ in range(size // BLOCK):
            f.write(os.urandom(BLOCK))
    for _ in range(runs):
        samples.setdefault("loopback_stream", []).append(loopback_stream(size))
        samples.setdefault("push_pipeline", []).append(
            push_pipeline(source, directory)["bytes_per_s"])
        samples.setdefault("direct_write_fsync", []).append(direct_write(directory, size))
        samples.setdefault("page_cache_write", []).append(page_cache_write(directory, size))
        for k, v in crypto_rates().items():
            samples.setdefault(k, []).append(v)
    source.unlink()
    return {k: {"best": max(v), "min": min(v), "runs": len(v)} for k, v in samples.items()}


def line(limits: dict) -> str:
    """One line of the limits, GB/s (best, range)."""
    return "; ".join(f"{k} {v['best'] / 1e9:.2f} GB/s ({v['min'] / 1e9:.2f}-{v['best'] / 1e9:.2f})"
                     for k, v in limits.items())


def _node(port_out, sink_port: int | None, total: int, cpu_out, directory: str,
          key: bytes) -> None:  # node_floor's node
    import xxhash
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_out.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    out = None
    if sink_port is not None:
        out = socket.create_connection(("127.0.0.1", sink_port))
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = mmap.mmap(-1, BLOCK + ALIGN)  # on a page, for O_DIRECT
    view = memoryview(buf)
    block, tag = view[:BLOCK], view[BLOCK:BLOCK + 16]
    fd, path = tempfile.mkstemp(dir=directory, prefix="limits-node.")
    os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    start = os.times()
    try:
        for i in range(total // BLOCK):
            if not _recv_exactly(conn, view[:BLOCK + 16]):
                break
            gcm = Cipher(algorithms.AES(key), modes.GCM(bytes(12), bytes(tag))).decryptor()
            gcm.authenticate_additional_data(block)
            gcm.finalize()  # raises InvalidTag
            xxhash.xxh3_128_digest(block)
            os.pwrite(fd, block, i * BLOCK)
            if out is not None:
                out.sendall(block)
        if out is not None:
            out.recv(1)
        end = os.times()
        cpu_out.send(end.user + end.system - start.user - start.system)
        conn.sendall(b"k")
    finally:
        os.close(fd)
        os.unlink(path)
        for sock in (conn, srv, out):
            if sock is not None:
                sock.close()


def node_floor(directory: Path, size: int = 1 << 30, forward: bool = False,
               runs: int = 3) -> float:
    """CPU seconds per GB of a node's work on incoming content at its plainest, in a process
    of its own: each 4 MiB piece received into a page-aligned buffer (`recv_into`), its GMAC
    tag checked, its xxh3_128 taken and the piece written with O_DIRECT, as a node must (an
    authenticated link, an id to match, the disk). `forward`: a relay hop's, each piece also
    sent on to a next process (`sendall`); like a node's hop on one machine, it is charged
    that process's TCP receive too (loopback delivers in the sender's context). No framing,
    no store, no Python per chunk beyond these calls. The least of `runs` runs of `size`
    bytes each: on this VM one run's CPU per GB swings 2-3x."""
    return min(_node_once(directory, size, forward) for _ in range(runs))


def _node_once(directory: Path, size: int, forward: bool) -> float:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = os.urandom(32)
    data = os.urandom(BLOCK)
    piece = data + AESGCM(key).encrypt(bytes(12), b"", data)  # the block, then its tag
    ctx = get_context("fork")
    sink_parent, sink_child = ctx.Pipe()
    node_parent, node_child = ctx.Pipe()
    sink = None
    if forward:
        sink = ctx.Process(target=_receiver, args=(sink_child, size))
        sink.start()
    try:
        sink_port = sink_parent.recv() if sink is not None else None
        node = ctx.Process(target=_node, args=(node_child, sink_port, size, node_child,
                                               str(directory), key))
        node.start()
        try:
            s = socket.create_connection(("127.0.0.1", node_parent.recv()))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(size // BLOCK):
                s.sendall(piece)
            cpu = node_parent.recv()
            s.recv(1)
            s.close()
        finally:
            node.join(10)
    finally:
        if sink is not None:
            sink.join(10)
    return cpu / (size // BLOCK * BLOCK / 1e9)


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work")
    res = measure(where)
    print(json.dumps(res))
    print(line(res), file=sys.stderr)
