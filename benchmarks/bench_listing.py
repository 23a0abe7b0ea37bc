#!/usr/bin/env python3
"""The message listings of the web view on a backlog: the delayed list in due order, by id,
for a queue and for one channel, with the ends of each message's content (its Celery task).

Fills a fresh schema (``bench_listing_<random>``, dropped at the end) with ``--messages``
(200,000) messages in ``--channels`` (1,000) channels of one queue, a tenth of them delayed
(up to ~17 minutes), then times each listing (51 rows, the page size of the view plus one)
``--repeat`` times (7) and prints the medians in ms.

    python benchmarks/bench_listing.py [--dsn postgresql://...] [--messages N]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from typing import Any

import psycopg
from psycopg import sql

import lonnymq
from lonnymq.report import TASK_PEEK

BODY = (
    b'{"body": "W1s0Ml0sIHt9LCB7fV0=", "content-encoding": "utf-8", "headers": {"task": '
    b'"t.add", "id": "x", "argsrepr": "(42,)", "kwargsrepr": "{}"}, "properties": {}}'
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.environ.get("LONNYMQ_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--dsn", default=default)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--channels", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    schema = f"bench_listing_{secrets.token_hex(4)}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        try:
            run(conn, schema, args)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def run(conn: psycopg.Connection[Any], schema: str, args: argparse.Namespace) -> None:
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    queue = broker.queue("big")
    started = time.perf_counter()
    for first in range(0, args.messages, 1000):
        batch = queue.batch()
        for n in range(first, min(first + 1000, args.messages)):
            delay = (n % 997) * 1000 + 60_000 if n % 10 == 0 else 0
            batch.channel(f"tenant-{n % args.channels:05d}").message(BODY, delay_ms=delay)
        batch.execute(conn)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "message")))
    print(f"{args.messages:,} messages in {args.channels:,} channels, filled in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip

    def timed(**kw: Any) -> tuple[float, list[lonnymq.queue.MessageInfo]]:
        took = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            page = broker.messages(conn, limit=51, peek=TASK_PEEK, **kw)
            took.append((time.perf_counter() - t) * 1000)
        return statistics.median(took), page

    one = "tenant-00010"
    for label, kw in [
        ("delayed by due time, the queue", {"state": "delayed", "order": "due"}),
        ("delayed by id, the queue", {"state": "delayed"}),
        ("delayed by due time, a channel", {"channel": one, "state": "delayed", "order": "due"}),
        ("delayed by id, a channel", {"channel": one, "state": "delayed"}),
        ("every live message by due time", {"order": "due"}),
        ("ready by id", {"state": "ready"}),
    ]:
        ms, page = timed(queue="big", **kw)
        print(f"{label}: {ms:.1f} ms ({len(page)} rows)")
    _, page = timed(queue="big", state="delayed", order="due")
    ms, _ = timed(
        queue="big", state="delayed", order="due", after=page[-1].id, after_due=page[-1].dequeue_at
    )
    print(f"delayed by due time, the second page: {ms:.1f} ms")


if __name__ == "__main__":
    main()
