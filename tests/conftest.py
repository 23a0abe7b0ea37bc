"""Test fixtures: a real Postgres ($LONNYMQ_TEST_DSN, or a throwaway server started here) and
one fresh schema per test, dropped afterwards."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq.testing import database

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with database("LONNYMQ_TEST_DSN") as dsn:
        yield dsn


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
    """A fresh, unique schema name, dropped (with everything in it) after the test."""
    name = f"lmq_test_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


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
