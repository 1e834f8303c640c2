"""How `monarch-fs query` splits a query between the nodes and the controller
(daemon/client/query_plan.py): whatever the split, the answer is the query run over every node's
rows at once; aggregates and filters run on the nodes; bad input is one clear error. The nodes
here are real SQLite databases with the nodes' schema, filled with random events."""

from __future__ import annotations

import random
import sqlite3

import pytest

from doc_examples import REPO, marked_blocks
from monarch_fs.daemon.client import query as q
from monarch_fs.daemon.wire.telemetry_calls import QueryReply
from monarch_fs.daemon.wire.telemetry_tables import EVENT_COLUMNS, SCHEMA, TABLES

HOSTS = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]


@pytest.fixture(scope="module")
def nodes():
    """Three nodes' databases, and one holding every row with its host (the reference)."""
    rng = random.Random(1)
    dbs = {}
    union = sqlite3.connect(":memory:")
    for table, cols in TABLES.items():
        union.execute(f"CREATE TABLE {table} (host, {', '.join(cols)})")
    for h in HOSTS:
        db = sqlite3.connect(":memory:")
        db.executescript(SCHEMA)
        for i in range(300):
            db.execute("INSERT INTO events (ts, node, kind, bytes, seconds, rank, code, text) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (1000 + i + rng.random(), h, rng.choice(["push.received", "proc.exited",
                                                                 "error"]),
                        rng.choice([None, rng.randrange(1000)]), rng.random(), rng.randrange(4),
                        rng.choice([0, 1, None]), rng.choice(["a", "b\nc", None])))
        for row in db.execute(f"SELECT id, {', '.join(EVENT_COLUMNS)} FROM events"):
            union.execute(f"INSERT INTO events VALUES ({', '.join('?' * (len(row) + 1))})",
                          (h, *row))
        dbs[h] = db
    return dbs, union


def answer(dbs: dict, sql: str) -> tuple[q.Plan, list[tuple]]:
    p = q.plan(sql)
    q.check(p)
    got = {}
    for h, db in dbs.items():
        got[h] = {}
        for table, node_sql in p.nodes.items():
            cur = db.execute(node_sql, {"host": h})
            got[h][table] = QueryReply([d[0] for d in cur.description],
                                       [list(r) for r in cur.fetchall()])
    return p, q._finish(p, got, 10)[1]


def rounded(rows: list[tuple]) -> list[tuple]:
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in rows]


CASES = [
    ("SELECT host, kind, count(*) AS n, sum(bytes), avg(seconds), min(ts), max(ts), "
     "total(bytes) FROM events WHERE ts > 1050 GROUP BY host, kind ORDER BY host, kind",
     "partial"),
    ("SELECT kind, count(*) n FROM events GROUP BY kind HAVING n > 10 ORDER BY n DESC, kind",
     "partial"),
    ("SELECT count(*), avg(bytes) FROM events", "partial"),
    ("SELECT count(*) FROM events WHERE host = '10.0.0.2:7000'", "partial"),
    ("SELECT rank, count(*) FROM events GROUP BY 1 ORDER BY 1", "partial"),
    ("SELECT upper(kind) AS k, count(*) FROM events GROUP BY k ORDER BY k", "partial"),
    ("SELECT host, sum(CASE WHEN kind = 'error' THEN seconds END) AS e, "
     "1e6 * sum(seconds) / count(bytes) AS per FROM events GROUP BY host ORDER BY host",
     "partial"),
    ("SELECT host, kind, ts FROM events WHERE code = 1 ORDER BY ts LIMIT 5", "LIMIT"),
    ("SELECT host, ts, rank, text FROM events WHERE code != 0 ORDER BY ts LIMIT 1 OFFSET 2",
     "LIMIT"),
    ("SELECT * FROM events WHERE bytes > 990 ORDER BY ts", "WHERE"),
    ("SELECT count(DISTINCT host) FROM events", "controller"),
    ("SELECT host, max(ts), rank FROM events GROUP BY host ORDER BY host", "partial"),
    ("SELECT kind, min(ts), host, rank FROM events GROUP BY kind ORDER BY kind", "partial"),
    ("SELECT host, count(*) FROM events WHERE kind = 'nosuch' GROUP BY host", "partial"),
    ("SELECT host, min(ts), max(ts), rank FROM events GROUP BY host ORDER BY host",
     "controller"),
    ("SELECT e.host, e.kind, (SELECT count(*) FROM events x WHERE x.host = e.host) "
     "FROM events e WHERE e.code = 1 ORDER BY e.ts LIMIT 3", "controller"),
    ("WITH f AS (SELECT host, min(ts) t FROM events WHERE kind = 'proc.exited' AND code = 1 "
     "GROUP BY host) SELECT * FROM f ORDER BY t", "WITH part"),
    ("WITH cur AS (SELECT host, kind, rank, max(ts) AS ts FROM events GROUP BY host, kind) "
     "SELECT host, kind, rank FROM cur WHERE rank != (SELECT rank FROM cur AS c "
     "WHERE c.kind = cur.kind ORDER BY ts DESC LIMIT 1) ORDER BY host, kind", "WITH part"),
    ("WITH e AS (SELECT * FROM events WHERE code = 1), r AS (SELECT host, count(*) n FROM "
     "events GROUP BY host) SELECT e.host, count(*), r.n FROM e JOIN r ON e.host = r.host "
     "GROUP BY e.host ORDER BY e.host", "WITH part"),
    ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
     "SELECT i, (SELECT count(*) FROM events WHERE rank = i) FROM n ORDER BY i", "controller"),
    ("SELECT host, kind, row_number() OVER (PARTITION BY host ORDER BY ts) r FROM events "
     "WHERE bytes > 900 ORDER BY host, r", "controller"),
]


@pytest.mark.parametrize("sql, pushed", CASES)
def test_the_answer_is_the_query_over_every_node_at_once(nodes, sql, pushed):
    dbs, union = nodes
    p, rows = answer(dbs, sql)
    reference = q.plan(sql).final if p.how.startswith("the WHERE") else sql
    assert rounded(rows) == rounded(union.execute(reference).fetchall())
    assert pushed in p.how


def test_aggregates_and_filters_run_on_the_nodes():
    p = q.plan("SELECT host, kind, count(*) FROM events WHERE kind LIKE 'push.%' "
               "GROUP BY host, kind")
    [node_sql] = p.nodes.values()
    # host is one value on a node: grouping by it there would only cost a sort
    assert node_sql.endswith("WHERE kind LIKE 'push.%' GROUP BY kind"), node_sql
    p = q.plan("SELECT ts, text FROM events WHERE kind = 'error' ORDER BY ts DESC LIMIT 3")
    assert p.nodes == {"events": 'SELECT "ts", "kind", "text" FROM events WHERE kind = '
                                 "'error' ORDER BY ts DESC LIMIT 3"}
    assert p.final.startswith("SELECT host, ts, text")  # every row says where it comes from


@pytest.mark.parametrize("sql, error", [
    ("DELETE FROM events", "read-only"),
    ("UPDATE events SET kind = 'x'", "read-only"),
    ("SELECT 1; SELECT 2", "one statement"),
    ("SELECT FROM WHERE", "cannot parse"),
    ("SELECT * FROM sqlite_master", "no table sqlite_master"),
    ("SELECT 1", "reads no table"),
    ("SELECT nosuch FROM events", "no such column: nosuch"),
])
def test_bad_input_is_one_clear_error(sql, error):
    with pytest.raises(q.QueryError, match=error):
        q.check(q.plan(sql))


def test_the_docs_questions_plan_and_split():
    """The questions of docs/guides/telemetry.md are valid queries over these tables, and each
    sends the nodes a filtered or aggregated part (none ships every row). tests/test_docs.py
    runs them on a real cluster."""
    queries = [b.code for b in marked_blocks(REPO / "docs" / "guides" / "telemetry.md")
               if b.lang == "sql"]
    assert len(queries) == 5
    for sql in queries:
        p = q.plan(sql)
        q.check(p)
        assert "the query itself on the controller" not in p.how, (sql, p.how)
        assert all(" WHERE " in s or " GROUP BY " in s for s in p.nodes.values()), p.nodes
