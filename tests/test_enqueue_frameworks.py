"""Transactional enqueue through Django and SQLAlchemy connections (psycopg 3 underneath).

``lonnymq.transaction`` accepts ``django.db.connection`` and a SQLAlchemy ``Session`` or
``Connection``: a Celery task published inside the block is stored in the framework's
transaction, and rolls back or commits together with the framework's own writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import lonnymq
from tests.apps import close_app
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]
Task = Any  # a Celery task (celery is untyped)


class Boom(Exception):
    """Raised inside a transaction to make the framework roll it back."""


def total(conn: Conn, schema: str, queue: str = "celery") -> int:
    return lonnymq.Broker(schema).queue(queue).stats(conn, count_ready=False).total


def rows(conn: Conn, table: str) -> list[int]:
    query = sql.SQL("SELECT id FROM {} ORDER BY id").format(sql.Identifier(*table.split(".")))
    return [r[0] for r in conn.execute(query).fetchall()]


@pytest.fixture
def task(pg_dsn: str, schema: str, conn: Conn) -> Iterator[Task]:
    """A Celery task on the lonnymq broker in ``schema``, after one warm-up publish (outside
    any transaction) that installs the schema and declares the ``celery`` queue and binding."""
    from celery import Celery

    app = Celery("fwapp", broker=lonnymq_url(pg_dsn))
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="fwapp.send_invoice")  # type: ignore[untyped-decorator]
    def send_invoice(order_id: int) -> int:
        return order_id

    send_invoice.delay(0)  # warm-up: declares the queue and its binding
    assert total(conn, schema) == 1
    yield send_invoice
    close_app(app)


@pytest.fixture
def orders(schema: str, conn: Conn) -> str:
    """A table ``<schema>.orders`` (dropped with the schema), as a qualified name."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(sql.Identifier(schema, "orders"))
    )
    return f"{schema}.orders"


def _insert_sql(table: str, conn: Conn) -> str:
    """``INSERT INTO <table> VALUES (%s)`` with the table name quoted (for framework cursors)."""
    query = sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(*table.split(".")))
    return query.as_string(conn)


# -- Django ---------------------------------------------------------------------------------


def _configure_django(pg_dsn: str) -> None:
    """Configure Django settings from ``pg_dsn`` and set it up, once per process."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    params = conninfo_to_dict(pg_dsn)
    database: dict[str, Any] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", "postgres"),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,  # anything else in the DSN (sslmode, ...) goes to psycopg as is
    }
    settings.configure(DATABASES={"default": database}, INSTALLED_APPS=[], USE_TZ=True)
    django.setup()


@pytest.fixture
def django_connection(pg_dsn: str) -> Iterator[Any]:
    """``django.db.connection`` (psycopg 3 backend), closed after the test."""
    import django

    with psycopg.connect(pg_dsn) as probe:
        server = probe.info.server_version
    if django.VERSION >= (5, 0) and server < 140000:
        pytest.skip(f"Django {django.__version__} needs PostgreSQL 14 or later")
    _configure_django(pg_dsn)
    from django.db import connection, connections

    assert connection.vendor == "postgresql"
    try:
        yield connection
    finally:
        connections.close_all()


def test_django_atomic_rollback_drops_the_task(
    django_connection: Any, task: Task, conn: Conn, schema: str
) -> None:
    from django.db import transaction

    with pytest.raises(Boom), transaction.atomic():
        with lonnymq.transaction(django_connection):
            task.delay(1)
        assert total(conn, schema) == 1  # not visible before commit
        raise Boom
    assert total(conn, schema) == 1  # only the warm-up message
    assert django_connection.get_autocommit()  # Django is back in autocommit mode


def test_django_atomic_commit_keeps_the_task(
    django_connection: Any, task: Task, conn: Conn, schema: str
) -> None:
    from django.db import transaction

    with transaction.atomic():
        with lonnymq.transaction(django_connection):
            task.delay(2)
        assert total(conn, schema) == 1  # not visible before commit
    assert total(conn, schema) == 2


def test_django_raw_sql_and_task_share_the_transaction(
    django_connection: Any, task: Task, conn: Conn, schema: str, orders: str
) -> None:
    from django.db import transaction

    insert = _insert_sql(orders, conn)
    with pytest.raises(Boom), transaction.atomic():
        with django_connection.cursor() as cursor:
            cursor.execute(insert, [1])
        with lonnymq.transaction(django_connection):
            task.delay(1)
        raise Boom
    assert (rows(conn, orders), total(conn, schema)) == ([], 1)  # both rolled back

    with transaction.atomic():
        with django_connection.cursor() as cursor:
            cursor.execute(insert, [2])
        with lonnymq.transaction(django_connection):
            task.delay(2)
        assert (rows(conn, orders), total(conn, schema)) == ([], 1)  # neither visible yet
    assert (rows(conn, orders), total(conn, schema)) == ([2], 2)  # both committed


def test_django_nested_atomic_savepoint(
    django_connection: Any, task: Task, conn: Conn, schema: str
) -> None:
    """A task published in a nested ``atomic()`` (a savepoint) that fails is dropped; one
    published in the outer block survives."""
    from django.db import transaction

    with transaction.atomic():
        with lonnymq.transaction(django_connection):
            task.delay(1)
        with pytest.raises(Boom), transaction.atomic():
            with lonnymq.transaction(django_connection):
                task.delay(2)
            raise Boom
    assert total(conn, schema) == 2  # the warm-up message and task 1


def test_django_autocommit_block_is_its_own_transaction(
    django_connection: Any, task: Task, conn: Conn, schema: str, orders: str
) -> None:
    """Outside ``atomic()`` Django is in autocommit mode: the block commits on its own."""
    insert = _insert_sql(orders, conn)
    with pytest.raises(Boom), lonnymq.transaction(django_connection):
        with django_connection.cursor() as cursor:
            cursor.execute(insert, [1])
        task.delay(1)
        raise Boom
    assert (rows(conn, orders), total(conn, schema)) == ([], 1)
    with lonnymq.transaction(django_connection):
        with django_connection.cursor() as cursor:
            cursor.execute(insert, [2])
        task.delay(2)
    assert (rows(conn, orders), total(conn, schema)) == ([2], 2)


# -- SQLAlchemy -----------------------------------------------------------------------------


@pytest.fixture
def engine(pg_dsn: str) -> Iterator[Any]:
    """A SQLAlchemy engine on the psycopg 3 driver, disposed of after the test."""
    from sqlalchemy import create_engine

    engine = create_engine("postgresql+psycopg://" + pg_dsn.split("://", 1)[1])
    try:
        yield engine
    finally:
        engine.dispose()


def test_sqlalchemy_session_rollback_and_commit(
    engine: Any, task: Task, conn: Conn, schema: str, orders: str
) -> None:
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    insert = text(_insert_sql(orders, conn).replace("%s", ":id"))
    with Session(engine) as session:
        session.execute(insert, {"id": 1})
        with lonnymq.transaction(session):
            task.delay(1)
        assert total(conn, schema) == 1  # not visible before commit
        session.rollback()
        assert (rows(conn, orders), total(conn, schema)) == ([], 1)

        # the block alone (no earlier statement in the session's transaction)
        with lonnymq.transaction(session):
            task.delay(2)
        session.execute(insert, {"id": 2})
        session.commit()
        assert (rows(conn, orders), total(conn, schema)) == ([2], 2)


def test_sqlalchemy_connection_begin_rollback_and_commit(
    engine: Any, task: Task, conn: Conn, schema: str, orders: str
) -> None:
    from sqlalchemy import text

    insert = text(_insert_sql(orders, conn).replace("%s", ":id"))
    with engine.connect() as connection:
        with pytest.raises(Boom), connection.begin():
            connection.execute(insert, {"id": 1})
            with lonnymq.transaction(connection):
                task.delay(1)
            assert total(conn, schema) == 1  # not visible before commit
            raise Boom
        assert (rows(conn, orders), total(conn, schema)) == ([], 1)

        with connection.begin():
            with lonnymq.transaction(connection):
                task.delay(2)
            connection.execute(insert, {"id": 2})
        assert (rows(conn, orders), total(conn, schema)) == ([2], 2)


# Regression: a SQLAlchemy Connection with no transaction begun yet used to hand out its
# driver connection without beginning SQLAlchemy's transaction, so Connection.commit() and
# rollback() did nothing to what was published.


def test_sqlalchemy_connection_autobegin_commit(
    engine: Any, task: Task, conn: Conn, schema: str
) -> None:
    """SQLAlchemy 2 style: no explicit ``begin()``; ``connection.commit()`` commits what the
    block published (here the block is the first thing done on the connection)."""
    with engine.connect() as connection:
        with lonnymq.transaction(connection):
            task.delay(1)
        connection.commit()
        assert total(conn, schema) == 2


def test_sqlalchemy_connection_autobegin_rollback(
    engine: Any, task: Task, conn: Conn, schema: str
) -> None:
    """``connection.rollback()`` discards what the block published, even when the block was
    the first thing done on the connection (no explicit ``begin()``)."""
    from sqlalchemy import text

    with engine.connect() as connection:
        with lonnymq.transaction(connection):
            task.delay(1)
        connection.rollback()
        connection.execute(text("SELECT 1"))  # a later, unrelated transaction ...
        connection.commit()  # ... must not commit the rolled-back message
        assert total(conn, schema) == 1


def test_sqlalchemy_connection_autobegin_after_execute(
    engine: Any, task: Task, conn: Conn, schema: str
) -> None:
    """Once SQLAlchemy has autobegun (an earlier execute), commit and rollback apply."""
    from sqlalchemy import text

    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
        with lonnymq.transaction(connection):
            task.delay(1)
        connection.rollback()
        assert total(conn, schema) == 1
        connection.execute(text("SELECT 1"))
        with lonnymq.transaction(connection):
            task.delay(2)
        connection.commit()
        assert total(conn, schema) == 2
