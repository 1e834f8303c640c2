"""Under --identity munge a query is signed, and a user who is not root reads the rows of their
own processes and the node's own events, never another user's command lines or stderr (issue
33, finding 3); `top` shows them their own running processes only. Real munged, a real root
daemon, two local users whose clients run as them (the fixtures of tests/test_identity.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest
import trio
from test_identity import as_user, munge_nodes
from users import CLI, SITE_PACKAGES, SYSTEM_PYTHON, LocalUser

from helpers import mfs, wait_for
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect

pytestmark = [
    pytest.mark.mount, pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged")
                       or not shutil.which("useradd"),
                       reason="needs root, munged (package munge) and useradd"),
]

PROCS = "SELECT kind, text, detail FROM events WHERE kind LIKE 'proc.%' ORDER BY id"

# A query as the node receives it, signed by the user who runs this (their own MUNGE
# credential): what a user could send without the command line's planner.
RAW = f"""
import json, site, sys
sys.path[:] = [p for p in sys.path if 'dist-packages' not in p]
site.addsitedir({SITE_PACKAGES!r})
import trio
from monarch_fs.daemon.wire import identity
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect

async def main(addr, token, sql):
    chan = await connect(addr, load_token(token))
    async with chan:
        args = await identity.sign(chan, "query", {{"sql": sql, "params": {{}}, "timeout": 10.0}})
        try:
            print(json.dumps((await chan.request("query", **args))["rows"]))
        except RemoteError as e:
            print("REFUSED", e)

trio.run(main, *sys.argv[1:])
"""


def rows(out) -> list[dict]:
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout)
    assert not got["unreachable"], got
    return got["rows"]


def test_a_user_reads_their_own_processes_rows_only(tmp_path):
    with munge_nodes(tmp_path, 1) as (daemons, munged, _forger, (a, b)):
        daemon = daemons[0]
        out = as_user(a, munged, "run", "--hosts", daemon.addr, "--", "/bin/sh", "-c",
                      "echo a-secret-tail >&2; exit 3", "--db-password=hunter2")
        assert out.returncode == 3, out.stdout + out.stderr
        out = as_user(b, munged, "run", "--hosts", daemon.addr, "--", "/bin/sh", "-c",
                      "echo b-tail >&2", "b-arg")
        assert out.returncode == 0, out.stdout + out.stderr

        # B sees B's processes, A's nowhere: not their argv, stderr, nor A's name.
        seen_by_b = rows(as_user(b, munged, "query", PROCS, "--hosts", daemon.addr, "--json"))
        assert [r["kind"] for r in seen_by_b] == ["proc.started", "proc.exited"], seen_by_b
        text = json.dumps(seen_by_b)
        assert "b-arg" in text and "b-tail" in text
        assert "hunter2" not in text and "a-secret-tail" not in text and a.name not in text
        everything = json.dumps(rows(as_user(b, munged, "query", "SELECT * FROM events",
                                             "--hosts", daemon.addr, "--json")))
        assert "hunter2" not in everything and "a-secret-tail" not in everything
        assert "daemon.started" in everything  # the node's own events are everyone's

        # A sees A's; root sees both.
        seen_by_a = json.dumps(rows(as_user(a, munged, "query", PROCS, "--hosts", daemon.addr,
                                            "--json")))
        assert "hunter2" in seen_by_a and "a-secret-tail" in seen_by_a
        assert "b-tail" not in seen_by_a
        root = mfs("query", PROCS, "--hosts", daemon.addr, "--json",
                   env={"MONARCH_FS_MUNGE_SOCKET": str(munged.socket),
                        "MONARCH_FS_TOKEN_FILE": daemon.token_file})
        seen_by_root = json.dumps(json.loads(root.stdout)["rows"])
        assert "hunter2" in seen_by_root and "b-tail" in seen_by_root

        # Past the command line's planner: the table itself is refused, the view is B's.
        script = tmp_path / "raw.py"
        script.write_text(RAW)
        script.chmod(0o644)
        shutil.copy(script, b.home / "raw.py")
        for sql, expect in (
                ("SELECT text FROM main.events WHERE kind = 'proc.started'",
                 "REFUSED " + daemon.addr + ": query refused: table main.events is not read "
                 "directly here"),
                ("SELECT count(*) FROM main.events", "REFUSED"),
                ("SELECT text FROM events WHERE kind = 'proc.started'", '[["/bin/sh -c')):
            out = b.run([SYSTEM_PYTHON, "-I", str(b.home / "raw.py"), daemon.addr,
                         str(b.home / "token"), sql],
                        env={"MONARCH_FS_MUNGE_SOCKET": str(munged.socket)})
            assert out.stdout.startswith(expect), (sql, out.stdout, out.stderr)
            assert "hunter2" not in out.stdout

        # A query without a credential is refused, naming why.
        async def unsigned() -> str:
            chan = await connect(daemon.addr, load_token(daemon.token_file))
            async with chan:
                try:
                    await chan.request("query", sql="SELECT text FROM events")
                except RemoteError as e:
                    return str(e)
            return "answered"

        assert "the request carries no MUNGE credential" in trio.run(unsigned)

        # `top` too: B does not see A's running process, nor its argv.
        run = a.popen(["/usr/bin/env", f"MONARCH_FS_MUNGE_SOCKET={munged.socket}",
                       f"MONARCH_FS_TOKEN_FILE={a.home / 'token'}", *CLI, "run", "--hosts",
                       daemon.addr, "--", "/bin/sh", "-c", "sleep 60", "--db-password=hunter2"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def top(user: LocalUser) -> list[dict]:
                out = as_user(user, munged, "top", "--once", "--json", "--interval", "0.2",
                              "--hosts", daemon.addr)
                assert out.returncode == 0, out.stdout + out.stderr
                return json.loads(out.stdout.splitlines()[-1])[0]["procs"]

            wait_for(lambda: top(a), 30, "A's process in A's top")
            assert "hunter2" in top(a)[0]["argv"]
            assert top(b) == []
        finally:
            run.send_signal(signal.SIGINT)
            run.wait(timeout=30)
