"""lonnymq transactional enqueue from Django: inside ``transaction.atomic()``, a row written
through Django and a Celery task published in ``with lonnymq.transaction(connection):`` roll
back together, or commit together.

Run it with ``python examples/django_enqueue.py``. It uses $DATABASE_URL when set, else starts
a throwaway Postgres of its own (see lonnymq.testing). Django is configured in the script
(``settings.configure``, psycopg 3 backend); no worker runs: the task is only published, and
the script counts the messages waiting in the ``celery`` queue.
"""

from __future__ import annotations

import uuid
from typing import Any

import django
import psycopg
from celery import Celery
from django.conf import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import lonnymq
from lonnymq.testing import database


class PaymentFailed(Exception):
    pass


def setup_django(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    db: dict[str, Any] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", "postgres"),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
    }
    settings.configure(DATABASES={"default": db}, INSTALLED_APPS=[], USE_TZ=True)
    django.setup()


def demo(dsn: str) -> list[str]:
    setup_django(dsn)
    from django.db import connection, connections, transaction

    schema = f"lonnymq_django_{uuid.uuid4().hex[:8]}"
    orders = sql.Identifier(schema, "orders")
    app = Celery("shop", broker="lonnymq://" + dsn.split("://", 1)[1])
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="shop.send_invoice")  # type: ignore[untyped-decorator]
    def send_invoice(order_id: int) -> None: ...

    def place_order(order_id: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(orders), [order_id])
        with lonnymq.transaction(connection):  # the publish goes through Django's connection
            send_invoice.delay(order_id)

    lines: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        queue = lonnymq.Broker(schema).queue("celery")

        def state() -> str:
            ids = [r[0] for r in conn.execute(sql.SQL("SELECT id FROM {}").format(orders))]
            return f"orders={ids} messages={queue.stats(conn).total}"

        try:
            lonnymq.install(conn, schema=schema)
            conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(orders))
            try:
                with transaction.atomic():
                    place_order(1)
                    raise PaymentFailed  # atomic() rolls back: no order, no task
            except PaymentFailed:
                pass
            lines.append(f"after rollback: {state()}")

            with transaction.atomic():
                place_order(2)
            lines.append(f"after commit: {state()}")
        finally:
            app.close()
            connections.close_all()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    return lines


def main() -> None:
    with database() as dsn:
        for line in demo(dsn):
            print(line)


if __name__ == "__main__":
    main()
