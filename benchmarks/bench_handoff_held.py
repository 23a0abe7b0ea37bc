#!/usr/bin/env python3
# mypy: allow-untyped-calls
"""A Kombu consumer asleep on a queue, a publisher 50 times a second, and another session
that holds a snapshot for part of the run: does the wake-up stay flat?

A hand-off (schema version 21) creates a locked message and the consumer's ack deletes it;
while a snapshot is held, its entries stay in the locked index, and each lock's time passes
two heartbeats and 30 s later (150 s by default). The run: ``--free`` seconds without a held
snapshot, ``--hold`` seconds with one (a session idle in a REPEATABLE READ transaction), then
``--after`` without. Printed per ``--bucket`` seconds: the publish call's p50 and the wake-up's
(from just before the publish to the consumer's callback) p50 and p99, in ms; the same
without the hand-off with ``--no-handoff``; and with ``--floor``, what bare Postgres does for
the same work under the same hold: a durable ``INSERT`` of the message into a table of its
own and a ``NOTIFY`` of its id in one transaction, a ``LISTEN`` loop that deletes the row by
its id when notified (the ack) and then counts it received. Each run installs lonnymq in a
fresh schema (the floor its table) and drops it at the end.

    python benchmarks/bench_handoff_held.py --free 30 --hold 300 --after 30
    python benchmarks/bench_handoff_held.py --no-handoff --free 30 --hold 300 --after 30
    python benchmarks/bench_handoff_held.py --floor --free 30 --hold 300 --after 30
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from bench_wakeup import percentile
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer, Producer
from psycopg import sql

import lonnymq

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def consume(
    url: str, options: dict[str, Any], got: dict[int, float], stop: threading.Event
) -> None:
    with Connection(url, transport_options=options) as conn:
        queue = Queue("held", Exchange("held"), "held")

        def received(body: Any, message: Any) -> None:
            got[int(body["i"])] = time.perf_counter()
            message.ack()

        with Consumer(conn, [queue], callbacks=[received], accept=["json"]):
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)


def floor_consume(
    dsn: str,
    table: sql.Identifier,
    got: dict[int, float],
    ready: threading.Event,
    stop: threading.Event,
) -> None:
    """The floor's consumer: LISTEN; each notification's row deleted by its id (the ack), then
    counted received."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN bench_held_floor")
        ready.set()
        while not stop.is_set():
            # (read first: the notifies generator holds the connection while it runs)
            for note in list(conn.notifies(timeout=0.2, stop_after=1)):
                conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(table), [note.payload])
                body = int(note.payload)
                got[body] = time.perf_counter()


def run_floor(args: argparse.Namespace) -> None:
    table = sql.Identifier(f"bench_held_floor_{secrets.token_hex(4)}")
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, body bytea NOT NULL)").format(table)
        )
    got: dict[int, float] = {}
    ready, stop = threading.Event(), threading.Event()
    consumer = threading.Thread(target=floor_consume, args=(args.dsn, table, got, ready, stop))
    consumer.start()
    ready.wait(10)
    try:
        with psycopg.connect(args.dsn, autocommit=True) as producer:
            insert = sql.SQL(
                "WITH m AS (INSERT INTO {} (id, body) VALUES (%s, %s) RETURNING id) "
                "SELECT pg_notify('bench_held_floor', m.id::text) FROM m"
            ).format(table)
            body = b'{"i": 0}' * 20
            sent, took = held_run(args, lambda i: producer.execute(insert, [i, body]))
        time.sleep(2)
    finally:
        stop.set()
        consumer.join()
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP TABLE {}").format(table))
    report(args, sent, took, got)


def held_run(
    args: argparse.Namespace, publish: Callable[[int], object]
) -> tuple[dict[int, float], dict[int, float]]:
    """Publish every ``--gap`` seconds, a snapshot held from ``--free`` for ``--hold``
    seconds: when each publish started, and what it took."""
    sent: dict[int, float] = {}
    took: dict[int, float] = {}
    with psycopg.connect(args.dsn, autocommit=True) as holder:
        start, phase, i = time.perf_counter(), "free", 0
        while True:
            elapsed = time.perf_counter() - start
            if phase == "free" and elapsed > args.free:
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT 1")
                phase = "hold"
            elif phase == "hold" and elapsed > args.free + args.hold:
                holder.execute("ROLLBACK")
                phase = "after"
            elif elapsed > args.free + args.hold + args.after:
                break
            sent[i] = time.perf_counter()
            publish(i)
            took[i] = time.perf_counter() - sent[i]
            i += 1
            time.sleep(args.gap)
    return sent, took


def run(args: argparse.Namespace) -> None:
    if args.floor:
        run_floor(args)
        return
    schema = f"bench_held_{secrets.token_hex(4)}"
    url = "lonnymq://" + args.dsn.split("://", 1)[1]
    options = {
        "schema": schema,
        "handoff": not args.no_handoff,
        "polling_interval": args.polling_interval,
    }
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        lonnymq.install(admin, schema)
    got: dict[int, float] = {}
    stop = threading.Event()
    consumer = threading.Thread(target=consume, args=(url, options, got, stop))
    consumer.start()
    try:
        time.sleep(2)
        with Connection(url, transport_options=options) as conn:
            producer = Producer(conn, Exchange("held"), routing_key="held", serializer="json")
            producer.publish({"i": -1}, declare=[Queue("held", Exchange("held"), "held")])
            time.sleep(0.5)
            sent, took = held_run(args, lambda i: producer.publish({"i": i}))
        time.sleep(2)
    finally:
        stop.set()
        consumer.join()
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    report(args, sent, took, got)


def report(
    args: argparse.Namespace, sent: dict[int, float], took: dict[int, float], got: dict[int, float]
) -> None:
    first = min(sent.values())
    buckets: dict[int, tuple[list[float], list[float]]] = {}
    for i, at in sent.items():
        publish, wake = buckets.setdefault(int((at - first) // args.bucket), ([], []))
        publish.append(took[i] * 1000)
        if i in got:
            wake.append((got[i] - at) * 1000)
    lost = [i for i in sent if i not in got]
    print(
        f"{'floor' if args.floor else 'handoff ' + ('off' if args.no_handoff else 'on')}: "
        f"{len(sent)} published, "
        f"{len(lost)} not received; hold from {args.free:.0f} s to "
        f"{args.free + args.hold:.0f} s"
    )
    for b, (publish, wake) in sorted(buckets.items()):
        p99 = percentile(wake, 0.99) if wake else float("nan")
        print(
            f"{b * args.bucket:5.0f} s  publish p50 {statistics.median(publish):5.2f}  "
            f"wake-up p50 {statistics.median(wake) if wake else float('nan'):5.2f}  "
            f"p99 {p99:5.2f}  ({len(wake)})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dsn", default=os.environ.get("LONNYMQ_BENCH_DSN", DEFAULT_DSN))
    p.add_argument("--free", type=float, default=30.0, help="seconds before the hold")
    p.add_argument("--hold", type=float, default=300.0, help="seconds of the held snapshot")
    p.add_argument("--after", type=float, default=30.0, help="seconds after the hold")
    p.add_argument("--gap", type=float, default=0.02, help="seconds between publishes")
    p.add_argument("--bucket", type=float, default=30.0, help="seconds per printed row")
    p.add_argument(
        "--polling-interval",
        type=float,
        default=30.0,
        help="the consumer's fallback poll, seconds (its dequeue moves the queue's positions)",
    )
    p.add_argument("--no-handoff", action="store_true", help="publish with handoff=False")
    p.add_argument("--floor", action="store_true", help="bare Postgres: INSERT+NOTIFY, LISTEN")
    run(p.parse_args())


if __name__ == "__main__":
    main()
