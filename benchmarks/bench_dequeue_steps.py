#!/usr/bin/env python3
"""Where a dequeue's server time goes, step by step: time per call of each schema function.

Each workload fills a fresh schema (``bench_steps_<random>``), then one session, with
``track_functions = pl``, drains it with ack-and-dequeue calls (the acks of a call travel with
the next one, as the transport does); the time each schema function took during the drain
(``pg_stat_user_functions``: ``self_time``, without the functions it called, and
``total_time``, with them) is divided by the number of dequeue calls. Function timing itself
costs about a microsecond per call, so a body split into more functions reads a little
slower here than it runs. The client's wall time per call is printed beside it.

Workloads (``--only``, repeatable):

- ``usual``: one queue, one channel, prefetch 1 (the usual call);
- ``channels``: one queue, 100 channels, prefetch 10 (the general path: lanes, passes);
- ``queues``: two queues, one channel each, prefetch 1 (a consumer of several queues, such
  as a Celery worker started with ``-Q a,b``: every call takes the general path).

    python benchmarks/bench_dequeue_steps.py --repeat 3

Compare two versions of the code with ``PYTHONPATH`` pointing at each checkout's ``src``,
interleaved, in one session of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import lonnymq

DEFAULT_DSN = os.environ.get("LONNYMQ_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Workload:
    name: str
    queues: tuple[str, ...]
    channels: int
    limit: int
    messages: int  # per queue


WORKLOADS = {
    "usual": Workload("usual", ("q",), 1, 1, 2000),
    "channels": Workload("channels", ("q",), 100, 10, 2000),
    "queues": Workload("queues", ("qa", "qb"), 1, 1, 1000),
}


def _functions(conn: psycopg.Connection[Any], schema: str) -> dict[str, tuple[int, float, float]]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute(
        "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
        "WHERE schemaname = %s",
        (schema,),
    ).fetchall()
    return {name: (calls, total, self_) for name, calls, total, self_ in rows}


def run(dsn: str, work: Workload) -> dict[str, Any]:
    schema = "bench_steps_" + uuid.uuid4().hex[:8]
    with psycopg.connect(dsn, autocommit=True) as admin:
        lonnymq.install(admin, schema=schema)
    try:
        broker = lonnymq.Broker(schema)
        with psycopg.connect(dsn, autocommit=True) as producer, producer.transaction():
            for queue in work.queues:
                for i in range(work.messages):
                    channel = f"c{i % work.channels}"
                    broker.queue(queue).channel(channel).message.create(producer, "x" * 200)
        queues = list(work.queues)
        with psycopg.connect(dsn, autocommit=True, options="-c track_functions=pl") as conn:
            broker.dequeue(conn, queues, limit=1, lock_ms=60_000, listen=False)  # plans
            time.sleep(1.1)  # (the statistics of a session are sent at most once a second)
            before = _functions(conn, schema)
            held: list[lonnymq.Message] = []
            calls = 0
            wall = []
            while True:
                start = time.perf_counter()
                result = broker.dequeue(
                    conn, queues, limit=work.limit, lock_ms=60_000, ack=held, listen=False
                )
                wall.append(time.perf_counter() - start)
                held = list(result.messages)
                calls += 1
                if not held:
                    break
            time.sleep(1.1)
            after = _functions(conn, schema)
        steps = {}
        for name, (n, total, self_) in after.items():
            n0, total0, self0 = before.get(name, (0, 0.0, 0.0))
            if n > n0:
                steps[name] = {
                    "calls_per_dequeue": (n - n0) / calls,
                    "self_us": (self_ - self0) / calls * 1000,
                    "total_us": (total - total0) / calls * 1000,
                }
        return {"calls": calls, "wall_ms_p50": statistics.median(wall) * 1000, "steps": steps}
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dsn", default=DEFAULT_DSN)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", action="append", choices=sorted(WORKLOADS))
    p.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.only or list(WORKLOADS):
        results[name] = [run(args.dsn, WORKLOADS[name]) for _ in range(args.repeat)]
        runs = results[name]
        top = runs[0]["steps"]
        entry = "message_dequeue_v3"
        print(f"== {name}: {runs[0]['calls']} dequeues a run, medians of {len(runs)} runs")
        print(
            f"wall p50 {statistics.median(r['wall_ms_p50'] for r in runs):.3f} ms, "
            f"server {statistics.median(r['steps'][entry]['total_us'] for r in runs):.0f} us"
        )
        print(f"{'function':30s} {'calls':>6s} {'self us':>8s} {'total us':>9s}")
        for fn in sorted(top, key=lambda f: -top[f]["total_us"]):
            med = {
                k: statistics.median(r["steps"].get(fn, {}).get(k, 0.0) for r in runs)
                for k in ("calls_per_dequeue", "self_us", "total_us")
            }
            print(
                f"{fn:30s} {med['calls_per_dequeue']:6.2f} {med['self_us']:8.0f} "
                f"{med['total_us']:9.0f}"
            )
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
