"""The dev box store's background filler (daemon/client/store_filler.py): a push returns once its
nodes have the version, and a filler it started fills the store afterwards; a push that wants
the store meanwhile gets it; a filler whose folder changed fills it as it is now, and one whose
home is gone leaves nothing behind; MONARCH_FS_STORE_FILL=inline fills before returning."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import trio
from fillers import wait_fillers
from test_controller_store import (
    evict,
    folders,
    make_src,
    push_from_store,
    resident_bytes,
    store_status,
)

from helpers import CLI_MODULE, tree, wait_for
from monarch_fs.daemon.client import filler_control, store_keep
from monarch_fs.settings import settings

pytestmark = pytest.mark.mount


def fill_log() -> list[str]:
    try:
        return (settings.home / "store-fill.log").read_text().splitlines()
    except FileNotFoundError:
        return []


def catch_filler(timeout: float = 30) -> int:
    """SIGSTOP the filler the last push started once it holds the store (its pid file), so
    that the test decides when it goes on; its pid."""
    deadline = time.monotonic() + timeout
    while (pid := filler_control.holder(settings.store_dir)) is None:
        if fill_log():
            pytest.fail(f"the filler finished before it could be caught: {fill_log()}")
        if time.monotonic() > deadline:
            pytest.fail("no filler took the store")
        time.sleep(0.001)
    os.kill(pid, signal.SIGSTOP)  # a process this test's push started
    return pid


def push_while_stopped(c, src, pid: int) -> tuple[str, str]:
    """Push `src` to `c` while filler `pid` is stopped holding the store: it goes on once the
    push asked it to stop. The push's stdout and stderr."""
    push = subprocess.Popen(
        [sys.executable, "-m", CLI_MODULE, "push", str(src), "--hosts", c.hostfile,
         "--token-file", c.token_file, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(filler_control.stop_path(settings.store_dir, pid).exists, 60,
                 "the push to ask the filler to stop")
    finally:
        os.kill(pid, signal.SIGCONT)
    out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    return out, err


def gone(pid: int) -> bool:
    return not filler_control.is_filler(pid)


def test_a_push_while_a_filler_runs_takes_the_store_from_it(tmp_path, fresh_cluster):
    """The first push's filler holds the store (stopped by the test while it does); a second
    push of the same folder to a fresh node asks it to stop, and gets the store within its
    wait instead of pushing without it. The second push's own filler fills the rest: a third
    push to a fresh node sends every chunk from the store."""
    src = make_src(tmp_path / "env", size=96 << 20)
    want = tree(src)
    r1 = fresh_cluster(1).push_json(src)
    assert r1["store"]["background_fill"]
    pid = catch_filler()
    out, err = push_while_stopped(fresh_cluster(1), src, pid)
    assert "without it" not in err, err
    r2 = json.loads(out)
    assert r2["store"]["path"] == str(settings.store_dir)
    wait_for(lambda: gone(pid), 10, "the first filler to exit")
    stopped = [ln for ln in fill_log() if f"filler {pid}:" in ln]
    assert len(stopped) == 1 and "(a push asked for the store)" in stopped[0], fill_log()
    assert not filler_control.stop_path(settings.store_dir, pid).exists()

    wait_fillers()
    assert filler_control.holder(settings.store_dir) is None
    third = fresh_cluster(1)
    push_from_store(third, src)
    assert tree(third.mnt(0) / "env") == want


def test_what_a_stopped_filler_left_is_filled_by_the_next(tmp_path, fresh_cluster):
    """A push of another folder stops the first push's filler: that push's own filler fills
    its folder, then what the stopped one left of the first, so a push of the first folder to
    a fresh node later sends every chunk from the store."""
    first = make_src(tmp_path / "env", size=96 << 20)
    other = make_src(tmp_path / "other", seed=1, size=8 << 20)
    c = fresh_cluster(1)
    assert c.push_json(first)["store"]["background_fill"]
    pid = catch_filler()
    out, err = push_while_stopped(c, other, pid)
    assert "without it" not in err, err
    assert json.loads(out)["store"]["background_fill"]
    wait_fillers()
    stopped, last = fill_log()
    assert f"filler {pid}:" in stopped and "(a push asked for the store)" in stopped
    assert "; then env " in last and last.endswith("0 lacking [SCHED_IDLE]"), last
    assert filler_control.read_pending(settings.store_dir) == []

    push_from_store(fresh_cluster(1), first)


def test_a_filler_fills_the_folder_as_it_is_now(tmp_path, fresh_cluster, monkeypatch):
    """A folder edited between the push and its filler: the filler fills what the folder
    holds now (what the next push needs), says so, and the push of the edited folder to a
    fresh node sends every chunk from the store. The filler reads the push's scan cache and
    writes nothing of it (a later push may be saving it); it drops requests to fillers that
    are gone."""
    monkeypatch.setenv("MONARCH_FS_STORE_FILL", "off")
    src = make_src(tmp_path / "env", size=8 << 20)
    r1 = fresh_cluster(1).push_json(src)
    assert not r1["store"]["background_fill"] and r1["store"]["lacking"] > 0
    assert fill_log() == []
    (src / "pkg" / "m3.py").write_text("# edited\n" + "y = 2\n" * 300)
    time.sleep(2.2)  # not racily clean: a scan that saved its cache would record it
    caches = sorted((settings.home / "scan-cache").iterdir())
    before = [(p.name, p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns)
              for p in caches]
    spec = store_keep.filler_spec(settings.home, settings.store_dir, settings.store_bound,
                                  src, (), settings.home / "scan-cache",
                                  bytes.fromhex(r1["version"]), "env")
    stale = filler_control.stop_path(settings.store_dir, 1 << 23)  # asked of no process
    stale.touch()
    filler_control.start(spec, settings.home)
    wait_fillers()
    assert not stale.exists()
    after = [(p.name, p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns)
             for p in sorted((settings.home / "scan-cache").iterdir())]
    assert after == before, "the filler wrote the scan cache a later push may be writing"
    [line] = fill_log()
    assert f"env {r1['version'][:12]}: kept " in line
    assert "0 lacking (the folder changed since the push: filled it as it is now" in line

    monkeypatch.setenv("MONARCH_FS_STORE_FILL", "background")
    fresh = fresh_cluster(1)
    r2 = fresh.push_json(src, "--compress", "on")
    assert r2["version"] != r1["version"]
    assert r2["store"]["sent_from_store"] == r2["chunks_total"] + folders(src)
    assert not r2["store"]["background_fill"] and r2["store"]["lacking"] == 0
    assert tree(fresh.mnt(0) / "env") == tree(src)


def test_a_filler_whose_home_is_gone_leaves_nothing(tmp_path, fresh_cluster):
    """A home removed under a running filler, and one removed before a filler starts: each
    exits, and neither makes the home again."""
    src = make_src(tmp_path / "env", size=96 << 20)
    home = settings.home
    r1 = fresh_cluster(1).push_json(src)
    assert r1["store"]["background_fill"]
    spec = store_keep.filler_spec(home, settings.store_dir, settings.store_bound, src, (),
                                  home / "scan-cache", bytes.fromhex(r1["version"]), "env")
    pid = catch_filler()
    shutil.rmtree(home)
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: gone(pid), 30, "the filler to exit")
    assert not home.exists()

    started = subprocess.run([sys.executable, "-m", filler_control.MODULE, json.dumps(spec)],
                             capture_output=True, text=True, timeout=60)
    assert (started.returncode, started.stdout, started.stderr) == (0, "", "")
    assert not home.exists()


def test_inline_fills_before_the_push_returns_and_off_not_at_all(tmp_path, fresh_cluster,
                                                                monkeypatch):
    """MONARCH_FS_STORE_FILL=inline is the fill as it was (bounded, before the push returns,
    no filler); off keeps only the folder objects; an unknown value fails the push before
    anything is sent, naming the variable."""
    src = make_src(tmp_path / "env", size=8 << 20)
    c = fresh_cluster(1)
    monkeypatch.setenv("MONARCH_FS_STORE_FILL", "bogus")
    bad = c.push(src, check=False)
    assert bad.returncode == 1
    assert "$MONARCH_FS_STORE_FILL='bogus': expected one of background, inline, off" in bad.stderr
    assert not (c.mnt(0) / "env").exists()

    monkeypatch.setenv("MONARCH_FS_STORE_FILL", "inline")
    r1 = c.push_json(src)
    assert r1["store"]["added"] > 0
    assert not r1["store"]["background_fill"] and r1["store"]["lacking"] == 0
    assert filler_control.running(settings.home) == [] and fill_log() == []
    os.sync()
    evict(src)
    fresh = fresh_cluster(1)
    r2 = fresh.push_json(src, "--compress", "on")
    assert resident_bytes(src) == 0, "the push read the source"
    assert r2["store"]["sent_from_store"] == r2["chunks_total"] + folders(src)

    monkeypatch.setenv("MONARCH_FS_STORE_FILL", "off")
    shutil.rmtree(settings.store_dir)
    r3 = fresh_cluster(1).push_json(src)
    assert not r3["store"]["background_fill"] and r3["store"]["lacking"] == r3["chunks_total"]
    assert filler_control.running(settings.home) == [] and fill_log() == []
    r4 = fresh_cluster(1).push_json(src, "--compress", "on")
    assert r4["store"]["sent_from_store"] == folders(src)  # what no file can give again


def test_stop_all_stops_a_running_filler(tmp_path, fresh_cluster):
    """What the tests' and benchmarks' cleanup calls before removing a home: a filler asked
    as a push asks, and waited for by its pid. `status --store` says which filler fills the
    store while one does."""
    src = make_src(tmp_path / "env", size=96 << 20)
    fresh_cluster(1).push_json(src)
    pid = catch_filler()
    assert store_status()["filling"] == pid

    flag = filler_control.stop_path(settings.store_dir, pid)
    stopped: list[int] = []

    async def stop_all() -> None:
        stopped.extend(await trio.to_thread.run_sync(filler_control.stop_all, settings.home))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_all)
            try:
                await trio.to_thread.run_sync(wait_for, flag.exists, 10, "the request")
            finally:
                os.kill(pid, signal.SIGCONT)

    trio.run(main)
    assert stopped == [pid] and gone(pid)
    lines = fill_log()
    assert len(lines) == 1 and "(a push asked for the store)" in lines[0], lines
    assert filler_control.holder(settings.store_dir) is None
    assert store_status()["filling"] is None


def test_a_filler_scans_with_the_push_s_excludes(tmp_path, fresh_cluster):
    """The filler scans the folder as the push did: with its --exclude patterns it finds the
    version pushed (not a changed folder) and fills exactly what the push left."""
    src = make_src(tmp_path / "env", size=8 << 20)
    r1 = fresh_cluster(1).push_json(src, "--exclude", "*.bin", "--name", "lib")
    assert r1["store"]["background_fill"] and r1["store"]["lacking"] == 40  # the modules
    wait_fillers()
    [line] = fill_log()
    assert f"lib {r1['version'][:12]}: kept 40 chunks in " in line
    assert line.endswith("; 0 lacking [SCHED_IDLE]"), line
