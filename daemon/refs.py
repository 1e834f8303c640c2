"""Which versions each workspace serves, persisted so a restarted daemon serves them at once.

The file is replaced atomically (write, fsync, rename, fsync the folder): after a crash it holds
either the old or the new list, never half of one. It is private to the daemon's user (0600).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def check_workspace_name(name: str) -> None:
    raw = name.encode("utf-8", "surrogateescape")
    if not raw or len(raw) > 255 or b"/" in raw or b"\0" in raw or raw.startswith(b"."):
        raise ValueError(f"invalid workspace name {name!r}: must be a plain name, not starting "
                         "with '.', with no '/' or NUL, at most 255 bytes")


class Refs:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.workspaces: dict[str, list[bytes]] = {}  # name -> versions, current first
        if self.path.exists():
            data = json.loads(self.path.read_text())
            self.workspaces = {name: [bytes.fromhex(v) for v in versions]
                               for name, versions in data["workspaces"].items()}

    def publish(self, name: str, version: bytes, keep: int) -> list[bytes]:
        """Make `version` current, keep the `keep` newest, persist; returns the new list."""
        versions = [version] + [v for v in self.workspaces.get(name, []) if v != version]
        self.workspaces[name] = versions[:keep]
        self._save()
        return self.workspaces[name]

    def remove(self, name: str) -> list[bytes]:
        """Forget workspace `name`, persisted; returns the versions it had. If saving fails,
        the list in memory is left as it was."""
        versions = self.workspaces.pop(name)
        try:
            self._save()
        except BaseException:
            self.workspaces[name] = versions
            raise
        return versions

    def _save(self) -> None:
        data = {"workspaces": {n: [v.hex() for v in vs] for n, vs in self.workspaces.items()}}
        tmp = self.path.with_suffix(".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
