"""A design probe for issue 26 ("The usual dequeue at the speed of Postgres"): what writing a
delivery's lock into its message row costs, next to the floor, which locks nothing beyond its
own transaction (one statement: delete the held rows, ``FOR UPDATE SKIP LOCKED`` the next).

Three variants, each one statement per call (ack the held messages, take the next), prefetch
1 and 100, ``synchronous_commit = off`` (CPU, not the WAL flush). The server plans the
statements as it chooses (a generic plan, forced, was 8 ms a call here: its row comparison
was not used as an index bound); compare prefetch 100, where a call's planning is a
hundredth of it per message:

- ``floor``: a bare table (primary key only), the held rows deleted, the next selected
  ``FOR UPDATE SKIP LOCKED`` (the lock ends with the statement's transaction);
- ``now``: lonnymq's ``message`` table as installed, the next rows locked as lonnymq locks
  them (``locked_until``, ``lock_token``, ``attempts + 1``: not a HOT update, since indexes
  name those columns);
- ``hot``: the same table without any index naming a column the lock changes (the ready and
  txid indexes without their predicates, no locked or name index) and fillfactor 70, so the
  lock is a HOT update.

Not the product: scratch schemas, dropped at the end.

    python benchmarks/probe_lock_write.py [--dsn DSN] [--repeat 3]
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

ROWS = 40_000
TAKEN = 4_000  # messages taken per measured run

Conn = psycopg.Connection[Any]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dsn_argument(parser)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    prefix = f"probe_lock_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        try:
            for _ in range(args.repeat):
                row = []
                for variant in ("floor", "now", "hot"):
                    for limit in (1, 100):
                        call = measure(conn, f"{prefix}_{variant}", variant, limit)
                        row.append(
                            f"{variant} p{limit}: {call * 1000:.3f} ms a call, "
                            f"{call / limit * 1e6:.1f} us a message"
                        )
                print(" | ".join(row), flush=True)
        finally:
            for variant in ("floor", "now", "hot"):
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                        sql.Identifier(f"{prefix}_{variant}")
                    )
                )


def setup(conn: Conn, schema: str, variant: str) -> None:
    s = sql.Identifier(schema)
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    if variant == "floor":
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.message (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "queue text NOT NULL, channel text NOT NULL, content bytea NOT NULL)"
            ).format(s)
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.message (queue, channel, content) "
                "SELECT 'q', 'c', '\\x00' FROM generate_series(1, %s)"
            ).format(s),
            (ROWS,),
        )
    else:
        lonnymq.install(conn, schema)
        if variant == "hot":
            for index in ("message_locked_idx", "message_name_idx", "message_ready_idx"):
                conn.execute(sql.SQL("DROP INDEX {}.{}").format(s, sql.Identifier(index)))
            conn.execute(sql.SQL("DROP INDEX {}.message_txid_idx").format(s))
            conn.execute(
                sql.SQL(
                    "CREATE INDEX message_ready_idx ON {}.message "
                    "(queue, channel, priority DESC, dequeue_at, id)"
                ).format(s)
            )
            conn.execute(sql.SQL("CREATE INDEX message_txid_idx ON {}.message (txid)").format(s))
            conn.execute(sql.SQL("ALTER TABLE {}.message SET (fillfactor = 70)").format(s))
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.message (queue, channel, txid, dequeue_at, content) "
                "SELECT 'q', 'c', pg_current_xact_id(), clock_timestamp(), '\\x00' "
                "FROM generate_series(1, %s)"
            ).format(s),
            (ROWS,),
        )
    conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(s))


def measure(conn: Conn, schema: str, variant: str, limit: int) -> float:
    """The median call, over calls that take TAKEN messages from a fresh table."""
    setup(conn, schema, variant)
    s = sql.Identifier(schema)
    if variant == "floor":
        statement = sql.SQL(
            "WITH gone AS (DELETE FROM {s}.message WHERE id = ANY(%s)) "
            "SELECT id, NULL::timestamptz FROM {s}.message WHERE id > %s ORDER BY id LIMIT %s "
            "FOR UPDATE SKIP LOCKED"
        ).format(s=s)
    else:
        ready = sql.SQL("") if variant == "hot" else sql.SQL(" AND m.locked_until IS NULL")
        statement = sql.SQL(
            "WITH gone AS (DELETE FROM {s}.message WHERE id = ANY(%s)), "
            "next AS (SELECT m.id FROM {s}.message m"
            " WHERE m.queue = 'q' AND m.channel = 'c' AND m.priority = 0"
            " AND (m.dequeue_at, m.id) > (%s::timestamptz, %s::bigint){ready}"
            " ORDER BY m.queue, m.channel, m.priority DESC, m.dequeue_at, m.id LIMIT %s"
            " FOR UPDATE SKIP LOCKED) "
            "UPDATE {s}.message m SET locked_until = clock_timestamp() + interval '1 minute',"
            " lock_token = gen_random_uuid(), attempts = m.attempts + 1 "
            "FROM next WHERE m.id = next.id RETURNING m.id, m.dequeue_at"
        ).format(s=s, ready=ready)
    # (each call reads from where the last one stopped, as a lane's position does: never
    # through the index entries of the rows acked before)
    held: list[int] = []
    last: tuple[Any, int] = ("-infinity", 0)
    calls = []
    taken = 0
    while taken < TAKEN:
        params = (held, last[1], limit) if variant == "floor" else (held, *last, limit)
        start = time.perf_counter()
        rows = conn.execute(statement, params).fetchall()
        calls.append(time.perf_counter() - start)
        held = [r[0] for r in rows]
        taken += len(held)
        if rows:
            last = max((r[1], r[0]) for r in rows) if variant != "floor" else (None, max(held))
    return statistics.median(calls)


if __name__ == "__main__":
    main()
