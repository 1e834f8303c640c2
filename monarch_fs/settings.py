"""Every MONARCH_FS_* setting the environment can give, read in this one place.

`settings` reads `os.environ` each time a field is used, never at import time: a variable set
after import (a test's monkeypatch, a child's environment) is what counts, and a malformed value
fails where it is used, naming the variable, not whatever happens to import this module first.
A variable set to the empty string counts as unset. The docs' settings table
(docs/reference/settings.md) is generated from these properties: each docstring starts
"MONARCH_FS_NAME (default): what it does", under the `# ---- who reads it ----` section.

It sits at the package top so every layer can import it (fs/ must not import daemon/ or mesh/).
Variables the code only *gives* to child processes (MONARCH_FS_MOUNT, MONARCH_FS_WORKSPACE,
MONARCH_FS_SECRETS_FD, MONARCH_FS_TRANSPORT, MONARCH_MESH_*) are part of the process protocol,
not settings: daemon/node/procs.py, mesh/proc_mesh.py and mesh/runtime.py own them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .fs.entry import DEFAULT_MAX_ENTRIES

# The defaults of the settings below, owned here so that the modules they configure import them
# from this one leaf (settings imports no module that imports it back).
DURABLE_MODES = ("background", "sync")  # the first is the default
STORE_FILL_MODES = ("background", "inline", "off")  # the first is the default
FLUSH_DELAY = 1.0  # seconds after the last publish before a background flush
EVENTS_INTERVAL = 2.0  # seconds between event writes (and the length of a `reads` row)
EVENTS_MAX_BYTES = 256 << 20
EVENTS_MAX_AGE = 30 * 86400.0
RDMA_SLOTS = 16
RDMA_SLOT_SIZE = 1 << 20


class Settings:
    """The environment's settings, one typed property per variable, with the defaults above (a
    store's pack size is the store's own, read from fs/store.py when the field is used)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def _str(self, name: str) -> str | None:
        return self._environ.get(name) or None

    def _int(self, name: str, default: int) -> int:
        raw = self._str(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"${name}={raw!r}: expected an integer") from None

    def _seconds(self, name: str, default: float, low: float, high: float) -> float:
        raw = self._str(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"${name}={raw!r}: expected seconds") from None
        if not low <= value <= high:
            raise ValueError(f"${name}={raw!r}: expected {low:g} to {high:g} s")
        return value

    def _switch(self, name: str) -> bool:
        """On unless set to "0": the switches exist to turn a default off, to compare or debug."""
        return self._str(name) != "0"

    # ---- clients and daemons ------------------------------------------------------------------

    @property
    def home(self) -> Path:
        """MONARCH_FS_HOME (~/.monarch-fs): the local cluster (`cluster/`: its token, hosts
        file and nodes), push's scan caches (`scan-cache/`) and the dev box store (`store/`)."""
        return Path(self._str("MONARCH_FS_HOME") or "~/.monarch-fs").expanduser()

    @property
    def store_dir(self) -> Path:
        """MONARCH_FS_STORE: the dev box's store of what push sent (default HOME/store), from
        which later pushes of unchanged content send without reading the source."""
        raw = self._str("MONARCH_FS_STORE")
        return Path(raw).expanduser() if raw else self.home / "store"

    @property
    def store_bound(self) -> int:
        """MONARCH_FS_STORE_MIB (20480, i.e. 20 GiB), in bytes: the dev box store's size bound;
        after a push over it, the least recently pushed snapshots are dropped (never the one
        just pushed). 0 keeps only the snapshot just pushed."""
        # (a torch venv is ~0.5 GiB in the store: the default holds some 40 of them)
        return max(0, self._int("MONARCH_FS_STORE_MIB", 20480)) << 20

    @property
    def store_fill(self) -> str:
        """MONARCH_FS_STORE_FILL (background): how a push fills the dev box store with the
        chunks it lacks after the publish (those that went raw to the nodes and compress):
        `background` in a process of lowest CPU priority that the push starts and does not
        wait for, `inline` before the push returns (at most as long again as the push took),
        `off` not at all (a later push reads them from the source)."""
        raw = self._str("MONARCH_FS_STORE_FILL") or STORE_FILL_MODES[0]
        if raw not in STORE_FILL_MODES:
            expected = ", ".join(STORE_FILL_MODES)
            raise ValueError(f"$MONARCH_FS_STORE_FILL={raw!r}: expected one of {expected}")
        return raw

    @property
    def token_file(self) -> str | None:
        """MONARCH_FS_TOKEN_FILE: the cluster token when no --token-file is given; without
        either, HOME/cluster/token."""
        return self._str("MONARCH_FS_TOKEN_FILE")

    @property
    def hosts(self) -> str | None:
        """MONARCH_FS_HOSTS: `host:port,...` or `@hostfile` when no --hosts is given; without
        either, the local cluster's hosts file."""
        return self._str("MONARCH_FS_HOSTS")

    @property
    def munge_socket(self) -> str | None:
        """MONARCH_FS_MUNGE_SOCKET: munged's socket, for the credentials a client makes and a
        daemon with --identity munge checks when no --munge-socket is given (default
        libmunge's /run/munge/munge.socket.2)."""
        return self._str("MONARCH_FS_MUNGE_SOCKET")

    # ---- the daemon ---------------------------------------------------------------------------

    @property
    def max_entries(self) -> int:
        """MONARCH_FS_MAX_ENTRIES (500,000): the largest snapshot, in entries, a daemon accepts
        when no --max-entries is given."""
        return self._int("MONARCH_FS_MAX_ENTRIES", DEFAULT_MAX_ENTRIES)

    @property
    def durable(self) -> str:
        """MONARCH_FS_DURABLE (background): a daemon's --durable when none is given:
        `background` publishes a version once its chunks are written and flushes them after,
        `sync` flushes before every publish (docs: what is durable when)."""
        raw = self._str("MONARCH_FS_DURABLE") or DURABLE_MODES[0]
        if raw not in DURABLE_MODES:
            expected = ", ".join(DURABLE_MODES)
            raise ValueError(f"$MONARCH_FS_DURABLE={raw!r}: expected one of {expected}")
        return raw

    @property
    def flush_delay(self) -> float:
        """MONARCH_FS_FLUSH_SECONDS (1), seconds: with `daemon --durable background`, how long
        after the last publish a daemon flushes its store to disk (what a power cut before
        then takes is found at the next start, and the last whole version served)."""
        return self._seconds("MONARCH_FS_FLUSH_SECONDS", FLUSH_DELAY, 0, 86400)

    @property
    def pack_limit(self) -> int:
        """MONARCH_FS_PACK_MIB (256), in bytes (at least 1 MiB): the size of a store's pack
        files. A pack is deleted once nothing in it is used, so smaller packs give space back
        sooner, in more files."""
        from .fs.store import PACK_LIMIT

        return max(1, self._int("MONARCH_FS_PACK_MIB", PACK_LIMIT >> 20)) << 20

    @property
    def no_open(self) -> bool:
        """MONARCH_FS_NO_OPEN (on): "0" answers open and opendir as a stock pyfuse3 does, one
        round trip each, instead of ENOSYS (FUSE no-open)."""
        return self._switch("MONARCH_FS_NO_OPEN")

    @property
    def passthrough(self) -> bool:
        """MONARCH_FS_PASSTHROUGH (on): "0" serves every file through the daemon instead of
        binding large ones to backing files the kernel reads directly."""
        return self._switch("MONARCH_FS_PASSTHROUGH")

    @property
    def events(self) -> bool:
        """MONARCH_FS_EVENTS (on): "0" records no telemetry on a daemon (no STATE/events.db;
        `query` is refused there), to compare the read path's cost with and without it."""
        return self._switch("MONARCH_FS_EVENTS")

    @property
    def events_bound(self) -> int:
        """MONARCH_FS_EVENTS_MIB (256), in bytes (at least 1 MiB): the size a daemon's events
        database is kept under; past it, its oldest rows go."""
        return max(1, self._int("MONARCH_FS_EVENTS_MIB", EVENTS_MAX_BYTES >> 20)) << 20

    @property
    def events_max_age(self) -> float:
        """MONARCH_FS_EVENTS_DAYS (30), in seconds: events older than that are deleted."""
        return max(1, self._int("MONARCH_FS_EVENTS_DAYS", int(EVENTS_MAX_AGE // 86400))) * 86400.0

    @property
    def events_interval(self) -> float:
        """MONARCH_FS_EVENTS_INTERVAL (2), seconds: how often a daemon writes its events and
        one `reads` row of its read counters."""
        return self._seconds("MONARCH_FS_EVENTS_INTERVAL", EVENTS_INTERVAL, 0.05, 3600)

    # ---- RDMA (daemons and push) --------------------------------------------------------------

    @property
    def rdma_device(self) -> str | None:
        """MONARCH_FS_RDMA_DEVICE: use only the RDMA device of this name (default: any)."""
        return self._str("MONARCH_FS_RDMA_DEVICE")

    @property
    def rdma_gid_index(self) -> int | None:
        """MONARCH_FS_RDMA_GID_INDEX: the GID table entry to use (default: 0, or the best RoCE
        v2 entry on RoCE)."""
        raw = self._str("MONARCH_FS_RDMA_GID_INDEX")
        return None if raw is None else self._int("MONARCH_FS_RDMA_GID_INDEX", 0)

    @property
    def rdma_slots(self) -> int:
        """MONARCH_FS_RDMA_SLOTS (16): buffers in the ring a sender proposes."""
        return self._int("MONARCH_FS_RDMA_SLOTS", RDMA_SLOTS)

    @property
    def rdma_slot_size(self) -> int:
        """MONARCH_FS_RDMA_SLOT_SIZE (1 MiB), in bytes: the size of each of those buffers."""
        return self._int("MONARCH_FS_RDMA_SLOT_SIZE", RDMA_SLOT_SIZE)


settings = Settings()
