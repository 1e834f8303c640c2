"""Whose rights make a workspace's link at its source path (push --at-source), and the folders
made for it, which `rm` removes.

A root daemon must not lend root's rights to whoever asks (issue 33, finding 1: user B pushed
/home/A/.local/lib/python3.11/site-packages from a private mount namespace, and the root
daemon made root-owned folders in A's home and a link there, so A's python ran B's code). So:

- under --identity munge, the link and its folders are made as the workspace's owner, the user
  whose credential pushed it: a child process drops to that user's uid, gid and groups before
  it touches a path, so the kernel refuses what that user could not do (another user's home,
  /root, a folder the user cannot write) and what it makes is that user's, never root's;
- with the shared token only (no identity), a root daemon does not know who asks: it exposes
  a source path only under a --source-prefix its operator chose (none by default), and the
  push's warning says so; the dev box's own folder on its own machine is still left quietly;
- a daemon that is not root acts as itself, for its own user or on the token alone: it makes
  no link for another user whose credential asks, since it would lend its own rights.

The folders made for a link are recorded in STATE/source-folders.json with whose rights made
them; withdrawing the link (rm, a push from elsewhere or with --no-at-source) removes them
too, deepest first, each only while it is empty.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import trio

from ...fs.private_files import replace_file
from . import link_as_user, source_path

log = logging.getLogger("monarch_fs.daemon")

CHILD_TIMEOUT = 30.0  # seconds; a walk of a hung NFS home must not hold the publish lock


def under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


class SourceLinks:
    """Make and withdraw source-path links with the right user's rights (module docstring)."""

    def __init__(self, state: Path, identity: bool, prefixes: tuple[str, ...] = ()) -> None:
        self.path = state / "source-folders.json"
        self.identity = identity  # --identity munge: requests carry who asks
        self.prefixes = prefixes  # --source-prefix: where a root daemon on a token exposes
        # name -> {"uid": whose rights made its folders (None: the daemon's), "folders": [...]}
        self.made: dict[str, dict[str, Any]] = {}
        try:
            data = json.loads(self.path.read_text())
            self.made = {n: r for n, r in data.items()
                         if isinstance(r, dict) and isinstance(r.get("folders"), list)}
        except (OSError, ValueError, AttributeError):
            pass

    def _rights(self, owner: int | None, source: str) -> int | None | str:
        """Whose rights act at `source` for workspace owner `owner`: None (the daemon's own),
        a uid, or why nobody's (a warning)."""
        me = os.geteuid()
        if me != 0 and owner not in (None, me):  # it has no other user's rights to act with
            return (f"this daemon runs as uid {me} and makes links only for its own user, "
                    f"not uid {owner}")
        if me != 0 or owner == 0:
            return None
        if owner is not None:
            return owner
        if self.identity:
            return "nobody known pushed it"
        if under(source, self.prefixes):
            return None
        where = ", ".join(self.prefixes) if self.prefixes else "none set"
        return ("this root daemon has no --identity munge, so it does not know who asks, and "
                f"exposes source paths only under --source-prefix ({where})")

    async def relink(self, name: str, target: str, old: str | None, new: str | None,
                     new_id: str | None, owner: int | None, claimed: list[str]) -> list[str]:
        """Withdraw `name`'s link at `old` if it moved (with the folders made for it), then
        expose it at `new` (`claimed`: the other workspaces pushed from `new`, whose link
        stays). Warnings, never raises."""
        out: list[str | None] = []
        if old is not None and old != new:
            record = self.made.pop(name, None) or {"uid": self._rights(owner, old),
                                                   "folders": []}
            if not isinstance(record["uid"], str):
                out.append(await self._run(record["uid"], {
                    "op": "withdraw", "source": old, "target": target,
                    "folders": record["folders"]}))
        if new is not None:
            rights = self._rights(owner, new)
            if (old == new and self.made.get(name, {}).get("uid", "") == rights
                    and await trio.to_thread.run_sync(source_path.leads_to, new, target)):
                return [w for w in out if w]  # made before, with these rights: no child again
            if isinstance(rights, str):
                out.append(None if _is_source_folder(new, new_id)
                           else f"not exposed at {new}: {rights}")
            else:
                made: list[str] = []
                out.append(await self._run(rights, {
                    "op": "expose", "source": new, "target": target, "source_id": new_id,
                    "claimed": claimed}, made))
                kept = self.made.get(name, {}).get("folders", []) if old == new else []
                self.made[name] = {"uid": rights, "folders": [*kept, *made]}
        await trio.to_thread.run_sync(self._save)
        return [w for w in out if w]

    async def _run(self, uid: int | None, req: dict[str, Any],
                   made: list[str] | None = None) -> str | None:
        """`req` done with the daemon's rights (uid None) or as user `uid`: its warning."""
        if uid is None:
            reply = await trio.to_thread.run_sync(link_as_user.work, req)
        else:
            try:
                user = pwd.getpwuid(uid)
            except KeyError:
                return f"not exposed at {req['source']}: uid {uid} has no account on this node"
            req = {**req, "uid": uid, "gid": user.pw_gid,
                   "groups": os.getgrouplist(user.pw_name, user.pw_gid)}
            reply = await self._child(req)
        if made is not None:
            made.extend(reply.get("made", []))
        warning = reply.get("warning")
        return warning if isinstance(warning, str) else None

    async def _child(self, req: dict[str, Any]) -> dict[str, Any]:
        """`req` done by a child process that becomes user req["uid"] first (link_as_user.py;
        started as root so that it can load this package wherever it is installed, even in a
        folder that user cannot read)."""
        what = "not exposed at" if req["op"] == "expose" else "link not removed at"
        argv = [sys.executable, "-I", "-m", link_as_user.__name__]
        try:
            with trio.fail_after(CHILD_TIMEOUT):
                done = await trio.run_process(argv, stdin=json.dumps(req).encode(),
                                              capture_stdout=True, capture_stderr=True,
                                              check=False, env={"LANG": "C.UTF-8"}, cwd="/")
        except (OSError, trio.TooSlowError) as e:
            return {"warning": f"{what} {req['source']}: acting as uid {req['uid']}: {e}"}
        try:
            reply = json.loads(done.stdout)
            if done.returncode == 0 and isinstance(reply, dict):
                return reply
        except ValueError:
            pass
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"warning": f"{what} {req['source']}: acting as uid {req['uid']}: exited "
                           f"{done.returncode}: {tail[0]}"}

    def _save(self) -> None:
        try:
            replace_file(self.path, json.dumps(self.made, indent=1).encode(),
                         self.path.with_suffix(".tmp"))
        except OSError as e:  # only `rm`'s clean-up of folders depends on it
            log.warning("cannot save %s: %s", self.path, e.strerror or e)


def _is_source_folder(source: str, source_id: str | None) -> bool:
    """Whether `source` is the dev box's folder itself (a node on the dev box's machine),
    where the scripts resolve already: nothing to make, nothing to warn about."""
    try:
        st = os.stat(source)
    except OSError:
        return False
    return source_id == f"{st.st_dev}:{st.st_ino}"
