#!/usr/bin/env python3
# mypy: allow-untyped-calls
"""How late a rate-limited channel's deliveries come after their token is due.

A channel of queue ``bench_rate`` gets a rate of ``--rate`` per second with a burst of 1 and a
backlog of ``--messages`` messages (published with Kombu, ``x-channel`` header). One Kombu
consumer (prefetch 1, the transport's event loop as Celery drives it: ``drain_events``) takes
them and acks each at once. With a burst of 1 and a backlog, each delivery is due one interval
T = 1 / rate after the previous one was handed out: the consumer sleeps in between (the
dequeue answers ``retry_ms`` = the time to the next token; no polling, no NOTIFY), and wakes
when it is due. The lateness of delivery k is ``gap_k - T``, with ``gap_k`` the time between
the receipt of deliveries k-1 and k in the consumer (the first ``--warmup`` are not counted).

Floor: what a process that sleeps until a deadline with ``time.sleep`` (the same wait the
consumer's timer does) gets on this machine, measured in the same run: ``now - deadline`` for
the same number of deadlines T apart.

Also printed: the rate achieved (deliveries / time) and the most deliveries in any window of
one second (at most rate + 1 with a burst of 1).

    python benchmarks/bench_rate.py                    # 20/s, 300 messages (15 s)
    python benchmarks/bench_rate.py --rate 50 --messages 500

The DSN is ``--dsn``, else ``$LONNYMQ_BENCH_DSN``, else
``postgresql://postgres@127.0.0.1:5432/test``; a fresh schema ``bench_rate_<random>`` is
installed and dropped at the end. Results go to ``--output`` (JSON, default
``benchmarks/results/rate.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer, Producer
from psycopg import sql

import lonnymq

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def most_in_a_second(times: list[float]) -> int:
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best


def floor_lateness(interval: float, n: int) -> list[float]:
    """``time.sleep`` until each of n deadlines ``interval`` apart: how late it wakes (ms)."""
    late = []
    deadline = time.perf_counter() + interval
    for _ in range(n):
        time.sleep(max(0.0, deadline - time.perf_counter()))
        late.append((time.perf_counter() - deadline) * 1000)
        deadline += interval
    return late


def run(dsn: str, rate: float, messages: int, warmup: int, burst: int = 1) -> dict[str, Any]:
    schema = f"bench_rate_{uuid.uuid4().hex[:8]}"
    url = "lonnymq://" + dsn.split("://", 1)[1]
    interval = 1.0 / rate
    with psycopg.connect(dsn, autocommit=True) as admin:
        broker = lonnymq.Broker(schema)
        broker.install(admin)
        channel = broker.queue("bench_rate").channel("t")
        channel.policy.set(admin, rate=f"{rate:g}/s", burst=burst)
        try:
            received: list[float] = []
            with Connection(url, transport_options={"schema": schema}) as conn:
                queue = Queue("bench_rate", Exchange("bench_rate", "direct"), "bench_rate")
                producer = Producer(conn.channel())
                for i in range(messages):
                    producer.publish(
                        {"i": i},
                        exchange=queue.exchange,
                        routing_key="bench_rate",
                        declare=[queue],
                        headers={"x-channel": "t"},
                    )

                def on_message(body: Any, message: Any) -> None:
                    received.append(time.perf_counter())
                    message.ack()

                kchan = conn.channel()
                consumer = Consumer(kchan, [queue], callbacks=[on_message], accept=["json"])
                consumer.qos(prefetch_count=1)
                consumer.consume()
                deadline = time.perf_counter() + messages * interval + 30
                while len(received) < messages and time.perf_counter() < deadline:
                    with contextlib.suppress(socket.timeout):
                        conn.drain_events(timeout=1)
                consumer.cancel()
            floor = floor_lateness(interval, max(0, len(received) - 1 - warmup))
        finally:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    gaps = [b - a for a, b in itertools.pairwise(received)][warmup:]
    late = [(g - interval) * 1000 for g in gaps]
    span = received[-1] - received[0] if len(received) > 1 else float("nan")
    return {
        "rate_per_s": rate,
        "burst": burst,
        "interval_ms": interval * 1000,
        "messages": messages,
        "received": len(received),
        "achieved_per_s": (len(received) - 1) / span,
        "most_in_a_second": most_in_a_second(received),
        "late_ms": {
            "p50": percentile(late, 0.5),
            "p90": percentile(late, 0.9),
            "p99": percentile(late, 0.99),
            "mean": statistics.fmean(late),
        },
        "floor_late_ms": {
            "p50": percentile(floor, 0.5),
            "p90": percentile(floor, 0.9),
            "p99": percentile(floor, 0.99),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    p.add_argument("--rate", type=float, default=20.0, help="deliveries per second")
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5, help="deliveries not counted at the start")
    p.add_argument(
        "--burst",
        type=int,
        default=1,
        help="the channel's burst (default 1; above 1 the lateness figure is not a wake-up's)",
    )
    p.add_argument("--output", type=Path, default=RESULTS / "rate.json")
    args = p.parse_args(argv)
    started = time.time()
    result = run(args.dsn, args.rate, args.messages, args.warmup, args.burst)
    late, floor = result["late_ms"], result["floor_late_ms"]
    print(
        f"rate {args.rate:g}/s burst {args.burst}, {result['received']} of {args.messages} "
        f"delivered: achieved {result['achieved_per_s']:.2f}/s, at most "
        f"{result['most_in_a_second']} in a second"
    )
    print(
        f"late after the token was due (ms): p50 {late['p50']:.2f}  p90 {late['p90']:.2f}  "
        f"p99 {late['p99']:.2f}"
    )
    print(
        f"floor (time.sleep to a deadline, ms): p50 {floor['p50']:.2f}  p90 "
        f"{floor['p90']:.2f}  p99 {floor['p99']:.2f}"
    )
    report = {
        "benchmark": "bench_rate",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "load_average_at_end": os.getloadavg(),
        **result,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
