"""lonnymq quick start: two tenants share a queue fairly, one of them limited to one
message in flight at a time.

Run it with ``python examples/quickstart.py``. It uses $DATABASE_URL when set, else starts a
throwaway Postgres of its own (see lonnymq.testing).
"""

from __future__ import annotations

import psycopg

import lonnymq
from lonnymq.testing import database


def demo(dsn: str) -> list[str]:
    # --8<-- [start:quickstart]
    queue = lonnymq.Queue("emails", schema="lonnymq_demo")

    with psycopg.connect(dsn, autocommit=True) as conn:
        lonnymq.install(conn, schema="lonnymq_demo")  # once; safe to repeat

        # Tenant "big" enqueues a backlog, then tenant "small" enqueues one message.
        for i in range(5):
            queue.channel("big").message.create(conn, f"big-{i}")
        queue.channel("small").message.create(conn, "small-0")
        # At most one of "big"'s messages may be in flight at a time.
        queue.channel("big").policy.set(conn, max_concurrency=1)

        delivered = []
        while True:
            result = queue.dequeue(conn, limit=10, lock_ms=30_000)
            if not result.messages:
                break  # result.retry_ms says when to look again (None: nothing pending)
            for message in result.messages:
                delivered.append(message.content.decode())
                message.delete(conn)  # ack; message.defer(conn, delay_ms=...) retries later
        # --8<-- [end:quickstart]
        conn.execute("DROP SCHEMA lonnymq_demo CASCADE")
    return delivered


def main() -> None:
    with database() as dsn:
        delivered = demo(dsn)
    print("delivered in this order:", ", ".join(delivered))


if __name__ == "__main__":
    main()
