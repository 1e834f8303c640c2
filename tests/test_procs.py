"""The daemon's process table on its own (daemon/node/procs.py): output, exits, and no orphans."""

from __future__ import annotations

import json
import os
import pwd
import signal
import sys
import threading

import pytest
import trio
import trio._core._thread_cache as thread_cache

from helpers import start_daemon, stop_daemon
from monarch_fs.daemon.node.process_start import MAX_SECRETS
from monarch_fs.daemon.node.procs import ProcessTable, SpawnRefused
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect
from procwatch import Started


class Owner:
    """Collects what a process table reports to the controller that owns the procs."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.exited = trio.Event()

    async def emit(self, kind: str, data: dict) -> None:
        self.events.append((kind, data))
        if kind == "exit":
            self.exited.set()

    def lines(self, stream: str) -> list[str]:
        return [line for kind, d in self.events if kind == "output" and d["stream"] == stream
                for line in d["lines"]]


async def test_output_then_exit_with_stderr_tail(tmp_path):
    owner = Owner()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery, allow_root=True)
        code = ("import sys; print('out 1'); print('err 1', file=sys.stderr); "
                "print('no newline', end=''); sys.exit(4)")
        await table.spawn(owner, owner.emit, {"argv": [sys.executable, "-c", code],
                                              "env": {"WHERE": "{mount}"}}, None)
        with trio.fail_after(10):
            await owner.exited.wait()
        await table.stop_all()
    assert owner.lines("stdout") == ["out 1", "no newline"]
    assert owner.events[-1] == ("exit", {"proc": 1, "code": 4, "signal": None,
                                         "stderr_tail": ["err 1"]})


async def test_procs_outlive_idle_worker_threads(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG fires when the *thread* that forked exits. Forking from a trio worker
    thread killed every proc once that thread retired (after 10 s idle; 0.1 s here)."""
    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.1)
    owner, started = Owner(), Started()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery, allow_root=True)
        reply = await table.spawn(owner, owner.emit, {"argv": ["sleep", "30"]}, None)
        started.add(reply.pid)
        # a worker thread, which then idles out
        worker = await trio.to_thread.run_sync(threading.current_thread)
        with trio.fail_after(10):
            while worker.is_alive():
                await trio.sleep(0.01)
        # The thread has retired (the OS thread ends just after): a death signal bound to it
        # would end the proc now, and its exit would be reported within this window.
        with trio.move_on_after(0.5):
            await owner.exited.wait()
        assert started.alive() == [reply.pid] and not owner.exited.is_set()
        await table.stop_all()
    assert owner.events[-1][1]["signal"] == "SIGTERM"
    assert not started.alive()


@pytest.mark.slow
async def test_exit_is_reported_even_if_an_escaped_grandchild_holds_the_pipes(tmp_path):
    owner, started = Owner(), Started()
    script = "setsid sh -c 'echo $$; exec sleep 30' & sleep 0.2; exit 5"  # leaves its group
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery, allow_root=True)
        reply = await table.spawn(owner, owner.emit, {"argv": ["sh", "-c", script]}, None)
        started.add(reply.pid)
        with trio.fail_after(10):
            await owner.exited.wait()
        await table.stop_all()
    assert owner.events[-1][1]["code"] == 5
    grandchild = int(owner.lines("stdout")[0])
    os.kill(grandchild, signal.SIGKILL)  # it escaped the group: not ours to leave behind
    assert not started.wait_gone(5)


# ---- issue 16, finding 6: a clean environment, and secrets that no environ shows -------------

# The child reads its secrets first (as the mesh runtime does), then reports its own environment
# block, its open descriptors, and those of a grandchild that inherits every inheritable fd.
PROBE = """
import json, os, subprocess, sys
from monarch_fs.daemon.node.procs import read_secrets
fd = os.environ.get("MONARCH_FS_SECRETS_FD")
pipe = os.readlink(f"/proc/self/fd/{fd}") if fd else None
secrets = read_secrets()
def environ(pid="self"):
    raw = open(f"/proc/{pid}/environ", "rb").read()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\\0") if kv)
grandchild = subprocess.run(
    [sys.executable, "-c", "import json, os; print(json.dumps([dict(os.environ), "
     "open('/proc/self/environ').read(), [os.readlink(f'/proc/self/fd/{n}') "
     "for n in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{n}')]]))"],
    close_fds=False, capture_output=True, text=True, check=True).stdout
print(json.dumps({"fd": fd, "pipe": pipe, "secrets": secrets, "environ": environ(),
                  "left": "MONARCH_FS_SECRETS_FD" in os.environ,
                  "fd_open": fd is not None and os.path.exists(f"/proc/self/fd/{fd}"),
                  "grandchild": json.loads(grandchild)}))
"""


async def _run_probe(tmp_path, args: dict) -> dict:
    owner = Owner()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery, allow_root=True)
        await table.spawn(owner, owner.emit, {"argv": [sys.executable, "-c", PROBE], **args},
                          None)
        with trio.fail_after(30):
            await owner.exited.wait()
        await table.stop_all()
    assert owner.events[-1][1]["code"] == 0, owner.lines("stderr")
    return json.loads(owner.lines("stdout")[0])


async def test_a_proc_starts_from_a_small_documented_environment(tmp_path, monkeypatch):
    """Not the daemon's: its MONARCH_FS_* (the way to the cluster token) and anything else it
    had stay behind; the base (PATH, locale, TZ, TERM, TMPDIR, the user's identity), what the
    request sets, and MONARCH_FS_MOUNT are there."""
    monkeypatch.setenv("MONARCH_FS_TOKEN_FILE", "/secret/token")
    monkeypatch.setenv("DAEMON_ONLY", "should not leak")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.setenv("HOME", "/not/the/users/home")
    out = await _run_probe(tmp_path, {"env": {"JOB": "{mount}/x", "PATH": os.environ["PATH"]}})
    env = out["environ"]
    me = pwd.getpwuid(os.getuid())
    assert env["LC_ALL"] == "C.UTF-8" and env["TZ"] == "UTC" and env["JOB"] == f"{tmp_path}/x"
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (me.pw_dir, me.pw_name, me.pw_name)
    assert env["MONARCH_FS_MOUNT"] == str(tmp_path)
    assert "DAEMON_ONLY" not in env and "MONARCH_FS_HOME" not in env
    assert [k for k in env if k.startswith("MONARCH_FS_")] == ["MONARCH_FS_MOUNT"]
    allowed = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "HOME", "USER", "LOGNAME",
               "SHELL", "JOB", "MONARCH_FS_MOUNT"}
    assert {k for k in env if not k.startswith("LC_")} <= allowed, sorted(env)
    assert out["fd"] is None and out["secrets"] == {}


async def test_secrets_reach_the_proc_through_a_pipe_and_no_environ_shows_them(tmp_path):
    secret = "s3cr3t-" + os.urandom(16).hex()
    out = await _run_probe(tmp_path, {"secrets": {"MONARCH_MESH_TOKEN": secret, "B": "2"}})
    assert out["secrets"] == {"MONARCH_MESH_TOKEN": secret, "B": "2"}
    assert out["fd"] is not None and not out["fd_open"] and not out["left"]  # read and closed
    assert secret not in json.dumps(out["environ"]) and "MONARCH_MESH_TOKEN" not in out["environ"]
    assert out["environ"]["MONARCH_FS_SECRETS_FD"] == out["fd"]  # only a descriptor number
    gc_env, gc_raw, gc_fds = out["grandchild"]
    assert secret not in gc_raw and secret not in json.dumps(gc_env)
    assert "MONARCH_FS_SECRETS_FD" not in gc_env
    assert out["pipe"].startswith("pipe:") and out["pipe"] not in gc_fds  # nor the pipe


async def test_bad_secrets_are_refused(tmp_path):
    owner = Owner()
    async with trio.open_nursery() as nursery:
        table = ProcessTable(tmp_path, nursery, allow_root=True)
        for secrets, message in [({"a": 1}, "object of strings"), (["x"], "object of strings"),
                                 ({"a": "x" * MAX_SECRETS}, "more than")]:
            with pytest.raises(SpawnRefused, match=message):
                await table.spawn(owner, owner.emit, {"argv": ["true"], "secrets": secrets},
                                  None)
        await table.stop_all()
    assert owner.events == [] and table.procs == {}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon with --allow-root-procs")
async def test_refused_spawns_leak_no_descriptor(tmp_path):
    """Issue 33, finding 6: an argv holding a NUL byte or a variable name holding '=' was
    refused only by Popen, after the daemon made the child's two pipes, which stayed open
    (19 -> 519 fds after 250 requests). Now 1,000 refusals, each saying why, leave the
    real daemon's descriptors as they were."""
    daemon = start_daemon(tmp_path / "node", "--allow-root-procs")
    try:
        chan = await connect(daemon.addr, load_token(daemon.token_file))
        async with chan:
            async def refuse(i: int) -> str:
                args = ({"argv": ["/bin/true", f"a\0{i}"]} if i % 2 else
                        {"argv": ["/bin/true"], "env": {f"X=Y{i}": "1"}})
                with pytest.raises(RemoteError) as e:
                    await chan.request("spawn", **args)
                return e.value.message

            await refuse(0)  # the first answer may open what the daemon keeps (its log)
            before = open_fds(daemon.pid)
            for i in range(1000):
                await refuse(i)
            assert open_fds(daemon.pid) <= before + 2, "the refusals leaked descriptors"
            assert "argument 1 holds a NUL byte" in await refuse(1)
            assert "name 'X=Y0' is empty or holds '='" in await refuse(0)
            reply = await chan.request("spawn", argv=["/bin/true"])  # still starts processes
            assert reply["pid"] > 0
    finally:
        stop_daemon(daemon)
