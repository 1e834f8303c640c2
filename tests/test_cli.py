"""The command line's own rules: host lists, token resolution, errors a person can read."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import mfs
from monarch_fs.daemon.client.hosts import HostsError, parse_hosts
from monarch_fs.daemon.wire.auth import NoToken, resolve_token, write_new_token


def test_host_list_forms(tmp_path, monkeypatch):
    assert parse_hosts("a:1, b:2") == ["a:1", "b:2"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the nodes\nnode1:7000\n\nnode2:7000  # second\n[::1]:7000\n")
    assert parse_hosts(f"@{hostfile}") == ["node1:7000", "node2:7000", "[::1]:7000"]
    monkeypatch.setenv("MONARCH_FS_HOSTS", "env:9")
    assert parse_hosts(None) == ["env:9"]


@pytest.mark.parametrize("spec, message", [
    ("nohost", "expected host:port"),
    ("a:99999", "port must be"),
    ("a:1,a:1", "twice"),
    ("@/does/not/exist", "cannot read host file"),
])
def test_bad_host_lists(spec, message):
    with pytest.raises(HostsError, match=message):
        parse_hosts(spec)


def test_no_hosts_anywhere(tmp_path, monkeypatch):
    monkeypatch.delenv("MONARCH_FS_HOSTS", raising=False)
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path))
    with pytest.raises(HostsError, match="cluster up"):
        parse_hosts(None)


def test_token_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MONARCH_FS_TOKEN_FILE", raising=False)
    with pytest.raises(NoToken):  # no token anywhere: nothing to authenticate with
        resolve_token(None)
    default = write_new_token(tmp_path / "home" / "cluster" / "token")
    assert resolve_token(None) == default
    env_token = write_new_token(tmp_path / "env-token")
    monkeypatch.setenv("MONARCH_FS_TOKEN_FILE", str(tmp_path / "env-token"))
    assert resolve_token(None) == env_token
    flag_token = write_new_token(tmp_path / "flag-token")
    assert resolve_token(str(tmp_path / "flag-token")) == flag_token
    assert (tmp_path / "flag-token").stat().st_mode & 0o777 == 0o600


@pytest.mark.mount
def test_push_json_has_the_documented_fields(cluster3, tmp_path):
    src = tmp_path / "fields"
    src.mkdir()
    (src / "a").write_text("a" * 1000)
    (src / "b").write_text("b")
    out = json.loads(cluster3.push(src).stdout)
    assert set(out) >= {"version", "name", "files", "bytes", "chunks_total", "chunks_sent",
                        "bytes_sent", "nodes", "seconds"}
    assert (out["files"], out["bytes"], out["chunks_total"], out["nodes"]) == (2, 1001, 2, 3)
    assert out["chunks_sent"] == 6  # two new chunks to each of three nodes


@pytest.mark.mount
def test_push_summary_is_one_balanced_line(cluster3, tmp_path):
    """The line a person reads after a push: what, where, how much, and how (a stray `)`
    once closed a parenthesis that was never opened)."""
    src = tmp_path / "summary"
    src.mkdir()
    (src / "a").write_text("s" * 1000)  # content no other test of the module pushes
    (src / "b").write_text("t")
    out = mfs("push", str(src), "--hosts", cluster3.hostfile, "--token-file",
              cluster3.token_file)
    line, = out.stdout.splitlines()
    assert re.fullmatch(r"pushed summary [0-9a-f]{12} to 3 nodes in \d+\.\d\ds: 2 files, "
                        r"1001 B; sent [\d.]+ (?:B|KiB) \(6 chunks; the snapshot has 2\), "
                        r"star, tcp",
                        line), line
    assert line.count("(") == line.count(")")


@pytest.mark.mount
def test_push_of_missing_folder_is_one_clear_line(cluster3, tmp_path):
    out = mfs("push", str(tmp_path / "nope"), "--hosts", cluster3.hostfile,
              "--token-file", cluster3.token_file, check=False)
    assert out.returncode == 1
    assert out.stderr.startswith("monarch-fs: error:") and "nope" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.mount
def test_status_names_unreachable_node(cluster3):
    out = mfs("status", "--hosts", ",".join(cluster3.hosts + ["127.0.0.1:1"]),
              "--token-file", cluster3.token_file, check=False)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and "127.0.0.1:1" in lines[3] and "UNREACHABLE" in lines[3]


@pytest.mark.mount
def test_the_monarch_fs_command_exits_with_its_output_whole_and_its_code(cluster3, tmp_path):
    """`monarch-fs` (monarch_fs.__main__) ends without the interpreter's teardown: what it
    printed arrives whole, through a pipe, and its exit code is the command's."""
    import subprocess
    import sys

    src = tmp_path / "whole"
    src.mkdir()
    for i in range(300):
        (src / f"f{i}").write_text(str(i))
    run = [sys.executable, "-m", "monarch_fs", "--verbose", "push", "--hosts", cluster3.hostfile,
           "--token-file", cluster3.token_file]
    ok = subprocess.run([*run, str(src), "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["files"] == 300
    bad = subprocess.run([*run, str(tmp_path / "nope")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "nope" in bad.stderr.splitlines()[-1]


def test_a_push_imports_no_other_commands_modules():
    """A push's start is part of its time (0.3 s of a 1.5 s push of 1 GiB, most of a
    no-change push's 0.25 s): the CLI loads what `status`, `rm`, `cluster`, an off-loopback
    probe and push --early need only when one of them runs, and the dev box store's chunk
    store only when a push opens it (not for an edit or no change: mark_pushed)."""
    code = ("import sys, monarch_fs.cli; print(' '.join(m for m in ("
            "'monarch_fs.daemon.client.status', 'monarch_fs.daemon.client.cluster', "
            "'monarch_fs.daemon.wire.process_calls', 'monarch_fs.daemon.client.first_reads', "
            "'monarch_fs.fs.store', 'monarch_fs.fs.file_objects')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == []


def test_a_cluster_error_is_still_one_line(tmp_path, monkeypatch):
    """The errors of modules the CLI now loads only when asked (a local cluster's here) are
    still reported in one line, not as a traceback."""
    monkeypatch.setenv("MONARCH_FS_HOME", str(tmp_path))
    proc = mfs("cluster", "up", "--nodes", "0", "--dir", str(tmp_path / "c"), check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == "monarch-fs: error: --nodes must be at least 1\n"
