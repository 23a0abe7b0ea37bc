"""Install and upgrade the lonnymq schema.

The SQL lives in ``lonnymq/sql``: ``schema/NN_family.sql`` is the full current schema, one file
per family of operations read in the order of their numbers (a fresh install), and
``migrations/NNNN_name.sql`` are the numbered steps from one version to the next.
A test checks that a fresh install and the replayed migrations give the same database.

Every statement is qualified with the configured schema by ``psycopg.sql`` composition. Applied
versions are recorded in ``<schema>.migration``; :func:`install` takes an advisory lock, so many
processes may call it at once, and it is a no-op when the schema is current.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from .exceptions import (
    InvalidName,
    SchemaError,
    SchemaNotInstalled,
    SchemaTooNew,
    UnsupportedServer,
)

logger = logging.getLogger("lonnymq")

DEFAULT_SCHEMA = "lonnymq"

#: The Postgres major versions lonnymq is tested on (the README, .ci/run): an older server is
#: refused at install; a newer one is used, with a warning.
OLDEST_SERVER = 13
NEWEST_TESTED_SERVER = 18

# Lower-case identifiers only, short enough that "<schema>_wake" and "<schema>_hint" fit a NOTIFY
# channel name.
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,47}")
_MIGRATION_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


def validate_schema(schema: object) -> str:
    """Return ``schema`` if it is an acceptable schema name, else raise :class:`InvalidName`."""
    if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
        raise InvalidName(
            f"invalid schema name {schema!r}: use 1 to 48 characters among lower-case "
            "letters, digits and underscores, not starting with a digit"
        )
    if schema.startswith("pg_"):
        raise InvalidName(f"invalid schema name {schema!r}: names starting with pg_ are reserved")
    return schema


def wake_channel(schema: str) -> str:
    """The NOTIFY channel on which ``schema`` announces available messages."""
    return f"{validate_schema(schema)}_wake"


def hint_channel(schema: str) -> str:
    """The NOTIFY channel on which ``schema``'s creates tell sleeping consumers which message
    they made (``'<id> <queue>'``; schema version 16)."""
    return f"{validate_schema(schema)}_hint"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str


_SCHEMA_FILE_RE = re.compile(r"\d{2}_[a-z0-9_]+\.sql")


@cache
def _schema_text() -> str:
    """The current schema: the files of ``sql/schema``, in the order of their numbers."""
    folder = resources.files("lonnymq.sql").joinpath("schema")
    parts = sorted(
        (entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if _SCHEMA_FILE_RE.fullmatch(entry.name)
    )
    if not parts:
        raise RuntimeError("lonnymq's schema files are missing")  # packaging bug
    return "\n".join(text for _, text in parts)


@cache
def _migration_files() -> tuple[Migration, ...]:
    found = []
    for entry in resources.files("lonnymq.sql").joinpath("migrations").iterdir():
        match = _MIGRATION_RE.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError("lonnymq migrations are not numbered 1..N")  # packaging bug
    return tuple(found)


CURRENT_VERSION = len(_migration_files())


def render(template: str, schema: str) -> sql.Composed:
    """Fill a SQL template's placeholders for ``schema``."""
    schema = validate_schema(schema)
    return sql.SQL(template).format(
        schema=sql.Identifier(schema),
        wake=sql.Literal(wake_channel(schema)),
        hint=sql.Literal(hint_channel(schema)),
        lock_prefix=sql.Literal(f"lonnymq:{schema}:"),
    )


def _record(schema: str, migrations: tuple[Migration, ...]) -> sql.Composed:
    rows = sql.SQL(", ").join(
        sql.SQL("({}, {})").format(sql.Literal(m.version), sql.Literal(m.name)) for m in migrations
    )
    return sql.SQL("INSERT INTO {}.migration (version, name) VALUES {};\n").format(
        sql.Identifier(schema), rows
    )


def migrations(schema: str = DEFAULT_SCHEMA) -> list[tuple[str, str]]:
    """The ordered ``(name, sql)`` migrations for ``schema``, for teams that apply DDL with
    their own tool (Alembic, Django migrations, Flyway...).

    Apply them in order, each in a transaction, and record nothing else: each one records its
    own version in ``<schema>.migration``, so :func:`install` and the transport see the schema
    as installed.
    """
    out = []
    for m in _migration_files():
        text = render(m.template, schema).as_string() + "\n" + _record(schema, (m,)).as_string()
        out.append((f"{m.version:04d}_{m.name}", text))
    return out


def fresh_install_sql(schema: str = DEFAULT_SCHEMA) -> str:
    """The SQL of a fresh install at the current version (the full schema)."""
    return (
        render(_schema_text(), schema).as_string()
        + "\n"
        + _record(schema, _migration_files()).as_string()
    )


_OBJECT_RE = re.compile(
    r"^CREATE (?:UNIQUE )?(TABLE|INDEX|FUNCTION) (?:\{schema\}\.)?(\w+)", re.MULTILINE
)


@cache
def expected_objects() -> tuple[tuple[str, str], ...]:
    """``(kind, name)`` of every table, index and function of the current schema."""
    return tuple((kind.lower(), name) for kind, name in _OBJECT_RE.findall(_schema_text()))


def missing_objects(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[str]:
    """The objects of the current schema that are not in ``schema`` (dropped by hand)."""
    rows = (
        _tuples(conn)
        .execute(
            "SELECT c.relname FROM pg_catalog.pg_class c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'i') "
            "UNION ALL SELECT p.proname FROM pg_catalog.pg_proc p "
            "JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
            (schema, schema),
        )
        .fetchall()
    )
    present = {row[0] for row in rows}
    return [f"{kind} {name}" for kind, name in expected_objects() if name not in present]


def repair_sql(schema: str = DEFAULT_SCHEMA) -> str:
    """The current schema as idempotent SQL: creates what is missing, keeps tables and their
    rows, replaces the functions with their current definitions."""
    text = _schema_text()
    text = re.sub(r"^CREATE TABLE ", "CREATE TABLE IF NOT EXISTS ", text, flags=re.MULTILINE)
    text = re.sub(
        r"^CREATE (UNIQUE )?INDEX ", r"CREATE \1INDEX IF NOT EXISTS ", text, flags=re.MULTILINE
    )
    text = re.sub(r"^CREATE FUNCTION ", "CREATE OR REPLACE FUNCTION ", text, flags=re.MULTILINE)
    return render(text, schema).as_string()


def _tuples(conn: psycopg.Connection[Any]) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor of ``conn`` whose rows are tuples, whatever rows the connection makes (an
    application's ``dict_row`` connection installs the schema too)."""
    return conn.cursor(row_factory=tuple_row)


def _lock_key(schema: str) -> sql.Composed:
    return sql.SQL("SELECT pg_advisory_xact_lock(hashtextextended({}, 0))").format(
        sql.Literal(f"lonnymq:{schema}:migrate")
    )


def installed_version(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> int | None:
    """The version of ``schema`` installed in the database, or None when it is not."""
    schema = validate_schema(schema)
    # A plain query of the catalog (an MVCC snapshot), not to_regclass(): to_regclass reads
    # the catalog cache, which keeps a "does not exist" entry from before another process
    # installed the schema while we waited for the install lock.
    row = (
        _tuples(conn)
        .execute(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = 'migration')",
            (schema,),
        )
        .fetchone()
    )
    if not row or not row[0]:
        return None
    found = (
        _tuples(conn)
        .execute(sql.SQL("SELECT max(version) FROM {}.migration").format(sql.Identifier(schema)))
        .fetchone()
    )
    return int(found[0]) if found and found[0] is not None else None


def pending_sql(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> str:
    """The SQL that :func:`install` would run now (empty when the schema is current)."""
    version = installed_version(conn, schema)
    if version is None:
        return fresh_install_sql(schema)
    if version > CURRENT_VERSION:
        raise SchemaTooNew(schema, version, CURRENT_VERSION)
    return "\n".join(text for _, text in migrations(schema)[version:])


def install(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[str]:
    """Install or upgrade ``schema`` to the current version; returns the names applied.

    Safe to call from many processes at once (an advisory lock serialises them) and a no-op
    when the schema is current. Runs in its own transaction (a savepoint when ``conn`` is
    already in one). Refuses a schema installed by a newer lonnymq.
    """
    schema = validate_schema(schema)
    check_server(conn)
    try:
        return _install(conn, schema)
    except psycopg.Error as exc:
        raise SchemaError(f"installing the lonnymq schema {schema!r} failed: {exc}") from exc


def check_server(conn: psycopg.Connection[Any]) -> int:
    """The server's major version; raises :class:`UnsupportedServer` below
    :data:`OLDEST_SERVER`, and logs a warning above :data:`NEWEST_TESTED_SERVER`."""
    major = conn.info.server_version // 10000
    if major < OLDEST_SERVER:
        text = conn.info.parameter_status("server_version") or str(major)
        raise UnsupportedServer(text, OLDEST_SERVER, NEWEST_TESTED_SERVER)
    if major > NEWEST_TESTED_SERVER:
        logger.warning(
            "lonnymq: PostgreSQL %d is newer than the newest version lonnymq was tested on "
            "(%d); report what does not work",
            major,
            NEWEST_TESTED_SERVER,
        )
    return major


def _install(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    with conn.transaction():
        conn.execute(_lock_key(schema))
        version = installed_version(conn, schema)
        if version is None:
            _refuse_foreign_objects(conn, schema)
            conn.execute(fresh_install_sql(schema).encode())
            return [name for name, _ in migrations(schema)]
        if version > CURRENT_VERSION:
            raise SchemaTooNew(schema, version, CURRENT_VERSION)
        applied = []
        for name, text in migrations(schema)[version:]:
            conn.execute(text.encode())
            applied.append(name)
        missing = missing_objects(conn, schema)
        if missing:  # objects dropped by hand: put them back (rows of other tables are kept)
            conn.execute(repair_sql(schema).encode())
            applied.append(f"repair of {', '.join(missing)}")
        return applied


def _refuse_foreign_objects(conn: psycopg.Connection[Any], schema: str) -> None:
    """A schema without a migration record must hold no tables: we do not install over
    objects we did not record (a half-removed install, or somebody else's schema)."""
    row = (
        _tuples(conn)
        .execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm')",
            (schema,),
        )
        .fetchone()
    )
    if row and row[0]:
        raise SchemaError(
            f"schema {schema!r} holds {row[0]} table(s) but no lonnymq migration record; "
            "refusing to install over them. Give lonnymq a schema of its own (the default "
            "is 'lonnymq'), or drop this one if it is a leftover lonnymq install"
        )


def check(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> int:
    """Raise unless ``schema`` is installed at a version this lonnymq can use."""
    version = installed_version(conn, schema)
    if version is None:
        raise SchemaNotInstalled(schema)
    if version > CURRENT_VERSION:
        raise SchemaTooNew(schema, version, CURRENT_VERSION)
    if version < CURRENT_VERSION:
        raise SchemaNotInstalled(schema, f"installed version {version} < {CURRENT_VERSION}")
    missing = missing_objects(conn, schema)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise SchemaNotInstalled(schema, f"missing: {shown}; `lonnymq migrate` restores them")
    return version
