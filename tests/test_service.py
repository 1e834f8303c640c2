"""The node service without a mount (daemon/node/service.py, session.py, publisher.py, and the
wire's requests.py and replies.py): real NodeServices on loopback listeners in this process,
driven by the real push client and the real protocol. No FUSE: the snapshot view each service
publishes to stays unmounted, so these tests need no root and no /dev/fuse, and what they check
is what a mounted daemon does (its own tests, test_sync.py and the rest, drive it through the
command line)."""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from helpers import staged
from monarch_fs.daemon.client.push import push
from monarch_fs.daemon.client.push_options import PushOptions
from monarch_fs.daemon.node import recovery
from monarch_fs.daemon.node.serve import serve
from monarch_fs.daemon.node.service import NodeService, open_listeners
from monarch_fs.daemon.node.session import ROUTES
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire import replies, requests
from monarch_fs.daemon.wire.chunk_read import ChunksReply, ReadChunks
from monarch_fs.daemon.wire.logs import Logs, LogsReply
from monarch_fs.daemon.wire.process_calls import (
    FreePort,
    FreePortReply,
    Kill,
    KillReply,
    Probe,
    Spawn,
    SpawnReply,
)
from monarch_fs.daemon.wire.stream_file import StreamChunks, StreamFile
from monarch_fs.daemon.wire.telemetry_calls import Query, QueryReply
from monarch_fs.daemon.wire.transport import RemoteError, connect
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Entry, Kind, Manifest
from monarch_fs.mesh.loop import service_nursery

TOKEN = b"service-test-token-0123456789abc"


@asynccontextmanager
async def serving(tmp_path: Path, n: int = 1, **service):
    """n NodeServices answering on 127.0.0.1:<a free port>, stopped when the block ends
    (`service`: more NodeService arguments)."""
    async with service_nursery() as nursery:
        nodes = []
        for i in range(n):
            node = NodeService(state=tmp_path / f"node-{i}" / "state",
                               mount=tmp_path / f"node-{i}" / "mnt", token=TOKEN,
                               node_name=f"node-{i}", **service)
            await recovery.load(node.publisher)
            listeners, _ = await open_listeners("127.0.0.1:0")
            await nursery.start(serve, node, listeners)
            nodes.append(node)
        yield nodes


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def served_bytes(node: NodeService, workspace: bytes, path: bytes) -> bytes:
    """A file of the current version as the (unmounted) view would serve it: its entry's
    chunks, read back from the store."""
    entry = node.fs.workspaces[workspace][0].entries[path]
    return b"".join(bytes(node.store.get(c)) for c in entry.chunks)


async def test_a_push_through_the_real_client_is_published_without_a_mount(tmp_path):
    """push() along a chain of two services: both hold every chunk, publish the version in
    their refs (saved) and their view, and report it in status; a second push keeps the
    first version as the previous one."""
    src = tmp_path / "app"
    files = {"a.txt": b"hello", "sub/b.bin": bytes(range(256)) * 300, "empty": b""}
    write_tree(src, files)
    async with serving(tmp_path, 2) as nodes:
        with trio.fail_after(30):
            first = await push(src, [n.addr for n in nodes], TOKEN,
                               PushOptions(topology="chain", transport="tcp"))
        assert first.nodes == 2 and first.topology == "chain"
        assert nodes[0].counters["chunks_forwarded"] > 0  # the relay really ran
        (src / "a.txt").write_bytes(b"hello again")
        with trio.fail_after(30):
            second = await push(src, [n.addr for n in nodes], TOKEN,
                               PushOptions(topology="chain", transport="tcp"))
        for node in nodes:
            chan = await connect(node.addr, TOKEN)
            async with chan:
                status = await chan.request("status")
            assert status["node"] == node.node_name and status["addr"] == node.addr
            assert status["fuse"] == "not mounted"
            assert status["workspaces"] == {"app": [second.version, first.version]}
            assert status["problems"] == []
            saved = json.loads((node.state / "refs.json").read_text())
            assert saved == {"workspaces": {"app": [second.version, first.version]},
                             "sources": {"app": str(src)}}  # push --at-source, the default
            assert served_bytes(node, b"app", b"a.txt") == b"hello again"
            assert served_bytes(node, b"app", b"sub/b.bin") == files["sub/b.bin"]
            assert served_bytes(node, b"app", b"empty") == b""
            versions = [t.hex for t in node.fs.workspaces[b"app"]]
            assert versions == [second.version, first.version]


def manifest_of(data: bytes) -> tuple[Manifest, dict[bytes, bytes]]:
    cid = chunk.chunk_id(data)
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"f", Kind.FILE, 0o644, len(data), 0, chunks=(cid,))])
    return m, {cid: chunk.encode(data)}


async def send_version(chan, data: bytes) -> str:
    """Stage a one-file version by hand (its chunk and its manifest); returns its id."""
    m, blobs = manifest_of(data)
    version, objects = staged(m)
    for cid, blob in {**blobs, **objects}.items():
        await chan.send(p.PutChunk(cid, blob))
    return version


async def test_prepare_commit_and_remove_over_the_protocol(tmp_path):
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            v1 = await send_version(chan, b"one")
            assert await chan.request("prepare", name="ws", version=v1) == {"prepared": v1}
            assert await chan.request("commit", name="ws", version=v1) == {
                "version": v1, "previous": None}
            v2 = await send_version(chan, b"two")  # a commit without a prepare prepares
            assert await chan.request("commit", name="ws", version=v2) == {
                "version": v2, "previous": v1}
            assert served_bytes(node, b"ws", b"f") == b"two"
            assert node.refs.workspaces == {"ws": [bytes.fromhex(v2), bytes.fromhex(v1)]}
            assert await chan.request("remove", name="ws") == {"versions": [v2, v1]}
            assert (await chan.request("status"))["workspaces"] == {}
            assert node.fs.workspaces == {}
            assert json.loads((node.state / "refs.json").read_text()) == {"workspaces": {}}


async def test_a_process_runs_and_reports_without_a_mount(tmp_path):
    async with serving(tmp_path, allow_root_procs=True) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            port = (await chan.request("free_port"))["port"]
            assert 0 < port < 65536
            started = await chan.request("spawn", argv=[sys.executable, "-c", "print('hi')"])
            assert started["proc"] >= 1
            events = list(chan.events)
            with trio.fail_after(30):
                while not any(e.kind == "exit" for e in events):
                    events.append(await chan.receive())
            lines = [line for e in events if e.kind == "output" for line in e.data["lines"]]
            assert lines == ["hi"]
            [exit_event] = [e for e in events if e.kind == "exit"]
            assert exit_event.data["proc"] == started["proc"]


@pytest.mark.parametrize("op, args, message", [
    ("prepare", {"name": "ws"}, "prepare: name and version are required"),
    ("commit", {"name": "ws", "version": "xyz"}, "commit: bad version 'xyz'"),
    ("prepare", {"name": ".hidden", "version": "00"}, "invalid workspace name '.hidden'"),
    ("prepare", {"name": "ws", "version": "ab" * 16}, "manifest not received"),
    ("remove", {}, "remove: a workspace name is required"),
    ("remove", {"name": "nope"}, "no workspace 'nope' on this node"),
    ("nope", {}, "unknown request 'nope'"),
    ("kill", {"proc": "x"}, "kill: proc must be an integer, not 'x'"),
    ("kill", {"proc": 5}, "no process 5 of this connection is running"),
    ("spawn", {"argv": ["true"], "workspace": "nope"},
     "no workspace 'nope' on this node; push it first"),
    ("spawn", {"argv": []}, "spawn: argv must be a non-empty list of strings"),
    ("relay", {"children": [{"port": 1}]}, "relay: children must be a list of {addr, children}"),
    ("bulk", {"kind": "rc"}, "bulk: this node does not offer RDMA"),
    ("flush", {"bulk_chunks": [1]}, "flush: bulk_chunks must be an integer, not [1]"),
])
async def test_bad_requests_are_refused_clearly_and_the_session_goes_on(tmp_path, op, args,
                                                                         message):
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            with pytest.raises(RemoteError) as e:
                await chan.request(op, **args)
            assert e.value.code == "refused"
            assert message in e.value.message, e.value.message
            assert (await chan.request("status"))["node"] == "node-0"


async def test_a_corrupt_chunk_refuses_the_requests_after_it(tmp_path):
    """A request sees every chunk sent before it: a chunk that does not match its id refuses
    the prepare (and status) that follow, and is not stored; flush reports it as this node's."""
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            cid = chunk.chunk_id(b"real")
            await chan.send(p.PutChunk(cid, chunk.encode(b"fake")))
            for op, args in [("prepare", {"name": "ws", "version": "ab" * 16}),
                             ("status", {})]:
                with pytest.raises(RemoteError, match="does not match its id"):
                    await chan.request(op, **args)
            failed = (await chan.request("flush"))["failed"]
            assert list(failed) == [""] and "does not match its id" in failed[""]
        assert node.store.missing([cid]) == [cid]


def test_every_op_has_one_route_and_parses_its_arguments():
    assert set(ROUTES) == {"status", "prepare", "commit", "current", "remove", "relay", "fan",
                           "flush", "bulk", "spawn", "kill", "free_port", "probe", "first_reads",
                           "query", "stats", "logs", "read_chunks", "stacks", "stream_file",
                           "stream_chunks"}
    version = "ab" * 16
    window = StreamFile(0, 9 << 20, 4 << 20, 0, [bytes(16), bytes([1]) * 16])
    assert StreamFile.parse(window.to_wire()) == window
    batch = StreamChunks([bytes(16), bytes([2]) * 16])
    assert StreamChunks.parse(batch.to_wire()) == batch
    assert requests.Prepare.parse({"name": "ws", "version": version}) == requests.Prepare(
        "ws", bytes.fromhex(version))
    assert requests.Commit.parse({"name": "ws", "version": version}).op == "commit"
    assert requests.Remove.parse({"name": "ws"}) == requests.Remove("ws")
    assert requests.Status.parse({}) == requests.Status() and FreePort.parse({}) == FreePort()
    assert requests.OpenRelay.parse({}) == requests.OpenRelay([], 60.0)
    assert requests.OpenRelay.parse({"wants": True}).wants
    early = requests.Prepare.parse({"name": "ws", "version": version, "early": ["cd" * 16],
                                    "wait": 2})
    assert (early.early, early.wait) == ((bytes.fromhex("cd" * 16),), 2.0)
    assert requests.OpenRelay.parse({"children": [{"addr": "h:1"}],
                                     "timeout": 5}).timeout == 5.0
    assert requests.Flush.parse({}) == requests.Flush(0)
    assert requests.Flush.parse({"bulk_chunks": 3}) == requests.Flush(3)
    fan = {"request": "commit", "args": {"name": "ws", "version": version}, "scope": "ab" * 16}
    assert requests.Fan.parse(fan) == requests.Fan("commit", fan["args"], "ab" * 16)
    assert Kill.parse({"proc": 2}) == Kill(2, 15)
    assert requests.Bulk.parse({"kind": "rc", "qp": {}}).setup == {"kind": "rc", "qp": {}}
    assert Probe.parse({"pad": "xyz"}) == Probe(3) and Probe.parse({}) == Probe(0)
    spawn = Spawn.parse({"argv": ["x"], "workspace": "ws", "version": version})
    assert (spawn.workspace, spawn.version) == ("ws", bytes.fromhex(version))
    assert Spawn.parse({"argv": ["x"]}).version is None
    assert Query.parse({"sql": "SELECT 1", "params": {"host": "h:1"}}) == Query(
        "SELECT 1", {"host": "h:1"}, 10.0)
    assert Logs.parse({}) == Logs() and Logs.parse(Logs("j", 2, "x+", 1.5, 7).to_wire()) == Logs(
        "j", 2, "x+", 1.5, 7)
    assert ReadChunks.parse(ReadChunks("ws", bytes(16), [bytes(16)]).to_wire()).ids == [bytes(16)]
    for kind, args in [(requests.Prepare, {"name": 1, "version": version}),
                       (requests.OpenRelay, {"timeout": "x"}),
                       (requests.Prepare, {"name": "ws", "version": version, "early": ["zz"]}),
                       (requests.Bulk, {}), (Kill, {"proc": None}), (Spawn, {"workspace": 3}),
                       (requests.Fan, {**fan, "request": "spawn"}),
                       (requests.Fan, {**fan, "args": []}),
                       (requests.Fan, {**fan, "scope": "not hex"}),
                       (Query, {}), (Query, {"sql": "SELECT 1", "params": {"h": [1]}}),
                       (Query, {"sql": "SELECT 1", "timeout": 0}),
                       (Logs, {"job": ""}), (Logs, {"rank": -1}), (Logs, {"grep": "("}),
                       (Logs, {"since": "yesterday"}), (ReadChunks, {"workspace": "ws"}),
                       (ReadChunks, {"workspace": "ws", "version": version, "ids": ["zz"]}),
                       (ReadChunks, {"workspace": "../x", "version": version, "ids": []}),
                       (StreamFile, {**window.to_wire(), "ids": []}),
                       (StreamFile, {**window.to_wire(), "ids": ["zz"]}),
                       (StreamFile, {**window.to_wire(), "size": "x"}),
                       (StreamChunks, {"ids": []}), (StreamChunks, {"ids": ["ab"]}),
                       (StreamChunks, {"ids": ["ab" * 16] * 1025})]:
        with pytest.raises((requests.RequestError, ValueError)):
            kind.parse(args)


def test_every_reply_round_trips_the_dict_nodes_send_and_refuses_a_malformed_one():
    """Each reply class encodes to exactly the dict a node has always sent (so old clients and
    the mesh still match) and decodes it back; a reply missing a field or with one of the
    wrong type is a MalformedReply (a ProtocolError, which fails that node only)."""
    v1, v2 = "ab" * 16, "cd" * 16
    wire = [
        (replies.PrepareReply, {"prepared": v1}),
        (replies.CurrentReply, {"current": False, "serving": v1}),
        (replies.CurrentReply, {"current": False, "serving": None}),
        (replies.CommitReply, {"version": v2, "previous": v1}),
        (replies.CommitReply, {"version": v1, "previous": None}),
        (replies.RemoveReply, {"versions": [v2, v1]}),
        (replies.RelayReply, {"failed": {"h:1": "refused"}}),
        (replies.FlushReply, {"failed": {"": "disk full"}}),
        (replies.BulkReply, {"qp": {"qpn": 7}}),
        (SpawnReply, {"proc": 1, "pid": 4242}),
        (KillReply, {}),
        (FreePortReply, {"port": 29500}),
        (replies.FanReply, {"failed": {"h:2": "refused"}, "replies": {"": {"current": True}}}),
        (QueryReply, {"columns": ["kind", "n"], "rows": [["push.received", 2], [None, 1.5]]}),
        (LogsReply, {"jobs": [["1206-000000-beef", 1.5]], "rows": []}),
        (LogsReply, {"jobs": [], "rows": [[7, 1.5, 2, 0, "stderr", "died"], [8, 2, None, None,
                                                                           "stdout", ""]]}),
        (ChunksReply, {"blobs": ["AGFi", None]}),
    ]
    for kind, value in wire:
        assert kind.from_wire(value).to_wire() == value
        assert list(kind.from_wire(value).to_wire()) == list(value)  # and in the same order
    # What a commit replaced rides with its reply on the node (freed once sent), never on
    # the wire.
    replaced = replies.CommitReply(bytes.fromhex(v1), None, replaced=[object()])
    assert replaced.to_wire() == {"version": v1, "previous": None}
    # A node from before `serving` serves nothing a push may count on.
    assert replies.CurrentReply.from_wire({"current": True}) == replies.CurrentReply(True, None)
    for kind, value in [(replies.PrepareReply, {}), (replies.PrepareReply, {"prepared": "xyz"}),
                        (replies.CurrentReply, {"current": True, "serving": "xyz"}),
                        (replies.CommitReply, {"version": v1}),
                        (replies.RemoveReply, {"versions": [1]}),
                        (replies.FlushReply, {"failed": []}),
                        (SpawnReply, {"proc": True, "pid": 1}),
                        (FreePortReply, {"port": "80"}), (KillReply, []),
                        (replies.FanReply, {"failed": {}}),
                        (replies.FanReply, {"failed": {}, "replies": []}),
                        (QueryReply, {"columns": ["a"], "rows": [[1, 2]]}),
                        (QueryReply, {"columns": ["a"], "rows": [[[1]]]}),
                        (LogsReply, {"jobs": []}), (LogsReply, {"jobs": [["j"]], "rows": []}),
                        (LogsReply, {"jobs": [], "rows": [[1, 2, 3]]}), (LogsReply, []),
                        (ChunksReply, {}), (ChunksReply, {"blobs": ["!!"]}),
                        (ChunksReply, {"blobs": [1]})]:
        with pytest.raises(replies.MalformedReply, match=f"malformed {kind.op} reply"):
            kind.from_wire(value)
    assert issubclass(replies.MalformedReply, p.ProtocolError)


async def test_a_status_reply_decodes_to_the_same_dict(tmp_path):
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            value = await chan.request("status")
    decoded = replies.StatusReply.from_wire(value)
    assert decoded.node == "node-0" and decoded.workspaces == {}
    assert json.dumps(decoded.to_wire()) == json.dumps(value)  # same keys, same order
    with pytest.raises(replies.MalformedReply, match="'workspaces'"):
        replies.StatusReply.from_wire({**value, "workspaces": {"ws": "v"}})
