"""`monarch-fs repro [JOB] --rank R`: run one rank of a job again on the dev box, as it ran on
the cluster.

What the node recorded when it started the rank (its `proc.started` event: daemon/node/
launches.py) says the command and working folder as asked, the environment the request set
(RANK and the torchrun variables, `run --env`; names that look like secrets were never
written down), and the workspace version it was pinned to. That version is written into a
temporary folder, file by file, each chunk checked against its id, from the first place that
has it: the dev box store (controller_store.py), the folder it was pushed from (its files as
they are now, a chunk taken only when its id matches), or the node that ran it (a
`read_chunks` request: wire/chunk_read.py). The command then runs there with `{workspace}` and
`{mount}` pointing at the copy, the rank's environment on top of this machine's PATH, HOME
and locale (what a node gives every process, process_start.base_env), and MASTER_ADDR
and MASTER_PORT pointing here. repro says what differs from the cluster run and exits as the
process does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import trio

from ...fs.chunk import CorruptChunk, chunk_id, decode, spans
from ...fs.manifest import Kind, Manifest
from ...fs.store import Store, StoreBusy
from ..wire import identity
from ..wire.chunk_read import ChunksReply, ReadChunks
from ..wire.protocol import ProtocolError
from ..wire.transport import Channel, ConnectError, ConnectionLost, RemoteError, connect
from .query import query

# What a node passes a process of its own environment (process_start.BASE_ENV, and LC_*), and the
# user's identity, taken here from this machine's.
LOCAL_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "HOME", "USER", "LOGNAME",
             "SHELL")
PYTHON = re.compile(r"python[0-9.]*")  # what --pdb can run under pdb


class ReproError(ValueError):
    """The rank cannot be run again here; the message says why."""


@dataclass
class Launch:
    """What a node recorded of one rank's start, and how that process ended."""

    host: str  # the node's address in the host list
    node: str  # its name
    job: str
    rank: int
    workspace: str | None
    record: dict[str, Any]  # launches.launch_record
    cwd_there: str | None  # the working folder on the node, expanded
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT: which attempt of `run --max-restarts`
    code: int | None = None
    signal: str | None = None
    stopped: str = ""  # why the node stopped it, if it did (another rank failed...)

    def ended(self) -> str:
        if self.signal:
            return f"killed by {self.signal}"
        return f"exit code {self.code}" if self.code is not None else "still running"


@dataclass
class Written:
    """A version written into a folder: how many files came from where."""

    root: Path
    sources: dict[str, int] = field(default_factory=dict)


def _one(result: Any, what: str) -> list[dict[str, Any]]:
    if result.failed and not result.rows:
        raise ReproError(f"cannot ask the nodes for {what}: " + "; ".join(
            f"{h}: {e}" for h, e in result.failed.items()))
    return [dict(zip(result.columns, r)) for r in result.rows]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


async def find_launches(hosts: Sequence[str], token: bytes, job: str | None,
                        rank: int | None) -> list[Launch]:
    """The start of rank `rank` (None: of every rank) of `job` (default: the newest job any
    node recorded a start of) in its newest attempt (`run --max-restarts`) in which it failed,
    else in the newest, each with its end, by rank. (For every rank: the newest attempt in
    which one failed.)"""
    of_rank = "" if rank is None else f" AND rank = {int(rank)}"
    if job is None:
        rows = _one(await query(
            hosts, token, "SELECT detail FROM events WHERE kind = 'proc.started' AND "
            f"json_extract(detail, '$.job') IS NOT NULL{of_rank} ORDER BY ts DESC LIMIT 1"),
            "what they started")
        if rows:
            job = json.loads(rows[0]["detail"])["job"]
    rows = [] if job is None else _one(await query(
        hosts, token, "SELECT host, node, ts, rank, restart, workspace, detail FROM events "
        f"WHERE kind = 'proc.started' AND json_extract(detail, '$.job') = {_quote(job)}"
        f"{of_rank} ORDER BY ts"), "what they started")
    if not rows or job is None:
        raise ReproError("no node recorded a start of " + (f"rank {rank}" if rank is not None
                                                           else "any rank") +
                         (f" of job {job}" if job else "") + " that you may see (under "
                         "--identity munge a user sees the starts of their own processes only)")
    ends = _one(await query(
        hosts, token, "SELECT host, rank, restart, ts, code, signal, detail FROM events WHERE "
        f"kind = 'proc.exited' AND json_extract(detail, '$.job') = {_quote(job)}{of_rank} "
        "ORDER BY ts"), "how they ended")
    failed = [e["restart"] or 0 for e in ends if (e["code"] or e["signal"])
              and not json.loads(e["detail"] or "{}").get("stopped")]
    attempt = max(failed) if failed else max(r["restart"] or 0 for r in rows)
    newest = {r["rank"]: r for r in rows if (r["restart"] or 0) == attempt}
    launches = []
    for r, row in sorted(newest.items()):
        detail = json.loads(row["detail"] or "{}")
        record = detail.get("launch")
        if not isinstance(record, dict) or not record.get("argv"):
            raise ReproError(f"{row['host']}: the start of rank {r} has no launch record (a "
                             "node older than monarch-fs repro started it)")
        launch = Launch(row["host"], row["node"], str(job), r, row["workspace"], record,
                        detail.get("cwd"), attempt)
        end = next((e for e in ends if e["host"] == row["host"] and e["rank"] == r
                    and e["ts"] >= row["ts"]), None)
        if end is not None:
            launch.code, launch.signal = end["code"], end["signal"]
            launch.stopped = json.loads(end["detail"] or "{}").get("stopped", "")
        launches.append(launch)
    return launches


Remote = Callable[[bytes], bytes]  # a chunk's raw bytes from the node (KeyError: it lacks it)


def write_version(version: str, dest: Path, store_dir: Path, source: Path | None,
                  remote: Remote | None) -> Written:
    """Write workspace version `version` into `dest`, each object from the dev box store,
    else the `source` folder as it is now, else `remote` (the node; blocking)."""
    vid = bytes.fromhex(version)
    store = None
    if (store_dir / "packs").is_dir():
        try:
            store = Store(store_dir)
        except (StoreBusy, OSError):  # a push holds it: the other places may do
            store = None
    places: list[tuple[str, Callable[[bytes, bytes, int, int], bytes | None]]] = []
    if store is not None:
        places.append(("the dev box store", lambda cid, rel, off, n: _stored(store, cid)))
    if source is not None:
        places.append(("the source folder",
                       lambda cid, rel, off, n: _read(os.path.join(os.fsencode(source), rel),
                                                      off, n)))
    if remote is not None:
        places.append(("the node", lambda cid, rel, off, n: _asked(remote, cid)))
    try:
        def get(oid: bytes) -> bytes:
            for _, place in places:
                if (data := place(oid, b"", 0, 0)) is not None and chunk_id(data) == oid:
                    return data
            raise KeyError(oid)

        try:
            manifest = Manifest.load(vid, get)
        except (KeyError, CorruptChunk):
            raise ReproError(f"version {version[:12]} is neither in the dev box store "
                             f"{store_dir} nor on the node that ran it") from None
        out = Written(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for e in manifest:
            path = os.path.join(os.fsencode(dest), e.path) if e.path else os.fsencode(dest)
            if e.kind == Kind.DIR:
                os.makedirs(path, exist_ok=True)
                os.chmod(path, (e.mode & 0o7777) | stat.S_IRWXU)
            elif e.kind == Kind.SYMLINK:
                os.symlink(e.target, path)
            else:
                where = _write_file(path, e.path, e.chunks, e.size, manifest.chunk_size,
                                    places)
                os.chmod(path, e.mode & 0o7777)
                os.utime(path, ns=(e.mtime_ns, e.mtime_ns))
                out.sources[where] = out.sources.get(where, 0) + 1
        return out
    finally:
        if store is not None:
            store.close()


def _stored(store: Store, cid: bytes) -> bytes | None:
    return bytes(decode(cid, store.get_blob(cid))) if store.has(cid) else None


def _asked(remote: Remote, cid: bytes) -> bytes | None:
    try:
        return remote(cid)
    except KeyError:
        return None


def _write_file(path: bytes, rel: bytes, chunks: Sequence[bytes], size: int, chunk_size: int,
                places: list[tuple[str, Callable[[bytes, bytes, int, int], bytes | None]]]
                ) -> str:
    """Write one file's chunks, each from the first place that has it; where the last came
    from."""
    where = "the dev box store"
    with open(path, "wb") as f:
        for cid, (offset, length) in zip(chunks, spans(size, chunk_size)):
            for name, place in places:
                data = place(cid, rel, offset, length)
                if data is not None and chunk_id(data) == cid:
                    f.write(data)
                    where = name
                    break
            else:
                raise ReproError(
                    f"{os.fsdecode(rel)}: bytes {offset}-{offset + length} of this version are "
                    "in none of " + ", ".join(n for n, _ in places) + " (the source folder "
                    "as it is now: changed since?); pass --source DIR of a copy as pushed")
    return where


def _read(path: bytes, offset: int, length: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(launch: Launch, here: Path, port: int | None = None, pdb: bool = False
            ) -> tuple[list[str], str, dict[str, str], list[str]]:
    """argv, working folder and environment to run `launch` with, its workspace at
    `here/NAME` and MASTER_PORT `port` (default: a free one), under pdb if asked; and a line
    per thing that differs from the cluster run."""
    rec = launch.record
    ws = here / (launch.workspace or "workspace")

    def expand(text: str) -> str:
        text = text.replace("{mount}", str(here))
        return text.replace("{workspace}", str(ws)) if launch.workspace else text

    argv = [expand(a) for a in rec["argv"]]
    if pdb:
        if not PYTHON.fullmatch(os.path.basename(argv[0])):
            raise ReproError(f"--pdb: rank {launch.rank} ran {argv[0]}, not a Python "
                             "interpreter (python, python3, python3.11...)")
        argv[1:1] = ["-m", "pdb"]
    cwd = expand(rec["cwd"]) if rec.get("cwd") else (str(ws) if launch.workspace
                                                     else os.getcwd())
    env = {k: v for k, v in os.environ.items() if k in LOCAL_ENV or k.startswith("LC_")}
    env.update({k: expand(v) for k, v in rec.get("env", {}).items()})
    env["MONARCH_FS_MOUNT"] = str(here)
    if launch.workspace:
        env["MONARCH_FS_WORKSPACE"] = str(ws)
    differs = [f"host: {socket.gethostname()}, not {launch.node} ({launch.host})"]
    if cwd != launch.cwd_there:
        differs.append(f"working folder: {cwd}, not {launch.cwd_there or 'the daemon’s'}")
    for name, value in (("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port if port is not None else free_port()))):
        if name in env:
            if env[name] != value:
                differs.append(f"{name}={value}, not {env[name]}")
            env[name] = value
    if rec.get("withheld"):
        differs.append("not recorded (secrets), so not set: " + ", ".join(rec["withheld"]))
    differs.append("PATH, HOME, USER and the locale are this machine's")
    return argv, cwd, env, differs


async def materialize(launch: Launch, here: Path, *, token: bytes, store_dir: Path,
                      source: str | None, err: TextIO) -> None:
    """Write the version `launch` ran into `here/NAME`, saying from where; what neither the
    dev box store nor the source folder has is asked of the node that ran it."""
    rec, name = launch.record, launch.workspace
    if not (rec.get("version") and name):
        err.write("monarch-fs repro: the job ran without --workspace: its command runs "
                  "against this machine's files as they are\n")
        return
    src = source or rec.get("source")
    async with NodeChunks(launch.host, token, name, rec["version"]) as node:
        written = await trio.to_thread.run_sync(
            lambda: write_version(rec["version"], here / name, store_dir,
                                  Path(src) if src else None, node.blocking_get))
    err.write(f"monarch-fs repro: {launch.workspace} {rec['version'][:12]} written to "
              f"{written.root} (" + ", ".join(f"{n} files from {w}" for w, n in
                                              written.sources.items()) + ")\n")


class NodeChunks:
    """Chunks of one version, asked of the node that serves it (`read_chunks`), connected at
    the first ask; `blocking_get` is for the worker thread that writes the version."""

    def __init__(self, host: str, token: bytes, workspace: str, version: str) -> None:
        self.host, self.token = host, token
        self.workspace, self.version = workspace, bytes.fromhex(version)
        self.chan: Channel | None = None
        self.asked = 0

    async def __aenter__(self) -> NodeChunks:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.chan is not None:
            await self.chan.aclose()

    async def get(self, cid: bytes) -> bytes:
        try:
            if self.chan is None:
                self.chan = await connect(self.host, self.token)
            req = ReadChunks(self.workspace, self.version, [cid])
            signed = await identity.sign(self.chan, req.op, req.to_wire())  # if it asks who
            reply = ChunksReply.from_wire(await self.chan.request(req.op, **signed))
        except RemoteError as e:
            raise ReproError(f"{self.host}: {e.message}") from None
        except (ConnectError, ConnectionLost, identity.IdentityError, ProtocolError) as e:
            raise ReproError(f"cannot ask {self.host} for what the dev box lacks of "
                             f"{self.workspace}: {e}") from None
        blob = reply.blobs[0] if reply.blobs else None
        if blob is None:
            raise KeyError(cid)
        self.asked += 1
        try:
            return bytes(decode(cid, blob))
        except CorruptChunk as e:
            raise ReproError(f"{self.host}: sent a damaged chunk: {e}") from None

    def blocking_get(self, cid: bytes) -> bytes:
        return trio.from_thread.run(self.get, cid)


def outcome(launch: Launch, code: int) -> tuple[int, str]:
    """The exit status for a process that ended with `code` (Popen's), and a line comparing
    that with how the rank ended on its node."""
    sig = _signal_name(-code) if code < 0 else None
    here = f"killed by {sig}" if sig else f"exit code {code}"
    same = (launch.code, launch.signal) == ((None, sig) if sig else (code, None))
    return (128 - code if code < 0 else code,
            f"{here} here; on {launch.node}: {launch.ended()}"
            + (f" (stopped: {launch.stopped})" if launch.stopped else "")
            + (": the same" if same else ": it differs"))


def scratch(job: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"monarch-fs-repro-{job or 'job'}-"))


def run(launch: Launch, *, token: bytes, store_dir: Path, source: str | None, keep: bool,
        pdb: bool, err: TextIO) -> int:
    """Write the version, run the rank, say what differs and how it ended; its exit status."""
    here = scratch(launch.job)
    try:
        trio.run(lambda: materialize(launch, here, token=token, store_dir=store_dir,
                                     source=source, err=err))
        argv, cwd, env, differs = prepare(launch, here, pdb=pdb)
        err.write(f"monarch-fs repro: rank {launch.rank} of job {launch.job}"
                  + (f" (attempt {launch.attempt + 1})" if launch.attempt else "") + ": "
                  f"{' '.join(argv)}\n" + "".join(f"  differs: {d}\n" for d in differs))
        err.flush()
        try:
            code = subprocess.run(argv, cwd=cwd, env=env).returncode
        except OSError as e:
            raise ReproError(f"cannot start {argv[0]} in {cwd}: {e.strerror or e}") from None
        status, line = outcome(launch, code)
        err.write(f"monarch-fs repro: {line}\n")
        return status
    finally:
        leave(here, keep, err)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def leave(here: Path, keep: bool, err: TextIO) -> None:
    """Done with the temporary folder a version was written to: keep it (--keep, and say
    where) or remove it."""
    if keep:
        err.write(f"monarch-fs repro: kept {here}\n")
    else:
        shutil.rmtree(here, ignore_errors=True)
