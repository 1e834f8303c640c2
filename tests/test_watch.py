"""`monarch-fs push --watch`: real watcher processes, real clusters, stopped by signal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import (
    Cluster,
    Watcher,
    peer_ports,
    reads,
    stop_node,
    tree,
    wait_for,
    watcher,
)
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.wire.auth import write_new_token


def watching_one_file(c: Cluster, tmp_path: Path) -> tuple[Path, Watcher]:
    """A folder `ws` holding f = "v1", and a watcher of it that has pushed it to every node."""
    src = tmp_path / "ws"
    src.mkdir()
    (src / "f").write_text("v1")
    w = watcher(c, src, tmp_path)
    try:
        assert w.push()["nodes"] == len(c.hosts)
    except BaseException:
        w.kill()
        raise
    return src, w


@pytest.mark.mount
def test_watch_pushes_each_edit_to_every_node(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    src = tmp_path / "app"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('step 1')\n")
    (src / "pkg" / "util.py").write_text("X = 1\n")
    w = watcher(c, src, tmp_path, "--exclude", "*.tmp", "--exclude", "__pycache__")
    try:
        first = w.push()
        assert first["changes"] == 0 and first["nodes"] == 2 and first["files"] == 2

        (src / "train.py").write_text("print('step 2: edited')\n")
        seconds = wait_for(lambda: all(reads(m / "app" / "train.py") == b"print('step 2: edited')\n"
                                       for m in c.mounts()), 10, "the edit on every node")
        assert seconds < 5
        second = w.push()
        assert second["changes"] >= 1 and second["version"] != first["version"]
        assert second["chunks_sent"] == 2  # the one changed file, to each of the two nodes

        # A burst (a checkout, a generator) is pushed once or twice, not once per file.
        (src / "gen").mkdir()
        for i in range(30):
            (src / "gen" / f"m{i}.py").write_text(f"N = {i}\n")
        wait_for(lambda: all(reads(m / "app" / "gen" / "m29.py") == b"N = 29\n"
                             for m in c.mounts()), 10, "the burst on every node")
        burst = [w.push()]
        while burst[-1]["files"] != 32:  # pushed as it came, until a push holds all of it
            burst.append(w.push())
        burst += w.pushes_for(1.5)  # a late push of it would come within the debounce (1 s)
        # (Files created in a new folder before inotify watches it are not reported one by
        # one; the folder's creation is, and the scan that follows finds them all.)
        assert 1 <= len(burst) <= 3 and burst[-1]["files"] == 32

        # Changes below excluded paths do not push.
        (src / "scratch.tmp").write_text("ignored")
        (src / "pkg" / "__pycache__").mkdir()
        (src / "pkg" / "__pycache__" / "util.cpython-311.pyc").write_bytes(b"\0" * 100)
        w.no_push(1.5)
        (src / "train.py").write_text("print('step 3')\n")  # the next real change pushes all
        assert w.push()["changes"] >= 1

        assert w.stop() == 0
        assert w.stderr()[-1] == "stopped watching"
        assert not any("Traceback" in ln for ln in w.stderr())
    finally:
        w.kill()
    expected = tree(src)
    for d in ("scratch.tmp", "pkg/__pycache__", "pkg/__pycache__/util.cpython-311.pyc"):
        expected.pop(os.fsencode(d))
    for m in c.mounts():
        assert tree(m / "app") == expected


@pytest.mark.mount
def test_watch_survives_a_failed_push(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    src, w = watching_one_file(c, tmp_path)
    try:
        stop_node(c, 1)  # node-1 goes away
        (src / "f").write_text("v2")
        w.stderr(wait_for="push failed")
        assert any(c.hosts[1] in ln for ln in w.stderr())
        assert reads(c.mnt(0) / "ws" / "f") == b"v1"  # two-phase: nobody switched
        assert w.proc.poll() is None  # still watching

        cluster_mod.restart_node(c.dir, 1)
        (src / "f").write_text("v3")
        out = w.push()
        assert out["nodes"] == 2 and out["changes"] >= 1
        for m in c.mounts():
            assert reads(m / "ws" / "f") == b"v3"
        assert w.stop(signal.SIGTERM) == 0
    finally:
        w.kill()


def test_ctrl_c_during_a_push_cancels_it_and_exits_130(tmp_path):
    """A 'node' that accepts the connection and never answers: the first push hangs in the
    handshake, and SIGINT ends it at once."""
    src = tmp_path / "ws"
    src.mkdir()
    (src / "f").write_text("x")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    token = tmp_path / "token"
    write_new_token(token)
    try:
        w = Watcher(src, f"127.0.0.1:{silent.getsockname()[1]}", str(token), tmp_path / "home",
                    "--timeout", "60")
        try:
            w.stderr(wait_for="watching")
            silent.settimeout(20)
            conn, _ = silent.accept()  # the push connected: it now waits for the handshake
            try:
                t0 = time.monotonic()
                assert w.stop() == 130
                assert time.monotonic() - t0 < 5  # at once: what Ctrl-C must do
                assert "cancelled" in w.stderr()[-1]
                assert not any("Traceback" in ln for ln in w.stderr())
            finally:
                conn.close()
        finally:
            w.kill()
    finally:
        silent.close()


@pytest.mark.mount
def test_watch_pushes_a_change_its_watcher_missed(fresh_cluster, tmp_path):
    """inotify does not report a write through a hard link outside the folder (nor, under a
    flood, events it dropped): the whole scan that runs once the watch is quiet after a push
    finds the change, and pushes it."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "f").write_text("v1")
    outside = tmp_path / "outside-link"
    os.link(src / "f", outside)
    w = watcher(c, src, tmp_path)
    try:
        assert w.push()["nodes"] == 1
        outside.write_text("v2, written past the watcher")
        assert w.push()["changes"] == 1
        assert reads(c.mnt(0) / "ws" / "f") == b"v2, written past the watcher"
        w.stderr(wait_for="the watcher missed a change")
        assert w.stop() == 0
    finally:
        w.kill()


@pytest.mark.mount
def test_watch_keeps_its_sessions_and_connects_again_to_a_restarted_node(fresh_cluster,
                                                                          tmp_path):
    """The watch pushes every edit over the sessions it opened for the first push (no
    connect per edit); a node restarted meanwhile is connected again within the next push,
    which succeeds on every node."""
    c = fresh_cluster(2)
    ports = {int(h.rsplit(":", 1)[1]) for h in c.hosts}
    src, w = watching_one_file(c, tmp_path)
    try:
        first = peer_ports(w.proc.pid, ports)
        assert len(first) == 2
        for n in (2, 3):
            (src / "f").write_text(f"v{n}")
            assert w.push()["nodes"] == 2
            assert peer_ports(w.proc.pid, ports) == first  # the same two sessions
        stop_node(c, 1)
        cluster_mod.restart_node(c.dir, 1)
        (src / "f").write_text("v4")
        out = w.push()
        assert out["nodes"] == 2 and not out["failed"]
        for m in c.mounts():
            assert reads(m / "ws" / "f") == b"v4"
        assert not any("push failed" in ln for ln in w.stderr())
        assert w.stop(signal.SIGTERM) == 0
    finally:
        w.kill()


def one_shot(c: Cluster, src: Path, home: Path, *args: str, cwd: Path | None = None
             ) -> subprocess.CompletedProcess:
    """`monarch-fs push` as a user types it (the entry point that can hand the push off)."""
    return subprocess.run([sys.executable, "-m", "monarch_fs", "push", str(src), "--hosts",
                           c.hostfile, "--token-file", c.token_file, *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, "MONARCH_FS_HOME": str(home)})


@pytest.mark.mount
def test_a_one_shot_push_is_handed_to_the_running_watch_of_its_folder(fresh_cluster,
                                                                      tmp_path):
    """With `push --watch` running, `monarch-fs push` of the same folder and hosts is pushed by
    the watch (its tree and sessions warm), printing what it would have printed; a push of
    another folder, or with other options, runs on its own; so does one once the watch is
    gone."""
    c = fresh_cluster(2)
    src, other = tmp_path / "ws", tmp_path / "other"
    for d in (src, other):
        d.mkdir()
        (d / "f").write_text("v1")
    home = tmp_path / "home"
    w = watcher(c, src, tmp_path)
    try:
        first = w.push()
        socks = list((home / "watch").glob("*.sock"))
        assert [p.name for p in socks] == [f"{w.proc.pid}.sock"]
        # and the folder a hand-off touches to wake it, which its watcher watches too
        assert (home / "watch" / f"{w.proc.pid}.wake").is_dir()
        assert stat.S_IMODE((home / "watch").stat().st_mode) == 0o700

        # no change: the watch answers, one question per node
        out = one_shot(c, src, home, "--json")
        assert out.returncode == 0, out.stderr
        handed = json.loads(out.stdout)
        assert handed["version"] == first["version"] and handed["chunks_sent"] == 0
        assert handed["watch"] == w.proc.pid
        assert w.push()["version"] == first["version"]  # the watch reports it too

        # an edit the watch has not pushed yet (the one-shot asks at once)
        (src / "f").write_text("v2")
        out = one_shot(c, src, home, "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert all(reads(m / "ws" / "f") == b"v2" for m in c.mounts())
        text = one_shot(c, Path("ws"), home, cwd=tmp_path)  # relative, plain output
        assert text.returncode == 0 and text.stdout.startswith("pushed ws ")
        assert f"(by the running push --watch, pid {w.proc.pid})" in text.stdout

        # not its folder, or other options: pushed by the one-shot process itself
        alone = one_shot(c, other, home, "--json")
        assert alone.returncode == 0 and "watch" not in json.loads(alone.stdout)
        renamed = one_shot(c, src, home, "--json", "--name", "elsewhere")
        assert renamed.returncode == 0 and "watch" not in json.loads(renamed.stdout)
        assert reads(c.mnt(0) / "elsewhere" / "f") == b"v2"
        # the host file rewritten since the watch started (a new allocation at the same path)
        hostfile = Path(c.hostfile[1:])
        hosts = hostfile.read_text()
        hostfile.write_text(c.hosts[0] + "\n")
        try:
            one = one_shot(c, src, home, "--json")
            assert one.returncode == 0 and "watch" not in json.loads(one.stdout)
            assert json.loads(one.stdout)["nodes"] == 1
        finally:
            hostfile.write_text(hosts)
        assert w.stop(signal.SIGTERM) == 0
    finally:
        w.kill()
    assert not list((home / "watch").glob("*.sock"))  # removed on the way out
    assert not list((home / "watch").glob("*.wake"))
    (src / "f").write_text("v3")
    out = one_shot(c, src, home, "--json")
    assert out.returncode == 0 and "watch" not in json.loads(out.stdout)
    assert reads(c.mnt(1) / "ws" / "f") == b"v3"


@pytest.mark.mount
def test_an_edit_saved_then_pushed_by_hand_is_pushed_once(fresh_cluster, tmp_path):
    """The watch starts pushing an edit as soon as it is saved; a one-shot push typed right
    after arrives while that push runs, and is answered by it (its scan came after the save),
    not by a second push of the same tree."""
    c = fresh_cluster(1)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "f").write_text("v1")
    home = tmp_path / "home"
    w = watcher(c, src, tmp_path)
    try:
        w.push()
        (tmp_path / "big").write_bytes(os.urandom(96 << 20))  # a push long enough to arrive in
        os.rename(tmp_path / "big", src / "big")  # saved at once, as editors do
        out = one_shot(c, src, home, "--json")
        assert out.returncode == 0, out.stderr
        handed = json.loads(out.stdout)
        pushed = w.push()
        assert handed["watch"] == w.proc.pid and handed["version"] == pushed["version"]
        assert pushed["changes"] >= 1 and handed["bytes"] == pushed["bytes"] > 96 << 20
        w.no_push(1.0)  # and no push of the same tree again
        assert reads(c.mnt(0) / "ws" / "big") == (src / "big").read_bytes()
        assert w.stop() == 0
    finally:
        w.kill()


@pytest.mark.mount
def test_keep_warm_leaves_a_watch_that_pushes_only_when_asked_and_stops_when_idle(
        fresh_cluster, tmp_path):
    """`push --keep-warm` pushes, then leaves a `push --watch --on-demand` of the folder in the
    background: an edit is taken in but not pushed until the next `monarch-fs push` of the
    folder, which that watch pushes; it stops after --idle minutes without a push, removing
    its socket."""
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "f").write_text("v1")
    home = tmp_path / "home"
    wrong = one_shot(c, src, home, "--idle", "5")  # --idle alone: for a watch, not one push
    assert wrong.returncode == 1 and "--idle are for push --watch" in wrong.stderr
    out = one_shot(c, src, home, "--json", "--keep-warm", "--idle", "0.1")
    assert out.returncode == 0, out.stderr
    assert "watch" not in json.loads(out.stdout)  # pushed by the command itself
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("keeping "))
    pid = int(line.split(" pid ")[1].split(",")[0])
    sock = home / "watch" / f"{pid}.sock"
    try:
        wait_for(sock.exists, what="the warm watch's socket")
        assert all(reads(m / "ws" / "f") == b"v1" for m in c.mounts())
        (src / "f").write_text("v2")
        time.sleep(1.0)  # the watcher saw it; on demand, nothing is pushed
        assert all(reads(m / "ws" / "f") == b"v1" for m in c.mounts())
        again = one_shot(c, src, home, "--json", "--keep-warm", "--idle", "0.1")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["watch"] == pid  # handed to it
        assert "keeping " not in again.stderr  # and no second watch started
        assert all(reads(m / "ws" / "f") == b"v2" for m in c.mounts())
        wait_for(lambda: not sock.exists(), timeout=60, what="the warm watch to stop when idle")
        assert "no push for 0.1 min" in (home / "watch" / "warm.log").read_text()
    finally:
        if sock.exists():  # (ours: started by the push above)
            os.kill(pid, signal.SIGTERM)


# Another user's "watch": it records what it is told and says every push is its own, done.
FAKE_WATCH = r"""
import socket, sys
fd, log, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(fileno=fd)
s.listen(4)
open(ready, "w").close()
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(1 << 20)
    except OSError:
        data = b""
    with open(log, "ab") as f:
        f.write(data)
    c.sendall(b'{"mine": true}\n{"stdout": "pushed proj 000000000000 (faked)\\n", "code": 0}\n')
    c.close()
"""


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("whose", ["folder", "listener"])
def test_another_users_socket_is_told_nothing(fresh_cluster, tmp_path, whose):
    """Issue 33, finding 9: in a shared MONARCH_FS_HOME (1777), another user made watch/ (0777)
    and a socket answering {"mine": true}: the push printed `pushed proj 000000000000` and
    exited 0, nothing pushed, and that user read the push's argv, cwd and MONARCH_FS_*. Now
    a watch folder not this user's alone is not used (a warning says whose), and a socket whose
    listener is another user's (SO_PEERCRED) is told nothing: the push runs itself."""
    nobody = 65534
    shared = Path(tempfile.mkdtemp(prefix="mfs-shared-home-"))
    shared.chmod(0o1777)
    try:
        watch = shared / "watch"
        watch.mkdir(mode=0o700)
        if whose == "folder":  # made first by the other user, open to all
            os.chown(watch, nobody, nobody)
            watch.chmod(0o777)
        log, ready = shared / "told", shared / "ready"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(watch / "1.sock"))  # the other user listens on it (its credentials)
        fake = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FAKE_WATCH, str(sock.fileno()),
                                 str(log), str(ready)], pass_fds=[sock.fileno()], user=nobody,
                                group=nobody, extra_groups=[], cwd="/")
        sock.close()
        try:
            wait_for(ready.exists, what="the other user's socket listening")
            c = fresh_cluster(1)
            src = tmp_path / "proj"
            src.mkdir()
            (src / "f").write_text("real")
            out = one_shot(c, src, shared)
            assert out.returncode == 0, out.stderr
            assert "(faked)" not in out.stdout, out.stdout
            assert reads(c.mnt(0) / "proj" / "f") == b"real"
            assert not log.exists() or log.read_bytes() == b"", "the other user was told"
            if whose == "folder":
                assert f"warning: {watch} belongs to uid {nobody}" in out.stderr, out.stderr
        finally:
            fake.kill()
            fake.wait()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
