"""Where a create's time goes (issue 26: "create 1 producer at least 0.85 of its floor"), not a
benchmark row. One connection, autocommit, durable commits (the server's
``synchronous_commit``), 300-byte payloads, medians of ``--calls`` per variant and run:

- ``floor``: ``bench_hot_path.py``'s publish floor, a bare single-row ``INSERT`` into
  ``floor_t``;
- ``message_row``: the same row inserted into lonnymq's ``message`` table by hand;
- ``function``: ``message_create_v1`` called with psycopg, nothing around it;
- ``api``: ``queue.channel(c).message.create(conn, payload)``.

Then the server's time in ``message_create_v1`` and ``wake_v2`` (``track_functions``), and
the function's statements timed one by one, warm, in a loop of one transaction (``DO``).
Then, when the server runs on this machine (its backend's ``/proc`` readable), the server's
CPU a call of ``floor``, ``message_row`` and ``function``: the backend's user and system time
over ``--cpu-calls`` calls of a connection of its own with ``synchronous_commit = off`` (no
WAL flush to wait for, nor its system time), five interleaved rounds, median and range.
Not the product: a scratch schema, dropped at the end.

    python benchmarks/probe_create_call.py [--dsn DSN] [--repeat 3] [--calls 1500]
        [--cpu-calls 10000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from floors import dsn_argument, install_floors
from psycopg import sql

import lonnymq
from lonnymq.queue import create
from lonnymq.queue._ops import render

PAYLOAD = os.urandom(300)

#: The statements of message_create_v1 on its usual path (no name, no limit, no hand-off).
STEPS = {
    "produce key": "PERFORM pg_advisory_xact_lock_shared({s}.queue_key_v1('produce', 'q'));",
    "limits read": (
        "SELECT CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END, q.max_priority "
        "INTO v_size, v_prio FROM (SELECT) AS one LEFT JOIN {s}.queue q ON q.name = 'q' "
        "LEFT JOIN {s}.channel c ON c.queue = 'q' AND c.name = 'c';"
    ),
    "insert": (
        "INSERT INTO {s}.message (queue, channel, priority, txid, dequeue_at, expires_at, name, "
        "content) VALUES ('q', 'c', 0, pg_current_xact_id(), clock_timestamp(), NULL, NULL, "
        "'\\x00') ON CONFLICT (queue, channel, name) WHERE name IS NOT NULL AND attempts = 0 "
        "DO NOTHING RETURNING id INTO v_id;"
    ),
    "wake_v2": "PERFORM {s}.wake_v2('q', v_id);",
}
_LOOP = """DO $$
DECLARE v_size int; v_prio int; v_id bigint := 1; t0 timestamptz;
BEGIN
    FOR i IN 1..50 LOOP {step} END LOOP;
    t0 := clock_timestamp();
    FOR i IN 1..2000 LOOP {step} END LOOP;
    RAISE NOTICE '%', extract(epoch FROM clock_timestamp() - t0) * 1e6 / 2000;
END $$"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dsn_argument(parser)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--cpu-calls", type=int, default=10_000)
    args = parser.parse_args()
    schema = f"probe_create_{uuid.uuid4().hex[:8]}"
    s = sql.Identifier(schema)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        lonnymq.install(admin, schema)
        try:
            install_floors(admin, schema)
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute("SET track_functions = 'all'")
                calls(conn, schema, args.repeat, args.calls)
            time.sleep(1)  # (the closed session's function statistics reach the view)
            for name, per_call, own in admin.execute(
                "SELECT funcname, total_time / calls, self_time / calls FROM "
                "pg_stat_user_functions WHERE schemaname = %s AND funcname IN "
                "('message_create_v1', 'wake_v2')",
                (schema,),
            ):
                print(f"server: {name} {per_call * 1000:.1f} us a call ({own * 1000:.1f} its own)")
            steps(admin, s)
            server_cpu(args.dsn, admin, schema, args.cpu_calls)
        finally:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))


def statements(schema: str) -> dict[str, tuple[sql.Composed | bytes, tuple[Any, ...]]]:
    """The statements of the variants floor, message_row and function, with their arguments."""
    s = sql.Identifier(schema)
    floor = sql.SQL("INSERT INTO {}.floor_t (ch, payload) VALUES (%s, %s)").format(s)
    row = sql.SQL(
        "INSERT INTO {}.message (queue, channel, priority, txid, dequeue_at, content) "
        "VALUES (%s, %s, 0, pg_current_xact_id(), clock_timestamp(), %s)"
    ).format(s)
    return {
        "floor": (floor, ("c", PAYLOAD)),
        "message_row": (row, ("q", "c", PAYLOAD)),
        "function": (render(create._CREATE, schema), ("q", "c", None, PAYLOAD, 0, 0, None)),
    }


def calls(conn: psycopg.Connection[Any], schema: str, repeat: int, count: int) -> None:
    channel = lonnymq.Broker(schema).queue("q").channel("c")
    variants: dict[str, Callable[[], object]] = {
        name: partial(conn.execute, statement, params)
        for name, (statement, params) in statements(schema).items()
    }
    variants["api"] = lambda: channel.message.create(conn, PAYLOAD)
    for _ in range(repeat):
        out = []
        for name, call in variants.items():
            took = []
            for _ in range(count):
                start = time.perf_counter()
                call()
                took.append(time.perf_counter() - start)
            out.append(f"{name} {statistics.median(took) * 1e6:.0f} us")
        print(" | ".join(out), flush=True)


def steps(admin: psycopg.Connection[Any], s: sql.Identifier) -> None:
    notices: list[str] = []
    admin.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    out = []
    for name, step in STEPS.items():
        statement = sql.SQL(step).format(s=s).as_string(admin)
        with admin.transaction(force_rollback=True):
            admin.execute(_LOOP.replace("{step}", statement).encode())
        out.append(f"{name} {float(notices[-1]):.1f} us")
    print("statements, warm: " + " | ".join(out))


def server_cpu(dsn: str, admin: psycopg.Connection[Any], schema: str, count: int) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    s = sql.Identifier(schema)
    took: dict[str, list[float]] = {name: [] for name in statements(schema)}
    for _ in range(5):
        for name, (statement, params) in statements(schema).items():
            admin.execute(sql.SQL("TRUNCATE {}.message, {}.floor_t").format(s, s))
            options = "-c synchronous_commit=off"
            with psycopg.connect(dsn, autocommit=True, options=options) as conn:
                stat = Path(f"/proc/{conn.info.backend_pid}/stat")
                if not stat.exists():
                    print("server CPU: not measured (the server runs elsewhere)")
                    return

                def cpu(stat: Path = stat) -> float:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

                for _ in range(300):  # (warm: plans, caches)
                    conn.execute(statement, params, prepare=True)
                start = cpu()
                for _ in range(count):
                    conn.execute(statement, params, prepare=True)
                took[name].append((cpu() - start) / count * 1e6)
    print(
        "server CPU a call, median (min-max) of 5: "
        + " | ".join(
            f"{name} {statistics.median(v):.0f} us ({min(v):.0f}-{max(v):.0f})"
            for name, v in took.items()
        )
    )


if __name__ == "__main__":
    main()
