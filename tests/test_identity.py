"""--identity munge: a root daemon runs each process as the user whose MUNGE credential asks,
and a workspace belongs to who pushed it. Real munged (a key of the test's own, and a second
munged with another key to forge), a real root daemon and mount, two local users whose clients
run as them (tests/users.py). Every refusal names its cause: missing, expired, replayed,
forged, made for another request, or root's."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from munge import Munged
from users import CLI, LocalUser

from helpers import Daemon, start_daemon, stop_daemon, wait_for
from monarch_fs.daemon.wire import identity
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.replies import FanReply
from monarch_fs.daemon.wire.transport import RemoteError, connect

pytestmark = [
    pytest.mark.mount, pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged")
                       or not shutil.which("useradd"),
                       reason="needs root, munged (package munge) and useradd"),
]

PROBE = ("import json, os; print('IDENT ' + json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
         "'groups': sorted(os.getgroups()), 'cwd': os.getcwd(), 'env': dict(os.environ)}))")


@contextmanager
def munge_nodes(tmp_path: Path, count: int):
    """munged, a forger's munged (another key), `count` root daemons with --identity munge
    sharing one token, and users A and B with that token in their homes."""
    # pytest's folders are root's alone (0700): the users' munge must reach the socket
    base = Path(tempfile.mkdtemp(prefix="mfs-munge-"))
    base.chmod(0o711)
    munged = Munged(base / "munge")
    forger = Munged(base / "forger")
    users: list[LocalUser] = []
    daemons: list[Daemon] = []
    try:
        users = [LocalUser("ident"), LocalUser("ident")]
        for i in range(count):
            daemons.append(start_daemon(
                tmp_path / f"node{i or ''}", "--identity", "munge", "--munge-socket",
                str(munged.socket), env={"DAEMON_ONLY_VARIABLE": "leak"},
                token=Path(daemons[0].token_file) if daemons else None))
        for user in users:
            shutil.copy(daemons[0].token_file, user.home / "token")
            os.chown(user.home / "token", user.pw.pw_uid, user.pw.pw_gid)
        yield daemons, munged, forger, users
    finally:
        for daemon in daemons:
            stop_daemon(daemon)
        for user in users:
            user.close()
        forger.close()
        munged.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def node(tmp_path):
    """One such daemon (munge_nodes)."""
    with munge_nodes(tmp_path, 1) as (daemons, munged, forger, users):
        yield daemons[0], munged, forger, users


def as_user(user: LocalUser, munged: Munged, *args: str, timeout: float = 120):
    return user.run([*CLI, *args], timeout=timeout,
                    env={"MONARCH_FS_MUNGE_SOCKET": str(munged.socket),
                         "MONARCH_FS_TOKEN_FILE": str(user.home / "token")})


def make_envs(a: LocalUser, b: LocalUser) -> None:
    """A folder `env` in each user's home, theirs, whose file `who` says whose it is."""
    for user, text in ((a, "from A\n"), (b, "from B\n")):
        src = user.home / "env"
        src.mkdir()
        (src / "who").write_text(text)
        os.chown(src, user.pw.pw_uid, user.pw.pw_gid)
        os.chown(src / "who", user.pw.pw_uid, user.pw.pw_gid)


def test_a_process_runs_as_the_user_who_asks(node):
    daemon, munged, _, (a, _b) = node
    out = as_user(a, munged, "run", "--hosts", daemon.addr, "--", "/usr/bin/python3", "-c",
                  PROBE)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "IDENT " in x)
    seen = json.loads(line.split("IDENT ", 1)[1])
    assert (seen["uid"], seen["gid"]) == (a.pw.pw_uid, a.pw.pw_gid)
    assert seen["groups"] == sorted(os.getgrouplist(a.name, a.pw.pw_gid))
    assert seen["cwd"] == str(a.home)
    env = seen["env"]
    assert env["HOME"] == str(a.home) and env["USER"] == a.name
    assert "DAEMON_ONLY_VARIABLE" not in env and "MONARCH_FS_MUNGE_SOCKET" not in env
    assert f"as {a.name}" in daemon.log()


def test_another_user_cannot_replace_or_remove_a_workspace(node, tmp_path):
    daemon, munged, _, (a, b) = node
    make_envs(a, b)
    out = as_user(a, munged, "push", str(a.home / "env"), "--hosts", daemon.addr)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: (daemon.mnt / "env" / "who").exists(), what="A's push served")
    # A's push with no change is settled by asking (a credential: is it A's?), not published.
    out = as_user(a, munged, "push", str(a.home / "env"), "--hosts", daemon.addr, "--json")
    assert out.returncode == 0, out.stderr
    assert not {"negotiate", "publish"} & set(json.loads(out.stdout)["phases"]), out.stdout

    out = as_user(b, munged, "push", str(b.home / "env"), "--hosts", daemon.addr)
    assert out.returncode != 0
    assert f"belongs to {a.name} (uid {a.pw.pw_uid})" in out.stderr, out.stderr
    assert f"{b.name} (uid {b.pw.pw_uid}) cannot replace it" in out.stderr, out.stderr
    assert (daemon.mnt / "env" / "who").read_text() == "from A\n"

    out = as_user(b, munged, "rm", "env", "--hosts", daemon.addr)
    assert out.returncode == 1 and "cannot remove it" in out.stdout + out.stderr, out
    assert (daemon.mnt / "env" / "who").read_text() == "from A\n"

    out = as_user(a, munged, "status", "--hosts", daemon.addr)
    assert out.returncode == 0, out.stderr
    assert f"by {a.name} (uid {a.pw.pw_uid})" in out.stdout, out.stdout
    assert "processes as the user who asks (munge credentials; root refused)" in out.stdout
    refs = json.loads((daemon.dir / "state" / "refs.json").read_text())
    assert refs["owners"] == {"env": a.pw.pw_uid}

    out = as_user(a, munged, "rm", "env", "--hosts", daemon.addr)  # its owner may
    assert out.returncode == 0, out.stdout + out.stderr


def test_bad_credentials_are_refused_with_their_cause(node, monkeypatch):
    daemon, munged, forger, _ = node
    monkeypatch.setenv("MONARCH_FS_MUNGE_SOCKET", str(munged.socket))
    spec = {"argv": ["/bin/true"]}

    async def refusal(chan, args) -> str:
        with pytest.raises(RemoteError) as e:
            await chan.request("spawn", **args)
        return e.value.message

    async def main() -> None:
        token = load_token(daemon.token_file)
        async with await connect(daemon.addr, token) as chan:
            assert chan.info["identity"] == "munge"
            assert "carries no MUNGE credential" in await refusal(chan, spec)

            # root's own credential: valid, but no process as root without --allow-root-procs
            signed = await identity.sign(chan, "spawn", spec)
            why = await refusal(chan, signed)
            assert "root's (uid 0)" in why and "--allow-root-procs" in why, why
            # the very same credential again: munged has seen it
            assert "replayed" in await refusal(chan, signed)

            # another request's credential
            other = await identity.sign(chan, "spawn", {"argv": ["/bin/false"]})
            assert "payload mismatch" in await refusal(chan, {**spec, "cred": other["cred"]})

            # made with another key
            text = identity.payload("spawn", spec, identity.session_id(chan))
            forged = forger.munge("-s", text).stdout.decode().strip()
            why = await refusal(chan, {**spec, "cred": forged})
            assert "invalid" in why and "another key" in why, why

            # past its time to live
            short = await identity.sign(chan, "spawn", spec, ttl=1)
            await trio.sleep(2.5)
            assert "expired" in await refusal(chan, short)

        # a credential from another connection does not carry over
        async with await connect(daemon.addr, token) as first:
            lifted = await identity.sign(first, "spawn", spec)
        async with await connect(daemon.addr, token) as second:
            assert "payload mismatch" in await refusal(second, lifted)

    trio.run(main)
    assert wait_for(lambda: daemon.proc.poll() is None, what="daemon alive") >= 0


def test_a_daemon_without_munged_says_so_in_one_line(tmp_path):
    from helpers import mfs
    from monarch_fs.daemon.wire.auth import write_new_token

    write_new_token(tmp_path / "token")
    out = mfs("daemon", "--listen", "127.0.0.1:0", "--mount", str(tmp_path / "mnt"),
              "--state", str(tmp_path / "state"), "--token-file", str(tmp_path / "token"),
              "--identity", "munge", "--munge-socket", str(tmp_path / "nope"), check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert f"no munged socket at {tmp_path / 'nope'}" in lines[0]
    assert not (tmp_path / "state").exists()


def test_a_push_down_the_control_tree_acts_as_who_asks_on_every_node(tmp_path, monkeypatch):
    """push --control tree: the dev box signs each request once for the tree (bound to a
    nonce, not a connection it does not hold), and every node, reached through the others,
    checks who asks: A's workspace is A's on all three, and B's push is refused on each."""
    with munge_nodes(tmp_path, 3) as (daemons, munged, _, (a, b)):
        hosts = ",".join(d.addr for d in daemons)  # a chain: 0 asks 1, 1 asks 2
        tree = ("--hosts", hosts, "--control", "tree", "--control-fanout", "1")
        make_envs(a, b)
        out = as_user(a, munged, "push", str(a.home / "env"), *tree, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["nodes"] == 3
        for d in daemons:
            assert (d.mnt / "env" / "who").read_text() == "from A\n"
            refs = json.loads((d.dir / "state" / "refs.json").read_text())
            assert refs["owners"] == {"env": a.pw.pw_uid}

        out = as_user(b, munged, "push", str(b.home / "env"), *tree)
        assert out.returncode != 0
        for d in daemons:  # each node checked B's credential itself
            assert f"{d.addr}: " in out.stderr, out.stderr
            assert (d.mnt / "env" / "who").read_text() == "from A\n"
        assert out.stderr.count(f"{b.name} (uid {b.pw.pw_uid}) cannot replace it") == 3

        # A request of the control tree is acted on once per daemon (munged's own replay
        # cache is shared by the three here), and only with the scope it was made for.
        monkeypatch.setenv("MONARCH_FS_MUNGE_SOCKET", str(munged.socket))
        leaf = daemons[2]
        args = {"name": "env", "version": "00" * 16}

        async def fan(chan, signed: dict, scope: str) -> FanReply:
            return FanReply.from_wire(await chan.request("fan", request="current",
                                                         args=signed, scope=scope))

        async def main() -> None:
            async with await connect(leaf.addr, load_token(leaf.token_file)) as chan:
                scope = secrets.token_hex(16)
                signed = await identity.sign(chan, "current", args, scope=scope)
                first = await fan(chan, signed, scope)
                # (the workspace is A's: what it serves is not said to another)
                assert first.replies[""] == {"current": False, "serving": None}
                assert not first.failed
                again = await fan(chan, signed, scope)
                assert "already acted on" in again.failed[""], again
                other = await fan(chan, signed, secrets.token_hex(16))
                assert "payload mismatch" in other.failed[""], other

        trio.run(main)
