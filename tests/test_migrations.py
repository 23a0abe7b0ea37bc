"""Installing and upgrading the schema: a fresh install equals the replayed migrations,
install is idempotent and refuses newer schemas, schema names are validated and quoted, and
nothing depends on search_path."""

from __future__ import annotations

import inspect
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from psycopg import sql

import lonnymq
from lonnymq import CURRENT_VERSION, Outcome, migrator
from lonnymq._compat import LiteralString
from lonnymq.testing import TempPostgres
from tests import invariants
from tests.conftest import function_calls

Conn = psycopg.Connection[Any]
Catalog = dict[str, list[tuple[Any, ...]]]


@pytest.fixture
def other_schema(pg_dsn: str) -> Iterator[str]:
    """A second fresh schema name, dropped after the test."""
    name = f"lmq_mig_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


# --- catalog snapshots -----------------------------------------------------------------------

# One query per kind of object; %(schema)s is the schema name. Rows are compared after the
# schema name is replaced by a placeholder, so two schemas can be compared.
_CATALOG: dict[str, LiteralString] = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.relrowsecurity,
               coalesce(c.relacl::text, ''), coalesce(obj_description(c.oid, 'pg_class'), ''),
               CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) END
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1""",
    # position among the live columns (a migration may leave dropped columns behind)
    "columns": """
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum),
               a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity,
               a.attgenerated, coalesce(pg_get_expr(d.adbin, d.adrelid), ''),
               coalesce(co.collname, ''), coalesce(col_description(c.oid, a.attnum), '')
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
        WHERE n.nspname = %(schema)s AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
        ORDER BY 1, 2""",
    "indexes": """
        SELECT i.relname, t.relname, pg_get_indexdef(i.oid), x.indisunique, x.indisprimary,
               x.indisvalid, x.indimmediate
        FROM pg_index x
        JOIN pg_class i ON i.oid = x.indexrelid
        JOIN pg_class t ON t.oid = x.indrelid
        JOIN pg_namespace n ON n.oid = i.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1""",
    # A NOT NULL constraint (a row of its own from Postgres 18 on) is compared by what it
    # constrains, not by its name: Postgres names it after its table and column and adds a
    # number when that name is taken, so the same column is "message_priority_not_null" in a
    # fresh install and "message_priority_not_null1" after migrations that recreate the table.
    # Nothing refers to these names; a missing NOT NULL still shows (here and in "columns").
    "constraints": """
        SELECT coalesce(t.relname, ''), CASE WHEN con.contype = 'n' THEN '' ELSE con.conname END,
               con.contype, pg_get_constraintdef(con.oid),
               con.condeferrable, con.condeferred, con.convalidated
        FROM pg_constraint con
        JOIN pg_namespace n ON n.oid = con.connamespace
        LEFT JOIN pg_class t ON t.oid = con.conrelid
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2, 4""",
    "sequences": """
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle
        FROM pg_sequence s
        JOIN pg_class c ON c.oid = s.seqrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal
        ORDER BY 1, 2""",
    "policies": """
        SELECT c.relname, p.polname, p.polcmd, p.polpermissive,
               coalesce(pg_get_expr(p.polqual, p.polrelid), ''),
               coalesce(pg_get_expr(p.polwithcheck, p.polrelid), '')
        FROM pg_policy p
        JOIN pg_class c ON c.oid = p.polrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2""",
    "types": """
        SELECT t.typname, t.typtype, format_type(t.oid, NULL),
               coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                         FROM pg_enum e WHERE e.enumtypid = t.oid), ''),
               coalesce(format_type(t.typbasetype, t.typtypmod), ''), t.typnotnull
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), l.lanname,
               p.prokind, p.provolatile, p.proisstrict, p.prosecdef, p.proleakproof,
               p.proparallel, p.procost, p.prorows, coalesce(p.proconfig::text, ''),
               coalesce(p.proacl::text, ''), coalesce(obj_description(p.oid, 'pg_proc'), ''),
               p.prosrc
        FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        JOIN pg_language l ON l.oid = p.prolang
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2""",
}


def _normalise(value: Any, schema: str) -> Any:
    return value.replace(schema, "<schema>") if isinstance(value, str) else value


def catalog(conn: Conn, schema: str) -> Catalog:
    """Every object of ``schema`` as rows, with the schema name replaced by a placeholder."""
    snapshot: Catalog = {}
    for kind, query in _CATALOG.items():
        rows = conn.execute(query, {"schema": schema}).fetchall()
        snapshot[kind] = [tuple(_normalise(v, schema) for v in row) for row in rows]
    return snapshot


def catalog_differences(a: Catalog, b: Catalog) -> list[str]:
    """Readable differences between two snapshots (empty when they are equal)."""
    out = []
    for kind in a.keys() | b.keys():
        rows_a, rows_b = a.get(kind, []), b.get(kind, [])
        if rows_a == rows_b:
            continue
        only_a = [r for r in rows_a if r not in rows_b]
        only_b = [r for r in rows_b if r not in rows_a]
        out.append(f"{kind}: only in the first {only_a}; only in the second {only_b}")
        if not only_a and not only_b:
            out.append(f"{kind}: same rows in another order")
    return out


def migration_rows(conn: Conn, schema: str, *, with_time: bool = False) -> list[tuple[Any, ...]]:
    columns = sql.SQL("version, name, applied_at" if with_time else "version, name")
    query = sql.SQL("SELECT {} FROM {}.migration ORDER BY version").format(
        columns, sql.Identifier(schema)
    )
    return conn.execute(query).fetchall()


def replay_migrations(conn: Conn, schema: str) -> None:
    """Apply lonnymq.migrations(schema) by hand, each in its own transaction, as a team using
    its own migration tool would."""
    for _name, text in lonnymq.migrations(schema):
        with conn.transaction():
            conn.execute(text.encode())


def schema_exists(conn: Conn, schema: str) -> bool:
    row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    return row == (1,)


# --- 1. fresh install == replayed migrations -------------------------------------------------


def test_fresh_install_equals_replayed_migrations(
    schema: str, other_schema: str, connect: Callable[..., Conn]
) -> None:
    conn = connect()
    assert lonnymq.install(conn, schema) == [name for name, _ in lonnymq.migrations(schema)]
    # replayed with no search_path at all: no migration may depend on it
    bare = connect(options="-c search_path=")
    replay_migrations(bare, other_schema)

    fresh, replayed = catalog(conn, schema), catalog(conn, other_schema)
    assert fresh["relations"] and fresh["functions"], "the snapshot saw nothing"
    assert not catalog_differences(fresh, replayed), "\n".join(catalog_differences(fresh, replayed))
    expected = [(int(name[:4]), name[5:]) for name, _ in lonnymq.migrations(schema)]
    assert migration_rows(conn, schema) == expected
    assert migration_rows(conn, other_schema) == expected
    assert expected[-1][0] == CURRENT_VERSION
    # the replayed schema is current for lonnymq
    assert lonnymq.install(conn, other_schema) == []
    assert lonnymq.Broker(other_schema).check(conn) == CURRENT_VERSION


@pytest.mark.parametrize(
    "change",
    [
        "ALTER TABLE {s}.message ADD COLUMN extra integer",
        "ALTER TABLE {s}.message ALTER COLUMN attempts TYPE bigint",
        "ALTER TABLE {s}.message ALTER COLUMN name SET NOT NULL",
        "ALTER TABLE {s}.message ALTER COLUMN priority DROP NOT NULL",
        "ALTER TABLE {s}.lane ALTER COLUMN served_at SET DEFAULT 'infinity'",
        "ALTER TABLE {s}.queue DROP CONSTRAINT queue_max_size_check",
        "DROP INDEX {s}.message_locked_idx",
        "CREATE INDEX message_extra_idx ON {s}.message (created_at)",
        "ALTER FUNCTION {s}.queue_ensure_v1(text) STABLE",
        "ALTER FUNCTION {s}.queue_ensure_v1(text) SET search_path = pg_catalog",
        "CREATE FUNCTION {s}.extra_v1() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
        "CREATE TABLE {s}.extra (id integer)",
    ],
)
def test_catalog_comparison_sees_differences(
    schema: str, other_schema: str, connect: Callable[..., Conn], change: LiteralString
) -> None:
    """The comparison above is not vacuous: one small change to a schema makes it fail."""
    conn = connect()
    lonnymq.install(conn, schema)
    lonnymq.install(conn, other_schema)
    assert not catalog_differences(catalog(conn, schema), catalog(conn, other_schema))
    conn.execute(sql.SQL(change).format(s=sql.Identifier(other_schema)))
    assert catalog_differences(catalog(conn, schema), catalog(conn, other_schema))


def test_catalog_comparison_ignores_only_the_names_of_not_null_constraints(
    schema: str, other_schema: str, connect: Callable[..., Conn]
) -> None:
    """From Postgres 18 on NOT NULL constraints have names, which differ between a fresh
    install and replayed migrations; other constraints' names still count."""
    conn = connect()
    lonnymq.install(conn, schema)
    lonnymq.install(conn, other_schema)
    rename = "ALTER TABLE {s}.{t} RENAME CONSTRAINT {a} TO {b}"

    def renamed(table: str, old: str, new: str) -> list[str]:
        conn.execute(
            sql.SQL(rename).format(
                s=sql.Identifier(other_schema),
                t=sql.Identifier(table),
                a=sql.Identifier(old),
                b=sql.Identifier(new),
            )
        )
        return catalog_differences(catalog(conn, schema), catalog(conn, other_schema))

    if conn.info.server_version >= 180000:
        assert not renamed("message", "message_priority_not_null", "message_priority_not_null1")
    assert renamed("queue", "queue_max_size_check", "queue_max_size_check1")


def test_catalog_comparison_sees_a_changed_function_body(
    schema: str, other_schema: str, connect: Callable[..., Conn]
) -> None:
    conn = connect()
    lonnymq.install(conn, schema)
    lonnymq.install(conn, other_schema)
    row = conn.execute(
        "SELECT pg_get_functiondef(%s::regprocedure)",
        (f"{other_schema}.lane_next_v1({other_schema}.lane, pg_snapshot)",),
    ).fetchone()
    assert row is not None
    changed = str(row[0]).replace("LIMIT 1", "LIMIT 2", 1)
    assert changed != row[0]
    conn.execute(changed.encode())
    differences = catalog_differences(catalog(conn, schema), catalog(conn, other_schema))
    assert differences and all(d.startswith("functions") for d in differences), differences


# --- 2. idempotence --------------------------------------------------------------------------


def test_install_is_idempotent(schema: str, connect: Callable[..., Conn]) -> None:
    conn = connect()
    assert not schema_exists(conn, schema)
    # pending_sql only reads: on a missing schema it is the fresh install, and creates nothing
    assert "CREATE TABLE" in migrator.pending_sql(conn, schema)
    assert migrator.installed_version(conn, schema) is None
    assert not schema_exists(conn, schema)

    assert lonnymq.install(conn, schema) == [name for name, _ in lonnymq.migrations(schema)]
    before = catalog(conn, schema)
    rows = migration_rows(conn, schema, with_time=True)
    assert lonnymq.install(conn, schema) == []
    assert lonnymq.Broker(schema).install(conn) == []
    assert catalog(conn, schema) == before
    assert migration_rows(conn, schema, with_time=True) == rows
    assert migrator.pending_sql(conn, schema) == ""
    assert migrator.installed_version(conn, schema) == CURRENT_VERSION
    assert lonnymq.Broker(schema).check(conn) == CURRENT_VERSION


def test_install_in_the_callers_transaction(schema: str, connect: Callable[..., Conn]) -> None:
    conn = connect(autocommit=False)
    conn.execute("SELECT 1")  # the caller's transaction is open: install uses a savepoint
    assert lonnymq.install(conn, schema) != []
    assert lonnymq.install(conn, schema) == []  # sees its own uncommitted install
    conn.rollback()
    assert migrator.installed_version(conn, schema) is None
    conn.rollback()


def test_concurrent_installs_apply_once(schema: str, connect: Callable[..., Conn]) -> None:
    conns = [connect() for _ in range(4)]
    results: list[list[str]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(conns))

    def work(conn: Conn) -> None:
        try:
            barrier.wait()
            results.append(lonnymq.install(conn, schema))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    applied = [r for r in results if r]
    assert len(results) == len(conns) and len(applied) == 1, results
    assert migration_rows(conns[0], schema) == [
        (int(name[:4]), name[5:]) for name, _ in lonnymq.migrations(schema)
    ]


# --- 2b. a server older than lonnymq supports ---------------------------------------------------


@pytest.fixture
def old_server() -> Iterator[TempPostgres]:
    """A throwaway Postgres 11 ($LONNYMQ_TEST_OLD_PG_BINDIR: .ci/postgres-binaries 11)."""
    bindir = os.environ.get("LONNYMQ_TEST_OLD_PG_BINDIR")
    if not bindir:
        if os.environ.get("CI"):
            pytest.fail("LONNYMQ_TEST_OLD_PG_BINDIR is not set (.ci/run sets it)")
        pytest.skip("set LONNYMQ_TEST_OLD_PG_BINDIR=$(.ci/postgres-binaries 11)")
    server = TempPostgres(bindir=Path(bindir)).init().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.mark.slow
def test_install_refuses_a_server_older_than_13(old_server: TempPostgres) -> None:
    """On Postgres 11, install (and so a transport's first use) refuses with a typed error
    that says what is needed, before it writes anything."""
    with psycopg.connect(old_server.dsn(), autocommit=True) as conn:
        assert conn.info.server_version // 10000 == 11
        with pytest.raises(lonnymq.UnsupportedServer, match=r"PostgreSQL 11\.\d+ is not") as err:
            lonnymq.install(conn)
        assert "13 or newer" in str(err.value) and err.value.oldest == 13
        assert not schema_exists(conn, "lonnymq")
        url = "lonnymq://" + old_server.dsn().split("://", 1)[1]
        with Connection(url) as kombu, pytest.raises(lonnymq.UnsupportedServer):  # type: ignore[no-untyped-call]
            kombu.SimpleQueue("jobs").put({"x": 1})
        assert not schema_exists(conn, "lonnymq")


# --- 3. a schema from a newer lonnymq ----------------------------------------------------------


def test_schema_too_new_is_refused(schema: str, connect: Callable[..., Conn]) -> None:
    conn = connect()
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    conn.execute(
        sql.SQL("INSERT INTO {}.migration (version, name) VALUES (999, 'from_the_future')").format(
            sql.Identifier(schema)
        )
    )
    before = catalog(conn, schema)
    rows = migration_rows(conn, schema, with_time=True)

    with pytest.raises(lonnymq.SchemaTooNew) as raised:
        lonnymq.install(conn, schema)
    assert (raised.value.schema, raised.value.installed, raised.value.known) == (
        schema,
        999,
        CURRENT_VERSION,
    )
    assert "999" in str(raised.value)
    with pytest.raises(lonnymq.SchemaTooNew):
        broker.install(conn)
    with pytest.raises(lonnymq.SchemaTooNew):
        broker.check(conn)
    with pytest.raises(lonnymq.SchemaTooNew):
        migrator.pending_sql(conn, schema)
    assert isinstance(raised.value, lonnymq.SchemaError)
    assert catalog(conn, schema) == before
    assert migration_rows(conn, schema, with_time=True) == rows


# --- 4. schema names -------------------------------------------------------------------------


class _NoDatabase:
    """Stands in for a connection; any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the database was touched (.{name}) before the name was checked")


INVALID_NAMES: list[object] = [
    "",
    "Upper",
    "1abc",
    "a-b",
    'x"; drop table',
    "a" * 49,
    "pg_foo",
    None,
    123,
    "a b",
    "abc\n",
    "é",
    "lonnymq.x",
    b"lonnymq",
]


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_invalid_schema_names_are_refused_before_the_database(name: object) -> None:
    fake: Any = _NoDatabase()
    bad: Any = name
    calls: list[Callable[[], object]] = [
        lambda: lonnymq.Broker(bad),
        lambda: lonnymq.Queue("q", schema=bad),
        lambda: lonnymq.install(fake, bad),
        lambda: lonnymq.migrations(bad),
        lambda: migrator.install(fake, bad),
        lambda: migrator.check(fake, bad),
        lambda: migrator.pending_sql(fake, bad),
        lambda: migrator.installed_version(fake, bad),
        lambda: migrator.fresh_install_sql(bad),
        lambda: migrator.wake_channel(bad),
    ]
    for call in calls:
        with pytest.raises(lonnymq.InvalidName):
            call()


@pytest.mark.parametrize("name", ["a", "_", "lonnymq", "tenant_42", "a" * 48, "x1_"])
def test_valid_schema_names_are_accepted(name: str) -> None:
    assert lonnymq.Broker(name).schema == name
    assert migrator.validate_schema(name) == name
    assert lonnymq.migrations(name)


# --- 5. quoting of the rendered SQL ----------------------------------------------------------


def _lex(text: str, *, keep_literals: bool) -> str:
    """``text`` without its comments; string literals kept or emptied to ''."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
        elif text[i] == "'":
            j = i + 1
            while True:
                j = text.index("'", j)
                if text.startswith("''", j):
                    j += 2
                    continue
                break
            out.append(text[i : j + 1] if keep_literals else "''")
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _code_only(text: str) -> str:
    return _lex(text, keep_literals=False)


@pytest.mark.parametrize("name", ["s1", "lmq_quote_probe"])
def test_rendered_sql_quotes_the_schema(name: str) -> None:
    texts = [text for _, text in lonnymq.migrations(schema=name)]
    fresh = migrator.fresh_install_sql(name)
    texts.append(fresh)
    quoted = f'"{name}"'
    # the NOTIFY channel and the advisory lock prefix are this schema's, as literals
    literals = [f"'{name}_wake'", f"'lonnymq:{name}:'"]
    for literal in literals:
        assert literal in _lex(fresh, keep_literals=True)
    for text in texts:
        code = _code_only(text)
        # every placeholder was filled in
        assert not re.findall(r"\{[a-z_]*\}", code), re.findall(r"\{[a-z_]*\}", code)
        # the schema appears only as a quoted identifier, or inside the two literals
        rest = _lex(text, keep_literals=True)
        for literal in literals:
            rest = rest.replace(literal, "''")
        for match in re.finditer(rf"(?<![\w$]){re.escape(name)}(?![\w$])", rest):
            context = rest[match.start() - 1 : match.end() + 1]
            assert context == quoted, (
                f"unquoted schema name: {rest[match.start() - 30 : match.end() + 30]!r}"
            )
        # every object created, and every use of a lonnymq table or function, is qualified
        for target in re.findall(r"CREATE SCHEMA (?:IF NOT EXISTS )?(\S+?);", code):
            assert target == quoted, target
        for kind, target in re.findall(
            r"CREATE (?:OR REPLACE )?(TABLE|FUNCTION|VIEW|TYPE|SEQUENCE)\s+(\S+)", code
        ):
            assert target.startswith(f"{quoted}."), f"CREATE {kind} {target}"
        for target in re.findall(r"CREATE (?:UNIQUE )?INDEX (?:CONCURRENTLY )?\w+ ON (\S+)", code):
            assert target.startswith(f"{quoted}."), target
        functions = set(re.findall(rf"CREATE FUNCTION {re.escape(quoted)}\.(\w+)", code))
        for match in re.finditer(r"(?<![\w.\"])(\w+)\s*\(", code):
            assert match.group(1) not in functions, f"unqualified call of {match.group(1)}"
        tables = set(re.findall(rf"CREATE TABLE {re.escape(quoted)}\.(\w+)", code))
        relation_refs = r"\b(?:FROM|JOIN|UPDATE|INTO|REFERENCES|TABLE|ON)\s+(\w+)\b(?!\s*\()"
        for target in re.findall(relation_refs, code):
            assert target not in tables, f"unqualified reference to table {target}"
        type_refs = r"(?<![\w.\"])(\w+)(?:%ROWTYPE|\[\])"
        for target in re.findall(type_refs, code):
            assert target not in tables, f"unqualified use of the type {target}"
    fresh_code = _code_only(fresh)
    assert {"migration", "queue", "channel", "message"} <= set(
        re.findall(rf"CREATE TABLE {re.escape(quoted)}\.(\w+)", fresh_code)
    )
    assert {"message_create_v1", "message_dequeue_v3"} <= set(
        re.findall(rf"CREATE FUNCTION {re.escape(quoted)}\.(\w+)", fresh_code)
    )


# --- 6. migrations() -------------------------------------------------------------------------


def test_migrations_default_schema_and_shape() -> None:
    default = lonnymq.migrations()
    assert default == lonnymq.migrations("lonnymq")
    assert lonnymq.DEFAULT_SCHEMA == "lonnymq"
    assert inspect.signature(lonnymq.migrations).parameters["schema"].default == "lonnymq"
    assert inspect.signature(lonnymq.install).parameters["schema"].default == "lonnymq"
    assert lonnymq.Broker().schema == "lonnymq"
    assert isinstance(default, list) and len(default) == CURRENT_VERSION >= 1
    for number, item in enumerate(default, start=1):
        assert isinstance(item, tuple) and len(item) == 2
        name, text = item
        assert isinstance(name, str) and isinstance(text, str)
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+", name)
        assert int(name[:4]) == number
        assert '"lonnymq".' in text and "{schema}" not in _code_only(text)
        # each migration records its own version, and only its own
        records = re.findall(
            r'INSERT INTO "lonnymq"\.migration \(version, name\) VALUES (.*);', text
        )
        assert records == [f"({number}, '{name[5:]}')"], records
    assert [name for name, _ in default] == sorted(name for name, _ in default)


# --- 7. no search_path -----------------------------------------------------------------------

# The functions the Python queue API reaches; all must run with an empty search_path.
API_FUNCTIONS = {
    "queue_ensure_v1",
    "queue_expiring_v1",
    "wake_v1",
    "lane_put_v1",
    "message_create_sized_v1",
    "message_create_v1",
    "message_create_many_v1",
    "ingest_v1",
    "ingest_fresh_v1",
    "ingest_freed_v1",
    "ingest_positions_v1",
    "ingest_wait_v2",
    "snapshot_v1",
    "fold_v1",
    "channel_headroom_v2",
    "channel_limits_v2",
    "rate_state_v1",
    "lane_prune_v1",
    "queue_idle_v1",
    "queue_retry_ms_v1",
    "message_dequeue_v3",
    "message_delete_many_v1",
    "message_delete_v1",
    "message_defer_v1",
    "message_heartbeat_v1",
    "message_bury_v1",
    "message_reject_v1",
    "channel_give_back_v1",
    "channel_apply_v1",
    "channel_policy_set_v2",
    "channel_policy_clear_v1",
    "queue_policy_set_v2",
    "queue_purge_v1",
    "queue_delete_v1",
    "queue_stats_v1",
    "queue_status_v1",
    "channel_list_v2",
    "channel_get_v1",
    "channel_get_v2",
    "rate_held_v1",
    "message_list_v1",
    "message_list_v2",
    "channel_list_v3",
    "consumer_list_v1",
    "message_get_v1",
    "message_remove_v1",
    "message_retry_v1",
    "message_update_v1",
    "message_eta_v1",
    "dead_purge_v1",
    "queue_configure_v1",
    "housekeep_v1",
    "lane_next_v1",
    "lane_get_v1",
    "channel_limits_v1",
    "positions_merge_v1",
    "lane_lock_v1",
    # (lane_key_v1, a SQL function, runs inlined into the statements of its callers, and
    # track_functions does not count an inlined call)
}


def test_everything_works_with_an_empty_search_path(
    schema: str, connect: Callable[..., Conn]
) -> None:
    conn = connect(options="-c search_path=")
    assert conn.execute("SHOW search_path").fetchone() == ("",)
    assert conn.execute("SELECT current_schemas(false)").fetchone() == ([],)
    conn.execute("SET track_functions = 'all'")  # to check below that everything ran

    broker = lonnymq.Broker(schema)
    assert broker.install(conn) != []
    assert broker.check(conn) == CURRENT_VERSION
    queue = broker.queue("default")
    a, b = queue.channel("a"), queue.channel("b")

    # create: plain, priority, named (and de-duplicated), delayed, batched
    assert isinstance(a.message.create(conn, b"a1"), lonnymq.Created)
    assert isinstance(a.message.create(conn, b"a2", priority=5), lonnymq.Created)
    named = b.message.create(conn, b"b1", name="job")
    assert isinstance(named, lonnymq.Created)
    assert b.message.create(conn, b"b2", name="job") == lonnymq.Deduplicated(named.id)
    b.message.create(conn, b"later", delay_ms=60_000)
    batch = queue.batch()
    batch.channel("c").message(b"c1")
    batch.channel("c").policy.set(max_concurrency=1)
    batch.execute(conn)

    # dequeue, heartbeat, defer (with state and delay), delete
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sorted(m.content for m in got) == [b"a1", b"a2", b"b1", b"c1"]
    assert broker.heartbeat(conn, got, lock_ms=60_000) == {m.id for m in got}
    first, *others = got
    assert first.defer(conn, state=b"step") is Outcome.OK
    assert others[0].defer(conn, delay_ms=60_000) is Outcome.OK
    for message in others[1:]:
        assert message.delete(conn) is Outcome.OK
    again = queue.dequeue(conn, lock_ms=60_000).messages
    assert [(m.id, m.state) for m in again] == [(first.id, b"step")]
    assert first.delete(conn) is Outcome.STATE_INVALID  # the old lock token
    assert again[0].delete(conn) is Outcome.OK

    # an expired lock is handed out again
    a.message.create(conn, b"lost")
    lost = queue.dequeue(conn, lock_ms=1).messages[0]
    time.sleep(0.01)
    assert queue.dequeue(conn, lock_ms=60_000).messages[0].id == lost.id

    # the queues with an x-expires (none here)
    assert broker.expiring(conn) == []
    # nothing due: retry_ms
    empty = queue.dequeue(conn)
    assert not empty and empty.retry_ms is not None
    # dead letters: reject, max_attempts, list, show, retry, remove, settings, housekeeping
    queue.configure(conn, max_attempts=1, dead_retention_ms=60_000)
    a.message.create(conn, b"bad")
    bad = queue.dequeue(conn, lock_ms=60_000).messages[0]
    assert bad.reject(conn, reason="test") is Outcome.OK
    b.message.create(conn, b"poison")
    poison = queue.dequeue(conn, lock_ms=1).messages[0]
    time.sleep(0.01)
    assert [d.id for d in queue.dequeue(conn, lock_ms=60_000).dead] == [poison.id]
    assert {m.id for m in broker.messages(conn, state="dead")} == {bad.id, poison.id}
    # version 1 of the listing (clients of schema versions 3 to 9)
    assert conn.execute(
        sql.SQL("SELECT count(*) FROM {}.message_list_v1(NULL, NULL, 'dead', 0, 10)").format(
            sql.Identifier(schema)
        )
    ).fetchone() == (2,)
    assert broker.consumers(conn) == []
    assert broker.message(conn, bad.id) is not None
    assert broker.status(conn)[0].dead == 2
    assert queue.channels(conn) != []
    # acks sent with the next dequeue: one applies, one does not (a dead letter by now)
    a.message.create(conn, b"a3")
    held = queue.dequeue(conn, lock_ms=60_000).messages[0]
    following = queue.dequeue(conn, ack=[held, (bad.id, held.lock_token)], lock_ms=60_000)
    assert following.acked == {held.id: Outcome.OK, bad.id: Outcome.NOT_FOUND}
    assert broker.delete_many(conn, following.messages) == {
        m.id: Outcome.OK for m in following.messages
    }
    # reschedule a waiting message, then run it now
    made = a.message.create(conn, b"waiting", delay_ms=60_000)
    assert isinstance(made, lonnymq.Created)
    waiting = made.id
    assert broker.update(conn, waiting, delay_ms=120_000, priority=2).priority == 2
    broker.update(conn, waiting, delay_ms=0)
    assert broker.remove(conn, [waiting]) == {waiting: "deleted"}
    retried = broker.retry(conn, [bad.id])
    assert [r.result for r in retried] == ["retried"] and retried[0].new_id is not None
    back = retried[0].new_id
    assert broker.remove(conn, [poison.id, back]) == {poison.id: "deleted", back: "deleted"}
    assert broker.housekeep(conn) == 0
    assert queue.purge_dead(conn) == 0
    queue.configure(conn, max_attempts=None)

    # policies: a full channel drops, a saturated one waits
    a.policy.set(conn, max_concurrency=1, max_size=1)
    assert a.policy.get(conn) == lonnymq.Policy(max_concurrency=1, max_size=1)
    assert isinstance(a.message.create(conn, b"x", raise_if_dropped=False), lonnymq.Dropped)
    a.policy.clear(conn)
    assert a.policy.get(conn) is None
    queue.policy.set(conn, max_concurrency=2, max_size=100)
    assert queue.policy.get(conn) == lonnymq.Policy(max_concurrency=2, max_size=100)
    queue.policy.clear(conn)
    info = a.info(conn)
    assert info.own is None and info.size == 1 and info.in_flight == 1

    # rates; the version-1 policy functions of older clients keep a rate
    r = queue.channel("r")
    r.policy.set(conn, rate="100/s", burst=2)
    for _ in range(3):
        r.message.create(conn, b"r")
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sum(1 for m in got if m.channel == "r") == 2
    broker.delete_many(conn, got)
    [listed] = [c for c in queue.channels(conn) if c.channel == "r"]
    assert listed.rate == lonnymq.Rate(100, 1000) and listed.burst == 2
    assert isinstance(broker.rate_held(conn), list)
    s = sql.Identifier(schema)
    r.policy.set(conn, max_concurrency=5, rate="100/s", burst=2)
    assert conn.execute(
        sql.SQL("SELECT own_max_concurrency FROM {}.channel_get_v1('default', 'r')").format(s)
    ).fetchone() == (5,)
    # version 2 of the channel listing (clients of release 0.1.0)
    assert conn.execute(
        sql.SQL("SELECT max_concurrency FROM {}.channel_list_v2('default', 100)").format(s)
        + sql.SQL(" WHERE channel_name = 'r'")
    ).fetchone() == (5,)
    r.policy.clear(conn)

    # stats, size, queues, purge, delete
    stats = queue.stats(conn)
    assert stats.total >= 1 and stats.delayed is not None
    assert queue.size(conn) == stats.waiting
    assert broker.queues(conn) == ["default"]
    assert queue.purge(conn) >= 1
    queue.delete(conn)
    assert broker.queues(conn) == []

    calls = function_calls(conn, schema, lambda calls: set(calls) >= API_FUNCTIONS)
    called = {name for name, n in calls.items() if n > 0}
    assert not API_FUNCTIONS - called, f"never ran: {sorted(API_FUNCTIONS - called)}"


# --- 8. half-installed schemas ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "operation"),
    [
        ("DROP FUNCTION {s}.message_create_v1", "create"),
        # message_create_v1, into a channel with a max_size
        ("DROP FUNCTION {s}.message_create_sized_v1", "create new"),
        ("DROP TABLE {s}.message CASCADE", "create"),
        ("DROP FUNCTION {s}.message_dequeue_v3", "dequeue"),
        # called by message_dequeue_v3 for the lanes it served, when the call is not the
        # usual one (here: a lane of two priorities)
        ("DROP FUNCTION {s}.lanes_served_v1", "dequeue behind a delayed message"),
        ("DROP FUNCTION {s}.message_delete_v1", "delete"),
    ],
)
def test_half_installed_schema_is_a_clear_error(
    schema: str, connect: Callable[..., Conn], damage: LiteralString, operation: str
) -> None:
    conn = connect()
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    queue = broker.queue("default")
    queue.channel("a").message.create(conn, b"x")
    held = queue.dequeue(conn, lock_ms=60_000).messages[0]
    queue.channel("a").message.create(conn, b"y")
    if operation == "dequeue behind a delayed message":
        queue.channel("a").message.create(conn, b"later", priority=5, delay_ms=60_000)
    conn.execute(sql.SQL(damage).format(s=sql.Identifier(schema)))

    with pytest.raises(lonnymq.SchemaNotInstalled, match="lonnymq migrate") as raised:
        if operation == "create":
            queue.channel("a").message.create(conn, b"z")
        elif operation == "create new":
            queue.channel("new").policy.set(conn, max_size=5)
            queue.channel("new").message.create(conn, b"z")
        elif operation.startswith("dequeue"):
            queue.dequeue(conn)
        else:
            held.delete(conn)
    assert raised.value.schema == schema
    assert schema in str(raised.value)
    assert isinstance(raised.value.__cause__, psycopg.Error)


def test_install_over_a_schema_without_migration_table(
    schema: str, connect: Callable[..., Conn]
) -> None:
    conn = connect()
    lonnymq.install(conn, schema)
    conn.execute(sql.SQL("DROP TABLE {}.migration").format(sql.Identifier(schema)))
    before = catalog(conn, schema)
    with pytest.raises(lonnymq.SchemaError):
        lonnymq.install(conn, schema)
    assert catalog(conn, schema) == before


# --- 9. the upgrade from version 4 -----------------------------------------------------------


@pytest.mark.parametrize("together", [True, False], ids=["one-transaction", "apart"])
def test_upgrade_from_version_4_while_other_transactions_commit(
    schema: str, connect: Callable[..., Conn], together: bool
) -> None:
    """Migration 5 took the ingest's first position with pg_current_snapshot(). When a
    transaction with a later xid committed during the upgrade (any busy database), that
    snapshot counted the upgrade's own transaction as visible, and the messages it moved (of
    its txid) as ingested: no lane pointed at them, and they were never handed out. Migration
    6 puts that transaction back among the running ones, so the next ingest takes them; with 5
    and 6 in one transaction (as install() applies them) and in two."""
    conn = connect(autocommit=False)
    other = connect()
    steps = lonnymq.migrations(schema)
    for _, text in steps[:4]:
        with conn.transaction():
            conn.execute(text.encode())
    s = sql.Identifier(schema)
    for channel, content, delay in (
        ("a", "a1", 0),
        ("a", "a2", 0),
        ("b", "b1", 0),
        ("c", "c1", 50),
    ):
        conn.execute(
            sql.SQL(
                "SELECT * FROM {s}.message_create_v1('jobs', %s, NULL, %s::bytea, 0, %s, NULL)"
            ).format(s=s),
            (channel, content.encode(), delay),
        )
    conn.commit()

    # the upgrade's transaction has its xid; a later one commits before the upgrade's snapshot
    conn.execute("SELECT pg_current_xact_id()")
    other.execute("SELECT pg_current_xact_id()")
    conn.execute(steps[4][1].encode())
    if not together:
        conn.commit()
    for _, text in steps[5:]:
        conn.execute(text.encode())
    conn.commit()

    conn.autocommit = True
    broker = lonnymq.Broker(schema)
    time.sleep(0.1)  # c1 is due
    got = []
    for _ in range(10):
        res = broker.dequeue(conn, ["jobs"], limit=10, lock_ms=60_000, listen=False)
        got += [bytes(m.content) for m in res.messages]
        if len(got) >= 4:
            break
    assert sorted(got) == [b"a1", b"a2", b"b1", b"c1"]
    invariants.assert_consistent(conn, schema)
    [status] = broker.status(conn)
    assert (status.counters.enqueued, status.counters.delivered) == (4, 4)


def test_a_fresh_install_inside_a_transaction_that_creates(
    schema: str, connect: Callable[..., Conn]
) -> None:
    """The install's first ingest position leaves out the installing transaction: the
    messages a caller's transaction creates right after the schema was installed in it are
    handed out, even when a later transaction committed in between."""
    conn = connect(autocommit=False)
    other = connect()
    broker = lonnymq.Broker(schema)
    conn.execute("SELECT pg_current_xact_id()")
    other.execute("SELECT pg_current_xact_id()")
    migrator.install(conn, schema)
    broker.queue("jobs").channel("a").message.create(conn, b"first")
    conn.commit()
    conn.autocommit = True
    res = broker.dequeue(conn, ["jobs"], limit=10, lock_ms=60_000, listen=False)
    assert [bytes(m.content) for m in res.messages] == [b"first"]
    invariants.assert_consistent(conn, schema)
    [status] = broker.status(conn)
    assert (status.counters.enqueued, status.counters.delivered) == (1, 1)


def test_upgrade_from_version_4_keeps_every_message_and_the_running_workers(
    schema: str, connect: Callable[..., Conn]
) -> None:
    """Migration 5 moves messages ready, delayed, in flight (on a limited channel too) and
    de-duplicated by name, with their ids, locks and tokens, and keeps the counters. A worker
    of version 4 still running goes on calling the functions of version 4: it acks what it
    held through message_ack_dequeue_v1 and gets the rest; producers of version 4
    (message_create_v1, message_publish_v1) too, until migration 12 drops version 4's
    dequeues (no supported client calls them), which changes nothing else."""
    conn = connect()
    steps = lonnymq.migrations(schema)
    for _, text in steps[:4]:
        with conn.transaction():
            conn.execute(text.encode())
    s = sql.Identifier(schema)

    def call(query: str, *params: Any) -> list[tuple[Any, ...]]:
        return conn.execute(sql.SQL(query).format(s=s), params).fetchall()

    call("SELECT {s}.channel_policy_set_v1('jobs', 'limited', 1, NULL)")
    for channel, content, delay, name in (
        ("limited", "l1", 0, None),
        ("limited", "l2", 0, None),
        ("a", "a1", 0, None),
        ("a", "a2", 0, "unique"),
        ("b", "later", 3_600_000, None),
    ):
        call(
            "SELECT * FROM {s}.message_create_v1('jobs', %s, %s, %s::bytea, 0, %s, NULL)",
            channel,
            name,
            content.encode(),
            delay,
        )
    held = call(
        "SELECT message_id, message_lock_token, channel_name, message_content "
        "FROM {s}.message_dequeue_v2('{{jobs}}', 2, 600000)"
    )
    assert sorted(bytes(r[3]) for r in held) == [b"a1", b"l1"]
    before = {(r[0], r[1]) for r in call("SELECT id, lock_token FROM {s}.message")}

    for _, text in steps[4:11]:  # versions 5 to 11, the last that keeps version 4's dequeues
        with conn.transaction():
            conn.execute(text.encode())
    assert call("SELECT max(version) FROM {s}.migration") == [(11,)]
    assert {(r[0], r[1]) for r in call("SELECT id, lock_token FROM {s}.message")} == before
    invariants.assert_consistent(conn, schema)
    broker = lonnymq.Broker(schema)
    [status] = broker.status(conn)
    assert (status.total, status.in_flight, status.ready, status.delayed) == (5, 2, 2, 1)
    assert (status.counters.enqueued, status.counters.delivered) == (5, 2)

    # the running worker of version 4: acks what it held with its next dequeue (version 4's
    # function), gets a2 and l2 (the limited channel's slot is free again)
    ids = [r[0] for r in held]
    tokens = [r[1] for r in held]
    got = call(
        "SELECT message_id, message_content, event FROM "
        "{s}.message_ack_dequeue_v1(%s, %s, '{{jobs}}', 10, 600000)",
        ids,
        tokens,
    )
    assert sorted(bytes(r[1]) for r in got) == [b"a2", b"l2"]
    # a producer of version 4: de-duplication still sees the moved message (delivered now:
    # a new one is created), and publish routes as before
    [(code, _)] = call(
        "SELECT * FROM {s}.message_create_v1('jobs', 'a', 'unique', 'x'::bytea, 0, 0, NULL)"
    )
    assert code == "created"
    assert [
        r[1]
        for r in call(
            "SELECT * FROM {s}.message_publish_v1('', 'jobs', 'b', NULL, 'p'::bytea, 0, 0, NULL)"
        )
    ] == ["created"]
    # the new client sees everything
    [status] = broker.status(conn)
    assert (status.total, status.in_flight, status.delayed) == (5, 2, 1)
    assert (status.counters.enqueued, status.counters.delivered, status.counters.acked) == (
        7,
        4,
        2,
    )
    invariants.assert_consistent(conn, schema)

    for _, text in steps[11:]:  # version 12: version 4's dequeues go; nothing else changes
        with conn.transaction():
            conn.execute(text.encode())
    assert broker.check(conn) == CURRENT_VERSION
    [after] = broker.status(conn)
    assert after == status
    gone = call(
        "SELECT proname FROM pg_catalog.pg_proc WHERE pronamespace = %s::regnamespace "
        "AND proname IN ('message_dequeue_v2', 'message_ack_dequeue_v1')",
        schema,
    )
    assert gone == []
    invariants.assert_consistent(conn, schema)


def test_upgrade_to_version_10_forwards_grants_and_keeps_queues(
    schema: str, connect: Callable[..., Conn]
) -> None:
    """Migration 10 (consumers, auto_delete and max_priority, queues that went, listings):
    roles granted before get the new functions of their kind; queues and messages stay (a
    queue declared before is not auto_delete and has no max_priority); the functions it
    replaced keep their grants."""
    conn = connect()
    for _, text in lonnymq.migrations(schema)[:9]:
        with conn.transaction():
            conn.execute(text.encode())
    s = sql.Identifier(schema)
    conn.execute(sql.SQL("SELECT {}.queue_declare_v1('jobs', 60000, NULL)").format(s))
    conn.execute(
        sql.SQL(
            "SELECT * FROM {}.message_create_v1('jobs', 'a', NULL, 'x'::bytea, 9, 0, NULL)"
        ).format(s)
    )
    suffix = uuid.uuid4().hex[:8]
    worker, admin = f"lmq_w10_{suffix}", f"lmq_a10_{suffix}"
    try:
        for role in (worker, admin):
            conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, sql.Identifier(role)))
        for fn, role in (
            ("queue_declare_v1(text, bigint, bigint)", worker),
            ("message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)", worker),
            ("message_get_v1(bigint)", admin),
            ("message_list_v1(text, text, text, bigint, integer)", admin),
        ):
            conn.execute(
                sql.SQL("GRANT EXECUTE ON FUNCTION {}.{} TO {}").format(
                    s, sql.SQL(fn), sql.Identifier(role)
                )
            )
        name, text = lonnymq.migrations(schema)[9]
        assert name == "0010_consumers_auto_delete_max_priority"
        with conn.transaction():
            conn.execute(text.encode())
        assert migrator.installed_version(conn, schema) == 10

        def may(role: str, fn: str) -> bool:
            row = conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')", (role, f"{schema}.{fn}")
            ).fetchone()
            return bool(row and row[0])

        assert may(worker, "consumer_sync_v1(uuid, text, integer, text, integer, text[], "
                   "text[], boolean[], integer[], timestamptz[])")  # fmt: skip
        assert may(worker, "queue_declare_v2(text, bigint, bigint, boolean, integer)")
        assert may(worker, "consumer_list_v1(text)")
        assert not may(worker, "message_list_v2(text, text, text, bigint, integer, text, "
                       "timestamptz, integer)")  # fmt: skip
        assert may(admin, "message_list_v2(text, text, text, bigint, integer, text, "
                   "timestamptz, integer)")  # fmt: skip
        assert may(admin, "channel_list_v3(text, integer, text)")
        assert may(admin, "message_list_v1(text, text, text, bigint, integer)")  # kept
        row = conn.execute(
            "SELECT has_table_privilege(%s, %s, 'SELECT')", (admin, f"{schema}.consumer")
        ).fetchone()
        assert row == (True,)
        assert conn.execute(
            sql.SQL("SELECT auto_delete, max_priority, expires_ms FROM {}.queue").format(s)
        ).fetchall() == [(False, None, 60000)]
        got = lonnymq.Broker(schema).queue("jobs").dequeue(conn, lock_ms=1000).messages
        assert [(m.content, m.priority) for m in got] == [(b"x", 9)]
    finally:
        for role in (worker, admin):
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_upgrade_to_version_26_forwards_grants_and_keeps_expiring_queues(
    schema: str, connect: Callable[..., Conn]
) -> None:
    """Migration 26 (a queue's use recorded lazily, and allowed for by the sweep): a role
    granted under version 25 may list the expiring queues with the new function; a queue
    declared before keeps its x-expires and is listed as used just now; one unused for
    longer than its x-expires goes at the next sweep."""
    conn = connect()
    for _, text in lonnymq.migrations(schema)[:25]:
        with conn.transaction():
            conn.execute(text.encode())
    s = sql.Identifier(schema)
    conn.execute(
        sql.SQL("SELECT {}.queue_declare_v2('reply', 86400000, NULL, true, NULL)").format(s)
    )
    conn.execute(sql.SQL("SELECT {}.queue_declare_v2('old', 1000, NULL, false, NULL)").format(s))
    conn.execute(
        sql.SQL(
            "UPDATE {}.queue SET used_at = now() - interval '5 seconds' WHERE name = 'old'"
        ).format(s)
    )
    role = f"lmq_p26_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        for statement in (  # as version 25's lonnymq.grant gave a producer
            "GRANT USAGE ON SCHEMA {} TO {}",
            "GRANT SELECT ON {}.queue TO {}",
            "GRANT EXECUTE ON FUNCTION {}.queue_status_v1(boolean) TO {}",
        ):
            conn.execute(sql.SQL(statement).format(s, sql.Identifier(role)))
        name, text = lonnymq.migrations(schema)[25]
        assert name == "0026_a_queue_used_within_its_expiry_stays"
        with conn.transaction():
            conn.execute(text.encode())
        assert migrator.installed_version(conn, schema) == 26
        row = conn.execute(
            "SELECT has_function_privilege(%s, %s, 'EXECUTE')",
            (role, f"{schema}.queue_expiring_v1()"),
        ).fetchone()
        assert row == (True,)
        broker = lonnymq.Broker(schema)
        listed = {e.queue: e for e in broker.expiring(conn)}
        assert listed["reply"].expires_ms == 86_400_000 and not listed["reply"].expired
        assert listed["reply"].unused_seconds == 0.0  # recorded now, less its lag (a minute)
        assert listed["old"].expired and listed["old"].unused_seconds > 3.5
        assert broker.expire(conn) == (0, 1)
        assert [e.queue for e in broker.expiring(conn)] == ["reply"]
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
