"""The query's limits, against real daemons (daemon/node/events_query.py, issue 33 findings 4,
5 and 10; issue 35's "a query sees what just happened"): a query sees every event of a push
that returned before it, whatever the write interval; a statement is stopped at its time
whatever it does, and at SIGTERM; an answer's bound counts every value, so a wide answer of
empty strings is one clear error, not a daemon's gigabytes; no function answers a memory
address; a node that does not answer in time says so. The privacy of a query under --identity
munge is in tests/test_identity.py's neighbour, test_query_privacy.py."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time

import pytest
import trio

from helpers import mfs, start_daemon, stop_daemon
from monarch_fs.daemon.node import events_query
from monarch_fs.daemon.wire.auth import load_token
from monarch_fs.daemon.wire.transport import RemoteError, connect

COUNT_TO = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < {}) ")


def query(c, sql: str, *args: str, check: bool = True) -> dict:
    out = mfs("query", sql, "--hosts", c.hostfile, "--token-file", c.token_file, "--json",
              *args, check=check)
    return json.loads(out.stdout)


def ask(addr: str, token_file: str, sql: str, timeout: float = 10.0) -> tuple[float, object]:
    """One `query` request, as a node receives it: (seconds to its answer, rows or the
    refusal's message)."""
    async def main() -> tuple[float, object]:
        chan = await connect(addr, load_token(token_file))
        async with chan:
            start = time.monotonic()
            try:
                got: object = (await chan.request("query", sql=sql, timeout=timeout))["rows"]
            except RemoteError as e:
                got = str(e).removeprefix(f"{addr}: ")
            return time.monotonic() - start, got
    return trio.run(main)


@pytest.mark.mount
def test_a_query_right_after_a_push_sees_its_events_on_every_node(fresh_cluster, tmp_path,
                                                                   monkeypatch):
    # Events are written once per interval (2 s by default; 60 s here, to leave no doubt):
    # the node writes what it holds before it answers a query.
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "60")
    c = fresh_cluster(3)
    src = tmp_path / "app"
    src.mkdir()
    (src / "train.py").write_text("print('step')\n")
    version = c.push_json(src)["version"]
    rows = query(c, "SELECT host, kind FROM events WHERE version = '" + version + "' "
                    "AND kind IN ('push.received', 'push.prepared', 'push.committed') "
                    "ORDER BY host, id")["rows"]
    assert sorted({r["host"] for r in rows}) == sorted(c.hosts), rows
    for host in c.hosts:
        assert [r["kind"] for r in rows if r["host"] == host] == [
            "push.received", "push.prepared", "push.committed"], rows
    counts = query(c, "SELECT host, count(*) AS n FROM events WHERE kind = 'push.committed' "
                      "GROUP BY host")["rows"]
    assert sorted((r["host"], r["n"]) for r in counts) == sorted((h, 1) for h in c.hosts)


@pytest.fixture
def node(tmp_path):
    daemon = start_daemon(tmp_path / "node")
    yield daemon
    stop_daemon(daemon)


@pytest.mark.mount
def test_a_slow_function_call_is_stopped_at_the_bound(node):
    # One call each: the instr (6 s a call with 1 MiB values), ltrim over a set of
    # 20,000 characters (15 s a call before: its time was the product of the lengths).
    for sql in (COUNT_TO.format(3) + "SELECT n, instr(printf('%.*c', 999999, 'a'), "
                "printf('%.*c', 500000, 'a') || 'b') FROM r",
                COUNT_TO.format(3) + "SELECT n, length(ltrim(printf('%.*c', 200000, 'a'), "
                "printf('%.*c', 20000, 'b') || 'a')) FROM r",
                COUNT_TO.format(3) + "SELECT n, replace(printf('%.*c', 200000, 'a'), "
                "printf('%.*c', 100000, 'a') || 'b', '') = '' FROM r"):
        seconds, got = ask(node.addr, node.token_file, sql, timeout=2)
        assert seconds < 3, (sql, seconds, got)
    # And a statement that never ends stops at its time, with the reason.
    seconds, got = ask(node.addr, node.token_file, COUNT_TO.format(10**12)
                       + "SELECT count(*) FROM r", timeout=1)
    assert got == "query: stopped after 1 s" and seconds < 2, (seconds, got)


@pytest.mark.mount
def test_sigterm_stops_a_daemon_that_runs_a_query(tmp_path):
    daemon = start_daemon(tmp_path / "node")
    try:
        async def main() -> float:
            chan = await connect(daemon.addr, load_token(daemon.token_file))
            async with chan, trio.open_nursery() as nursery:
                async def long_query() -> None:
                    try:
                        await chan.request("query", timeout=60, sql=COUNT_TO.format(10**12)
                                           + "SELECT count(*) FROM r")
                    except Exception:
                        pass  # the daemon went away: the point

                nursery.start_soon(long_query)
                await trio.sleep(1)
                start = time.monotonic()
                os.kill(daemon.pid, signal.SIGTERM)
                await trio.to_thread.run_sync(daemon.proc.wait, 30)
                nursery.cancel_scope.cancel()
                return time.monotonic() - start

        assert trio.run(main) < 8  # the query had 59 s to go; SIGTERM took 98 s (issue 33)
    finally:
        stop_daemon(daemon)


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.mount
def test_a_wide_answer_of_empty_strings_is_one_clear_error(node):
    before = _peak_rss_kib(node.pid)
    empties = ", ".join(["''"] * 90)
    seconds, got = ask(node.addr, node.token_file,
                       COUNT_TO.format(200_000) + f"SELECT {empties} FROM r", timeout=30)
    assert isinstance(got, str) and "the answer is larger than this node sends" in got, got
    assert _peak_rss_kib(node.pid) - before < 200 << 10  # was 1.4 GB with 500 columns
    _, got = ask(node.addr, node.token_file, COUNT_TO.format(200_000) + "SELECT "
                 + ", ".join(["''"] * 500) + " FROM r")
    assert got == "query: too many columns in result set (at most 100 here)", got
    # Escapes count: 150 values of 100,000 'é' are 29 MiB of UTF-8 but 86 MiB of the reply's
    # JSON, more than a frame holds.
    _, got = ask(node.addr, node.token_file, COUNT_TO.format(150) + "SELECT "
                 "replace(printf('%.*c', 100000, 'a'), 'a', 'é') FROM r")
    assert isinstance(got, str) and "the answer is larger than this node sends" in got, got
    # The daemon goes on answering.
    _, got = ask(node.addr, node.token_file, "SELECT count(*) > 0 FROM events")
    assert got == [[1]]


@pytest.mark.mount
def test_a_sort_without_end_is_bounded_in_memory_and_writes_no_temporary_files(node):
    # 8 s of this sort wrote 880 MB of temporary files (deleted, so unseen by du) before.
    before = _peak_rss_kib(node.pid)
    seconds, got = ask(node.addr, node.token_file, COUNT_TO.format(10**12) + "SELECT max(b) "
                       "FROM (SELECT randomblob(1000) AS b FROM r ORDER BY random())", timeout=30)
    assert isinstance(got, str) and "needs more than the 256 MiB" in got, got
    assert seconds < 15 and _peak_rss_kib(node.pid) - before < 400 << 10
    _, got = ask(node.addr, node.token_file, "SELECT count(*) > 0 FROM events")
    assert got == [[1]]  # the writer (under the same bound) wrote, and queries go on


@pytest.mark.mount
def test_no_function_answers_a_memory_address(fresh_cluster):
    c = fresh_cluster(1)
    # max() runs on the node (a partial aggregate): its value came from the node's memory.
    out = query(c, "SELECT max(hex(fts3_tokenizer('simple'))) AS a FROM events", check=False)
    assert out["rows"] == [{"a": None}] or not out["rows"], out
    [refusal] = out["unreachable"]
    assert refusal["error"].startswith(f"{c.hosts[0]}: query refused: function "
                                       "fts3_tokenizer is not allowed here"), refusal
    for sql in ("SELECT hex(fts3_tokenizer('simple'))", "SELECT fts5(NULL)",
                "SELECT rtreenode(2, x'00')", "SELECT load_extension('/tmp/x')"):
        _, got = ask(c.hosts[0], c.token_file, sql)
        assert isinstance(got, str) and got.startswith("query refused: function"), (sql, got)


@pytest.mark.mount
def test_a_node_that_does_not_answer_says_so(fresh_cluster):
    c = fresh_cluster(2)
    os.kill(c.pid(0), signal.SIGSTOP)
    try:
        out = mfs("query", "SELECT count(*) AS n FROM events", "--hosts", c.hostfile,
                  "--token-file", c.token_file, "--timeout", "1", check=False)
    finally:
        os.kill(c.pid(0), signal.SIGCONT)
    assert out.returncode == 1
    assert f"{c.hosts[0]}: UNREACHABLE: no answer within 6 s" in out.stdout, out.stdout


def test_the_linear_builtins_answer_as_sqlite_s():
    """instr, replace and the trims are replaced by linear ones (events_query.LINEAR): same
    answers as SQLite's own, on text, numbers, NULL and blobs."""
    values = ["", " ", "  hello  ", "héllo wörld", "aXbXc", "xxabcxx", "ab", None, 12, 1.5,
              b"\x00ab\x00", "日本語のテキスト 語"]
    needles = ["", "X", "l", "ö", "語", "x", "ab", "b", None, 2, b"a", "xa", " h"]
    calls = [("instr", 2), ("replace", 3), ("trim", 1), ("trim", 2), ("ltrim", 1),
             ("ltrim", 2), ("rtrim", 1), ("rtrim", 2)]
    ours = sqlite3.connect(":memory:")
    for name, nargs, fn in events_query.LINEAR:
        ours.create_function(name, nargs, fn, deterministic=True)
    theirs = sqlite3.connect(":memory:")
    for name, nargs in calls:
        sql = f"SELECT {name}({', '.join('?' * nargs)})"
        for x in values:
            for y in needles if nargs > 1 else [None]:
                args = (x, y, "--")[:nargs]
                expect = theirs.execute(sql, args).fetchone()[0]
                assert ours.execute(sql, args).fetchone()[0] == expect, (name, args, expect)
