"""Transactional enqueue: publish Kombu messages and Celery tasks on the caller's own
database connection, inside the caller's transaction.

    with lonnymq.transaction(conn):        # a psycopg Connection (or see below)
        conn.execute("INSERT INTO orders ...")
        send_invoice.delay(order_id)       # stored in the same transaction

Roll the transaction back and the task never existed; commit and it runs. Inside the block,
every publish through the lonnymq transport in this thread (or asyncio task) goes through
``conn`` instead of the transport's own connection. On a connection in autocommit mode the
block is a transaction of its own (committed at the end of the block, rolled back on error);
otherwise the block joins the caller's open transaction and commits nothing.

``conn`` may be a psycopg ``Connection``, a Django database connection
(``django.db.connection``, with the psycopg 3 backend), or a SQLAlchemy ``Session`` or
``Connection`` on the psycopg 3 driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import psycopg

from .exceptions import InvalidArgument

_CURRENT: ContextVar[psycopg.Connection[Any] | None] = ContextVar(
    "lonnymq_transaction", default=None
)


def current_connection() -> psycopg.Connection[Any] | None:
    """The caller's connection publishes go through, inside a :func:`transaction` block."""
    return _CURRENT.get()


def psycopg_connection(conn: Any) -> psycopg.Connection[Any]:
    """The psycopg connection behind ``conn`` (psycopg, Django or SQLAlchemy)."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, psycopg.AsyncConnection):
        raise InvalidArgument(
            "lonnymq.transaction needs a sync psycopg Connection: Kombu and Celery publish "
            "synchronously (async producers can use lonnymq.Queue(...).channel(...).message"
            ".create with an AsyncConnection)"
        )
    # Django: a DatabaseWrapper; its .connection is the driver connection once opened.
    if hasattr(conn, "ensure_connection") and hasattr(conn, "vendor"):
        conn.ensure_connection()
        return psycopg_connection(conn.connection)
    # SQLAlchemy: a Session (.connection()) or a Connection (.connection.driver_connection).
    driver = getattr(getattr(conn, "connection", None), "driver_connection", None)
    if driver is not None:
        pg = psycopg_connection(driver)
        # Begin SQLAlchemy's transaction as Connection.execute would, so that its commit()
        # and rollback() cover what we publish on the driver connection.
        begin = callable(getattr(conn, "in_transaction", None)) and not conn.in_transaction()
        if begin and not pg.autocommit:
            conn.begin()
        return pg
    if callable(getattr(conn, "connection", None)) and hasattr(conn, "get_bind"):
        return psycopg_connection(conn.connection())
    raise InvalidArgument(
        f"lonnymq.transaction needs a psycopg Connection (or a Django / SQLAlchemy connection "
        f"on psycopg 3), not {type(conn).__name__}"
    )


@contextmanager
def transaction(conn: Any) -> Iterator[psycopg.Connection[Any]]:
    """Route publishes in this block through ``conn``, in its transaction (see module doc)."""
    pg = psycopg_connection(conn)
    token = _CURRENT.set(pg)
    try:
        if pg.autocommit:
            with pg.transaction():
                yield pg
        else:
            yield pg
    finally:
        _CURRENT.reset(token)
