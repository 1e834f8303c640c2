"""Sessions after the handshake, against real daemons, through a man in the middle on loopback:
every frame is authenticated (a proxy that relays the handshake cannot inject a request), and
payloads are encrypted when asked for (nothing readable on the wire)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import trio

from helpers import mfs

pytestmark = pytest.mark.mount

_HEADER = struct.Struct("<IB")
WELCOME, REQUEST = 3, 5


class Proxy:
    """Relays bytes between clients and one daemon, recording what passes. With `inject`, it
    writes that frame to the daemon as soon as the daemon's Welcome has gone by, as an
    attacker who relayed the handshake would. With `corrupt` (a frame type), it flips a byte
    in the middle of the first such frame a client sends the daemon. `from_clients` keeps what
    each client sent, as it reached the daemon."""

    def __init__(self, target: str, inject: bytes | None = None,
                 corrupt: int | None = None) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.inject = inject
        self.corrupt = corrupt
        self.corrupted = False
        self.recorded = bytearray()
        self.from_clients: list[bytearray] = []
        self.addr = ""

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.addr = "127.0.0.1:%d" % listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        daemon = await trio.open_tcp_stream(self.host, self.port)
        # Both pipes may write to the daemon (the client's bytes, the injected frame): one
        # at a time, or trio refuses the second send.
        to_daemon = trio.Lock()
        async with client, daemon, trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, client, daemon, False, nursery.cancel_scope,
                               to_daemon)
            nursery.start_soon(self._pipe, daemon, client, True, nursery.cancel_scope,
                               to_daemon)

    async def _pipe(self, src, dst, from_daemon: bool, scope: trio.CancelScope,
                    to_daemon: trio.Lock) -> None:
        seen = bytearray()  # the daemon's frames, to spot its Welcome
        sent = bytearray()  # the client's bytes, as passed on (and to find the frame to corrupt)
        if not from_daemon:
            self.from_clients.append(sent)
        next_frame, target = 0, -1  # in `sent`: where the next frame starts, the byte to flip
        try:
            while data := await src.receive_some(1 << 16):
                self.recorded += data
                if not from_daemon:
                    data, start = bytearray(data), len(sent)
                    sent += data
                    while (self.corrupt is not None and target < 0
                           and len(sent) >= next_frame + _HEADER.size):
                        size, ftype = _HEADER.unpack_from(sent, next_frame)
                        if ftype == self.corrupt:
                            target = next_frame + _HEADER.size + size // 2
                        next_frame += _HEADER.size + size
                    if start <= target < len(sent) and not self.corrupted:
                        data[target - start] ^= 1
                        sent[target] ^= 1
                        self.corrupted = True
                if from_daemon:
                    await dst.send_all(data)
                else:
                    async with to_daemon:
                        await dst.send_all(data)
                if not from_daemon or self.inject is None:
                    continue
                seen += data
                while len(seen) >= _HEADER.size:
                    size, ftype = _HEADER.unpack_from(seen)
                    if len(seen) < _HEADER.size + size:
                        break
                    del seen[:_HEADER.size + size]
                    if ftype == WELCOME:
                        async with to_daemon:
                            await src.send_all(self.inject)  # src is the daemon here
                        self.inject = None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


def forged_spawn(marker: Path, tag: bytes) -> bytes:
    """A spawn request as the proxy would write it: plain (what ran as root before sessions
    were sealed), or with a guessed tag (it has no session key)."""
    body = ('{"id":99,"op":"spawn","args":{"argv":["touch","%s"]}}' % marker).encode()
    return _HEADER.pack(len(body) + len(tag), REQUEST) + body + tag


async def run_cli(*args: str):
    return await trio.to_thread.run_sync(lambda: mfs(*args, check=False))


@pytest.mark.parametrize("tag", [b"", b"\0" * 16], ids=["plain", "guessed-tag"])
async def test_a_proxy_that_relays_the_handshake_cannot_inject_a_spawn(fresh_cluster, tmp_path,
                                                                       tag):
    c = fresh_cluster(1)
    marker = tmp_path / "injected-command-ran"
    proxy = Proxy(c.hosts[0], inject=forged_spawn(marker, tag))
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        out = await run_cli("status", "--hosts", proxy.addr, "--token-file", c.token_file,
                            "--json")
        nursery.cancel_scope.cancel()
    assert proxy.inject is None, "the proxy never saw the Welcome go by"
    await trio.sleep(0.5)  # what a spawn would have taken
    assert not marker.exists(), "the daemon ran a request the proxy injected"
    log = (c.dir / "node-0" / "log").read_text()
    assert "failed authentication" in log
    assert c.status()[0]["node"] == "node-0"  # and it still serves
    assert out.returncode != 0 or "node-0" in out.stdout


@pytest.mark.parametrize("encrypt", ["on", "off"])
async def test_pushed_bytes_are_unreadable_on_the_wire_when_encrypted(fresh_cluster, tmp_path,
                                                                     encrypt):
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    secret = b"model weights nobody may read " * 2000
    (src / "small.txt").write_bytes(b"api_key = 'not-for-the-network'\n")
    (src / "big.bin").write_bytes(secret + os.urandom(1 << 20))  # several frames, one large
    proxy = Proxy(c.hosts[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        out = await run_cli("push", str(src), "--hosts", proxy.addr, "--token-file",
                            c.token_file, "--encrypt", encrypt, "--json")
        nursery.cancel_scope.cancel()
    assert out.returncode == 0, out.stderr
    assert (c.mnt(0) / "ws" / "big.bin").read_bytes()[:len(secret)] == secret
    readable = b"not-for-the-network" in proxy.recorded or b"nobody may read" in proxy.recorded
    assert readable == (encrypt == "off")


async def test_the_mesh_encrypts_its_spawn_requests(fresh_cluster, tmp_path):
    """Spawn requests carry the mesh's secret: the mesh always asks for encryption."""
    from monarch_fs.mesh import HostMesh

    c = fresh_cluster(1)
    proxy = Proxy(c.hosts[0])
    hostfile = tmp_path / "hosts"
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        hostfile.write_text(proxy.addr + "\n")

        def spawn() -> None:
            with HostMesh.connect(f"@{hostfile}", token_file=c.token_file) as hosts:
                hosts.spawn_procs(per_host=1)  # returns once the proc connected back

        await trio.to_thread.run_sync(spawn)
        nursery.cancel_scope.cancel()
    assert len(proxy.recorded) > 1000
    assert b"MONARCH_MESH" not in proxy.recorded and b"spawn" not in proxy.recorded
