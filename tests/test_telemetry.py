"""Telemetry on a local cluster of real daemons (daemon/node/events.py, daemon/client/query.py,
daemon/client/top.py), through the real command line: after a push, a failing `run` and a node
restart, `monarch-fs query` returns the rows that tell what happened on each node; a node that
was killed is reported and the others answer; no statement can change the events; and the
events database holds its size bound under a flood."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time

import pytest
import trio

from helpers import mfs, stop_node, wait_for, write_files
from monarch_fs.daemon.client import cluster as cluster_mod
from monarch_fs.daemon.node.events import EventLog
from monarch_fs.daemon.wire.auth import resolve_token
from monarch_fs.daemon.wire.identity import Identity
from monarch_fs.daemon.wire.telemetry_tables import SCHEMA
from monarch_fs.daemon.wire.transport import RemoteError, connect

INTERVAL = "0.2"  # the daemons write their events every 0.2 s here (2 s by default)


@pytest.fixture
def fast_events(monkeypatch):
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", INTERVAL)


def query(c, sql: str, *args: str, check: bool = True) -> dict:
    out = mfs("query", sql, "--hosts", c.hostfile, "--token-file", c.token_file, "--json",
              *args, check=check)
    return json.loads(out.stdout)


def rows_until(c, sql: str, enough, what: str) -> list[dict]:
    """The rows of `sql` once `enough(rows)` holds (events are written once per interval)."""
    got: list[dict] = []

    def ready() -> bool:
        nonlocal got
        got = query(c, sql)["rows"]
        return enough(got)

    wait_for(ready, 20, what, interval=0.2)
    return got


@pytest.mark.mount
def test_queries_tell_a_push_a_failing_run_and_a_restart(fresh_cluster, fast_events, tmp_path):
    c = fresh_cluster(3)
    # small files are read through the daemon (large ones: passthrough)
    src = write_files(tmp_path / "app", {
        "train.py": "print('step')\n", "weights.bin": os.urandom(3 << 20),
        **{f"part{i}.bin": os.urandom(128 << 10) for i in range(8)}})
    version = c.push_json(src)["version"]

    # How long each push phase took on each node: received, prepared, committed, per host.
    phases = rows_until(
        c, f"SELECT host, kind, count, bytes, seconds FROM events "
           f"WHERE version = '{version}' AND kind LIKE 'push.%' ORDER BY host, id",
        lambda rows: len(rows) == 9, "every node's three push phases")
    assert {r["host"] for r in phases} == set(c.hosts)
    for host in c.hosts:
        mine = [r for r in phases if r["host"] == host]
        assert [r["kind"] for r in mine] == ["push.received", "push.prepared", "push.committed"]
        assert mine[0]["bytes"] >= 3 << 20 and mine[0]["count"] >= 2
        assert all(r["seconds"] >= 0 for r in mine)
    published = query(c, "SELECT host, workspace, version FROM events "
                         "WHERE kind = 'version.published'")["rows"]
    assert sorted((r["host"], r["workspace"], r["version"]) for r in published) == sorted(
        (h, "app", version) for h in c.hosts)

    # Aggregates are computed on the nodes and combined here; the answer is the whole one.
    counts = query(c, "SELECT kind, count(*) AS n, sum(bytes) AS b FROM events "
                      "WHERE kind = 'push.received' GROUP BY kind")["rows"]
    assert counts == [{"kind": "push.received", "n": 3,
                       "b": sum(r["bytes"] for r in phases if r["kind"] == "push.received")}]

    # A failing run: rank 1 dies first and says why; the others are stopped by the daemon.
    run = mfs("run", "--hosts", c.hostfile, "--token-file", c.token_file, "--per-host", "1",
              "--", "sh", "-c", 'if [ "$RANK" = 1 ]; then echo "rank one: out of memory" >&2; '
              'exit 7; fi; sleep 60', check=False)
    assert run.returncode == 7, run.stderr
    first = rows_until(
        c, "SELECT host, rank, code, signal, text FROM events WHERE kind = 'proc.exited' "
           "AND (code != 0 OR signal IS NOT NULL) "
           "AND json_extract(detail, '$.stopped') IS NULL ORDER BY ts LIMIT 1",
        lambda rows: len(rows) == 1, "the first rank to die")
    assert first == [{"host": c.hosts[1], "rank": 1, "code": 7, "signal": None,
                      "text": "rank one: out of memory"}]
    stopped = rows_until(
        c, "SELECT host, rank, signal FROM events WHERE kind = 'proc.exited' AND "
           "json_extract(detail, '$.stopped') IS NOT NULL ORDER BY rank",
        lambda rows: len(rows) == 2, "the other ranks, stopped")
    assert [(r["host"], r["rank"]) for r in stopped] == [(c.hosts[0], 0), (c.hosts[2], 2)]

    # Reads on node 0 show up in its `reads` rows, and nowhere else.
    for i in range(8):
        assert len((c.mnt(0) / "app" / f"part{i}.bin").read_bytes()) == 128 << 10
    reads = rows_until(c, "SELECT host, sum(bytes) AS b, sum(reads) AS n FROM reads "
                          "GROUP BY host HAVING b > 0",
                       lambda rows: rows and rows[0]["b"] >= 8 * 128 << 10, "node 0's reads")
    assert [r["host"] for r in reads] == [c.hosts[0]] and reads[0]["n"] >= 1

    # A restart: node 2's history survives it, and both starts are there, with their pids.
    old_pid = c.pid(2)
    stop_node(c, 2)
    cluster_mod.restart_node(c.dir, 2)
    starts = rows_until(c, "SELECT host, pid, kind FROM events WHERE kind LIKE 'daemon.%' "
                           f"AND host = '{c.hosts[2]}' ORDER BY id",
                        lambda rows: len(rows) == 3, "node 2's stop and two starts")
    assert [r["kind"] for r in starts] == ["daemon.started", "daemon.stopped", "daemon.started"]
    assert starts[0]["pid"] == old_pid and starts[2]["pid"] == c.pid(2) != old_pid
    kept = query(c, f"SELECT count(*) AS n FROM events WHERE host = '{c.hosts[2]}' "
                    "AND kind = 'push.committed'")["rows"]
    assert kept == [{"n": 1}]

    # No statement changes the events: the controller refuses, and so does every node.
    refused = mfs("query", "DELETE FROM events", "--hosts", c.hostfile, "--token-file",
                  c.token_file, check=False)
    assert refused.returncode == 1 and "read-only" in refused.stderr
    before = query(c, "SELECT count(*) AS n FROM events WHERE kind != 'request.refused'")

    async def write_directly() -> list[str]:
        out = []
        token = resolve_token(c.token_file)
        async with await connect(c.hosts[0], token) as chan:
            for sql in ["DELETE FROM events", "UPDATE events SET kind = 'x'",
                        "INSERT INTO events (ts, node, kind) VALUES (0, 'n', 'forged')",
                        "DROP TABLE events", "PRAGMA journal_mode = DELETE",
                        "ATTACH DATABASE '/tmp/x.db' AS x",
                        "WITH d AS (DELETE FROM events RETURNING id) SELECT * FROM d"]:
                with pytest.raises(RemoteError) as e:
                    await chan.request("query", sql=sql)
                assert e.value.code == "refused"
                out.append(e.value.message)
        return out

    messages = trio.run(write_directly)
    assert sum("only reading statements" in m for m in messages) >= 5, messages
    after = query(c, "SELECT count(*) AS n FROM events WHERE kind != 'request.refused'")
    assert after["rows"][0]["n"] >= before["rows"][0]["n"]
    assert query(c, "SELECT count(*) AS n FROM events WHERE kind = 'forged'")["rows"] == [
        {"n": 0}]


@pytest.mark.mount
def test_a_killed_node_is_reported_and_the_others_answer(fresh_cluster, fast_events, tmp_path):
    c = fresh_cluster(3)
    version = c.push_json(write_files(tmp_path / "env", {"a.py": "x = 1\n"}))["version"]
    rows_until(c, "SELECT host FROM events WHERE kind = 'push.committed'",
               lambda rows: len(rows) == 3, "every node's commit")
    pid = c.pid(1)
    os.kill(pid, signal.SIGKILL)  # a daemon this test started, by its pid
    os.waitpid(pid, 0)

    out = query(c, "SELECT host, version FROM events WHERE kind = 'version.published' "
                   "ORDER BY host", check=False)
    assert sorted(r["host"] for r in out["rows"]) == sorted([c.hosts[0], c.hosts[2]])
    assert all(r["version"] == version for r in out["rows"])
    assert [u["host"] for u in out["unreachable"]] == [c.hosts[1]]
    assert out["unreachable"][0]["error"]

    text = mfs("query", "SELECT kind, count(*) AS n FROM events GROUP BY kind",
               "--hosts", c.hostfile, "--token-file", c.token_file, check=False)
    assert text.returncode == 1
    assert f"{c.hosts[1]}: UNREACHABLE" in text.stdout and "push.committed" in text.stdout

    # top: the live view says the same, the others with the version they serve.
    view = json.loads(mfs("top", "--once", "--json", "--interval", "0.2", "--hosts",
                          c.hostfile, "--token-file", c.token_file, check=False).stdout)
    by_host = {n["host"]: n for n in view}
    assert by_host[c.hosts[1]]["error"]
    for h in (c.hosts[0], c.hosts[2]):
        assert by_host[h]["versions"] == {"env": version[:12]} and by_host[h]["error"] is None
        assert by_host[h]["read_bytes_s"] is not None and by_host[h]["procs"] == []


@pytest.mark.mount
def test_top_shows_reads_and_running_processes(fresh_cluster, tmp_path):
    c = fresh_cluster(2)
    # small: read through the daemon (large files are passthrough)
    c.push_json(write_files(tmp_path / "data",
                            {f"f{i}": os.urandom(200 << 10) for i in range(16)}))
    run = cluster_run_sleeper(c)
    try:
        wait_for(lambda: all(n["procs"] for n in top_view(c)), 20, "both ranks running")

        stop = threading.Event()

        def reading() -> None:  # a reader on node 0 while top looks
            while not stop.is_set():
                for i in range(16):
                    with open(c.mnt(0) / "data" / f"f{i}", "rb", buffering=0) as f:
                        while f.read(1 << 20):
                            pass
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

        reader = threading.Thread(target=reading)
        reader.start()
        try:
            seen: list[list[dict]] = []
            wait_for(lambda: (seen.append(top_view(c, "0.5"))
                              or (seen[-1][0]["read_bytes_s"] or 0) > 0), 30,
                     "node 0's reads in top")
        finally:
            stop.set()
            reader.join()
        first = seen[-1][0]
        assert first["requests_s"] > 0 and [p["rank"] for p in first["procs"]] == [0]
        screen = mfs("top", "--once", "--interval", "0.2", "--hosts", c.hostfile,
                     "--token-file", c.token_file).stdout
        assert "HIT%" in screen and "data=" in screen and "(ranks 1)" in screen
    finally:
        run.send_signal(signal.SIGINT)
        run.wait(timeout=30)


def top_view(c, interval: str = "0.2") -> list[dict]:
    return json.loads(mfs("top", "--once", "--json", "--interval", interval, "--hosts",
                          c.hostfile, "--token-file", c.token_file).stdout)


def cluster_run_sleeper(c):
    import subprocess
    import sys

    from helpers import CLI_MODULE

    return subprocess.Popen([sys.executable, "-m", CLI_MODULE, "run", "--hosts", c.hostfile,
                             "--token-file", c.token_file, "--per-host", "1", "--",
                             "sleep", "60"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def test_retention_holds_the_size_bound_under_a_flood(tmp_path):
    """A flood of events into a 1 MiB bound: after every write the database and its log stay
    within the bound (plus what one write adds), the newest rows are kept, the oldest go."""
    events = EventLog(tmp_path / "events.db", "node-0", max_bytes=1 << 20, interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        biggest = 0
        for batch in range(40):
            for i in range(2500):
                events.record("error", text=f"flood {batch}-{i}: " + "x" * 200, count=i)
            await events.flush()
            files = [tmp_path / n for n in ("events.db", "events.db-wal")]
            biggest = max(biggest, sum(f.stat().st_size for f in files if f.exists()))
        nursery.cancel_scope.cancel()
    answer = await events.query("SELECT count(*), min(text), max(id) FROM events")
    await events.close()
    count, oldest, last = answer.rows[0]
    assert biggest <= (1 << 20) * 1.5, biggest  # a write of 2,500 rows adds ~0.6 MiB at most
    assert (tmp_path / "events.db").stat().st_size <= 1 << 20
    assert events.pruned > 90_000 and last == 100_000
    assert 0 < count < 10_000 and not oldest.startswith("flood 0-")
    latest = await _query_after_close(tmp_path)
    assert latest == "flood 39-2499: " + "x" * 200


async def _query_after_close(tmp_path) -> str:
    reopened = EventLog(tmp_path / "events.db", "node-0")
    async with trio.open_nursery() as nursery:
        await nursery.start(reopened.run)
        answer = await reopened.query("SELECT text FROM events ORDER BY id DESC LIMIT 1")
        nursery.cancel_scope.cancel()
    await reopened.close()
    return answer.rows[0][0]


async def test_retention_drops_what_is_older_than_the_age_bound(tmp_path):
    events = EventLog(tmp_path / "events.db", "node-0", max_age=0.5, interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        events.record("warning", text="old")
        await events.flush()
        await trio.sleep(0.7)
        events.record("warning", text="new")
        await events.flush()
        answer = await events.query("SELECT text FROM events")
        nursery.cancel_scope.cancel()
    await events.close()
    assert answer.rows == [["new"]]


async def test_a_query_is_bounded_in_time_and_rows(tmp_path):
    events = EventLog(tmp_path / "events.db", "node-0", interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        start = time.monotonic()
        with pytest.raises(Exception, match="stopped after 0.3 s"):
            await events.query("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 "
                               "FROM n) SELECT count(*) FROM n", timeout=0.3)
        assert time.monotonic() - start < 3
        with pytest.raises(Exception, match="more than 1,000 rows"):
            await events.query("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 "
                               "FROM n LIMIT 5000) SELECT i FROM n", max_rows=1000)
        nursery.cancel_scope.cancel()
    await events.close()


async def test_a_name_that_is_not_utf8_is_recorded_escaped_and_never_stops_recording(tmp_path):
    """A refused request names what it was sent: a workspace or file name that is not UTF-8
    (decoded with surrogateescape) is stored with its bytes escaped. A row the database
    refuses anyway is dropped, not retried for ever, and the writer goes on (the fuzz of
    tests/test_hardening.py once took the daemon down this way)."""
    events = EventLog(tmp_path / "events.db", "node-0", interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        name = os.fsdecode(b"ws\xff") + "\ud800"  # bytes escaped; any surrogate JSON carries
        events.record("request.refused", workspace=name, text=f"invalid name {name}")
        await events.flush()
        events._pending.append(("not a time",) * 3)  # a row no INSERT takes
        await events.flush()
        events.record("warning", text="after")
        await events.flush()
        answer = await events.query("SELECT kind, workspace, text FROM events ORDER BY id")
        nursery.cancel_scope.cancel()
    await events.close()
    rows = [r for r in answer.rows if r[0] != "error"]  # (the writer's own complaint)
    assert rows == [["request.refused", "ws\\udcff\\ud800", "invalid name ws\\udcff\\ud800"],
                    ["warning", None, "after"]]


async def test_a_damaged_database_is_moved_aside_and_recording_goes_on(tmp_path):
    (tmp_path / "events.db").write_bytes(b"not a database at all" * 100)
    events = EventLog(tmp_path / "events.db", "node-0", interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        events.record("warning", text="after")
        await events.flush()
        answer = await events.query("SELECT kind, text FROM events")
        nursery.cancel_scope.cancel()
    await events.close()
    assert answer.rows == [["warning", "after"]]
    assert (tmp_path / "events.db.broken").read_bytes().startswith(b"not a database")


async def test_a_database_made_before_the_uid_column_gains_it(tmp_path):
    """A node upgraded in place keeps its history, and its processes' rows say whose they are
    (under --identity munge a user reads their own: daemon/node/events_query.py)."""
    old = sqlite3.connect(tmp_path / "events.db")
    old.executescript(SCHEMA.replace(",            -- a JSON object", "  -- a JSON object")
                      .replace("    uid INTEGER             -- whose row: a process's user "
                               "(NULL: the node's own event)\n", ""))
    assert "uid" not in {r[1] for r in old.execute("PRAGMA table_info(events)")}
    old.execute("INSERT INTO events (ts, node, kind, text) VALUES (?, 'node-0', 'warning', "
                "'before')", (time.time(),))
    old.commit()
    old.close()
    events = EventLog(tmp_path / "events.db", "node-0", interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        events.record("proc.exited", text="after", uid=1234)
        answer = await events.query("SELECT text, uid FROM events ORDER BY id")
        mine = await events.query("SELECT text FROM events ORDER BY id",
                                  asker=Identity(1234, 1234))
        theirs = await events.query("SELECT text FROM events ORDER BY id",
                                    asker=Identity(4321, 4321))
        nursery.cancel_scope.cancel()
    await events.close()
    assert answer.rows == [["before", None], ["after", 1234]]
    assert mine.rows == [["before"], ["after"]] and theirs.rows == [["before"]]


async def test_a_huge_detail_is_cut_to_json_every_query_can_read(tmp_path):
    """A detail past what a query may read (a process's whole environment, say) would make
    every query over `detail` fail; it keeps its short values, as JSON."""
    events = EventLog(tmp_path / "events.db", "node-0", interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(events.run)
        events.record("proc.started", detail={"cwd": "/w", "env": {"X": "y" * (2 << 20)}})
        events.record("proc.exited", detail={"stopped": "a kill request"})
        answer = await events.query("SELECT kind, json_extract(detail, '$.cwd'), "
                                    "json_extract(detail, '$.stopped'), length(detail) "
                                    "FROM events ORDER BY id")
        nursery.cancel_scope.cancel()
    await events.close()
    (started, cwd, _, size), exited = answer.rows
    assert (started, cwd) == ("proc.started", "/w") and size < 1024
    assert exited[:3] == ["proc.exited", None, "a kill request"]
