"""A probe for issue 26 ("The usual dequeue at the speed of Postgres"): how close to the consume
floor of ``bench_hot_path.py`` the floor's own statement gets on lonnymq's ``message`` table,
before anything lonnymq adds (lanes, counts, expiry, fairness).

One statement a call (delete the held rows, lock the next ``FOR UPDATE SKIP LOCKED`` in ready
order, write their lock), prefetch ``--limit`` (default 100), one consumer, one channel of
30,000 messages of 300 bytes, ``synchronous_commit = off``, a fresh table per run; messages
per second over the drain and the median call:

- ``floor``: ``bench_hot_path.py``'s consume floor as it is (``floor_m``: primary key and an
  index ``(ch, at, id) WHERE locked_until IS NULL``; the lock is ``locked_until``);
- ``table``: the same statement on lonnymq's ``message`` table as installed, the lock as
  lonnymq writes it (``locked_until``, a ``gen_random_uuid()`` token, ``attempts + 1``), read
  through ``message_ready_idx``; it returns the id and the content, as the floor does;
- ``columns``: ``table`` returning every column a dequeue returns;
- ``no_locked_idx``: ``table`` without ``message_locked_idx`` (which a lock write inserts into);
- ``bare_indexes``: ``table`` with only the primary key and ``message_ready_idx``;
- ``one_token``: ``table`` with one constant token instead of ``gen_random_uuid()`` a row.

Not the product: scratch schemas, dropped at the end.

    python benchmarks/probe_consume_table.py [--dsn DSN] [--repeat 3] [--limit 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from floors import dsn_argument, install_floors
from psycopg import sql

import lonnymq

ROWS = 30_000
PAYLOAD = os.urandom(300)
VARIANTS = ("floor", "table", "columns", "no_locked_idx", "bare_indexes", "one_token")

Conn = psycopg.Connection[Any]

_FLOOR = (
    "WITH d AS (DELETE FROM {s}.floor_m WHERE id = ANY(%s::bigint[])), "
    "n AS (SELECT id FROM {s}.floor_m WHERE ch = 'c' AND locked_until IS NULL "
    "ORDER BY at, id LIMIT %s FOR UPDATE SKIP LOCKED) "
    "UPDATE {s}.floor_m SET locked_until = now() + interval '1 minute' "
    "WHERE id = ANY (ARRAY(SELECT id FROM n)) RETURNING id, payload"
)
_TABLE = (
    "WITH d AS (DELETE FROM {s}.message WHERE id = ANY(%s::bigint[])), "
    "n AS (SELECT id FROM {s}.message m WHERE m.queue = 'q' AND m.channel = 'c' "
    "AND m.priority = 0 AND m.locked_until IS NULL "
    "ORDER BY m.priority DESC, m.dequeue_at, m.id LIMIT %s FOR UPDATE SKIP LOCKED) "
    "UPDATE {s}.message m SET locked_until = now() + interval '1 minute', "
    "lock_token = {token}, attempts = m.attempts + 1 "
    "WHERE id = ANY (ARRAY(SELECT id FROM n)) RETURNING {columns}"
)
_COLUMNS = (
    "m.id, m.queue, m.channel, m.name, m.priority, m.attempts, m.lock_token, m.created_at, "
    "m.content, m.state, NULL::bigint, 'delivered'::text"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dsn_argument(parser)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=int, default=100)
    args = parser.parse_args()
    schema = f"probe_consume_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        try:
            for _ in range(args.repeat):
                rates = {v: drain(admin, args.dsn, schema, v, args.limit) for v in VARIANTS}
                floor = rates["floor"][0]
                print(
                    " | ".join(
                        f"{v} {rate:,.0f}/s {call * 1000:.2f} ms ({rate / floor:.2f})"
                        for v, (rate, call) in rates.items()
                    ),
                    flush=True,
                )
        finally:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


def setup(admin: Conn, schema: str, variant: str) -> None:
    s = sql.Identifier(schema)
    admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    if variant == "floor":
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        install_floors(admin, schema)
        admin.execute(
            sql.SQL(
                "INSERT INTO {}.floor_m (ch, payload) SELECT 'c', %s FROM generate_series(1, %s)"
            ).format(s),
            (PAYLOAD, ROWS),
        )
        admin.execute(sql.SQL("VACUUM ANALYZE {}.floor_m").format(s))
        return
    lonnymq.install(admin, schema)
    dropped = {
        "no_locked_idx": ["message_locked_idx"],
        "bare_indexes": [
            "message_locked_idx",
            "message_txid_idx",
            "message_name_idx",
            "message_expires_idx",
        ],
    }.get(variant, [])
    for index in dropped:
        admin.execute(sql.SQL("DROP INDEX {}.{}").format(s, sql.Identifier(index)))
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.message (queue, channel, txid, dequeue_at, content) "
            "SELECT 'q', 'c', pg_current_xact_id(), clock_timestamp(), %s "
            "FROM generate_series(1, %s)"
        ).format(s),
        (PAYLOAD, ROWS),
    )
    admin.execute(sql.SQL("VACUUM ANALYZE {}.message").format(s))


def drain(admin: Conn, dsn: str, schema: str, variant: str, limit: int) -> tuple[float, float]:
    """Messages a second over the drain of a fresh table, and the median call (seconds)."""
    setup(admin, schema, variant)
    s = sql.Identifier(schema)
    if variant == "floor":
        statement = sql.SQL(_FLOOR).format(s=s)
    else:
        token = (
            "'00000000-0000-4000-8000-000000000001'::uuid"
            if variant == "one_token"
            else ("gen_random_uuid()")
        )
        columns = _COLUMNS if variant == "columns" else "m.id, m.content"
        statement = sql.SQL(_TABLE).format(s=s, token=sql.SQL(token), columns=sql.SQL(columns))
    calls = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        held: list[int] = []
        taken = 0
        start = time.perf_counter()
        while taken < ROWS:
            t0 = time.perf_counter()
            rows = conn.execute(statement, (held, limit)).fetchall()
            calls.append(time.perf_counter() - t0)
            if not rows:
                break
            held = [r[0] for r in rows]
            taken += len(rows)
        seconds = time.perf_counter() - start
    return taken / seconds, statistics.median(calls)


if __name__ == "__main__":
    main()
