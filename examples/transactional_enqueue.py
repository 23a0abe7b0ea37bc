"""lonnymq transactional enqueue: an order row and its "order placed" message are written in
one psycopg transaction, so they are rolled back or committed together.

Run it with ``python examples/transactional_enqueue.py``. It uses $DATABASE_URL when set, else
starts a throwaway Postgres of its own (see lonnymq.testing). No Celery worker is needed: the
message is published and read back with Kombu's SimpleQueue on the lonnymq transport (Celery's
``task.delay(...)`` inside ``lonnymq.transaction(conn)`` works the same way).
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from kombu.connection import Connection
from psycopg import sql

import lonnymq
from lonnymq.testing import database


def place_order(conn: psycopg.Connection[Any], simple: Any, orders: sql.Composable, n: int) -> None:
    """Insert order ``n`` and publish its message, in ``conn``'s open transaction."""
    with lonnymq.transaction(conn):  # publishes in this block go through conn
        conn.execute(sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders), (n,))
        simple.put({"event": "order placed", "order_id": n})


def delivered(simple: Any) -> list[Any]:
    """Everything waiting in the queue (acknowledged as it is read)."""
    out: list[Any] = []
    while True:
        try:
            message = simple.get(block=False)
        except simple.Empty:
            return out
        out.append(message.payload)
        message.ack()


def stored(conn: psycopg.Connection[Any], orders: sql.Composable) -> list[int]:
    query = sql.SQL("SELECT id FROM {} ORDER BY id").format(orders)
    return [row[0] for row in conn.execute(query).fetchall()]


def demo(dsn: str) -> list[str]:
    schema = f"lonnymq_txdemo_{uuid.uuid4().hex[:8]}"
    orders = sql.Identifier(schema, "orders")
    url = "lonnymq://" + dsn.split("://", 1)[1]
    lines: list[str] = []
    kombu = Connection(url, transport_options={"schema": schema})  # type: ignore[no-untyped-call]
    with kombu as kombu_conn:
        simple = kombu_conn.SimpleQueue("orders")  # installs the schema, declares the queue
        with psycopg.connect(dsn) as conn:  # not autocommit: we commit or roll back ourselves
            try:
                conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(orders))
                conn.commit()

                place_order(conn, simple, orders, 1)
                conn.rollback()  # e.g. payment failed: no order row, no message
                lines.append(f"after rollback: orders={stored(conn, orders)}")
                lines.append(f"after rollback: delivered={delivered(simple)}")
                conn.rollback()

                place_order(conn, simple, orders, 2)
                conn.commit()  # the order row and its message become visible together
                lines.append(f"after commit: orders={stored(conn, orders)}")
                lines.append(f"after commit: delivered={delivered(simple)}")
                conn.rollback()
            finally:
                simple.close()
                conn.rollback()
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
                conn.commit()
    return lines


def main() -> None:
    with database() as dsn:
        for line in demo(dsn):
            print(line)


if __name__ == "__main__":
    main()
