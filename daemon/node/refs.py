"""Which versions each workspace serves, persisted so a restarted daemon serves them at once.

The file is replaced atomically (write, fsync, rename, fsync the folder): after a crash it holds
either the old or the new list, never half of one. A publish saves first and changes the list in
memory only once the save succeeded, so a failed save (a full disk) leaves no trace: what
`status` reports, what the mount serves and what a restart serves stay the last good list. It
is private to the daemon's user (0600).
"""

from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path

import trio

from ...fs.private_files import fsync_dir, replace_file
from ..wire.requests import check_source_path, check_workspace_name


def describe_user(uid: int) -> str:
    """User `uid` as this node names it: "alice (uid 1001)", or "uid 1001"."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class Refs:
    """The workspaces a node serves, as saved in refs.json (see the module docstring): kept
    apart from the mount so a restart serves the same versions, and so a failed save changes
    nothing anywhere."""

    def __init__(self, path: str | os.PathLike[str]):
        """Load the saved list. What cannot be loaded (a damaged file, a bad name or version)
        is left out and described in `problems`, never fatal: the rest is served. A file that
        cannot be parsed at all is renamed aside, so the next save does not destroy it."""
        self.path = Path(path)
        self.workspaces: dict[str, list[bytes]] = {}  # name -> versions, current first
        # Workspaces the daemon could not serve at start (see `hold`): kept in the file until
        # that name is published again, so a fault that is fixed loses nothing.
        self.held: dict[str, list[bytes]] = {}
        # name -> the absolute path it was pushed from, where the node exposes it too
        # (push --at-source, source_path.py); saved as "sources" beside "workspaces".
        self.sources: dict[str, str] = {}
        # name -> the uid of the user who pushed it (--identity munge), who alone may replace
        # or remove it; saved as "owners". A workspace pushed without identity has none.
        self.owners: dict[str, int] = {}
        # name -> its retained versions that were published early (push --early) and may lack
        # chunks (daemon/node/incomplete.py); saved as "early", in the same write as the publish
        # that made them current, so that no restart takes one for a whole version.
        self.early: dict[str, list[bytes]] = {}
        self.problems: list[str] = []
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as e:
            self._set_aside(f"cannot be read ({e})")
            return
        try:
            data = json.loads(text)
            saved = data["workspaces"]
            if not isinstance(saved, dict):
                raise TypeError("'workspaces' is not an object")
        except (ValueError, KeyError, TypeError) as e:
            self._set_aside(f"is damaged ({type(e).__name__}: {e})")
            return
        for name, versions in saved.items():
            try:
                check_workspace_name(name)
                if not isinstance(versions, list) or not versions:
                    raise ValueError("no list of versions")
                self.workspaces[name] = [bytes.fromhex(v) for v in versions]
            except (ValueError, TypeError) as e:
                self.problems.append(f"{self.path}: workspace {ascii(name)} not served: {e}")
        sources = data.get("sources", {})
        for name, source in (sources.items() if isinstance(sources, dict) else ()):
            try:
                check_source_path(source)
            except ValueError as e:
                self.problems.append(f"{self.path}: workspace {ascii(name)}: {e}; its link "
                                     "there is not managed any more")
                continue
            if name in self.workspaces:
                self.sources[name] = source
        owners = data.get("owners", {})
        for name, uid in (owners.items() if isinstance(owners, dict) else ()):
            if name in self.workspaces or name in self.held:
                if isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0:
                    self.owners[name] = uid
                else:
                    self.problems.append(f"{self.path}: workspace {ascii(name)}: owner {uid!r} "
                                         "is not a uid; anyone may replace it")
        early = data.get("early", {})
        for name, versions in (early.items() if isinstance(early, dict) else ()):
            known = self.workspaces.get(name) or self.held.get(name) or []
            try:
                self.early[name] = [v for v in map(bytes.fromhex, versions) if v in known]
            except (ValueError, TypeError):  # which versions are whole is unknown: none is
                self.problems.append(f"{self.path}: workspace {ascii(name)}: its early versions "
                                     "are unreadable; every version of it is taken as incomplete")
                self.early[name] = list(known)

    def _set_aside(self, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            os.rename(self.path, aside)
            kept = f"kept as {aside.name}"
        except OSError as e:
            kept = f"and could not be set aside: {e}"
        self.problems.append(f"{self.path} {why}; no workspace served from it, {kept}")

    def hold(self, name: str) -> None:
        """Stop serving `name` (its current version cannot be loaded) but keep it on disk."""
        self.held[name] = self.workspaces.pop(name)

    def claimed_by(self, source: str) -> list[str]:
        """The workspaces pushed from `source` (exposed there, or asked to be)."""
        return sorted(n for n, s in self.sources.items() if s == source)

    def next_versions(self, name: str, version: bytes, keep: int) -> list[bytes]:
        """What `name` serves once `version` is published: it first, the `keep` newest."""
        return ([version] + [v for v in self.workspaces.get(name, []) if v != version])[:keep]

    def check_owner(self, name: str, uid: int | None, doing: str) -> None:
        """Refuse (ValueError, for the client) user `uid` `doing` workspace `name` that another
        user pushed; None (no identity) is not checked."""
        owner = self.owners.get(name)
        if uid is None or owner is None or owner == uid:
            return
        raise ValueError(f"workspace {name!r} belongs to {describe_user(owner)}, who pushed it: "
                         f"{describe_user(uid)} cannot {doing} it; push under another name "
                         "(--name)")

    async def publish(self, name: str, versions: list[bytes], source: str | None = None,
                      owner: int | None = None, early: list[bytes] | None = None) -> None:
        """Save `versions` for `name` (pushed from `source`, None: not exposed there; by user
        `owner`, None: no identity; `early`: those of them that may lack chunks), then take
        them in memory. Raises OSError, changing nothing, if the save fails."""
        new = {**self.workspaces, name: versions}
        incomplete = {n: vs for n, vs in self.early.items() if n != name}
        if early:
            incomplete[name] = [v for v in early if v in versions]
        held = {n: vs for n, vs in self.held.items() if n != name}
        sources = {n: s for n, s in self.sources.items() if n != name}
        if source is not None:
            sources[name] = source
        owners = {n: u for n, u in self.owners.items() if n != name}
        if owner is not None:
            owners[name] = owner
        with trio.CancelScope(shield=True):  # memory follows the disk, even when cancelled
            await self._save_in_thread({**held, **new}, sources, owners, incomplete)
            self.workspaces, self.held, self.sources, self.owners = new, held, sources, owners
            self.early = incomplete

    async def remove(self, name: str) -> list[bytes]:
        """Forget workspace `name`, persisted; returns the versions it had. Raises KeyError for
        a name it does not serve, OSError (changing nothing) if the save fails."""
        versions = self.workspaces[name]
        rest = {n: vs for n, vs in self.workspaces.items() if n != name}
        sources = {n: s for n, s in self.sources.items() if n != name}
        owners = {n: u for n, u in self.owners.items() if n != name}
        early = {n: vs for n, vs in self.early.items() if n != name}
        with trio.CancelScope(shield=True):
            await self._save_in_thread({**self.held, **rest}, sources, owners, early)
            self.workspaces, self.sources, self.owners, self.early = rest, sources, owners, early
        return versions

    async def _save_in_thread(self, workspaces: dict[str, list[bytes]],
                              sources: dict[str, str], owners: dict[str, int],
                              early: dict[str, list[bytes]]) -> None:
        """The save fsyncs the file and its folder: off the trio thread, which also answers
        FUSE requests. The callers (a commit, a removal) hold the daemon's publish lock, so
        nothing changes this object meanwhile; memory is changed back on the trio thread."""
        await trio.to_thread.run_sync(self._save, workspaces, sources, owners, early)

    def _save(self, workspaces: dict[str, list[bytes]], sources: dict[str, str],
              owners: dict[str, int], early: dict[str, list[bytes]]) -> None:
        self._write(workspaces, sources, owners, early)
        try:
            fsync_dir(self.path.parent)
        except OSError:
            # The new list is in place but may not survive a crash: put the old one back (best
            # effort), so the disk does not keep a commit that reported failure.
            try:
                self._write({**self.held, **self.workspaces}, self.sources, self.owners,
                            self.early)
            except OSError:
                pass
            raise

    def _write(self, workspaces: dict[str, list[bytes]], sources: dict[str, str],
               owners: dict[str, int], early: dict[str, list[bytes]]) -> None:
        """Replace the file by one holding `workspaces`; on failure the old file stays."""
        data: dict[str, dict] = {
            "workspaces": {n: [v.hex() for v in vs] for n, vs in workspaces.items()}}
        if sources:
            data["sources"] = sources
        if owners:
            data["owners"] = owners
        if any(early.values()):
            data["early"] = {n: [v.hex() for v in vs] for n, vs in early.items() if vs}
        replace_file(self.path, json.dumps(data, indent=1).encode(),
                     self.path.with_suffix(".tmp"), fsync=True)
