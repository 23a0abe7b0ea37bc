# mypy: allow-untyped-calls
"""lonnymq with plain Kombu: a topic exchange routing to two queues, messages published into
tenant channels with the ``x-channel`` header, consumed with ack, and one message rejected
with requeue (it comes back, marked redelivered, and is acked the second time).

Run it with ``python examples/kombu_producer_consumer.py``. It uses $DATABASE_URL when set,
else starts a throwaway Postgres of its own (see lonnymq.testing). Producer and consumer run
in this one process; they could as well be two processes on two machines, since exchanges,
bindings and messages all live in Postgres.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer, Producer
from psycopg import sql

import lonnymq  # noqa: F401  registers the lonnymq:// transport alias
from lonnymq.testing import database

EVENTS = Exchange("events", type="topic")
ORDERS = Queue("orders", EVENTS, routing_key="order.*")  # order.created, order.paid, ...
AUDIT = Queue("audit", EVENTS, routing_key="#")  # every event

PUBLISHED = [  # (tenant channel, routing key, body)
    ("tenant-a", "order.created", {"order": 1}),
    ("tenant-b", "order.created", {"order": 2}),
    ("tenant-a", "order.paid", {"order": 1}),
    ("tenant-b", "user.signed_up", {"user": 7}),
]


def consume(conn: Any) -> list[str]:
    """Drain both queues; the first delivery of order 2 is rejected with requeue."""
    got: list[str] = []
    requeued: set[int] = set()

    def handler(queue: str) -> Callable[[Any, Any], None]:
        def handle(body: dict[str, int], message: Any) -> None:
            tenant = message.headers["x-channel"]
            event = message.delivery_info["routing_key"]
            redelivered = " (redelivered)" if message.delivery_info.get("redelivered") else ""
            if queue == "orders" and body.get("order") == 2 and 2 not in requeued:
                requeued.add(2)
                print(f"{queue}: {tenant} {event} {body} -> rejected with requeue")
                message.reject(requeue=True)  # unlocks the row: it is delivered again
                return
            got.append(f"{queue}: {tenant} {event} {body}{redelivered}")
            message.ack()  # deletes the row

        return handle

    with (
        Consumer(conn, [ORDERS], callbacks=[handler("orders")], prefetch_count=10),
        Consumer(conn, [AUDIT], callbacks=[handler("audit")], prefetch_count=10),
    ):
        expected = 3 + 4  # orders gets the 3 order.* events, audit all 4
        while len(got) < expected:
            try:
                conn.drain_events(timeout=5)
            except TimeoutError:
                break  # nothing more within 5 s
    return got


def demo(dsn: str) -> list[str]:
    schema = f"lonnymq_kombu_{uuid.uuid4().hex[:8]}"
    url = "lonnymq://" + dsn.split("://", 1)[1]
    try:
        with Connection(url, transport_options={"schema": schema}) as conn:
            channel = conn.channel()
            # Declare the exchange, the queues and their bindings (stored in Postgres), so
            # that messages published before anyone consumes are kept.
            for queue in (ORDERS, AUDIT):
                queue(channel).declare()
            producer = Producer(channel, exchange=EVENTS)
            for tenant, routing_key, body in PUBLISHED:
                producer.publish(body, routing_key=routing_key, headers={"x-channel": tenant})
            print(f"published {len(PUBLISHED)} events to the topic exchange {EVENTS.name!r}")
            return consume(conn)
    finally:
        with psycopg.connect(dsn, autocommit=True) as pg:
            pg.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def main() -> None:
    with database() as dsn:
        got = demo(dsn)
    for line in sorted(got):
        print(line)
    print(f"consumed and acked {len(got)} messages")


if __name__ == "__main__":
    main()
