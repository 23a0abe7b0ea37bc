"""A design probe for issue 26 ("The usual dequeue at the speed of Postgres"): what it costs
per message to give each message its round-robin round where it is ingested (an ``UPDATE`` of
an indexed column of lonnymq's ``message`` table, so not HOT), next to what a dequeue that
is then one ordered index scan with ``SKIP LOCKED`` costs per message (the floor's work on
the same table). Not the product: a scratch schema with lonnymq's tables, a ``round`` column
and its index added, dropped at the end.

    python benchmarks/probe_rounds_at_ingest.py [--dsn DSN] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

import psycopg
from floors import dsn_argument
from psycopg import sql

import lonnymq

CHANNELS = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dsn_argument(parser)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    schema = f"probe_rounds_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        try:
            run(conn, schema, args.repeat)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def run(conn: psycopg.Connection[Any], schema: str, repeat: int) -> None:
    s = sql.Identifier(schema)
    lonnymq.install(conn, schema)
    conn.execute(sql.SQL("ALTER TABLE {}.message ADD COLUMN round bigint").format(s))
    conn.execute(
        sql.SQL(
            "CREATE INDEX message_round_idx ON {}.message (queue, round, id) "
            "WHERE locked_until IS NULL AND round IS NOT NULL"
        ).format(s)
    )
    conn.execute("SET synchronous_commit = off")  # CPU, not the WAL flush
    fill = sql.SQL(
        "INSERT INTO {}.message (queue, channel, txid, dequeue_at, content) "
        "SELECT 'q', 'c' || (g %% %s), pg_current_xact_id(), clock_timestamp(), '\\x00' "
        "FROM generate_series(1, %s) AS g"
    ).format(s)
    # the ingest's work: each new message's round, its rank in its channel
    assign = sql.SQL(
        "WITH new AS ("
        " SELECT m.id, row_number() OVER (PARTITION BY m.channel ORDER BY m.id) AS k"
        " FROM {s}.message m WHERE m.queue = 'q' AND m.round IS NULL AND m.locked_until IS NULL"
        " ORDER BY m.id LIMIT %s) "
        "UPDATE {s}.message m SET round = new.k FROM new WHERE m.id = new.id"
    ).format(s=s)
    for batch in (100, 1000):
        per_message = []
        for _ in range(repeat):
            conn.execute(fill, (CHANNELS, batch))
            start = time.perf_counter()
            conn.execute(assign, (batch,))
            per_message.append((time.perf_counter() - start) / batch * 1e6)
        print(
            f"round given at ingest, {batch} messages a statement: "
            f"{statistics.median(per_message):.1f} us per message "
            f"({min(per_message):.1f}-{max(per_message):.1f})"
        )
    # the dequeue it allows: the held messages deleted and the next locked, one statement
    dequeue = sql.SQL(
        "WITH gone AS (DELETE FROM {s}.message WHERE id = ANY(%s)), "
        "next AS (SELECT m.id FROM {s}.message m"
        " WHERE m.queue = 'q' AND m.locked_until IS NULL AND m.round IS NOT NULL"
        " ORDER BY m.queue, m.round, m.id LIMIT %s FOR UPDATE SKIP LOCKED) "
        "UPDATE {s}.message m SET locked_until = clock_timestamp() + interval '1 minute',"
        " lock_token = gen_random_uuid(), attempts = m.attempts + 1 "
        "FROM next WHERE m.id = next.id RETURNING m.id"
    ).format(s=s)
    conn.execute(fill, (CHANNELS, 20_000))
    conn.execute(assign, (20_000,))
    for limit in (1, 100):
        held: list[int] = []
        calls = []
        handed = 0
        while handed < 3_000:
            start = time.perf_counter()
            held = [r[0] for r in conn.execute(dequeue, (held, limit)).fetchall()]
            calls.append(time.perf_counter() - start)
            handed += len(held)
        call = statistics.median(calls)
        print(
            f"ack + dequeue by round, prefetch {limit}: {call * 1000:.3f} ms a call, "
            f"{call / limit * 1e6:.1f} us per message"
        )


if __name__ == "__main__":
    main()
