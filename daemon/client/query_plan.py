"""How `monarch-fs query` splits a statement between the nodes and the controller (query.py
runs the parts): what each node runs over its own tables, and what the controller runs over
the rows that come back.

What travels is as little as the query allows (`plan`, with sqlglot parsing the statement):
- an aggregate over one table (`GROUP BY`, `count`, `sum`, `total`, `min`, `max`, `avg`)
  runs as partial aggregates on every node, grouped the same way, under the query's WHERE;
  the controller combines them (counts summed, averages as summed sums over summed counts)
  and applies HAVING, ORDER BY and LIMIT: one row per group per node travels;
- any other query on one table sends the WHERE and only the columns it uses to the nodes
  (and with ORDER BY ... LIMIT over plain columns, each node's first LIMIT rows only);
- joins, subqueries, window functions and set operations get each table's used columns from
  every node (filtered where a WHERE applies to a table read once), and run whole on the
  controller.
`host` is each node's address in the host list; on a node it is the parameter `:host`, so a
filter on it runs there too. A non-aggregate query gets `host` as its first column unless it
names it itself.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from ..wire.telemetry_tables import SCHEMA, TABLES

DIALECT = "sqlite"
# Aggregates a node can compute in part: how the controller combines each node's partial.
_COMBINE = {exp.Count: "coalesce(sum({}), 0)", exp.Sum: "sum({})", exp.Min: "min({})",
            exp.Max: "max({})"}


class QueryError(ValueError):
    """A query that cannot run: not a single reading statement, unparseable, or wrong for
    these tables (the message says which)."""


@dataclass(frozen=True)
class Plan:
    """What each node runs (`nodes`: controller table -> its SQL, `:host` bound to the node's
    address; `columns`: that table's columns, after `host`) and what the controller runs over
    those tables (`final`). `how` says in a few words what was pushed down."""

    nodes: dict[str, str]
    columns: dict[str, list[str]]
    final: str
    how: str
    # Tables the controller makes first, in order, from the nodes' tables (a WITH query's
    # parts, each split like a query of its own): (name, SQL).
    stages: list[tuple[str, str]] = field(default_factory=list)


def plan(sql: str) -> Plan:
    """Split `sql` into the nodes' part and the controller's (see the module docstring);
    QueryError for a statement that cannot run."""
    try:
        trees = [t for t in sqlglot.parse(sql, read=DIALECT) if t is not None]
    except ParseError as e:
        raise QueryError(f"cannot parse the query: {_first_error(e)}") from None
    if len(trees) != 1:
        raise QueryError("one statement at a time, please")
    tree = trees[0]
    if not isinstance(tree, exp.Query):
        raise QueryError(f"only SELECT statements run: telemetry is read-only (this is "
                         f"{type(tree).__name__.upper()})")
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    tables = [t for t in tree.find_all(exp.Table) if t.name.lower() not in ctes]
    names = {t.name.lower() for t in tables}
    unknown = names - set(TABLES)
    if unknown:
        raise QueryError(f"no table {', '.join(sorted(unknown))}: the tables are "
                         f"{' and '.join(TABLES)} (monarch-fs query --schema)")
    if not names:
        raise QueryError(f"the query reads no table: the tables are {' and '.join(TABLES)}")
    return _split(tree, tables, top=True) or _staged_plan(tree) or _rows_plan(tree, tables)


def _split(tree: exp.Query, tables: list[exp.Table], top: bool = False) -> Plan | None:
    """The plan of a SELECT over one table: partial aggregates, or the filter, on the nodes;
    None for anything else. `top`: the statement itself (its rows get a `host` column)."""
    simple = _single_table_select(tree, tables) if isinstance(tree, exp.Select) else None
    if simple is None or not isinstance(tree, exp.Select):
        return None
    if _aggregates(tree):
        return _aggregate_plan(tree, simple)
    return _filter_plan(tree, simple, top)


def _staged_plan(tree: exp.Query) -> Plan | None:
    """A WITH query whose parts each read one table and whose body reads only them: each part
    is split as a query of its own (its own tables on the nodes, a table of its rows made on
    the controller), and the body runs over those tables."""
    with_ = tree.args.get("with") or tree.args.get("with_")
    if with_ is None or with_.args.get("recursive"):
        return None
    names = [c.alias_or_name.lower() for c in with_.expressions]
    nodes: dict[str, str] = {}
    columns: dict[str, list[str]] = {}
    stages: list[tuple[str, str]] = []
    for cte in with_.expressions:
        body = cte.this
        tables = [t for t in body.find_all(exp.Table) if t.name.lower() not in names]
        if len(tables) != len(list(body.find_all(exp.Table))):
            return None  # a part that reads another part
        part = _split(body, tables)
        if part is None:
            return None
        rename = {old: f"_{cte.alias_or_name.lower()}_{old.strip('_')}" for old in part.nodes}
        for old, new in rename.items():
            nodes[new] = part.nodes[old]
            columns[new] = part.columns[old]
        stages.append((cte.alias_or_name, _renamed(part.final, rename)))
    outer = tree.copy()
    outer.set("with", None)
    outer.set("with_", None)
    if any(t.name.lower() not in names for t in outer.find_all(exp.Table)):
        return None
    return Plan(nodes, columns, outer.sql(dialect=DIALECT),
                f"each WITH part split on its own ({len(stages)}); the body on the "
                "controller", stages)


def _renamed(sql: str, names: dict[str, str]) -> str:
    tree = sqlglot.parse_one(sql, read=DIALECT)
    return tree.transform(lambda n: exp.to_table(names[n.name]) if isinstance(n, exp.Table)
                          and n.name in names else n).sql(dialect=DIALECT)


def _first_error(e: ParseError) -> str:
    errors = getattr(e, "errors", None) or []
    if errors and isinstance(errors[0], dict) and errors[0].get("description"):
        first = errors[0]
        return f"{first['description']} (line {first.get('line')}, column {first.get('col')})"
    return str(e).splitlines()[0]


def _single_table_select(tree: exp.Select, tables: list[exp.Table]) -> str | None:
    """The table a plain SELECT reads, when it reads exactly one, with no join, subquery,
    CTE, window function or set operation; else None."""
    if len(tables) != 1 or tree.args.get("joins"):
        return None
    if tree.args.get("with") or tree.args.get("with_"):
        return None
    if any(s is not tree for s in tree.find_all(exp.Select)) or tree.find(exp.Window):
        return None
    return tables[0].name.lower()


def _aggregates(tree: exp.Select) -> bool:
    return bool(tree.args.get("group")) or any(_is_aggregate(n) for n in tree.walk())


def _is_aggregate(node: exp.Expr) -> bool:
    if isinstance(node, exp.AggFunc):
        return True
    return isinstance(node, exp.Anonymous) and node.name.lower() in ("total", "string_agg")


def _host_param(node: exp.Expr) -> exp.Expr:
    """`host` is the parameter :host on a node."""
    if isinstance(node, exp.Column) and node.name.lower() == "host" and not node.table:
        return exp.Placeholder(this="host")
    return node


def _on_node(node: exp.Expr) -> exp.Expr:
    return node.copy().transform(_host_param)


def _used_columns(tree: exp.Expr, table: str) -> list[str] | None:
    """The columns of `table` the query names (in the table's order); None: all (a `*`)."""
    for sel in tree.find_all(exp.Select):
        for e in sel.expressions:
            if isinstance(e, exp.Star) or (isinstance(e, exp.Column)
                                           and isinstance(e.this, exp.Star)):
                return None
    named = {c.name.lower() for c in tree.find_all(exp.Column)}
    return [c for c in TABLES[table] if c in named]


def _select_sql(columns: Sequence[str], table: str, where: exp.Expr | None,
                tail: str = "") -> str:
    cols = ", ".join(f'"{c}"' for c in columns)
    cond = f" WHERE {where.sql(dialect=DIALECT)}" if where is not None else ""
    return f"SELECT {cols} FROM {table}{cond}{tail}"


def _filter_plan(tree: exp.Select, table: str, top: bool) -> Plan:
    """One table, no aggregate: the WHERE and the used columns go to the nodes (and
    ORDER BY ... LIMIT over plain columns too)."""
    used = _used_columns(tree, table)
    columns = list(TABLES[table]) if used is None else used or ["ts"]
    where = tree.args.get("where")
    cond = _on_node(where.this) if where is not None else None
    tail = ""
    order, limit = tree.args.get("order"), tree.args.get("limit")
    aliases = {e.alias.lower() for e in tree.expressions if isinstance(e, exp.Alias)}
    if order is not None and limit is not None and not tree.args.get("distinct") \
            and isinstance(limit.expression, exp.Literal) and _plain(order, table, aliases):
        offset = tree.args.get("offset")
        n = int(limit.expression.this)
        if offset is not None and isinstance(offset.expression, exp.Literal):
            n += int(offset.expression.this)
        elif offset is not None:
            n = -1
        if n >= 0:
            tail = f" {_on_node(order).sql(dialect=DIALECT)} LIMIT {n}"
    final = tree.copy()
    if top and used is not None and not any(e.alias_or_name.lower() == "host"
                                            for e in final.expressions):
        final.set("expressions", [exp.column("host"), *final.expressions])
    pushed = "the WHERE" if where is not None else "no filter"
    return Plan({table: _select_sql(columns, table, cond, tail)}, {table: columns},
                final.sql(dialect=DIALECT),
                f"{pushed}{' and ORDER BY ... LIMIT' if tail else ''} on the nodes; "
                f"{len(columns)} columns travel")


def _plain(order: exp.Expr, table: str, aliases: set[str]) -> bool:
    """Whether ORDER BY names only the table's columns (a node can sort alone)."""
    for c in order.find_all(exp.Column):
        name = c.name.lower()
        if name in aliases or (name not in TABLES[table] and name != "host"):
            return False
    return not any(isinstance(o.this, exp.Literal) for o in order.expressions)


def _aggregate_plan(tree: exp.Select, table: str) -> Plan | None:
    """Partial aggregates on the nodes, combined on the controller; None when the query's
    aggregates or bare columns cannot be split that way."""
    group = tree.args.get("group")
    keys: list[exp.Expr] = []
    selected = tree.expressions
    for g in group.expressions if group is not None else []:
        if isinstance(g, exp.Literal) and not g.is_string:  # GROUP BY 2
            i = int(g.this) - 1
            if not 0 <= i < len(selected):
                return None
            g = selected[i].unalias()
        elif isinstance(g, exp.Column) and not g.table:  # GROUP BY an alias
            named = [e for e in selected if isinstance(e, exp.Alias)
                     and e.alias.lower() == g.name.lower()]
            if named and g.name.lower() not in TABLES[table]:
                g = named[0].unalias()
        keys.append(g)
    node_cols: list[str] = []
    node_exprs: list[str] = []
    for i, g in enumerate(keys):
        node_cols.append(f"_g{i}")
        node_exprs.append(f"{_on_node(g).sql(dialect=DIALECT)} AS _g{i}")
    partials: list[str] = []

    def partial(sql: str) -> str:
        name = f"_a{len(partials)}"
        partials.append(f"{sql} AS {name}")
        node_cols.append(name)
        return name

    failed = False
    aggs = [n for n in tree.walk() if _is_aggregate(n)]
    # SQLite's bare columns: with a single min() or max(), they come from the row holding it;
    # each node's are those of its own row, and the controller's max picks the right node's.
    bare_ok = len(aggs) == 1 and type(aggs[0]) in (exp.Min, exp.Max) \
        and not aggs[0].args.get("expressions")

    def combine(node: exp.Expr) -> exp.Expr:
        nonlocal failed
        for i, g in enumerate(keys):
            if node == g:
                return exp.column(f"_g{i}")
        if bare_ok and isinstance(node, exp.Column) and node.find_ancestor(exp.AggFunc) is None \
                and (node.name.lower() in TABLES[table] or node.name.lower() == "host"):
            return exp.column(partial(_on_node(node).sql(dialect=DIALECT)))
        if not _is_aggregate(node):
            return node
        if node.args.get("distinct") or isinstance(node.this, exp.Distinct):
            failed = True
            return node
        if isinstance(node, exp.Anonymous):  # total(x); string_agg is left to the rows
            if node.name.lower() != "total" or len(node.expressions) != 1:
                failed = True
                return node
            arg = _on_node(node.expressions[0]).sql(dialect=DIALECT)
            return sqlglot.parse_one(f"total({partial(f'total({arg})')})", read=DIALECT)
        arg = node.this
        if not isinstance(arg, exp.Expr) or node.args.get("expressions"):
            failed = True
            return node
        inner = "*" if isinstance(arg, exp.Star) else _on_node(arg).sql(dialect=DIALECT)
        if isinstance(node, exp.Avg):
            s, n = partial(f"sum({inner})"), partial(f"count({inner})")
            return sqlglot.parse_one(f"sum({s}) * 1.0 / sum({n})", read=DIALECT)
        for kind, how in _COMBINE.items():
            if type(node) is kind:
                name = partial(f"{type(node).__name__.lower()}({inner})")
                return sqlglot.parse_one(how.format(name), read=DIALECT)
        failed = True  # group_concat, stddev...: on the controller, over the rows
        return node

    final = tree.copy()
    final.set("where", None)
    final.set("from_", exp.From(this=exp.to_table("_partial")))
    outputs = []
    for e in final.expressions:
        name = e.alias if isinstance(e, exp.Alias) else (
            e.name if isinstance(e, exp.Column) else e.sql(dialect=DIALECT))
        outputs.append(exp.alias_(e.unalias().transform(combine), name, quoted=True))
    final.set("expressions", outputs)
    for key in ("having", "order"):
        if final.args.get(key) is not None:
            final.set(key, final.args[key].transform(combine))
    if keys:
        final.set("group", exp.Group(expressions=[exp.column(f"_g{i}")
                                                  for i in range(len(keys))]))
    out_names = {str(o.alias).lower() for o in outputs}
    if failed or any(isinstance(e, exp.Star) for e in tree.expressions):
        return None
    def bare(e: exp.Expr | None, allowed: set[str]) -> bool:
        """A column left that is no group key, partial or (in HAVING, ORDER BY) output."""
        return e is not None and any(
            not c.name.lower().startswith(("_g", "_a")) and c.name.lower() not in allowed
            for c in e.find_all(exp.Column))

    if any(bare(o.unalias(), set()) for o in outputs) or any(
            bare(final.args.get(k), out_names) for k in ("having", "order")):
        return None
    where = tree.args.get("where")
    cond = f" WHERE {_on_node(where.this).sql(dialect=DIALECT)}" if where is not None else ""
    # A key that is the same on the whole node (host) is left out of its GROUP BY: it would
    # make SQLite sort every row; with none left, a node without rows must return none.
    varying = [g for g in keys if g.find(exp.Column) is not None
               and any(c.name.lower() != "host" for c in g.find_all(exp.Column))]
    by = (" GROUP BY " + ", ".join(_on_node(g).sql(dialect=DIALECT) for g in varying)) \
        if varying else (" HAVING count(*) > 0" if keys else "")
    node_sql = f"SELECT {', '.join(node_exprs + partials)} FROM {table}{cond}{by}"
    return Plan({"_partial": node_sql}, {"_partial": node_cols}, final.sql(dialect=DIALECT),
                f"partial aggregates{' under the WHERE' if where is not None else ''} on the "
                f"nodes, {len(keys)} group keys; combined on the controller")


def _rows_plan(tree: exp.Expr, tables: list[exp.Table]) -> Plan:
    """Each table's used columns from every node (filtered by the WHERE of a table read
    once, where it names only that table's columns); the whole query on the controller."""
    nodes, columns = {}, {}
    for name in sorted({t.name.lower() for t in tables}):
        used = _used_columns(tree, name)
        cols = list(TABLES[name]) if used is None else used or ["ts"]  # one, to count rows
        reads = [t for t in tables if t.name.lower() == name]
        cond = _pushable_where(reads[0], name) if len(reads) == 1 else None
        nodes[name] = _select_sql(cols, name, cond)
        columns[name] = cols
    return Plan(nodes, columns, tree.sql(dialect=DIALECT),
                "the used columns (and a table's own WHERE) on the nodes; the query itself "
                "on the controller")


def _pushable_where(table: exp.Table, name: str) -> exp.Expr | None:
    """The conjuncts of the WHERE of the SELECT that reads `table` alone (no join) that name
    only its columns and hold no subquery."""
    sel = table.parent_select
    if sel is None or sel.args.get("joins") or table.parent is not sel.args.get("from_"):
        return None
    where = sel.args.get("where")
    if where is None:
        return None
    alias = table.alias_or_name.lower()
    keep = []
    for part in where.this.flatten() if isinstance(where.this, exp.And) else [where.this]:
        if part.find(exp.Select) or part.find(exp.Subquery):
            continue
        cols = list(part.find_all(exp.Column))
        if all((not c.table or c.table.lower() in (alias, name))
               and (c.name.lower() in TABLES[name] or c.name.lower() == "host") for c in cols):
            keep.append(_on_node(part).transform(
                lambda n: exp.column(n.name) if isinstance(n, exp.Column) else n))
    return exp.and_(*keep) if keep else None


def check(p: Plan) -> None:
    """Have SQLite prepare every part against empty tables, so a wrong column or function
    is one error before any node is asked (QueryError)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        for sql in p.nodes.values():
            _explain(db, sql, {"host": ""})
        for table, cols in p.columns.items():
            db.execute(f'DROP TABLE IF EXISTS "{table}"')
            db.execute(create_table(table, cols))
        for name, sql in p.stages:
            _explain(db, sql, {})
            db.execute(f'CREATE TABLE "{name}" AS {sql}')
        _explain(db, p.final, {})
    finally:
        db.close()


def _explain(db: sqlite3.Connection, sql: str, params: dict) -> None:
    try:
        db.execute(f"EXPLAIN {sql}", params)
    except sqlite3.Error as e:
        raise QueryError(f"query: {e}") from None


def create_table(table: str, columns: Sequence[str]) -> str:
    return f'CREATE TABLE "{table}" (host, {", ".join(f"{chr(34)}{c}{chr(34)}" for c in columns)})'
