"""Source-path links act with the rights of the user who pushed, never root's (issue 33,
finding 1; daemon/node/source_links.py).

A real root daemon with --identity munge and a real munged (test_identity.munge_nodes), two
local users made for the test (tests/users.py: useradd, deleted after). User B pushes from a
private mount namespace (`unshare -Urm`, a tmpfs over A's home or /root), so B's dev box has
folders there that the node's real ones do not: the daemon used to make them, root-owned, and a
link to B's workspace inside A's home, so that A's next python ran B's .pth file as A."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import stat
from pathlib import Path

import pytest
from munge import Munged
from test_identity import munge_nodes
from users import CLI, LocalUser

pytestmark = [
    pytest.mark.mount, pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged")
                       or not shutil.which("useradd") or not shutil.which("unshare"),
                       reason="needs root, munged (package munge), useradd and unshare"),
]

EVIL = "import os; os.environ['PWNED'] = '1'\n"


def push_from_private_view(user: LocalUser, munged: Munged, hide: Path, src: Path,
                           addr: str, *args: str):
    """As `user`, in a mount namespace of its own with an empty tmpfs over `hide`: make `src`
    (a folder holding a .pth file) and push it, so the node sees a path that exists only in
    that user's view. Its token is copied beside its home, which `hide` may cover."""
    token = user.base / "token"
    if not token.exists():
        shutil.copy(user.home / "token", token)
        os.chown(token, user.pw.pw_uid, user.pw.pw_gid)
    script = (f"mount -t tmpfs none {shlex.quote(str(hide))} && "
              f"mkdir -p {shlex.quote(str(src))} && "
              f"printf %s {shlex.quote(EVIL)} > {shlex.quote(str(src / 'evil.pth'))} && "
              f"exec {shlex.join([*CLI, 'push', str(src), '--hosts', addr, *args])}")
    return user.run(["unshare", "-Urm", "sh", "-c", script], timeout=120,
                    env={"MONARCH_FS_MUNGE_SOCKET": str(munged.socket),
                         "MONARCH_FS_TOKEN_FILE": str(token)})


def test_a_user_cannot_plant_a_link_in_another_users_home_or_in_root(tmp_path):
    with munge_nodes(tmp_path, 1) as ([daemon], munged, _, (a, b)):
        site = a.home / ".local" / "lib" / "python3.11" / "site-packages"
        out = push_from_private_view(b, munged, a.home, site, daemon.addr)
        assert out.returncode == 0, out.stderr  # published; the link is a warning
        assert f"not exposed at {site}: Permission denied" in out.stderr, out.stderr
        assert not os.path.lexists(a.home / ".local")  # no root-owned folder, no link
        assert (daemon.mnt / "site-packages" / "evil.pth").read_text() == EVIL

        secret = Path("/root") / f"mfs-{secrets.token_hex(4)}"
        out = push_from_private_view(b, munged, Path("/root"), secret / "env", daemon.addr,
                                     "--name", "rootenv")
        assert out.returncode == 0, out.stderr
        assert f"not exposed at {secret / 'env'}: Permission denied" in out.stderr, out.stderr
        assert not os.path.lexists(secret)


def test_a_users_own_link_and_folders_are_theirs_and_rm_removes_them(tmp_path):
    with munge_nodes(tmp_path, 1) as ([daemon], munged, _, (a, _b)):
        work = a.home / "work"  # on the node, A's home has no work/ yet
        src = work / "env"
        out = push_from_private_view(a, munged, a.home, src, daemon.addr)
        assert out.returncode == 0, out.stderr
        assert "not exposed" not in out.stderr, out.stderr
        assert os.readlink(src) == str(daemon.mnt / "env")
        for made in (work, src):
            st = os.lstat(made)
            assert (st.st_uid, st.st_gid) == (a.pw.pw_uid, a.pw.pw_gid), made
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o755

        out = a.run([*CLI, "rm", "env", "--hosts", daemon.addr],
                    env={"MONARCH_FS_MUNGE_SOCKET": str(munged.socket),
                         "MONARCH_FS_TOKEN_FILE": str(a.home / "token")})
        assert out.returncode == 0, out.stdout + out.stderr
        assert not os.path.lexists(work)  # what the push made, rm removed
