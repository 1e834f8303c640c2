"""Issue 16, findings 1, 4 and 5, against real daemons: a name or a manifest field the kernel
cannot take, an exception inside a FUSE handler, state that does not load at start, and a
commit whose refs cannot be saved. Each once took a node down or published a failed version;
now each gets a clear error, the node keeps serving every other workspace, and a restart
serves exactly what was last published."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import (
    mfs,
    mount_ops,
    mounted,
    staged,
    start_cluster,
    stop_cluster,
    stop_node,
    wait_for,
)
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.wire import protocol as p
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect
from monarch_fs.fs import chunk
from monarch_fs.fs.manifest import Entry, Kind, Manifest, ManifestError

pytestmark = pytest.mark.mount


def alive(c, i: int = 0) -> bool:
    """The node's daemon runs (a daemon that died is a zombie child here: not alive)."""
    return cluster_mod.running_node(c.dir, i)





def state(c, i: int = 0) -> Path:
    return c.dir / f"node-{i}" / "state"


def saved_refs(c, i: int = 0) -> dict:
    return json.loads((state(c, i) / "refs.json").read_text())["workspaces"]


def folder(root: Path, name: str | bytes, content: str) -> Path:
    src = root / (os.fsdecode(name) if isinstance(name, bytes) else name)
    src.mkdir(parents=True)
    (src / "f").write_text(content)
    return src


async def publish_by_hand(c, name: str, manifest: Manifest,
                          blobs: dict[bytes, bytes] | None = None) -> dict:
    """What a hostile or buggy client can do: stage chunks and a manifest (its folder objects,
    built without validation), then prepare and commit them under `name` through the real
    protocol."""
    version, objects = staged(manifest)
    chan = await connect(c.hosts[0], load_token(c.token_file))
    async with chan:
        for cid, blob in {**(blobs or {}), **objects}.items():
            await chan.send(p.PutChunk(cid, blob))
        await chan.request("prepare", name=name, version=version)
        return await chan.request("commit", name=name, version=version)


# --------------------------------------------------------------------------------------------
# Finding 1: a workspace name that is not UTF-8


def test_a_non_utf8_folder_is_refused_by_the_client_naming_it(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "good", "good"))
    bad = folder(tmp_path, b"caf\xe9", "latin-1 named")
    out = c.push(bad, check=False)
    assert out.returncode == 1
    assert "caf\\xe9" in out.stderr and "not UTF-8" in out.stderr and "--name" in out.stderr
    assert "Traceback" not in out.stderr
    assert set(saved_refs(c)) == {"good"}
    watching = mfs("push", str(bad), "--watch", "--hosts", c.hostfile, "--token-file",
                   c.token_file, check=False, timeout=60)  # once, not at every change
    assert watching.returncode == 1 and "--name" in watching.stderr
    # with --name it goes through, and every file name inside may still be any bytes
    (bad / os.fsdecode(b"\xff\xfe")).write_text("bytes name")
    c.push(bad, "--name", "cafe")
    assert (c.mnt(0) / "cafe" / os.fsdecode(b"\xff\xfe")).read_text() == "bytes name"
    assert sorted(os.listdir(os.fsencode(c.mnt(0) / "cafe"))) == [b"f", b"\xff\xfe"]
    assert os.getxattr(c.mnt(0), "user.monarch.workspaces").decode().count("=") == 2
    assert (c.mnt(0) / "good" / "f").read_text() == "good"


async def test_a_non_utf8_workspace_name_is_refused_at_prepare_and_changes_nothing(
        fresh_cluster, tmp_path):
    """A client that does not check (an older one) sends the name anyway: every node refuses
    it at prepare, and at commit, before anything changes; a restart serves the same."""
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "good", "good"))
    before = (state(c) / "refs.json").read_bytes()
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0)])
    for name in ("caf\udce9", "\ud800", "caf\udce9/x"):
        with pytest.raises(RemoteError, match="invalid workspace name") as e:
            await publish_by_hand(c, name, m)
        assert e.value.code == "refused"
        chan = await connect(c.hosts[0], load_token(c.token_file))
        async with chan:  # commit without prepare is refused the same way
            with pytest.raises(RemoteError, match="not UTF-8|plain name"):
                await chan.request("commit", name=name, version=m.id.hex())
    assert (state(c) / "refs.json").read_bytes() == before
    assert sorted(os.listdir(c.mnt(0))) == [".versions", "good"]
    assert [n["workspaces"] for n in c.status()] == [{"good": [saved_refs(c)["good"][0]]}]
    stop_node(c)
    cluster_mod.restart_node(c.dir, 0)
    assert (c.mnt(0) / "good" / "f").read_text() == "good"


def test_refs_saved_by_an_older_daemon_with_a_non_utf8_name_are_survived(fresh_cluster,
                                                                         tmp_path):
    """What the bug left on disk (the name in refs.json as a lone surrogate escape): the node
    starts, serves every other workspace, and `status` says what it left out and why."""
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "good", "good"))
    stop_node(c)
    refs = saved_refs(c)
    refs["caf\udce9"] = refs["good"]  # json writes it as "caf\udce9", as the old daemon did
    (state(c) / "refs.json").write_text(json.dumps({"workspaces": refs}))
    cluster_mod.restart_node(c.dir, 0)
    assert (c.mnt(0) / "good" / "f").read_text() == "good"
    assert sorted(os.listdir(c.mnt(0))) == [".versions", "good"]
    [node] = c.status()
    assert node["reachable"] and set(node["workspaces"]) == {"good"}
    assert any("caf\\udce9" in pr and "not UTF-8" in pr for pr in node["problems"])
    text = mfs("status", "--hosts", c.hostfile, "--token-file", c.token_file).stdout
    assert "problem:" in text and "not UTF-8" in text
    # the next publish drops the name for good; the node keeps running
    c.push(folder(tmp_path, "next", "next"))
    assert set(saved_refs(c)) == {"good", "next"} and alive(c)


# --------------------------------------------------------------------------------------------
# Finding 4: manifest fields past what the kernel takes, and exceptions in FUSE handlers


@pytest.mark.parametrize("entry,error", [
    (Entry(b"d", Kind.DIR, 0o10755, 0, 0), "entry b'd': bad mode"),
    (Entry(b"l", Kind.SYMLINK, 0o777, 2**64 - 1, 0, b"t"), "symlink b'l': size"),
    (Entry(b"l", Kind.SYMLINK, 0o777, 4096, 0, b"t" * 4096), "symlink b'l': bad target"),
    (Entry(b"f", Kind.FILE, 0o644, 2**64 - 1, 0, chunks=(b"\1" * 16,)), "entry b'f': size"),
    (Entry(b"f", Kind.FILE, 0o10644, 0, 0), "entry b'f': bad mode"),
    (Entry(b"x" * 256, Kind.FILE, 0o644, 0, 0), "longer than 255"),
], ids=["dir-mode", "symlink-size", "symlink-target", "file-size", "mode", "name-length"])
async def test_a_field_the_kernel_cannot_take_is_refused_at_prepare(fresh_cluster, tmp_path,
                                                                    entry, error):
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "good", "good"))
    m = Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), entry])
    with pytest.raises(RemoteError, match=error) as e:
        await publish_by_hand(c, "good", m)
    assert e.value.code == "refused" and m.id.hex()[:12] in str(e.value)
    assert (c.mnt(0) / "good" / "f").read_text() == "good"
    os.listdir(c.mnt(0) / "good")
    assert alive(c)
    assert [n["workspaces"]["good"] for n in c.status()] == [saved_refs(c)["good"]]


async def test_a_folder_listed_while_empty_shows_what_a_publish_adds(fresh_cluster):
    """Found by the hypothesis test below: the kernel answers an empty cached listing without
    looking for its pages, so a folder listed while empty kept showing nothing after a publish
    added names to it, when its own attributes (mtime) were unchanged (pushing another folder
    under the same name, or a tree whose times were restored). Listings now hold "." and
    "..", as on a local disk."""
    c = fresh_cluster(1)
    root, d = Entry(b"", Kind.DIR, 0o755, 0, 0), Entry(b"d", Kind.DIR, 0o755, 0, 0)
    await publish_by_hand(c, "ws", Manifest([root, d]))
    mnt = c.mnt(0) / "ws"
    assert await trio.to_thread.run_sync(os.listdir, mnt / "d") == []
    await publish_by_hand(c, "ws", Manifest([root, d, Entry(b"d/new", Kind.DIR, 0o755, 0, 0)]))
    assert await trio.to_thread.run_sync(os.listdir, mnt / "d") == ["new"]
    ls = await trio.run_process(["ls", "-ai", str(mnt / "d")], capture_stdout=True)
    inos = {line.split()[1]: int(line.split()[0]) for line in ls.stdout.decode().splitlines()}
    assert inos == {".": os.lstat(mnt / "d").st_ino, "..": os.lstat(mnt).st_ino,
                    "new": os.lstat(mnt / "d" / "new").st_ino}


_GUARD_CHILD = r"""
import logging, signal, sys
import pyfuse3, trio
from monarch_fs.fs.chunk import chunk_id
from monarch_fs.fs.fuse_ops import SnapshotFS
from monarch_fs.fs.mount_options import mount_options
from monarch_fs.fs.manifest import Entry, Kind, Manifest

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
ROOT = Entry(b"", Kind.DIR, 0o755, 0, 0)
# Built without validate(): what a daemon without today's checks served
bad = Manifest([ROOT, Entry(b"huge", Kind.DIR, 0o755, 2**64 - 1, 0)])
good = Manifest([ROOT, Entry(b"f", Kind.FILE, 0o644, 5, 0, chunks=(chunk_id(b"hello"),))])

async def main():
    fs = SnapshotFS(lambda cid: b"hello")
    await fs.set_workspace(b"bad", [(b"\1" * 16, bad)])
    await fs.set_workspace(b"good", [(b"\2" * 16, good)])
    pyfuse3.init(fs, sys.argv[1], mount_options())
    fs.mounted = True
    try:
        async with trio.open_nursery() as nursery:
            async def fuse():
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
            nursery.start_soon(fuse)
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                print("ready", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    finally:
        pyfuse3.close(unmount=True)

trio.run(main)
"""


def test_an_exception_in_a_fuse_handler_answers_eio_and_the_mount_stays(tmp_path):
    """A SnapshotFS serving an entry that no longer passes validation (a directory of size
    2^64-1) in a child process: its `ls` and `stat` fail with EIO, one log line each, and the
    mount keeps serving everything else. Without the guard the first `ls` ended the process."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _GUARD_CHILD, str(mnt)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n", child.stderr.read()
        wait_for(lambda: mounted(mnt), 10, "the mount")
        with pytest.raises(OSError) as e:
            os.listdir(mnt / "bad")
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:
            os.lstat(mnt / "bad" / "huge")
        assert e.value.errno == errno.EIO
        assert (mnt / "good" / "f").read_bytes() == b"hello"
        assert sorted(os.listdir(mnt)) == [".versions", "bad", "good"]
        assert child.poll() is None
        assert mount_ops(mnt).get("failed") == 2
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        child.wait(timeout=20)
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    log = child.stderr.read()
    failures = [line for line in log.splitlines() if "answered EIO" in line]
    assert len(failures) == 2, log
    assert any(line.startswith("ERROR FUSE readdir on inode ") and "OverflowError" in line
               for line in failures), log
    assert any(line.startswith("ERROR FUSE lookup on inode ") for line in failures), log
    assert "Traceback" not in log
    assert not mounted(mnt)
    assert child.returncode == 0


# --------------------------------------------------------------------------------------------
# State that does not load at start


def test_damaged_refs_at_start_are_reported_and_set_aside(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "ws", "v1"))
    stop_node(c)
    (state(c) / "refs.json").write_bytes(b'{"workspaces": {"ws": ["not hex"]')
    cluster_mod.restart_node(c.dir, 0)
    [node] = c.status()
    assert node["reachable"] and node["workspaces"] == {}
    assert any("refs.json is damaged" in pr and "kept as refs.json.damaged-" in pr
               for pr in node["problems"]), node["problems"]
    aside = list(state(c).glob("refs.json.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b'{"workspaces"')
    # the node takes pushes again, and a restart serves them
    c.push(folder(tmp_path, "again", "again"))
    stop_node(c)
    cluster_mod.restart_node(c.dir, 0)
    assert (c.mnt(0) / "again" / "f").read_text() == "again"
    assert c.status()[0]["problems"] == []


def test_a_workspace_whose_manifest_is_missing_is_held_and_the_rest_served(fresh_cluster,
                                                                           tmp_path):
    """A refs entry whose manifest the store lacks, and a pack that cannot be read: both are
    problems in `status`; every other workspace is served; the held entry stays in refs.json
    (so a fixed fault loses nothing) until that name is pushed again."""
    c = fresh_cluster(1)
    c.push(folder(tmp_path, "a", "a"))
    c.push(folder(tmp_path, "b", "b"))
    stop_node(c)
    refs = saved_refs(c)
    refs["b"] = ["ab" * 16]  # no such manifest in the store
    (state(c) / "refs.json").write_text(json.dumps({"workspaces": refs}))
    (state(c) / "store" / "packs" / "00000099.pack").mkdir()  # unreadable, even for root
    cluster_mod.restart_node(c.dir, 0)
    assert (c.mnt(0) / "a" / "f").read_text() == "a"
    assert sorted(os.listdir(c.mnt(0))) == [".versions", "a"]
    [node] = c.status()
    assert set(node["workspaces"]) == {"a"}
    problems = "\n".join(node["problems"])
    assert "workspace 'b' not served" in problems and "manifest not in the store" in problems
    assert "00000099.pack cannot be read" in problems
    c.push(folder(tmp_path, "c", "c"))
    assert saved_refs(c)["b"] == ["ab" * 16]  # held, not forgotten
    c.push(tmp_path / "b")
    assert (c.mnt(0) / "b" / "f").read_text() == "b"
    problems = "\n".join(c.status()[0]["problems"])  # b's is gone, the pack's stays
    assert "workspace 'b'" not in problems and "00000099.pack cannot be read" in problems
    assert set(saved_refs(c)) == {"a", "b", "c"} and saved_refs(c)["b"] != ["ab" * 16]


# --------------------------------------------------------------------------------------------
# Finding 5: a commit whose refs cannot be saved


def test_a_commit_that_cannot_save_its_refs_leaves_no_trace(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = folder(tmp_path, "ws", "v1")
    v1 = c.push_json(src)["version"]
    # A folder where the refs' temporary file goes: its save fails, for root too.
    (state(c) / "refs.tmp").mkdir()
    (src / "f").write_text("v2")
    out = c.push(src, check=False)
    assert out.returncode != 0 and "cannot save" in out.stderr, out.stderr
    [node] = c.status()
    assert node["workspaces"] == {"ws": [v1]}  # status, the mount and run agree: v1
    assert (c.mnt(0) / "ws" / "f").read_text() == "v1"
    assert os.listdir(c.mnt(0) / ".versions" / "ws") == [v1]
    run = mfs("run", "--hosts", c.hostfile, "--token-file", c.token_file, "--workspace", "ws",
              "--", "cat", "f")
    assert "v1" in run.stdout
    # the next successful push of another workspace does not publish the failed version
    (state(c) / "refs.tmp").rmdir()
    c.push(folder(tmp_path, "other", "other"))
    assert saved_refs(c)["ws"] == [v1]
    stop_node(c)
    cluster_mod.restart_node(c.dir, 0)
    assert (c.mnt(0) / "ws" / "f").read_text() == "v1"
    assert c.status()[0]["workspaces"]["ws"] == [v1]
    # and a push of it now goes through
    assert c.push_json(src)["version"] != v1
    assert (c.mnt(0) / "ws" / "f").read_text() == "v2"


# --------------------------------------------------------------------------------------------
# Hypothesis: random manifest fields and names through the real protocol, then the mount


@pytest.fixture(scope="module")
def hyp_node(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("hyp"), 1)
    c.push(folder(tmp_path_factory.mktemp("src"), "keep", "keep"))
    yield c
    stop_cluster(c)


_U64_EDGES = [0, 1, 4095, 4096, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
_I64_EDGES = [-(2**63), -(2**63) + 1, -1, 0, 1, 10**18, 2**63 - 1]
_ODD_BYTES = [b"caf\xe9", b"\xff\xfe", b"\x80", b"\xed\xa0\x80", b"a" * 255, b" ", b"-",
              b"new\nline", b"=x y", b"\\", b"*?"]
# Names a snapshot may hold (any bytes but '/' and NUL, not '.' or '..', at most 255), and some
# it may not.
_good_names = st.one_of(
    st.binary(min_size=1, max_size=12).map(
        lambda b: b.replace(b"/", b"_").replace(b"\0", b"_").replace(b".", b"_")),
    st.sampled_from(_ODD_BYTES))
_bad_names = st.sampled_from([b"b" * 256, b".", b"..", b"a/b", b"nul\0", b""])


@st.composite
def workspace_names(draw) -> bytes:
    """Mostly one name, so that most pushes switch versions of a served workspace."""
    which = draw(st.integers(0, 9))
    if which < 6:
        return draw(st.sampled_from([b"hyp", b"hyp2"]))
    if which < 8:  # valid, if odd
        return draw(st.sampled_from([b"a" * 255, b" ", b"-", b"new\nline", b"=x y", b"\\"]))
    return draw(st.sampled_from([b"caf\xe9", b"\xff\xfe", b"\xed\xa0\x80", b".hidden", b"a/b",
                                 b"", b"b" * 256, b"nul\0"]))


@st.composite
def entries(draw) -> tuple[list[Entry], dict[bytes, bytes], dict[bytes, bytes]]:
    """(entries, chunk blobs to send, path -> content of the files whose size matches it).

    Each field is usually one a scan could produce and, at the manifest's `odd` rate, one near
    or past what the kernel takes (so that about half the manifests are served)."""
    odd_rate = 0 if draw(st.integers(0, 9)) < 4 else draw(st.sampled_from([10, 30]))  # percent

    def odd() -> bool:
        return odd_rate > 0 and draw(st.integers(0, 99)) < odd_rate

    def odd_size() -> int:
        return draw(st.one_of(st.sampled_from(_U64_EDGES), st.integers(0, 2**64 - 1)))

    mtimes = st.one_of(st.sampled_from(_I64_EDGES), st.integers(-(2**63), 2**63 - 1))
    out = [Entry(b"", Kind.DIR, draw(st.integers(0, 0o7777)), 0, draw(mtimes))]
    dirs, blobs, contents = [b""], {}, {}
    for _ in range(draw(st.integers(0, 10))):
        parent = draw(st.sampled_from(dirs))
        name = draw(_bad_names if odd() else _good_names)
        path = parent + b"/" + name if parent else name
        if any(e.path == path for e in out):
            continue  # a duplicate: test_manifest.py refuses those (which one is named depends
            # on the order a folder's records are checked, not only on the flat order here)
        kind = draw(st.sampled_from(Kind))
        mode = draw(st.sampled_from([0o10000, 0o170777, 2**32 - 1]) if odd()
                    else st.integers(0, 0o7777))
        mtime = draw(mtimes)
        if kind == Kind.DIR:
            out.append(Entry(path, kind, mode, 0, mtime))  # a folder object has no size
            dirs.append(path)
        elif kind == Kind.FILE:
            data = draw(st.binary(max_size=64))
            cids = (chunk.chunk_id(data),) if data else ()
            size = odd_size() if odd() else len(data)
            out.append(Entry(path, kind, mode, size, mtime, chunks=cids))
            if data:
                blobs[cids[0]] = chunk.encode(data)
            if size == len(data):
                contents[path] = data
        else:
            target = draw(st.binary(min_size=4094, max_size=4097) if odd() else
                          st.one_of(st.binary(min_size=1, max_size=40), st.sampled_from(
                              [b"/etc/hostname", b"../../../escape", b"t" * 4095])))
            out.append(Entry(path, kind, mode, odd_size() if odd() else len(target), mtime,
                             target))
    return out, blobs, contents


async def _status(c) -> dict:
    chan = await connect(c.hosts[0], load_token(c.token_file))
    async with chan:
        return await chan.request("status")


def node_status(c) -> dict:
    """`status` of node 0 through the protocol (the CLI costs an interpreter start)."""
    return trio.run(_status, c)


def valid_workspace_name(ws: bytes) -> bool:
    try:
        ws.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return 0 < len(ws) <= 255 and not ws.startswith(b".") and b"/" not in ws and b"\0" not in ws


def first_unservable(m: Manifest) -> bytes | None:
    """The path of the first entry (in manifest order) that the kernel could not be handed as
    is, or None. Written from the kernel's limits, independently of Manifest.validate: a
    name is 1-255 bytes without '/' or NUL and not '.' or '..'; st_size is a signed 64-bit
    off_t; a directory's size is 0 and a symlink's the length of its target, which readlink
    returns whole only below PATH_MAX (4096) bytes; modes are permission bits."""
    seen: dict[bytes, Kind] = {}
    for e in m.entries:
        parts = e.path.split(b"/") if e.path else []
        parent = e.path.rpartition(b"/")[0]
        if (any(not 0 < len(part) <= 255 or b"\0" in part or part in (b".", b"..")
                for part in parts)
                or e.path in seen or (e.path and seen.get(parent) != Kind.DIR)
                or not 0 <= e.mode <= 0o7777
                or (e.kind == Kind.DIR and e.size != 0)
                or (e.kind == Kind.SYMLINK and (e.size != len(e.target)
                                                or not 0 < len(e.target) < 4096
                                                or b"\0" in e.target))
                or (e.kind == Kind.FILE and (e.size >= 2**63
                                             or len(e.chunks) != -(-e.size // m.chunk_size)))):
            return e.path
        seen[e.path] = e.kind
    return None


def check_served(mnt: Path, m: Manifest, version: str, contents: dict[bytes, bytes]) -> None:
    """Everything a reader sees of the workspace at `mnt` is what the manifest says."""
    base = os.fsencode(mnt)
    for e in m.entries:
        path = os.path.join(base, e.path) if e.path else base
        st_ = os.lstat(path)
        assert stat.S_IFMT(st_.st_mode) == {Kind.DIR: stat.S_IFDIR, Kind.FILE: stat.S_IFREG,
                                            Kind.SYMLINK: stat.S_IFLNK}[e.kind], e
        assert stat.S_IMODE(st_.st_mode) == e.mode, e
        assert st_.st_size == e.size and st_.st_mtime_ns == e.mtime_ns, e
        assert "user.monarch.version" in os.listxattr(path, follow_symlinks=False)
        if e.kind != Kind.SYMLINK:  # the kernel keeps user.* xattrs of symlinks to itself
            assert os.getxattr(path, "user.monarch.version") == version.encode()
        if e.kind == Kind.DIR:
            assert sorted(os.listdir(path)) == sorted(
                c.name for c in m.entries if c.path and c.parent == e.path), e
        elif e.kind == Kind.SYMLINK:
            assert os.readlink(path) == e.target
        elif e.path in contents:
            with open(path, "rb") as f:
                assert f.read() == contents[e.path]
        else:  # a size its chunk disagrees with: an error, never other bytes
            with pytest.raises(OSError) as err, open(path, "rb") as f:
                f.read()
            assert err.value.errno == errno.EIO


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(entries(), workspace_names())
def test_fuzz_random_manifests_and_names_never_take_the_daemon_down(hyp_node, drawn, ws):
    """Each manifest is either refused with an error naming the first entry the kernel could
    not take (first_unservable) or the workspace name, and nothing changes; or it is served
    exactly as it says. The daemon never exits, and no request ever reaches the EIO guard
    (validation stops everything first)."""
    c = hyp_node
    ents, blobs, contents = drawn
    m = Manifest(ents)
    name = os.fsdecode(ws)
    bad = first_unservable(m)
    try:
        m.objects()  # it does not validate, but an entry needs a parent folder to be in
    except ManifestError:
        assert bad is not None  # a name with '/' whose first part is no folder
        event("not expressible as folder objects")
        return
    expected_error = ("invalid workspace name" if not valid_workspace_name(ws)  # checked first
                      else None if bad is None else repr(bad))
    before = node_status(c)["workspaces"]
    try:
        reply = trio.run(publish_by_hand, c, name, m, blobs)
    except RemoteError as e:
        event("refused: " + ("name" if bad is None else "entry"))
        assert expected_error is not None, f"refused a servable manifest: {e}"
        assert e.code == "refused" and expected_error in str(e), (e, expected_error)
        assert node_status(c)["workspaces"] == before
    else:
        event(f"served {'1' if len(m.entries) == 1 else 'several'} entries")
        assert expected_error is None, f"accepted, though it holds {expected_error}"
        assert reply["version"] == m.id.hex()
        check_served(c.mnt(0) / name, m, reply["version"], contents)
        assert node_status(c)["workspaces"][name][0] == reply["version"]
    assert alive(c)
    assert (c.mnt(0) / "keep" / "f").read_text() == "keep"
    ops = mount_ops(c.mnt(0))
    assert "failed" not in ops, ops
