# mypy: allow-untyped-calls
# (kombu is untyped)
"""Test fixtures: a real Postgres ($LONNYMQ_TEST_DSN, or a throwaway server started here) and
one fresh schema per test, dropped afterwards; connections to it (psycopg, kombu, as a role of
lonnymq.grant) closed after the test; and the small helpers the test modules share."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import lonnymq
from lonnymq.queue import QueueStatus
from lonnymq.testing import NoServerBinaries, database, find_bindir
from tests import invariants

Conn = psycopg.Connection[Any]


def wanted_version() -> int | None:
    """The Postgres major version the suite must run on ($LONNYMQ_TEST_PG_VERSION), if any."""
    value = os.environ.get("LONNYMQ_TEST_PG_VERSION", "").strip()
    if value and not value.isdigit():
        raise pytest.UsageError(f"LONNYMQ_TEST_PG_VERSION must be a major version, not {value!r}")
    return int(value) if value else None


def pytest_configure(config: pytest.Config) -> None:
    """With $LONNYMQ_TEST_PG_VERSION and no $LONNYMQ_TEST_DSN, every throwaway server of the
    run (the suite's, and those tests start themselves) is of that version."""
    wanted = wanted_version()
    if wanted is not None and not os.environ.get("LONNYMQ_TEST_DSN"):
        try:
            bindir = find_bindir("LONNYMQ_TEST_DSN", version=wanted)
        except NoServerBinaries as exc:
            raise pytest.UsageError(str(exc)) from None
        os.environ["LONNYMQ_PG_BINDIR"] = str(bindir)


_SERVER: list[str] = []  # the server the session ran on, for the summary


@contextlib.contextmanager
def _own_database(dsn: str) -> Iterator[str]:
    """Under pytest-xdist (``-n``) with $LONNYMQ_TEST_DSN, each worker process of the run gets
    a database of its own on that server, made for it and dropped afterwards: the tests count
    the database's sessions (a connection left behind fails a test) and its LISTEN channels,
    advisory locks and horizons are per database. A throwaway server is the worker's own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or not os.environ.get("LONNYMQ_TEST_DSN"):
        yield dsn
        return
    parts = urllib.parse.urlsplit(dsn)
    assert parts.scheme in ("postgresql", "postgres"), "$LONNYMQ_TEST_DSN must be a URL"
    base = urllib.parse.unquote(parts.path.lstrip("/")) or parts.username or "postgres"
    name = f"{base}_{worker}"[:63]
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(dsn, autocommit=True) as admin:
        try:
            admin.execute(drop)  # left by a run that was killed
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise RuntimeError(
                f"the role of $LONNYMQ_TEST_DSN may not create the database {name!r} ({exc}): "
                "each test process (pytest -n, in pyproject.toml's addopts) needs one of its "
                "own; grant the role CREATEDB, or run the tests in one process: pytest -n 0"
            ) from None
    try:
        yield parts._replace(path="/" + urllib.parse.quote(name)).geturl()
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(drop)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """The test database: $LONNYMQ_TEST_DSN, else a throwaway server (see pytest_configure).
    The session stops at once when it is not of $LONNYMQ_TEST_PG_VERSION."""
    with database("LONNYMQ_TEST_DSN") as shared, _own_database(shared) as dsn:
        with psycopg.connect(dsn) as c:
            number, text = c.info.server_version, c.info.parameter_status("server_version")
        wanted = wanted_version()
        if wanted is not None and number // 10000 != wanted:
            pytest.exit(
                f"LONNYMQ_TEST_PG_VERSION={wanted}, but the test database runs Postgres {text}",
                returncode=4,
            )
        where = "$LONNYMQ_TEST_DSN" if os.environ.get("LONNYMQ_TEST_DSN") else "a throwaway server"
        _SERVER.append(f"PostgreSQL {text} ({where})")
        yield dsn


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for server in _SERVER:
        terminalreporter.write_line(f"lonnymq tests ran on {server}")


@pytest.fixture(scope="session")
def _observer(pg_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(pg_dsn, autocommit=True, application_name="lonnymq-test-observer") as c:
        yield c


def _sessions(observer: Conn) -> dict[int, tuple[Any, ...]]:
    """The client sessions of the test database but the observer's: pid -> what they are."""
    rows = observer.execute(
        "SELECT pid, application_name, state, left(query, 200) FROM pg_stat_activity "
        "WHERE datname = current_database() AND backend_type = 'client backend' "
        "AND pid <> pg_backend_pid()"
    ).fetchall()
    return {int(r[0]): tuple(r[1:]) for r in rows}


@pytest.fixture(autouse=True)
def _no_connection_left_behind(_observer: Conn) -> Iterator[None]:
    """Every test closes the connections it opened (its own, and its processes' and threads'):
    a session that appeared during the test and is still there 10 s after it is a leak."""
    before = set(_sessions(_observer))
    yield
    deadline = time.monotonic() + 10.0
    while True:
        left = {pid: s for pid, s in _sessions(_observer).items() if pid not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"connections left behind: {left}"


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A fresh, unique schema name, dropped (with everything in it) after the test; before
    that, its messages are checked for what the table's CHECK constraints held until schema
    version 27 (a lock expiry with a lock token, the priority's and the name's ranges)."""
    name = f"lmq_test_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            bad = invariants.bad_messages(conn, name)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
    assert not bad, f"messages that break the table's invariants: {bad}"


@pytest.fixture
def connect(pg_dsn: str) -> Iterator[Callable[..., Conn]]:
    """Open autocommit connections that are closed after the test."""
    opened: list[Conn] = []

    def _connect(**kwargs: Any) -> Conn:
        kwargs.setdefault("autocommit", True)
        conn = psycopg.connect(pg_dsn, **kwargs)
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        conn.close()


@pytest.fixture
def conn(connect: Callable[..., Conn]) -> Conn:
    return connect()


@pytest.fixture
def broker(schema: str, conn: Conn) -> lonnymq.Broker:
    """A Broker on a freshly installed schema."""
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    return broker


@pytest.fixture
def queue(broker: lonnymq.Broker) -> lonnymq.Queue:
    return broker.queue("default")


def hold_ingest_key(conn: Conn, schema: str) -> None:
    """Take ``schema``'s ingest key in ``conn``'s transaction (a connection without
    autocommit), as a running ingest holds it: until that transaction ends."""
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"lonnymq:{schema}:ingest"]
    )


# --- kombu connections -------------------------------------------------------------------------


def lonnymq_url(dsn: str) -> str:
    """The kombu URL (``lonnymq://``) of a ``postgresql://`` DSN."""
    scheme, rest = dsn.split("://", 1)
    assert scheme in ("postgresql", "postgres"), dsn
    return f"lonnymq://{rest}"


@pytest.fixture
def url(pg_dsn: str) -> str:
    """The kombu URL of the test database."""
    return lonnymq_url(pg_dsn)


@pytest.fixture
def kombu_defaults() -> dict[str, Any]:
    """The transport options :func:`make_connection` sets unless told otherwise, besides the
    schema (a module overrides this fixture for other defaults)."""
    return {"visibility_timeout": 30}


@pytest.fixture
def make_connection(
    pg_dsn: str, schema: str, kombu_defaults: dict[str, Any]
) -> Iterator[Callable[..., Connection]]:
    """kombu Connections to the test database on the test's schema (with
    :func:`kombu_defaults`), released after the test."""
    opened: list[Connection] = []

    def make(**options: Any) -> Connection:
        options.setdefault("schema", schema)
        for key, value in kombu_defaults.items():
            options.setdefault(key, value)
        connection = Connection(lonnymq_url(pg_dsn), transport_options=options)
        opened.append(connection)
        return connection

    yield make
    for connection in opened:
        connection.release()


# --- roles (lonnymq.grant) ---------------------------------------------------------------------


def dsn_as(pg_dsn: str, role: str) -> str:
    """The test database's DSN for login role ``role`` (no password)."""
    params = conninfo_to_dict(pg_dsn)
    host = params.get("host") or "127.0.0.1"
    return f"postgresql://{role}@{host}:{params.get('port') or 5432}/{params.get('dbname')}"


@pytest.fixture
def roles(conn: Conn, schema: str) -> Iterator[dict[str, str]]:
    """Login roles named for this test, on its schema (installed here): producer, worker and
    admin (granted) and nobody (no grant). Dropped after the test."""
    suffix = uuid.uuid4().hex[:8]
    names = {kind: f"lmq_{kind}_{suffix}" for kind in ("producer", "worker", "admin", "nobody")}
    lonnymq.install(conn, schema)
    for kind, role in names.items():
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        if kind != "nobody":
            lonnymq.grant(conn, kind, role, schema=schema)  # type: ignore[arg-type]
    yield names
    for role in names.values():
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def connect_as(pg_dsn: str) -> Iterator[Callable[[str], Conn]]:
    """Open autocommit connections as a role (see :func:`roles`), closed after the test."""
    opened: list[Conn] = []

    def connect(role: str) -> Conn:
        c = psycopg.connect(dsn_as(pg_dsn, role), autocommit=True)
        opened.append(c)
        return c

    yield connect
    for c in opened:
        c.close()


def kombu_as(pg_dsn: str, role: str, schema: str) -> Connection:
    """A kombu Connection as ``role`` on ``schema`` (the caller releases it: ``with``)."""
    url = lonnymq_url(dsn_as(pg_dsn, role))
    return Connection(url, transport_options={"schema": schema, "visibility_timeout": 30})


# --- small helpers -----------------------------------------------------------------------------


def created(result: lonnymq.CreateResult) -> int:
    """The id of a message a create made (asserting it did)."""
    assert isinstance(result, lonnymq.Created), result
    return result.id


def status_of(broker: lonnymq.Broker, conn: Conn, queue: str) -> QueueStatus:
    """The status of one queue (asserting the broker lists it once)."""
    found = [s for s in broker.status(conn) if s.queue == queue]
    assert len(found) == 1, [s.queue for s in broker.status(conn)]
    return found[0]


def function_calls(
    conn: Conn, schema: str, settled: Callable[[dict[str, int]], bool] = bool
) -> dict[str, int]:
    """Calls of ``schema``'s functions counted by Postgres (``track_functions``), this
    session's own included: flushed at once from Postgres 15 on; before 15 the statistics
    collector has them within a second or so, so this waits (10 s at most) for ``settled``."""
    query = "SELECT funcname, calls FROM pg_stat_user_functions WHERE schemaname = %s"
    if conn.info.server_version >= 150000:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")  # the flush happens when the session goes idle
        return dict(conn.execute(query, (schema,)).fetchall())
    deadline = time.monotonic() + 10
    while True:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        calls: dict[str, int] = dict(conn.execute(query, (schema,)).fetchall())
        if settled(calls) or time.monotonic() > deadline:
            return calls
        time.sleep(0.2)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
