#!/usr/bin/env python3
"""Page timings of the web view (``lonnymq web``) on a big queue.

Fills a schema with ``--messages`` (default 1,000,000) messages in ``--channels`` (default
100,000) channels of the queue ``big`` (through ``queue.batch()``): a few large tenants and
many small ones, a tenth of the messages delayed, some in flight, some dead letters, policies
on some channels; plus a small queue ``small``. Then it starts ``lonnymq web`` on the schema
and times every page and API endpoint (the first request, then ``--repeat`` requests
``--pause`` seconds apart: median and max), and the queue-API call behind each one, and prints
a table. The first request of a page waits for the web view's first readings of the status
and the channel listing; later ones get the kept readings, refreshed in the background (see
``lonnymq.web.readings``), so the median and max include the contention with those
refreshes.

    python benchmarks/bench_web.py [--dsn DSN] [--keep] [--schema NAME] [--reuse]

``--keep`` leaves the schema for a later run with ``--reuse --schema NAME`` (filling takes a
few minutes). The DSN is ``--dsn``, else ``$LONNYMQ_BENCH_DSN``, else the local test database.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

import lonnymq

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
BIG = "big"


def tenant(i: int) -> str:
    return f"tenant-{i:06d}"


def ingest(conn: psycopg.Connection[Any], schema: str) -> None:
    """Let the queue take in what was just created, as a running consumer would between
    batches. (Left to the first dequeue, the ingest of 100,000 new channels at once takes more
    locks than Postgres's default max_locks_per_transaction allows: "out of shared memory".)"""
    query = sql.SQL("SELECT {}.ingest_v1(ARRAY[%s], false, false)").format(sql.Identifier(schema))
    conn.execute(query, (BIG,))


def fill(conn: psycopg.Connection[Any], schema: str, messages: int, channels: int) -> None:
    """``messages`` in ``channels`` channels of queue ``big``: tenant 0..99 get half of them
    (a few large backlogs), the others share the rest; one in ten is delayed an hour."""
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    queue = broker.queue(BIG)
    large = min(100, channels)
    half = messages // 2
    plan: list[tuple[str, int]] = [(tenant(i), half // large) for i in range(large)]
    rest = messages - sum(n for _, n in plan)
    small = max(1, channels - large)
    plan += [
        (tenant(large + i), rest // small + (1 if i < rest % small else 0)) for i in range(small)
    ]
    body = b'{"body": "eyJ4IjogMX0=", "content-type": "application/json"}'
    started = time.monotonic()
    done = 0
    batch = queue.batch()
    pending = 0
    for c, (name, count) in enumerate(plan):
        channel = batch.channel(name)
        if c % 100 == 7:
            channel.policy.set(max_concurrency=2, max_size=100_000)
        for n in range(count):
            channel.message(body, delay_ms=3_600_000 if n % 10 == 9 else 0)
        pending += count
        if pending >= 10_000:
            batch.execute(conn)
            ingest(conn, schema)
            done += pending
            pending = 0
            batch = queue.batch()
            rate = done / (time.monotonic() - started)
            print(f"\rfilled {done:,}/{messages:,} ({rate:,.0f}/s)", end="", flush=True)
    if pending:
        batch.execute(conn)
        ingest(conn, schema)
    print(
        f"\rfilled {messages:,} messages in {channels:,} channels "
        f"({time.monotonic() - started:.0f} s)"
    )
    # in flight and dead letters
    got = queue.dequeue(conn, limit=500, lock_ms=3_600_000)
    for m in got.messages[:200]:
        broker.reject(conn, m.id, m.lock_token, reason="bench: rejected")
    small_q = broker.queue("small")
    for i in range(20):
        small_q.channel(f"s{i % 3}").message.create(conn, f"small {i}")
    conn.execute("ANALYZE")  # a fresh table's planner statistics, as autovacuum would have


Row = tuple[str, float, float, float]


def time_call(call: Callable[[], object], repeat: int, pause: float = 0.0) -> Row:
    """(name left empty, first call ms, median ms, max ms) of ``repeat`` calls after the
    first, ``pause`` seconds apart."""
    t = time.perf_counter()
    call()  # the first: plans, caches, the web view's first readings
    first = (time.perf_counter() - t) * 1000
    times = []
    for _ in range(repeat):
        time.sleep(pause)
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1000)
    return "", first, statistics.median(times), max(times)


def get(url: str) -> Callable[[], object]:
    def call() -> object:
        with urllib.request.urlopen(url, timeout=30) as response:
            body = response.read()
            assert response.status == 200, (url, response.status)
            return body

    return call


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lonnymq web exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("lonnymq web did not answer in 30 s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("LONNYMQ_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--schema", default=f"bench_web_{uuid.uuid4().hex[:8]}")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--channels", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=10, help="requests per page after the first")
    ap.add_argument(
        "--pause", type=float, default=0.5, help="seconds between two requests of a page"
    )
    ap.add_argument("--keep", action="store_true", help="leave the schema for --reuse")
    ap.add_argument("--reuse", action="store_true", help="the schema is filled already")
    ap.add_argument("--sql-only", action="store_true", help="time the queue API calls only")
    args = ap.parse_args()
    schema = args.schema
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        try:
            if not args.reuse:
                fill(conn, schema, args.messages, args.channels)
            return measure(conn, args)
        finally:
            if not args.keep:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


def measure(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    schema = args.schema
    broker = lonnymq.Broker(schema)
    big = broker.queue(BIG)
    status = {s.queue: s for s in broker.status(conn)}
    s = status[BIG]
    print(
        f"queue {BIG}: {s.total:,} messages ({s.ready:,} ready, {s.delayed:,} delayed, "
        f"{s.in_flight:,} in flight), {s.dead:,} dead, {s.channels:,} channels"
    )
    first = broker.messages(conn, queue=BIG, limit=1)[0].id
    dead = broker.messages(conn, queue=BIG, state="dead", limit=1)[0].id
    channel = tenant(150)
    rows: list[Row] = []
    calls: dict[str, Callable[[], object]] = {
        "status (count_ready)": lambda: broker.status(conn),
        "horizon": lambda: broker.horizon(conn),
        "channels limit 50": lambda: big.channels(conn, limit=50),
        "messages queue, 50": lambda: broker.messages(conn, queue=BIG, limit=51),
        "messages queue ready": lambda: broker.messages(conn, queue=BIG, state="ready", limit=51),
        "messages queue locked": lambda: broker.messages(conn, queue=BIG, state="locked", limit=51),
        "messages queue dead": lambda: broker.messages(conn, queue=BIG, state="dead", limit=51),
        "messages channel": lambda: broker.messages(conn, queue=BIG, channel=channel, limit=51),
        "message by id": lambda: broker.message(conn, first),
        "channel info": lambda: big.channel(channel).info(conn),
    }
    for name, call in calls.items():
        _, first_ms, med, worst = time_call(call, args.repeat)
        rows.append((f"sql: {name}", first_ms, med, worst))
    if not args.sql_only:
        rows += time_pages(args, first, dead, channel)
    report(rows)
    return 0


def time_pages(args: argparse.Namespace, first: int, dead: int, channel: str) -> list[Row]:
    rows: list[Row] = []
    schema = args.schema
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "lonnymq",
        "web",
        "--dsn",
        args.dsn,
        "--schema",
        schema,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_up(base + "/healthz", proc)
        q = urllib.parse.quote
        pages = {
            "/": "/",
            "/?part=live": "/?part=live",
            "/api/status": "/api/status",
            "/queue?q=big": f"/queue?q={BIG}",
            "/queue?q=big (live part)": f"/queue?q={BIG}&part=live",
            "/api/queue": f"/api/queue?q={BIG}",
            "/messages?queue": f"/messages?queue={BIG}",
            "/messages?state=ready": f"/messages?queue={BIG}&state=ready",
            "/messages?state=locked": f"/messages?queue={BIG}&state=locked",
            "/messages?state=dead": f"/messages?queue={BIG}&state=dead",
            "/messages?channel": f"/messages?queue={BIG}&channel={q(channel)}",
            "/api/messages?channel": f"/api/messages?queue={BIG}&channel={q(channel)}",
            "/messages/ID": f"/messages/{first}",
            "/messages/ID (dead)": f"/messages/{dead}",
            "/api/messages/ID": f"/api/messages/{first}",
        }
        for name, path in pages.items():
            _, first_ms, med, worst = time_call(get(base + path), args.repeat, args.pause)
            rows.append((f"GET {name}", first_ms, med, worst))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return rows


def report(rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{'what':<{width}}  {'first ms':>9}  {'median ms':>9}  {'max ms':>7}")
    for name, first_ms, med, worst in rows:
        flag = "  OVER 300 ms" if name.startswith("GET") and worst > 300 else ""
        print(f"{name:<{width}}  {first_ms:9.1f}  {med:9.1f}  {worst:7.1f}{flag}")


if __name__ == "__main__":
    sys.exit(main())
