"""lonnymq transactional enqueue from SQLAlchemy: in a ``Session``, a row inserted through the
session and a Celery task published in ``with lonnymq.transaction(session):`` roll back
together, or commit together.

Run it with ``python examples/sqlalchemy_enqueue.py``. It uses $DATABASE_URL when set, else
starts a throwaway Postgres of its own (see lonnymq.testing). The engine uses the psycopg 3
driver (``postgresql+psycopg://``). No worker runs: the task is only published, and the script
counts the messages waiting in the ``celery`` queue.
"""

from __future__ import annotations

import uuid

import psycopg
from celery import Celery
from psycopg import sql
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import lonnymq
from lonnymq.testing import database


def demo(dsn: str) -> list[str]:
    schema = f"lonnymq_sqla_{uuid.uuid4().hex[:8]}"
    app = Celery("shop", broker="lonnymq://" + dsn.split("://", 1)[1])
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="shop.send_invoice")  # type: ignore[untyped-decorator]
    def send_invoice(order_id: int) -> None: ...

    engine = create_engine("postgresql+psycopg://" + dsn.split("://", 1)[1])
    lines: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        queue = lonnymq.Broker(schema).queue("celery")
        orders = sql.Identifier(schema, "orders")
        insert = text(sql.SQL("INSERT INTO {} (id) VALUES (:id)").format(orders).as_string(conn))

        def state() -> str:
            ids = [r[0] for r in conn.execute(sql.SQL("SELECT id FROM {}").format(orders))]
            return f"orders={ids} messages={queue.stats(conn).total}"

        try:
            lonnymq.install(conn, schema=schema)
            conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(orders))
            with Session(engine) as session:
                session.execute(insert, {"id": 1})
                with lonnymq.transaction(session):  # publishes go through the session
                    send_invoice.delay(1)
                lines.append(f"before rollback: {state()}")  # nothing visible yet
                session.rollback()
                lines.append(f"after rollback: {state()}")

                session.execute(insert, {"id": 2})
                with lonnymq.transaction(session):
                    send_invoice.delay(2)
                session.commit()
                lines.append(f"after commit: {state()}")
        finally:
            app.close()
            engine.dispose()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    return lines


def main() -> None:
    with database() as dsn:
        for line in demo(dsn):
            print(line)


if __name__ == "__main__":
    main()
