"""A workspace exposed at its source's absolute path on every node (push --at-source;
daemon/node/source_path.py), so a pushed venv's console scripts, whose shebangs and pyvenv.cfg
name the dev box's path, run on a node that does not have that path.

The path checks and the link making run here on real folders, without a mount; the node service
and its protocol run on loopback (no FUSE); and on netns nodes whose mount namespace hides the
dev box's folder, a real venv's `pip` script runs by its source path, and fails without it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_service import TOKEN, send_version, serving

from monarch_fs.daemon.client.push_options import source_args
from monarch_fs.daemon.node import source_path
from monarch_fs.daemon.wire.requests import Commit, RequestError, check_source_path
from monarch_fs.daemon.wire.transport import RemoteError, connect
from netns import NetCluster, unsupported_reason

# ---- the path checks (client and node share them) ------------------------------------------


@pytest.mark.parametrize("path", ["/home/alice/venv", "/tmp/x/env", "/var/tmp/a/env",
                                  "/opt/env", "/scratch/bob/proj/.venv", "/root/env"])
def test_ordinary_source_paths_pass(path):
    check_source_path(path)


@pytest.mark.parametrize("path, why", [
    ("venv", "is relative: it must be absolute"),
    ("./venv", "is relative"),
    ("/", "is not normal"),
    ("/venv", "is a folder right in /"),
    ("/home/alice/../../etc/cron.d", "is not normal"),
    ("/home//alice/venv", "is not normal"),
    ("/home/alice/venv/", "is not normal"),
    ("/home/./alice", "is not normal"),
    ("/proc/self/cwd", "inside the system folder /proc"),
    ("/sys/kernel/x", "inside the system folder /sys"),
    ("/etc/systemd/system/sshd.service.d", "inside the system folder /etc"),
    ("/usr/local/venv", "inside the system folder /usr"),
    ("/var/lib/x", "inside the system folder /var"),
    ("/home/a\0b", "holds a NUL byte"),
    ("/home/a\udcffb", "is not UTF-8"),
])
def test_unsafe_source_paths_are_refused_saying_why(path, why):
    with pytest.raises(ValueError) as e:
        check_source_path(path)
    assert why in str(e.value)


def test_the_client_refuses_before_scanning_and_points_at_the_flag():
    with pytest.raises(ValueError, match=r"inside the system folder /etc.*--no-at-source"):
        source_args("/etc/ssl")


def test_a_commit_request_with_a_bad_source_is_refused():
    with pytest.raises(ValueError, match="is relative"):
        Commit.parse({"name": "ws", "version": "00", "source": "venv"})
    with pytest.raises(RequestError, match="source must be a path"):
        Commit.parse({"name": "ws", "version": "00", "source": 5})
    with pytest.raises(RequestError, match="source_id must be 'DEV:INO'"):
        Commit.parse({"name": "ws", "version": "00", "source": "/tmp/a/b", "source_id": "x"})
    req = Commit.parse({"name": "ws", "version": "00", "source": "/tmp/a/b",
                        "source_id": "1:2"})
    assert (req.source, req.source_id) == ("/tmp/a/b", "1:2")


def test_a_source_overlapping_the_node_own_folders_is_refused():
    mount, state = Path("/mnt/monarch"), Path("/var/lib/monarch-fs")
    for bad in ("/mnt/monarch", "/mnt/monarch/env", "/mnt"):
        with pytest.raises(ValueError, match="overlaps this node's mount"):
            source_path.check_outside(bad, mount, state)
    source_path.check_outside("/mnt/monarchy/env", mount, state)


# ---- the link, on real folders ---------------------------------------------------------------


def nobody(link: str) -> None:
    return None


def test_the_link_is_made_with_its_folders_and_withdrawn(tmp_path):
    src = str(tmp_path / "a" / "b" / "venv")
    target = str(tmp_path / "mnt" / "venv")
    old = os.umask(0o077)
    try:
        assert source_path.expose(src, target, None, nobody) is None
    finally:
        os.umask(old)
    assert os.readlink(src) == target
    for folder in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        assert folder.stat().st_uid == os.geteuid()
    assert source_path.expose(src, target, None, nobody) is None  # again: nothing to do
    assert source_path.withdraw(src, str(tmp_path / "mnt" / "other")) is None
    assert os.path.islink(src)  # not the link of that workspace: kept
    assert source_path.withdraw(src, target) is None
    assert not os.path.lexists(src) and (tmp_path / "a" / "b").is_dir()
    assert source_path.withdraw(str(tmp_path / "gone" / "venv"), target) is None


@pytest.mark.parametrize("what", ["file", "folder", "foreign link"])
def test_what_is_there_stays_and_the_warning_names_it(tmp_path, what):
    src = tmp_path / "venv"
    if what == "file":
        src.write_text("mine")
    elif what == "folder":
        src.mkdir()
    else:
        src.symlink_to("/somewhere/else")
    warning = source_path.expose(str(src), str(tmp_path / "mnt" / "venv"), None, nobody)
    assert warning is not None and f"not exposed at {src}" in warning
    assert "left as is" in warning
    if what == "file":
        assert src.read_text() == "mine"
    elif what == "folder":
        assert src.is_dir() and not src.is_symlink()
    else:
        assert os.readlink(src) == "/somewhere/else"


def test_the_source_folder_itself_is_left_quietly(tmp_path):
    src = tmp_path / "venv"
    src.mkdir()
    st = src.stat()
    assert source_path.expose(str(src), str(tmp_path / "mnt" / "venv"),
                              f"{st.st_dev}:{st.st_ino}", nobody) is None
    assert src.is_dir() and not src.is_symlink()
    link = tmp_path / "link"  # pushed by a path through a link: the same folder
    link.symlink_to(src)
    assert source_path.expose(str(link), str(tmp_path / "mnt" / "link"),
                              f"{st.st_dev}:{st.st_ino}", nobody) is None
    assert os.readlink(link) == str(src)


def test_another_workspace_keeps_its_link_and_a_stale_one_is_replaced(tmp_path):
    src, mnt = tmp_path / "venv", tmp_path / "mnt"
    src.symlink_to(mnt / "first")
    warning = source_path.expose(str(src), str(mnt / "second"), None,
                                 lambda link: "first" if link == str(mnt / "first") else None)
    assert warning is not None and "leads to workspace 'first'" in warning
    assert os.readlink(src) == str(mnt / "first")
    assert source_path.expose(str(src), str(mnt / "second"), None, nobody) is None
    assert os.readlink(src) == str(mnt / "second")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".venv")] == []


def test_a_link_on_the_way_into_a_system_folder_is_not_followed(tmp_path):
    (tmp_path / "home").symlink_to("/etc")
    warning = source_path.expose(str(tmp_path / "home" / "x" / "venv"),
                                 str(tmp_path / "mnt" / "venv"), None, nobody)
    assert warning is not None and "inside the system folder /etc" in warning
    assert not os.path.lexists("/etc/x/venv")


def test_a_trusted_link_on_the_way_is_followed(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "real")
    assert source_path.expose(str(tmp_path / "home" / "u" / "venv"),
                              str(tmp_path / "mnt" / "venv"), None, nobody) is None
    assert os.readlink(tmp_path / "real" / "u" / "venv") == str(tmp_path / "mnt" / "venv")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a link as another user")
def test_a_link_another_user_made_is_not_followed(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "real")
    os.lchown(tmp_path / "home", 65534, 65534)
    warning = source_path.expose(str(tmp_path / "home" / "u" / "venv"),
                                 str(tmp_path / "mnt" / "venv"), None, nobody)
    assert warning is not None and "owned by uid 65534" in warning
    assert list((tmp_path / "real").iterdir()) == []


# ---- the node service over the protocol (no mount) -------------------------------------------


async def test_commit_links_the_source_records_it_and_rm_removes_it(tmp_path):
    src = str(tmp_path / "devbox" / "ws")  # does not exist here: the node makes the link
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            v1 = await send_version(chan, b"one")
            assert await chan.request("prepare", name="ws", version=v1, source=src) == {
                "prepared": v1}
            assert await chan.request("commit", name="ws", version=v1, source=src) == {
                "version": v1, "previous": None}
            assert os.readlink(src) == str(node.mount / "ws")
            saved = json.loads((node.state / "refs.json").read_text())
            assert saved["sources"] == {"ws": src}
            # A second workspace pushed from the same path: the first keeps it.
            v2 = await send_version(chan, b"two")
            reply = await chan.request("commit", name="other", version=v2, source=src)
            assert reply["warnings"] == [
                f"not exposed at {src}: it leads to workspace 'ws' (pushed from this path "
                "too); left as is"]
            assert os.readlink(src) == str(node.mount / "ws")
            await chan.request("remove", name="ws")
            assert not os.path.lexists(src)
            assert json.loads((node.state / "refs.json").read_text())["sources"] == {
                "other": src}
            # Pushed again without a source: its old link (none here) is withdrawn, and the
            # path is forgotten.
            await chan.request("commit", name="other", version=v2)
            assert "sources" not in json.loads((node.state / "refs.json").read_text())


async def test_a_source_in_the_node_mount_is_refused_before_anything_changes(tmp_path):
    async with serving(tmp_path) as [node]:
        chan = await connect(node.addr, TOKEN)
        async with chan:
            v1 = await send_version(chan, b"one")
            for op in ("prepare", "commit"):
                with pytest.raises(RemoteError) as e:
                    await chan.request(op, name="ws", version=v1,
                                       source=str(node.mount / "ws"))
                assert "overlaps this node's mount" in e.value.message
            assert node.refs.workspaces == {}


# ---- netns nodes that do not have the dev box's folder ---------------------------------------


def make_venv(path: Path) -> None:
    """A real venv (with pip, whose console script's shebang names this venv's python)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300,
                   capture_output=True)
    assert (path / "bin" / "pip").read_text().startswith(f"#!{path}/bin/python")


@pytest.mark.netns
@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(unsupported_reason() is not None, reason=unsupported_reason() or "")
def test_a_pushed_venv_console_script_runs_on_nodes_without_its_path(tmp_path):
    devbox = tmp_path / "devbox"
    src = devbox / "venv"
    make_venv(src)
    pip = str(src / "bin" / "pip")
    with NetCluster(2, rate="1gbit") as c:
        for i in range(2):
            c.hide_on_node(i, devbox)
            assert c.run_on_node(i, ["ls", "-A", str(devbox)], check=True).stdout == ""
        c.run_on_node(1, ["mkdir", str(src)], check=True)  # node 1 has its own folder there

        # Without the option: the pushed script's interpreter does not exist on the nodes.
        c.run_devbox(c.push_argv(src, "--no-at-source"), check=True)
        mounted_pip = f"{c.mount}/venv/bin/pip"
        ran = c.run_on_node(0, [mounted_pip, "--version"])
        assert ran.returncode != 0 and "No such file or directory" in ran.stderr, ran
        assert c.run_on_node(0, [pip, "--version"]).returncode != 0

        # With it (the default): node 0 runs the script by its source path, and through the
        # mount too; node 1's folder stays, and the push says so, naming node and path.
        pushed = c.run_devbox(c.push_argv(src), check=True)
        assert (f"warning: {c.hosts[1]}: not exposed at {src}: a folder is there; "
                "left as is") in pushed.stderr, pushed.stderr
        for argv in ([pip, "--version"], [mounted_pip, "--version"]):
            out = c.run_on_node(0, argv, check=True).stdout
            assert out.startswith("pip ") and f"from {src}/lib/" in out, out
        assert c.run_on_node(0, ["readlink", str(src)], check=True).stdout.strip() == \
            f"{c.mount}/venv"
        assert c.run_on_node(1, ["stat", "-c", "%F", str(src)], check=True).stdout.strip() \
            == "directory"
        assert src.is_dir() and not src.is_symlink()  # the dev box's own folder is untouched

        removed = c.run_devbox([*c.push_argv(src)[:3], "rm", "venv",
                                *c.push_argv(src)[5:]], check=True)
        assert removed.returncode == 0
        assert c.run_on_node(0, ["ls", "-A", str(devbox)], check=True).stdout == ""
