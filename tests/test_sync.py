"""The sync path end to end: real daemons, real FUSE mounts, real sockets, the real CLI."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from helpers import CLI_MODULE, mfs, mount_ops, mounted, tree

pytestmark = pytest.mark.mount


def make_every_kind(root: Path) -> None:
    """A tree with every kind of entry a pushed folder can hold."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(300_000))
    (root / "big.bin").write_bytes(os.urandom(5 * 1024 * 1024 + 17))  # two 4 MiB chunks
    (root / "text.txt").write_text("hello " * 10_000)  # compressible
    (root / "empty").write_bytes(b"")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    (root / "private").write_text("secret")
    (root / "private").chmod(0o600)
    (root / "with space").write_text("space")
    (root / "new\nline").write_text("newline")
    (root / os.fsdecode(b"latin-\xe9")).write_text("not utf-8")
    os.symlink("pkg/__init__.py", root / "rel-link")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("../../outside/escape", root / "pkg" / "escaping-link")
    os.symlink("missing-target", root / "dangling")
    os.link(root / "text.txt", root / "hardlink.txt")
    os.mkfifo(root / "fifo")


def test_every_entry_kind_identical_on_every_node(cluster3, tmp_path):
    src = tmp_path / "kinds"
    src.mkdir()
    make_every_kind(src)
    out = cluster3.push(src)
    result = json.loads(out.stdout)
    assert "skipped fifo" in out.stderr  # one warning for the FIFO
    expected = tree(src)
    del expected[b"fifo"]
    for mnt in cluster3.mounts():
        assert tree(mnt / "kinds") == expected
    assert result["nodes"] == 3 and result["name"] == "kinds"
    assert result["files"] == 11  # a hard link counts as a file with identical content
    assert (cluster3.mnt(0) / "kinds" / ".." / ".versions" / "kinds" / result["version"]).is_dir()
    # symlinks are served verbatim, never followed by the daemon
    link = cluster3.mnt(1) / "kinds" / "pkg" / "escaping-link"
    assert os.readlink(link) == "../../outside/escape"
    ran = subprocess.run([cluster3.mnt(2) / "kinds" / "run.sh"], capture_output=True, text=True)
    assert ran.stdout == "ran\n"


def test_edits_visible_everywhere_and_old_version_kept(cluster3, tmp_path):
    src = tmp_path / "edits"
    (src / "d").mkdir(parents=True)
    (src / "keep.txt").write_text("unchanged")
    (src / "modify.txt").write_text("before")
    (src / "delete.txt").write_text("deleted soon")
    (src / "d" / "rename-me.txt").write_text("moving")
    (src / "mode.sh").write_text("#!/bin/sh\n")
    (src / "grows").mkdir()
    (src / "grows" / "a").write_text("a")
    first = cluster3.push_json(src)
    # Readers look before the edit, so the kernel has the old entries, pages and listings
    # cached.
    for mnt in cluster3.mounts():
        assert (mnt / "edits" / "modify.txt").read_text() == "before"
        assert (mnt / "edits" / "delete.txt").exists()
        assert (mnt / "edits" / "d" / "rename-me.txt").exists()
        assert tree(mnt / "edits") == tree(src)
        assert os.listdir(mnt / ".versions" / "edits") == [first["version"]]
    inode_before = os.stat(cluster3.mnt(0) / "edits" / "keep.txt").st_ino
    dir_times = {d: d.stat().st_mtime_ns for d in (src, src / "d", src / "grows")}

    (src / "modify.txt").write_text("after, and longer")
    (src / "delete.txt").unlink()
    (src / "added.txt").write_text("new file")
    (src / "d" / "rename-me.txt").rename(src / "renamed.txt")
    (src / "mode.sh").chmod(0o755)
    (src / "grows" / "b").write_text("b")  # a name the kernel never looked up
    for d, mtime in dir_times.items():  # listings change while the folders' times do not
        os.utime(d, ns=(mtime, mtime))
    second = cluster3.push_json(src)
    assert second["version"] != first["version"]
    assert second["chunks_sent"] <= 3 * 3  # only the new content: three new chunks per node

    expected = tree(src)
    for mnt in cluster3.mounts():
        assert tree(mnt / "edits") == expected  # no stale entry, attribute or page
        old = tree(mnt / ".versions" / "edits" / first["version"])
        assert old[b"modify.txt"][3] == b"before" and b"delete.txt" in old
        assert sorted(os.listdir(mnt / ".versions" / "edits")) == sorted(
            [first["version"], second["version"]])
    # an unchanged file keeps its inode (and page cache) across versions
    assert os.stat(cluster3.mnt(0) / "edits" / "keep.txt").st_ino == inode_before


def test_no_change_repush_sends_nothing_and_asks_each_node_once(cluster3, tmp_path):
    """A push of what every node serves already is settled by one question to each node:
    nothing is negotiated, sent or published. When one node serves something else, the whole
    push runs, and every node ends on the pushed version."""
    src = tmp_path / "same"
    src.mkdir()
    original = os.urandom(100_000)
    (src / "f").write_bytes(original)
    mtime_ns = (src / "f").stat().st_mtime_ns  # the manifest holds it: restored below
    first = cluster3.push_json(src)
    assert "publish" in first["phases"]
    again = cluster3.push_json(src)
    assert again["version"] == first["version"] and again["nodes"] == 3
    assert again["chunks_sent"] == 0 and again["bytes_sent"] == 0
    assert "current" in again["phases"]
    assert not {"negotiate", "send", "publish"} & set(again["phases"])

    (src / "f").write_bytes(b"another version, on node 0 only")
    cluster3.push_json(src, "--hosts", cluster3.hosts[0])
    (src / "f").write_bytes(original)
    os.utime(src / "f", ns=(mtime_ns, mtime_ns))
    back = cluster3.push_json(src)
    assert back["version"] == first["version"] and "publish" in back["phases"]
    for mnt in cluster3.mounts():
        assert (mnt / "same" / "f").read_bytes() == original


def test_open_file_keeps_its_version_across_publish(cluster3, tmp_path):
    src = tmp_path / "held"
    src.mkdir()
    (src / "f.txt").write_text("A" * 100_000)
    cluster3.push(src)
    with open(cluster3.mnt(0) / "held" / "f.txt", "rb") as f:
        head = f.read(10)
        (src / "f.txt").write_text("B" * 100_000)
        cluster3.push(src)
        rest = f.read()
    assert head + rest == b"A" * 100_000
    assert (cluster3.mnt(0) / "held" / "f.txt").read_text() == "B" * 100_000


def test_mount_is_read_only(cluster3, tmp_path):
    src = tmp_path / "ro"
    src.mkdir()
    (src / "f").write_text("x")
    cluster3.push(src)
    target = cluster3.mnt(1) / "ro"
    for attempt in (lambda: open(target / "f", "w"), lambda: open(target / "new", "w"),
                    lambda: os.mkdir(target / "d"), lambda: os.unlink(target / "f")):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS


def test_xattrs_name_version_and_chunks(cluster3, tmp_path):
    src = tmp_path / "xa"
    src.mkdir()
    (src / "f").write_text("xattr")
    result = cluster3.push_json(src)
    f = cluster3.mnt(0) / "xa" / "f"
    assert os.getxattr(f, "user.monarch.version").decode() == result["version"]
    from monarch_fs.fs.chunk import chunk_id
    assert os.getxattr(f, "user.monarch.chunks").decode() == chunk_id(b"xattr").hex()
    assert set(os.listxattr(f)) == {"user.monarch.workspace", "user.monarch.version",
                                    "user.monarch.chunks"}
    # the root tells what the node serves and how busy it has been
    root = cluster3.mnt(0)
    assert f"xa={result['version']}" in os.getxattr(root, "user.monarch.workspaces").decode()
    before = mount_ops(root)
    f.read_bytes()
    after = mount_ops(root)
    assert int(after["getxattr"]) > int(before["getxattr"])
    assert int(after["read"]) == int(before.get("read", 0)) + 1
    # Python's open() asks whether a file is a terminal: a request the daemon refuses as a
    # local disk would, and counts
    with open(f, "rb") as fh:
        assert not fh.isatty()
        with pytest.raises(OSError) as e:
            fcntl.ioctl(fh, termios.TCGETS, bytes(64))
        assert e.value.errno == errno.ENOTTY
    ops = mount_ops(root)
    assert int(ops["ioctl"]) >= int(after.get("ioctl", 0)) + 3  # open()'s own, isatty, TCGETS


def test_with_open_round_trips_files_and_listings_still_follow_each_version(
        fresh_cluster, tmp_path, monkeypatch):
    """The path a stock pyfuse3 takes (open/opendir answered, handles are inodes): reads,
    listings and edits behave the same, only each open is a request."""
    monkeypatch.setenv("MONARCH_FS_NO_OPEN", "0")
    monkeypatch.setenv("MONARCH_FS_PASSTHROUGH", "0")
    c = fresh_cluster(1)
    assert c.status()[0]["fuse"] == "open per file (MONARCH_FS_NO_OPEN=0)"
    src = tmp_path / "stock"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_text("a1")
    (src / "big").write_bytes(os.urandom(5 << 20))  # two chunks
    c.push(src)
    mnt = c.mnt(0) / "stock"
    assert tree(mnt) == tree(src)
    root = c.mnt(0)

    def opens() -> int:
        return mount_ops(root).get("open", 0)

    before = opens()
    assert (mnt / "d" / "a").read_text() == "a1"
    assert opens() == before + 1
    (src / "d" / "a").write_text("a2, longer")
    (src / "d" / "b").write_text("b")
    c.push(src)
    assert tree(mnt) == tree(src)


@pytest.mark.parametrize("mode", ["no-open", pytest.param("passthrough", marks=pytest.mark.root)])
def test_warm_reads_and_listings_cost_no_requests(fresh_cluster, tmp_path, monkeypatch, mode):
    """Once read, a file's pages and a directory's listing stay in the kernel: reading and
    listing again sends the daemon no read and no readdir. With no-open (the patched pyfuse3
    without passthrough) it sends only the ioctl with which Python's open() asks whether a
    file is a terminal (the kernel forwards every ioctl); with passthrough each open is a
    request too."""
    from monarch_fs.fs import open_mode
    assert open_mode.NO_OPEN_BUILT, "pyfuse3 is not the patched build (make builds it)"
    if mode == "no-open":
        monkeypatch.setenv("MONARCH_FS_PASSTHROUGH", "0")
    elif os.geteuid() != 0:
        pytest.skip("passthrough needs root")
    c = fresh_cluster(1)
    assert c.status()[0]["fuse"].split()[0] == mode
    src = tmp_path / "warm"
    (src / "pkg").mkdir(parents=True)
    for i in range(50):
        (src / "pkg" / f"m{i}.py").write_text(f"x = {i}\n" * 100)
    c.push(src)
    root, pkg = c.mnt(0), c.mnt(0) / "warm" / "pkg"

    def ops() -> dict[str, int]:
        return mount_ops(root)

    def walk() -> dict[str, bytes]:
        return {name: (pkg / name).read_bytes() for name in os.listdir(pkg)}

    first = walk()
    before = ops()
    assert walk() == first
    after = ops()
    served = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # Releases and forgets are the kernel's housekeeping, sent without waiting: some from the
    # first walk may still be on their way.
    for late in ("release", "forget"):
        served.pop(late, None)
    if mode == "no-open":  # and the xattr read of `ops` itself
        assert served == {"getxattr": 1, "ioctl": 50}, served
    else:
        assert served == {"getxattr": 1, "ioctl": 50, "open": 50}, served
    assert len(first) == 50 and first["m7.py"] == b"x = 7\n" * 100


def test_status_reports_every_node(cluster3, tmp_path):
    src = tmp_path / "st"
    src.mkdir()
    (src / "f").write_text("status")
    result = cluster3.push_json(src)
    nodes = cluster3.status()
    assert [n["host"] for n in nodes] == cluster3.hosts
    for n in nodes:
        assert n["reachable"] and n["workspaces"]["st"][0] == result["version"]
        assert n["store_bytes"] > 0


def test_restarted_daemon_serves_last_version_without_push(fresh_cluster, tmp_path):
    c = fresh_cluster(1)
    src = tmp_path / "persist"
    src.mkdir()
    (src / "f.txt").write_text("v1")
    c.push(src)
    (src / "f.txt").write_text("v2")
    c.push(src)
    inode = os.stat(c.mnt(0) / "persist" / "f.txt").st_ino
    pid = c.pid(0)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while mounted(c.mnt(0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mounted(c.mnt(0)), "SIGTERM must unmount"
    # Start a daemon on the same state: it serves v2 at once.
    nd = c.dir / "node-0"
    proc = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "daemon", "--listen", "127.0.0.1:0",
         "--mount", str(nd / "mnt"), "--state", str(nd / "state"),
         "--token-file", c.token_file, "--ready-file", str(nd / "ready2")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (nd / "ready2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (c.mnt(0) / "persist" / "f.txt").read_text() == "v2"
        assert os.stat(c.mnt(0) / "persist" / "f.txt").st_ino == inode  # stable across restarts
        assert len(os.listdir(c.mnt(0) / ".versions" / "persist")) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0, "SIGINT must exit 0"
    assert not mounted(c.mnt(0))


def test_wrong_token_is_refused_and_nothing_changes(cluster3, tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "f").write_text("good")
    good = cluster3.push_json(src)
    (src / "f").write_text("evil")
    bad_token = tmp_path / "bad-token"
    bad_token.write_text("not-the-token")
    out = mfs("push", str(src), "--hosts", cluster3.hostfile, "--token-file", str(bad_token),
              check=False)
    assert out.returncode != 0
    assert "wrong token" in out.stderr and cluster3.hosts[0] in out.stderr
    assert "Traceback" not in out.stderr
    for mnt in cluster3.mounts():
        assert (mnt / "tok" / "f").read_text() == "good"
    # the daemons keep serving authenticated clients
    assert all(n["reachable"] and n["workspaces"]["tok"][0] == good["version"]
               for n in cluster3.status())


def test_unreachable_host_fails_whole_push(cluster3, tmp_path):
    src = tmp_path / "unreach"
    src.mkdir()
    (src / "f").write_text("v1")
    cluster3.push(src)
    (src / "f").write_text("v2")
    dead = "127.0.0.1:1"  # nothing listens on port 1
    hosts = ",".join(cluster3.hosts + [dead])
    out = mfs("push", str(src), "--hosts", hosts, "--token-file", cluster3.token_file,
              check=False)
    assert out.returncode != 0
    assert dead in out.stderr and "refused" in out.stderr
    assert "nothing was published" in out.stderr and "Traceback" not in out.stderr
    for mnt in cluster3.mounts():
        assert (mnt / "unreach" / "f").read_text() == "v1"




def test_sigterm_unmounts_and_exits_zero(fresh_cluster):
    c = fresh_cluster(1)
    proc_pid = c.pid(0)
    os.kill(proc_pid, signal.SIGTERM)
    # The daemon is this process's child (cluster.up started it), so once it exits it stays a
    # zombie, /proc entry included, until waitpid reaps it here: then its exit code is checked.
    # Only if something else reaped it first (ChildProcessError) does a vanished /proc entry
    # stand for its end.
    gone = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(proc_pid, os.WNOHANG)
            if pid:
                assert os.waitstatus_to_exitcode(status) == 0
                gone = True
                break
        except ChildProcessError:
            if not os.path.exists(f"/proc/{proc_pid}"):
                gone = True
                break
        time.sleep(0.05)
    assert gone, "daemon still running 10 s after SIGTERM"
    assert not mounted(c.mnt(0))


def test_virtualenv_runs_from_every_mount(cluster3, tmp_path):
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    # Install a small package into the venv, the way pip lays it out.
    pkg = tmp_path / "hello_pkg"
    (pkg / "hello_mfs").mkdir(parents=True)
    (pkg / "hello_mfs" / "__init__.py").write_text(
        "def greet():\n    return 'hello from the mount'\n")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires=["setuptools"]\nbuild-backend="setuptools.build_meta"\n'
        '[project]\nname="hello-mfs"\nversion="1.0"\n')
    site = subprocess.run([str(env / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", site, str(pkg)], check=True)
    cluster3.push(env, "--name", "venv")
    for mnt in cluster3.mounts():
        py = mnt / "venv" / "bin" / "python"
        out = subprocess.run([str(py), "-c", "import sys, hello_mfs; print(sys.prefix); "
                              "print(hello_mfs.__file__); print(hello_mfs.greet())"],
                             capture_output=True, text=True, check=True)
        prefix, where, greeting = out.stdout.splitlines()
        assert prefix == str(mnt / "venv")
        assert where.startswith(str(mnt / "venv"))
        assert greeting == "hello from the mount"


def test_names_looked_up_before_they_exist_appear_after_publish(cluster3, tmp_path):
    """The kernel caches 'no such file' answers; a publish that adds the name must drop them."""
    src = tmp_path / "later"
    src.mkdir()
    (src / "a").write_text("a")
    mnt = cluster3.mnt(0)
    for path in (mnt / "later", mnt / ".versions" / "later"):
        assert not path.exists()  # a negative entry for a workspace not pushed yet
    first = cluster3.push_json(src)
    assert (mnt / "later" / "a").read_text() == "a"
    for name in ("b", "sub"):
        assert not (mnt / "later" / name).exists()
    assert not (mnt / ".versions" / "later" / ("f" * 32)).exists()
    (src / "b").write_text("b")
    (src / "sub").mkdir()
    second = cluster3.push_json(src)
    assert (mnt / "later" / "b").read_text() == "b" and (mnt / "later" / "sub").is_dir()
    assert (mnt / ".versions" / "later" / second["version"]).is_dir()
    assert (mnt / ".versions" / "later" / first["version"] / "a").exists()
