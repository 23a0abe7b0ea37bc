#!/usr/bin/env python3
# mypy: allow-untyped-calls
"""lonnymq next to RabbitMQ, Redis and kombu's SQLAlchemy transport, through Kombu and Celery.

Run ``python benchmarks/bench_brokers.py --help``; see ``benchmarks/README.md``.

Every broker gets the same ~300-byte JSON body, persistent (``delivery_mode=2``) messages and
durable queues and exchange; RabbitMQ publishes with publisher confirms; Postgres runs with its
server settings (recorded). Each run uses a fresh queue, deleted afterwards. Scenarios repeat
``--repeat`` times and, within a repetition, run the brokers one after the other (their order
rotating between repetitions), so load from other work on the machine hits all of them alike.
Worker processes are ``spawn``ed; clocks are ``time.perf_counter`` (CLOCK_MONOTONIC, shared
by the processes of the machine on Linux) except in the Celery scenario (``time.time``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import queue as stdqueue
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from multiprocessing.context import SpawnContext
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import psycopg
from kombu.connection import Connection
from kombu.entity import Exchange
from kombu.entity import Queue as KQueue
from kombu.messaging import Consumer, Producer
from psycopg import sql

import lonnymq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wakeup import WakeupScenarios

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
PG_DSN = os.environ.get("LONNYMQ_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
PG_HOSTPART = PG_DSN.split("://", 1)[1]
# kombu's SQLAlchemy transport keeps sessions idle in transaction: in lonnymq's database they
# would hold back its xmin horizon, so that dead index entries of consumed messages could not
# be skipped and lonnymq's dequeues would slow down with every message (seen: prefetch-1
# consume at ~60/s). It gets a database of its own on the same server (horizons are per
# database since Postgres 14).
SQLA_DSN = os.environ.get("LONNYMQ_BENCH_SQLA_DSN", PG_DSN.rsplit("/", 1)[0] + "/postgres")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "pyamqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
EXCHANGE = "bench_brokers"
BODY_BYTES = 300
ALL_BROKERS = ("lonnymq", "rabbitmq", "redis", "sqla", "pgmq", "lonnymq_blocking")
#: lonnymq with event_loop=False (Celery's blocking loop): an A/B of the event loop, not in
#: the default run
SCENARIOS = (
    "publish", "consume", "latency", "celery", "pickup", "roundtrip", "wakeup", "scale", "churn"
)  # fmt: skip
DEFAULT_SCENARIOS = (
    "publish", "consume", "latency", "celery", "pickup", "roundtrip", "wakeup", "scale"
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Brokers


@dataclass(frozen=True)
class BrokerSpec:
    name: str
    url: str
    options: dict[str, Any]
    #: fraction of the message counts this broker gets (the SQLAlchemy transport is slow)
    scale: float = 1.0

    def connection(self, **override: Any) -> Connection:
        options = {**self.options, **override}
        return Connection(self.url, transport_options=options)

    @property
    def is_lonnymq(self) -> bool:
        return self.name.startswith("lonnymq")

    def count(self, n: int) -> int:
        return max(10, int(n * self.scale))


def make_brokers(names: Sequence[str], token: str) -> tuple[list[BrokerSpec], dict[str, str]]:
    """The brokers to compare, and the ones asked for that cannot run here (with why)."""
    out: list[BrokerSpec] = []
    missing: dict[str, str] = {}
    for name in names:
        if name == "lonnymq":
            schema = f"bench_brokers_{token}"
            out.append(BrokerSpec(name, f"lonnymq://{PG_HOSTPART}", {"schema": schema}))
        elif name == "lonnymq_blocking":
            schema = f"bench_brokers_{token}_blocking"
            options = {"schema": schema, "event_loop": False}
            out.append(BrokerSpec(name, f"lonnymq://{PG_HOSTPART}", options))
        elif name == "rabbitmq":
            out.append(BrokerSpec(name, AMQP_URL, {"confirm_publish": True}))
        elif name == "redis":
            out.append(BrokerSpec(name, REDIS_URL, {}))
        elif name == "sqla":
            why = sqla_unavailable()
            if why:
                missing[name] = why
                continue
            out.append(
                BrokerSpec(
                    name,
                    f"sqla+postgresql+psycopg://{SQLA_DSN.split('://', 1)[1]}",
                    {
                        "queue_tablename": f"bench_kq_{token}",
                        "message_tablename": f"bench_km_{token}",
                    },
                    scale=0.2,
                )
            )
        elif name == "pgmq":
            why = pgmq_unavailable()
            if why:
                missing[name] = why
            else:  # pragma: no cover - not reachable on the machine this was written on
                out.append(BrokerSpec(name, f"pgmq://{PG_HOSTPART}", {}))
        else:
            raise SystemExit(f"unknown broker {name!r}; known: {', '.join(ALL_BROKERS)}")
    return out, missing


def sqla_unavailable() -> str | None:
    """kombu's SQLAlchemy transport names its index ``ix_kombu_message_timestamp_id`` whatever
    the table is called, and index names are unique per schema: with one already there (a
    kombu_message table, or the tables a killed run of this benchmark left), it cannot create
    its tables."""
    with psycopg.connect(SQLA_DSN, autocommit=True) as pg:
        row = pg.execute(
            "SELECT tablename FROM pg_indexes WHERE schemaname = 'public' "
            "AND indexname = 'ix_kombu_message_timestamp_id'"
        ).fetchone()
    if row:
        return (
            f"index ix_kombu_message_timestamp_id already exists (on table {row[0]}); kombu's "
            "SQLAlchemy transport would fail to create its tables. Drop that table (a killed "
            "run of this benchmark leaves bench_km_*/bench_kq_*) or use another database"
        )
    return None


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum}")  # runs the cleanup in main()'s finally


def pgmq_unavailable() -> str | None:
    """Why kombu's pgmq transport cannot be measured here, or None when it can."""
    try:
        import kombu.transport.pgmq  # noqa: F401
    except ImportError:
        return "kombu has no pgmq transport"
    with psycopg.connect(PG_DSN, autocommit=True) as pg:
        row = pg.execute("SELECT count(*) FROM pg_available_extensions WHERE name = 'pgmq'")
        found = row.fetchone()
    if not found or not found[0]:
        return (
            "kombu 5.7 has a pgmq transport, but the pgmq Postgres extension is not installed "
            "and cannot be installed here: no Debian package (apt-cache search pgmq finds "
            "nothing; only PyPI and Debian are reachable), and the PyPI 'pgmq' package is only "
            "the Python client"
        )
    return None


def kombu_queue(name: str) -> KQueue:
    exchange = Exchange(EXCHANGE, "direct", durable=True)
    return KQueue(name, exchange, routing_key=name, durable=True)


_PAD = "x" * (BODY_BYTES - len(json.dumps({"ts": time.perf_counter(), "seq": 0, "pad": ""})))


def make_body(seq: int, **extra: Any) -> dict[str, Any]:
    """A ~300-byte JSON body carrying its send time (perf_counter)."""
    return {"ts": time.perf_counter(), "seq": seq, **extra, "pad": _PAD}


def publish(producer: Producer, qname: str, body: Any, headers: Any = None) -> None:
    producer.publish(
        body,
        exchange=EXCHANGE,
        routing_key=qname,
        serializer="json",
        delivery_mode=2,
        retry=False,
        headers=headers or {},
    )


def queue_count(spec: BrokerSpec, qname: str) -> int:
    with spec.connection() as conn:
        ch = conn.channel()
        try:
            _, count, _ = ch.queue_declare(queue=qname, passive=True)
        except conn.channel_errors:
            if spec.name == "redis":  # an empty Redis list does not exist: the queue "is not"
                return 0
            raise
        return int(count)


def delete_queue(spec: BrokerSpec, qname: str) -> None:
    with contextlib.suppress(Exception), spec.connection() as conn:
        q = kombu_queue(qname)(conn.channel())
        # kombu's virtual transports (Redis) delete only the bindings this channel knows of
        q.declare()
        q.delete()


# --------------------------------------------------------------------------------------------
# Worker processes


@dataclass
class WorkerOut:
    start: float = 0.0
    end: float = 0.0
    last_ack: float = 0.0
    messages: int = 0
    latencies: list[tuple[float, float]] = field(default_factory=list)
    error: str | None = None


def publish_worker(
    spec: BrokerSpec,
    qname: str,
    n: int,
    barrier: Barrier,
    out: multiprocessing.Queue[WorkerOut],
) -> None:
    res = WorkerOut()
    try:
        with spec.connection() as conn:
            ch = conn.channel()
            kombu_queue(qname)(ch).declare()
            producer = Producer(ch)
            publish(producer, qname, make_body(-1))  # warm-up: connection, declarations
            barrier.wait(timeout=120)
            clock = time.perf_counter
            res.start = clock()
            for i in range(n):
                publish(producer, qname, make_body(i))
                res.messages += 1
            res.end = clock()
    except Exception:
        res.error = traceback.format_exc()
        barrier.abort()
    out.put(res)


def consume_worker(
    spec: BrokerSpec,
    qname: str,
    prefetch: int,
    total: int,
    max_seconds: float,
    barrier: Barrier,
    counter: Synchronized[int],
    out: multiprocessing.Queue[WorkerOut],
) -> None:
    res = WorkerOut()
    clock = time.perf_counter

    def on_message(body: Any, message: Any) -> None:
        message.ack()
        res.last_ack = clock()
        res.messages += 1
        with counter.get_lock():
            counter.value += 1

    try:
        with spec.connection() as conn:
            ch = conn.channel()
            q = kombu_queue(qname)(ch)
            q.declare()
            consumer = Consumer(
                ch, queues=[q], callbacks=[on_message], accept=["json"], auto_declare=False
            )
            consumer.qos(prefetch_count=prefetch)
            barrier.wait(timeout=120)
            res.start = clock()
            consumer.consume()
            deadline = res.start + max_seconds
            while counter.value < total and clock() < deadline:
                with contextlib.suppress(socket.timeout):
                    conn.drain_events(timeout=0.2)
            res.end = clock()
            with contextlib.suppress(Exception):
                consumer.cancel()
    except Exception:
        res.error = traceback.format_exc()
        barrier.abort()
    out.put(res)


def latency_worker(
    spec: BrokerSpec,
    qname: str,
    prefetch: int,
    expected: int,
    only_key: str | None,
    ready: Event,
    stop: Event,
    out: multiprocessing.Queue[WorkerOut],
) -> None:
    """Consume and ack everything; record (receive time, receive - send) of each message (of
    those whose body has ``only_key`` set, when given) until ``expected`` or ``stop``."""
    res = WorkerOut()
    clock = time.perf_counter

    def on_message(body: Any, message: Any) -> None:
        now = clock()
        message.ack()
        res.messages += 1
        if isinstance(body, dict) and (only_key is None or body.get(only_key)):
            res.latencies.append((now, now - float(body["ts"])))

    try:
        with spec.connection() as conn:
            ch = conn.channel()
            q = kombu_queue(qname)(ch)
            q.declare()
            consumer = Consumer(
                ch, queues=[q], callbacks=[on_message], accept=["json"], auto_declare=False
            )
            consumer.qos(prefetch_count=prefetch)
            consumer.consume()
            with contextlib.suppress(socket.timeout):  # settle: first poll, LISTEN set up
                conn.drain_events(timeout=0.5)
            ready.set()
            res.start = clock()
            while not stop.is_set() and (expected <= 0 or len(res.latencies) < expected):
                with contextlib.suppress(socket.timeout):
                    conn.drain_events(timeout=0.2)
            res.end = clock()
            with contextlib.suppress(Exception):
                consumer.cancel()
    except Exception:
        res.error = traceback.format_exc()
        ready.set()
    out.put(res)


# --------------------------------------------------------------------------------------------
# Helpers of the parent


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def load1() -> float:
    return os.getloadavg()[0]


def fresh_name(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


@contextlib.contextmanager
def pg_conn() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        yield conn


def prefill(
    spec: BrokerSpec, qname: str, n: int, headers: Callable[[int], dict[str, Any]] | None = None
) -> None:
    """Put n messages in the queue through kombu (lonnymq: in transactions of 1,000 via
    ``lonnymq.transaction``; RabbitMQ: without confirms; both still persistent)."""
    with (
        spec.connection(confirm_publish=False)
        if spec.name == "rabbitmq"
        else (spec.connection()) as conn
    ):
        ch = conn.channel()
        kombu_queue(qname)(ch).declare()
        producer = Producer(ch)
        if spec.is_lonnymq:
            with pg_conn() as pg:
                for start in range(0, n, 1000):
                    with lonnymq.transaction(pg):
                        for i in range(start, min(n, start + 1000)):
                            publish(producer, qname, make_body(i), headers and headers(i))
        else:
            for i in range(n):
                publish(producer, qname, make_body(i), headers and headers(i))
    deadline = time.monotonic() + 30
    while (count := queue_count(spec, qname)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    if count < n:
        raise RuntimeError(f"{spec.name}: prefill of {qname} has {count}/{n} messages")


def lonnymq_content(spec: BrokerSpec) -> bytes:
    """The stored form of one kombu message on lonnymq, to bulk-insert copies of it."""
    qname = fresh_name("bench_tpl")
    with spec.connection() as conn:
        ch = conn.channel()
        kombu_queue(qname)(ch).declare()
        publish(Producer(ch), qname, make_body(0))
    broker = lonnymq.Broker(schema=spec.options["schema"])
    with pg_conn() as pg:
        res = broker.queue(qname).dequeue(pg, limit=1, lock_ms=60_000)
        content = res.messages[0].content
        res.messages[0].delete(pg)
    delete_queue(spec, qname)
    return content


def bulk_fill(spec: BrokerSpec, qname: str, channel: str, n: int, content: bytes) -> float:
    """n copies of ``content`` in one lonnymq channel, with the core API's batches of 1,000
    (one pipelined transaction each). Returns the seconds it took."""
    broker = lonnymq.Broker(schema=spec.options["schema"])
    t0 = time.perf_counter()
    with pg_conn() as pg:
        for start in range(0, n, 1000):
            batch = broker.queue(qname).batch()
            ch = batch.channel(channel)
            for _ in range(min(1000, n - start)):
                ch.message(content)
            batch.execute(pg)
            if start and start % 100_000 == 0:
                print(f"    filled {start:,}/{n:,}", flush=True)
    return time.perf_counter() - t0


def churn_sampler(
    schema: str,
    vacuum_every: float | None,
    t_start: float,
    stop: threading.Event,
    samples: list[dict[str, Any]],
) -> None:
    """During the churn: every minute, the schema's table sizes; with ``vacuum_every``, a
    ``VACUUM`` of its tables that often (what autovacuum would do, off on the dev server)."""
    next_sample = t_start + 60.0
    next_vacuum = None if vacuum_every is None else t_start + vacuum_every
    while not stop.is_set():
        now = time.perf_counter()
        if next_vacuum is not None and now >= next_vacuum:
            with pg_conn() as pg:
                for table in lonnymq_table_stats(schema):
                    pg.execute(sql.SQL("VACUUM {}").format(sql.Identifier(schema, table)))
            next_vacuum = now + (vacuum_every or 0)
        if now >= next_sample:
            stats = lonnymq_table_stats(schema)
            samples.append(
                {
                    "minute": round((now - t_start) / 60, 2),
                    "bytes": {t: v["total_bytes"] for t, v in stats.items()},
                }
            )
            next_sample += 60.0
        stop.wait(1.0)


def snapshot_holder(
    schema: str, hold_from: float, hold_until: float, stop: threading.Event, info: dict[str, Any]
) -> None:
    """From ``hold_from`` to ``hold_until`` (perf_counter times), a session idle in a
    REPEATABLE READ transaction that has read the queue's tables: the xmin horizon stays where
    it was, so no row deleted meanwhile can be pruned or vacuumed (what an idle transaction,
    a long report or ``pg_dump`` does)."""
    if stop.wait(max(0.0, hold_from - time.perf_counter())):
        return
    with psycopg.connect(PG_DSN, application_name="bench_churn_holder") as pg:
        pg.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pg.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message")))
        row = pg.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text").fetchone()
        info["held_xmin"] = row[0] if row else None
        info["held_from_s"] = round(time.perf_counter() - hold_from, 3)
        stop.wait(max(0.0, hold_until - time.perf_counter()))
        pg.rollback()
        info["released_after_s"] = round(time.perf_counter() - hold_from, 3)


def autovacuum_setting() -> str:
    with pg_conn() as pg:
        row = pg.execute("SHOW autovacuum").fetchone()
    return str(row[0]) if row else "unknown"


def lonnymq_table_stats(schema: str) -> dict[str, dict[str, int]]:
    with pg_conn() as pg:
        pg.execute("SELECT pg_stat_clear_snapshot()")
        rows = pg.execute(
            "SELECT relname, pg_total_relation_size(relid), n_live_tup, n_dead_tup "
            "FROM pg_stat_user_tables WHERE schemaname = %s ORDER BY relname",
            (schema,),
        ).fetchall()
    return {
        str(r[0]): {"total_bytes": int(r[1]), "n_live_tup": int(r[2]), "n_dead_tup": int(r[3])}
        for r in rows
    }


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Series:
    scenario: str
    variant: str
    broker: str
    metric: str  # "msgs_per_s", "p50_ms", "p99_ms"
    values: list[float] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "msgs_per_s"

    def summary(self) -> dict[str, Any]:
        if not self.values:
            return {"median": None, "min": None, "max": None, "n": 0}
        return {
            "median": statistics.median(self.values),
            "min": min(self.values),
            "max": max(self.values),
            "n": len(self.values),
        }


class Results:
    def __init__(self) -> None:
        self.series: dict[tuple[str, str, str, str], Series] = {}
        self.scenario_load: dict[str, list[float]] = {}
        self.notes: dict[str, Any] = {}

    def get(self, scenario: str, variant: str, broker: str, metric: str) -> Series:
        key = (scenario, variant, broker, metric)
        if key not in self.series:
            self.series[key] = Series(scenario, variant, broker, metric)
        return self.series[key]

    def add(
        self,
        scenario: str,
        variant: str,
        broker: str,
        figures: dict[str, float],
        run: dict[str, Any],
    ) -> None:
        for metric, value in figures.items():
            s = self.get(scenario, variant, broker, metric)
            s.values.append(value)
        self.get(scenario, variant, broker, next(iter(figures))).runs.append(run)

    def error(self, scenario: str, variant: str, broker: str, metric: str, text: str) -> None:
        self.get(scenario, variant, broker, metric).errors.append(text)

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "scenario": s.scenario,
                "variant": s.variant,
                "broker": s.broker,
                "metric": s.metric,
                "higher_is_better": s.higher_is_better,
                "summary": s.summary(),
                "values": s.values,
                "runs": s.runs,
                "errors": s.errors,
            }
            for s in self.series.values()
        ]


# --------------------------------------------------------------------------------------------
# The benchmark


class Bench(WakeupScenarios):
    """The scenarios (those of idle wake-ups in :mod:`bench_wakeup`)."""

    def __init__(self, args: argparse.Namespace, brokers: list[BrokerSpec]) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.repeat: int = args.repeat
        self.brokers = brokers
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")
        self.results = Results()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench_brokers_"))
        self.extra_schemas: list[str] = []

    def q(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def lonnymq(self) -> BrokerSpec | None:
        return next((b for b in self.brokers if b.name == "lonnymq"), None)

    def rotated(self, rep: int, brokers: list[BrokerSpec] | None = None) -> list[BrokerSpec]:
        pool = brokers if brokers is not None else self.brokers
        k = rep % len(pool) if pool else 0
        return pool[k:] + pool[:k]

    def measure(
        self,
        scenario: str,
        variant: str,
        spec: BrokerSpec,
        metric: str,
        fn: Callable[[], tuple[dict[str, float], dict[str, Any]]],
    ) -> None:
        load = load1()
        try:
            figures, run = fn()
        except Exception:
            text = traceback.format_exc()
            print(f"  {scenario:<8} {variant:<26} {spec.name:<9} ERROR:\n{text}", flush=True)
            self.results.error(scenario, variant, spec.name, metric, text)
            return
        run["load_before"] = load
        self.results.add(scenario, variant, spec.name, figures, run)
        shown = "  ".join(f"{k} {v:,.1f}" for k, v in figures.items())
        print(
            f"  {scenario:<8} {variant:<26} {spec.name:<9} {shown}  [load {load:.2f}]", flush=True
        )

    def begin(self, scenario: str) -> None:
        load = os.getloadavg()
        self.results.scenario_load[scenario] = list(load)
        print(f"\n== {scenario}  (load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True)

    # -- 1. publish ---------------------------------------------------------------------------

    def publish_run(self, spec: BrokerSpec, procs: int, per_proc: int) -> Any:
        qname = fresh_name("bench_pub")
        barrier = self.ctx.Barrier(procs)
        out: multiprocessing.Queue[WorkerOut] = self.ctx.Queue()
        workers = [
            self.ctx.Process(target=publish_worker, args=(spec, qname, per_proc, barrier, out))
            for _ in range(procs)
        ]
        try:
            for p in workers:
                p.start()
            outs = [out.get(timeout=600) for _ in workers]
            for p in workers:
                p.join()
            errors = [o.error for o in outs if o.error]
            if errors:
                raise RuntimeError(errors[0])
            elapsed = max(o.end for o in outs) - min(o.start for o in outs)
            messages = sum(o.messages for o in outs)
            stored = queue_count(spec, qname)
        finally:
            delete_queue(spec, qname)
        if stored != messages + procs:
            raise RuntimeError(f"published {messages} (+{procs} warm-up), queue has {stored}")
        return (
            {"msgs_per_s": messages / elapsed},
            {"messages": messages, "elapsed_s": elapsed, "queue_count_after": stored},
        )

    def scenario_publish(self) -> None:
        self.begin("publish")
        per_proc = self.q(2000, 300)
        for rep in range(self.repeat):
            for procs in (1, 4):
                variant = f"{procs} producer{'s' if procs > 1 else ''}"
                for spec in self.rotated(rep):
                    n = spec.count(per_proc)
                    self.measure(
                        "publish",
                        variant,
                        spec,
                        "msgs_per_s",
                        functools.partial(self.publish_run, spec, procs, n),
                    )

    # -- 2. consume + ack ---------------------------------------------------------------------

    def consume_run(
        self,
        spec: BrokerSpec,
        procs: int,
        prefetch: int,
        total: int,
        qname: str | None = None,
        fill: Callable[[str], None] | None = None,
    ) -> Any:
        """Consume ``total`` messages with ``procs`` processes: from ``qname`` as it is, or
        from a fresh queue that ``fill`` (default: prefill ``total``) fills first."""
        own_queue = qname is None
        name = qname or fresh_name("bench_con")
        try:
            if own_queue:
                (fill or (lambda q: prefill(spec, q, total)))(name)
            before = queue_count(spec, name)
            barrier = self.ctx.Barrier(procs)
            counter = self.ctx.Value("q", 0)
            out: multiprocessing.Queue[WorkerOut] = self.ctx.Queue()
            max_s = 300.0
            workers = [
                self.ctx.Process(
                    target=consume_worker,
                    args=(spec, name, prefetch, total, max_s, barrier, counter, out),
                )
                for _ in range(procs)
            ]
            for p in workers:
                p.start()
            outs = [out.get(timeout=max_s + 120) for _ in workers]
            for p in workers:
                p.join()
            errors = [o.error for o in outs if o.error]
            if errors:
                raise RuntimeError(errors[0])
            acked = sum(o.messages for o in outs)
            elapsed = max(o.last_ack for o in outs) - min(o.start for o in outs)
            time.sleep(0.2)  # let closed channels give back what they had prefetched
            left = queue_count(spec, name)
        finally:
            if own_queue:
                delete_queue(spec, name)
        if acked < total:
            raise RuntimeError(f"only {acked}/{total} messages consumed in {max_s:.0f}s")
        return (
            {"msgs_per_s": acked / elapsed},
            {
                "messages": acked,
                "elapsed_s": elapsed,
                "queue_count_before": before,
                "queue_count_after": left,
                "per_process": [o.messages for o in outs],
            },
        )

    def scenario_consume(self) -> None:
        self.begin("consume")
        total = self.q(5000, 1000)
        for rep in range(self.repeat):
            for prefetch in (1, 100):
                for procs in (1, 4):
                    variant = f"{procs} consumer{'s' if procs > 1 else ''} prefetch {prefetch}"
                    for spec in self.rotated(rep):
                        n = spec.count(total)
                        self.measure(
                            "consume",
                            variant,
                            spec,
                            "msgs_per_s",
                            functools.partial(self.consume_run, spec, procs, prefetch, n),
                        )

    # -- 3. idle wake-up latency --------------------------------------------------------------

    def latency_run(
        self,
        spec: BrokerSpec,
        n: int,
        rate: float,
        qname: str | None = None,
        headers: dict[str, Any] | None = None,
        only_key: str | None = None,
        prefetch: int = 1,
        settle_s: float = 1.0,
    ) -> Any:
        """An idle consumer; ``n`` messages published at ``rate``/s; latency = receive time -
        the send time in the body (taken just before the publish call)."""
        own_queue = qname is None
        name = qname or fresh_name("bench_lat")
        ready, stop = self.ctx.Event(), self.ctx.Event()
        out: multiprocessing.Queue[WorkerOut] = self.ctx.Queue()
        worker = self.ctx.Process(
            target=latency_worker, args=(spec, name, prefetch, n, only_key, ready, stop, out)
        )
        worker.start()
        try:
            if not ready.wait(120):
                raise RuntimeError("consumer not ready after 120s")
            time.sleep(settle_s)
            extra = {only_key: True} if only_key else {}
            with spec.connection() as conn:
                ch = conn.channel()
                # virtual transports without shared routing (sqla) keep bindings per process
                kombu_queue(name)(ch).declare()
                producer = Producer(ch)
                due = time.perf_counter()
                for i in range(n):
                    pause = due - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    publish(producer, name, make_body(i, **extra), headers)
                    due += 1.0 / rate
            try:
                res = out.get(timeout=15)
            except stdqueue.Empty:
                stop.set()
                res = out.get(timeout=60)
            worker.join(timeout=30)
        finally:
            stop.set()
            if worker.is_alive():
                worker.join(timeout=30)
            if own_queue:
                delete_queue(spec, name)
        if res.error:
            raise RuntimeError(res.error)
        lat = [x[1] * 1000 for x in res.latencies]
        first_send = min(t - d for t, d in res.latencies) if res.latencies else 0.0
        last_recv = max(t for t, _ in res.latencies) if res.latencies else 0.0
        if len(lat) < n:
            raise RuntimeError(f"received {len(lat)}/{n} messages")
        return (
            {"p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99)},
            {
                "messages": len(lat),
                "consumed_total": res.messages,
                "rate_per_s": rate,
                "max_ms": max(lat),
                "mean_ms": statistics.fmean(lat),
                "throughput_per_s": len(lat) / (last_recv - first_send),
            },
        )

    def scenario_latency(self) -> None:
        self.begin("latency")
        n = self.q(500, 100)
        for rep in range(self.repeat):
            for spec in self.rotated(rep):
                self.measure(
                    "latency",
                    "idle consumer, 50 msg/s",
                    spec,
                    "p50_ms",
                    functools.partial(self.latency_run, spec, n, 50.0),
                )

    # -- 4. Celery ----------------------------------------------------------------------------

    def celery_run(self, spec: BrokerSpec, pool: str, concurrency: int, n: int) -> Any:
        from celery_bench_app import LINE_BYTES, TASK_NAME, make_app, worker_command

        qname = fresh_name("bench_cel")
        out_file = self.tmp / f"{qname}.done"
        log_file = self.tmp / f"{qname}.log"
        app = make_app(spec.url, spec.options, qname)
        proc: subprocess.Popen[bytes] | None = None
        try:
            t0 = time.perf_counter()
            with app.producer_pool.acquire(block=True) as producer:
                for _ in range(n):
                    app.send_task(TASK_NAME, args=[str(out_file), _PAD], producer=producer)
            publish_s = time.perf_counter() - t0
            queued = queue_count(spec, qname)
            if queued != n:
                raise RuntimeError(f"{queued}/{n} tasks in the queue after publishing")
            cmd, env = worker_command(
                spec.url,
                spec.options,
                qname,
                pool,
                concurrency,
                "--prefetch-multiplier",
                str(self.args.prefetch_multiplier),
            )
            launched = time.time()
            with log_file.open("wb") as log:
                proc = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                size = out_file.stat().st_size if out_file.exists() else 0
                if size >= n * LINE_BYTES:
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.01)
            done = [float(x) for x in out_file.read_text().split()] if out_file.exists() else []
            if len(done) < n:
                tail = log_file.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{len(done)}/{n} tasks done; worker log:\n{tail}")
            first, last = min(done), max(done)
        finally:
            if proc is not None:
                self.stop_worker(proc)
            with contextlib.suppress(Exception):
                app.close()
            delete_queue(spec, qname)
        return (
            {"msgs_per_s": (n - 1) / (last - first)},
            {
                "tasks": n,
                "first_to_last_s": last - first,
                "launch_to_first_s": first - launched,
                "launch_to_last_rate": n / (last - launched),
                "publish_s": publish_s,
            },
        )

    @staticmethod
    def stop_worker(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def scenario_celery(self) -> None:
        self.begin("celery")
        sys.path.insert(0, str(HERE))
        tasks = self.q(2000, 300)
        for rep in range(self.repeat):
            for pool, conc in (("threads", 4), ("prefork", 2)):
                variant = f"{pool} -c {conc}"
                for spec in self.rotated(rep):
                    n = spec.count(tasks)
                    self.measure(
                        "celery",
                        variant,
                        spec,
                        "msgs_per_s",
                        functools.partial(self.celery_run, spec, pool, conc, n),
                    )

    # -- 5. scale (lonnymq) -------------------------------------------------------------------

    def scenario_scale(self) -> None:
        spec = self.lonnymq()
        if spec is None:
            print("\n== scale: skipped (lonnymq not among --brokers)")
            return
        self.begin("scale")
        # a) one channel vs many channels
        messages = self.q(10_000, 2000)
        many = self.q(10_000, 2000)
        for _rep in range(self.repeat):
            for channels in (1, many):
                for procs in (1, 4):
                    variant = f"{channels} ch, {procs} cons prefetch 100"

                    def fill(q: str, channels: int = channels) -> None:
                        prefill(spec, q, messages, lambda i: {"x-channel": f"t{i % channels}"})

                    self.measure(
                        "scale",
                        variant,
                        spec,
                        "msgs_per_s",
                        functools.partial(self.consume_run, spec, procs, 100, messages, fill=fill),
                    )
        # b) empty queue vs a big backlog
        if self.args.backlog:
            self.scale_backlog(spec, self.args.backlog)
        else:
            print("  (backlog comparison skipped: use --only scale or --backlog N)")
        # c) a light tenant next to a heavy tenant's backlog
        self.scale_tenants(spec)

    def scale_backlog(self, spec: BrokerSpec, backlog: int) -> None:
        content = lonnymq_content(spec)
        take = self.q(5000, 1000)
        big = fresh_name("bench_backlog")
        print(f"  filling {big} with {backlog:,} messages ...", flush=True)
        fill_s = bulk_fill(spec, big, big, backlog, content)
        print(f"  filled in {fill_s:.0f}s ({backlog / fill_s:,.0f} msgs/s)", flush=True)
        self.results.notes["backlog_fill"] = {"messages": backlog, "seconds": fill_s}
        label = f"{backlog:,}" if backlog < 1_000_000 else f"{backlog / 1e6:g}M"

        def fill_top(q: str) -> None:
            bulk_fill(spec, q, q, take, content)

        try:
            for _rep in range(self.repeat):
                for prefetch in (1, 100):
                    self.measure(
                        "scale",
                        f"{take} msgs, empty q, pf {prefetch}",
                        spec,
                        "msgs_per_s",
                        functools.partial(self.consume_run, spec, 1, prefetch, take, fill=fill_top),
                    )
                    self.measure(
                        "scale",
                        f"{take} msgs, {label} backlog, pf {prefetch}",
                        spec,
                        "msgs_per_s",
                        functools.partial(self.consume_run, spec, 1, prefetch, take, qname=big),
                    )
        finally:
            self.results.notes["tables_after_backlog"] = lonnymq_table_stats(spec.options["schema"])
            t0 = time.perf_counter()
            delete_queue(spec, big)
            self.results.notes["backlog_delete_s"] = time.perf_counter() - t0

    def scale_tenants(self, spec: BrokerSpec) -> None:
        heavy = self.q(100_000, 20_000)
        n, rate = self.q(200, 50), 20.0
        content = lonnymq_content(spec)
        for _rep in range(self.repeat):
            for with_heavy in (False, True):
                variant = "light tenant, " + (f"heavy {heavy:,} backlog" if with_heavy else "alone")

                def run(with_heavy: bool = with_heavy) -> Any:
                    qname = fresh_name("bench_ten")
                    try:
                        if with_heavy:
                            bulk_fill(spec, qname, "heavy", heavy, content)
                        figures, info = self.latency_run(
                            spec,
                            n,
                            rate,
                            qname=qname,
                            headers={"x-channel": "light"},
                            only_key="light",
                        )
                        info["heavy_left"] = queue_count(spec, qname)
                        return figures, info
                    finally:
                        delete_queue(spec, qname)

                self.measure("tenants", variant, spec, "p50_ms", run)

    # -- 6. churn -----------------------------------------------------------------------------

    def scenario_churn(self) -> None:
        minutes: float = self.args.churn_minutes
        for base in self.brokers:
            if base.name != "lonnymq":
                continue
            self.begin("churn")
            # a schema of its own, so the table sizes start from an empty install
            schema = base.options["schema"] + "_churn"
            spec = replace(base, options={**base.options, "schema": schema})
            self.extra_schemas.append(schema)
            # max throughput: 1 producer publishing flat out while 1 consumer (prefetch 1)
            # consumes, on this machine as loaded now
            _, cal = self.latency_run(spec, self.q(3000, 1000), 1e9)
            top = float(cal["throughput_per_s"])
            rate = 0.5 * top
            print(
                f"  max ~{top:.0f} msg/s (1 producer + 1 consumer prefetch 1); "
                f"churning at {rate:.0f} msg/s for {minutes:g} min",
                flush=True,
            )
            qname = fresh_name("bench_churn")
            ready, stop = self.ctx.Event(), self.ctx.Event()
            out: multiprocessing.Queue[WorkerOut] = self.ctx.Queue()
            worker = self.ctx.Process(
                target=latency_worker, args=(spec, qname, 1, 0, None, ready, stop, out)
            )
            worker.start()
            ready.wait(120)
            start_stats = lonnymq_table_stats(schema)
            t_start = time.perf_counter()
            end = t_start + minutes * 60
            sent = 0
            sampling = threading.Event()
            samples: list[dict[str, Any]] = []
            sampler = threading.Thread(
                target=churn_sampler,
                args=(schema, self.args.churn_vacuum, t_start, sampling, samples),
                daemon=True,
            )
            sampler.start()
            hold: dict[str, Any] = {}
            hold_window = None
            if self.args.churn_hold:
                # the middle half of the run (10 of 20 minutes by default)
                hold_window = (t_start + minutes * 15, t_start + minutes * 45)
                holder = threading.Thread(
                    target=snapshot_holder,
                    args=(schema, *hold_window, sampling, hold),
                    daemon=True,
                )
                holder.start()
            with spec.connection() as conn:
                ch = conn.channel()
                kombu_queue(qname)(ch).declare()
                producer = Producer(ch)
                due = t_start
                while (now := time.perf_counter()) < end:
                    if due > now:
                        time.sleep(due - now)
                    publish(producer, qname, make_body(sent))
                    sent += 1
                    due += 1.0 / rate
            time.sleep(2.0)
            stop.set()
            sampling.set()
            sampler.join(timeout=120)
            res = out.get(timeout=120)
            worker.join(timeout=30)
            end_stats = lonnymq_table_stats(schema)
            delete_queue(spec, qname)
            if res.error:
                print(f"  churn ERROR:\n{res.error}")
                self.results.notes["churn_error"] = res.error
                continue
            window = min(60.0, minutes * 60 / 5)
            first = [lat * 1000 for t, lat in res.latencies if t - t_start < window]
            last = [lat * 1000 for t, lat in res.latencies if t > end - window]
            figures = {
                "p50_ms_start": percentile(first, 0.5),
                "p50_ms_end": percentile(last, 0.5),
            }
            if hold_window is not None:
                # the last minute of the hold: where a dequeue walking dead rows is slowest
                held_last = [
                    lat * 1000
                    for t, lat in res.latencies
                    if hold_window[1] - window < t <= hold_window[1]
                ]
                figures["p50_ms_end_of_hold"] = percentile(held_last, 0.5)
                figures["p99_ms_end_of_hold"] = percentile(held_last, 0.99)
                hold["from_minute"] = minutes / 4
                hold["until_minute"] = minutes * 3 / 4
            self.results.notes["churn"] = {
                "minutes": minutes,
                "rate_per_s": rate,
                "calibration_max_per_s": top,
                "sent": sent,
                "received": len(res.latencies),
                "window_s": window,
                "p99_ms_start": percentile(first, 0.99),
                "p99_ms_end": percentile(last, 0.99),
                "tables_start": start_stats,
                "tables_end": end_stats,
                "vacuum_every_s": self.args.churn_vacuum,
                "snapshot_held": hold or None,
                "autovacuum": autovacuum_setting(),
                "table_bytes_per_minute": samples,
                **figures,
            }
            for metric, value in figures.items():
                self.results.get(
                    "churn", f"{rate:.0f} msg/s, {minutes:g} min", "lonnymq", metric
                ).values.append(value)
            held_txt = (
                f", {figures['p50_ms_end_of_hold']:.1f} ms in the last minute of the held "
                f"snapshot (p99 {figures['p99_ms_end_of_hold']:.1f} ms)"
                if hold_window is not None
                else ""
            )
            print(
                f"  churn: p50 {figures['p50_ms_start']:.1f} ms at start{held_txt}, "
                f"{figures['p50_ms_end']:.1f} ms at end; sent {sent}, received "
                f"{len(res.latencies)}"
            )
            for sample in samples:
                sizes = ", ".join(
                    f"{t} {b / 1e6:,.1f} MB" for t, b in sample["bytes"].items() if b > 100_000
                )
                print(f"    minute {sample['minute']:>4.1f}: {sizes}")
            for table in sorted(set(start_stats) | set(end_stats)):
                a, b = start_stats.get(table, {}), end_stats.get(table, {})
                print(
                    f"    {table:<12} size {a.get('total_bytes', 0):>12,} -> "
                    f"{b.get('total_bytes', 0):>12,} B  dead {a.get('n_dead_tup', 0):>9,} -> "
                    f"{b.get('n_dead_tup', 0):>9,}"
                )

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> None:
        for spec in self.brokers:
            try:
                if spec.is_lonnymq:
                    with pg_conn() as pg:
                        for schema in [spec.options["schema"], *self.extra_schemas]:
                            pg.execute(
                                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                                    sql.Identifier(schema)
                                )
                            )
                elif spec.name == "sqla":
                    # kombu caches its engines (with idle-in-transaction sessions holding
                    # locks on the tables) for the life of the process: let them go first
                    from kombu.transport.sqlalchemy import Channel as SqlaChannel
                    from sqlalchemy.orm import Session

                    gc.collect()
                    for obj in gc.get_objects():
                        if isinstance(obj, Session):
                            obj.close()
                    for engine, _ in list(SqlaChannel._engines.values()):
                        engine.dispose()
                    SqlaChannel._engines.clear()
                    with psycopg.connect(SQLA_DSN, autocommit=True) as pg:
                        pg.execute("SET lock_timeout = '20s'")
                        for key in ("message_tablename", "queue_tablename"):
                            pg.execute(
                                sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(
                                    sql.Identifier(spec.options[key])
                                )
                            )
                else:
                    with spec.connection() as conn:
                        Exchange(EXCHANGE, "direct", durable=True)(conn.channel()).delete()
                    if spec.name == "redis":  # Celery's per-queue exchanges (bench_cel_*)
                        import redis

                        client = redis.Redis.from_url(REDIS_URL)
                        for key in client.scan_iter("_kombu.binding*bench_cel_*"):
                            client.delete(key)
            except Exception as exc:
                print(f"cleanup of {spec.name} failed: {exc!r}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Environment


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def src_digest() -> str:
    """sha256 of lonnymq's source files as they are now (src/ may change during a run: spawned
    workers and Celery workers import it afresh)."""
    digest = hashlib.sha256()
    src = Path(lonnymq.__file__).resolve().parent
    for path in sorted(src.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".sql"):
            digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment(brokers: list[BrokerSpec]) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    env["cpus"] = os.cpu_count()
    packages = ("kombu", "celery", "psycopg", "sqlalchemy", "redis", "amqp", "matplotlib")
    env["packages"] = {}
    for name in (*packages, "lonnymq"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env["packages"][name] = importlib.metadata.version(name)
    root = HERE.parent
    env["lonnymq_git_commit"] = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    changes = _run(["git", "-C", str(root), "status", "--porcelain", "--", "src"])
    env["lonnymq_src_uncommitted"] = [x for x in (changes or "").split("\n") if x]
    env["lonnymq_src_sha256_at_start"] = src_digest()
    # src/ may be edited while a run goes on: to measure a fixed commit, run with PYTHONPATH
    # pointing at a snapshot (git archive COMMIT src | tar -x -C DIR; PYTHONPATH=DIR/src)
    env["lonnymq_imported_from"] = str(Path(lonnymq.__file__).resolve().parent)
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH")
    with pg_conn() as pg:
        row = pg.execute("SELECT version()").fetchone()
        settings: dict[str, Any] = {"version": row[0] if row else None}
        for name in (
            "fsync",
            "synchronous_commit",
            "wal_sync_method",
            "full_page_writes",
            "autovacuum",
            "shared_buffers",
            "max_connections",
        ):
            r = pg.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            settings[name] = r[0] if r else None
        env["postgres"] = settings
    names = {b.name for b in brokers}
    if "rabbitmq" in names:
        rabbit: dict[str, Any] = {"rabbitmqctl_version": _run(["rabbitmqctl", "version"])}
        try:
            req = urllib.request.Request("http://127.0.0.1:15672/api/overview")
            req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
            with urllib.request.urlopen(req, timeout=3) as resp:
                overview = json.loads(resp.read())
            rabbit["management"] = {
                k: overview.get(k) for k in ("rabbitmq_version", "erlang_version")
            }
        except Exception as exc:
            rabbit["management"] = f"unavailable: {exc.__class__.__name__}"
        env["rabbitmq"] = rabbit
    if "redis" in names:
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        info = r.info()
        keep = ("redis_version", "aof_enabled", "rdb_bgsave_in_progress", "used_memory_human")
        env["redis"] = {k: info.get(k) for k in keep}
        with contextlib.suppress(Exception):
            env["redis"]["config"] = r.config_get("appendonly") | r.config_get("appendfsync")
            env["redis"]["config"] |= r.config_get("save")
    return env


# --------------------------------------------------------------------------------------------
# Report: table and chart


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def print_table(results: Results, brokers: list[str]) -> list[str]:
    lines: list[str] = []
    groups: dict[tuple[str, str, str], dict[str, Series]] = {}
    for s in results.series.values():
        groups.setdefault((s.scenario, s.variant, s.metric), {})[s.broker] = s
    header = f"{'scenario':<8} {'variant':<36} {'metric':<10}"
    for b in brokers:
        header += f" {b + ' med (min-max)':>26}"
    others = [b for b in brokers if b != "lonnymq"]
    for b in others:
        header += f" {'lq/' + b:>9}"
    lines.append(header)
    lines.append("-" * len(header))
    for (scenario, variant, metric), by_broker in groups.items():
        row = f"{scenario:<8} {variant:<36} {metric:<10}"
        for b in brokers:
            cs = by_broker.get(b)
            if cs is None:
                cell = "-"
            elif not cs.values:
                cell = "ERROR" if cs.errors else "-"
            else:
                sm = cs.summary()
                cell = f"{_fmt(sm['median'])} ({_fmt(sm['min'])}-{_fmt(sm['max'])})"
                if cs.errors:
                    cell += f" {len(cs.errors)}err"
            row += f" {cell:>26}"
        lq = by_broker.get("lonnymq")
        lq_med = lq.summary()["median"] if lq else None
        for b in others:
            other = by_broker.get(b)
            med = other.summary()["median"] if other else None
            ratio = f"{lq_med / med:.2f}" if lq_med and med else "-"
            row += f" {ratio:>9}"
        lines.append(row)
    lines.append(
        "\nmedian (min-max) over the runs. msgs_per_s: higher is better; *_ms: latency, lower is"
        "\nbetter. lq/<broker>: lonnymq's median divided by that broker's (throughput: >1 means"
        "\nlonnymq is faster; latency: >1 means lonnymq is slower)."
    )
    print("\n" + "\n".join(lines))
    return lines


def draw_chart(results: Results, brokers: list[str], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no chart ({path}): matplotlib is not installed (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str], list[tuple[str, dict[str, float]]]] = {}
    for s in results.series.values():
        if s.metric not in ("msgs_per_s", "p50_ms", "p99_ms") or not s.values:
            continue
        key = (s.scenario, s.metric)
        entries = panels.setdefault(key, [])
        for variant, values in entries:
            if variant == s.variant:
                values[s.broker] = statistics.median(s.values)
                break
        else:
            entries.append((s.variant, {s.broker: statistics.median(s.values)}))
    if not panels:
        return
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(15, 4.6 * rows), squeeze=False)
    colors = {"lonnymq": "#2b6cb0", "rabbitmq": "#dd6b20", "redis": "#c53030", "sqla": "#718096"}
    for ax, ((scenario, metric), entries) in zip(axes.flat, panels.items(), strict=False):
        present = [b for b in brokers if any(b in v for _, v in entries)]
        width = 0.8 / max(1, len(present))
        for j, b in enumerate(present):
            xs = [i + (j - (len(present) - 1) / 2) * width for i in range(len(entries))]
            ys = [v.get(b, 0.0) for _, v in entries]
            bars = ax.bar(xs, ys, width, label=b, color=colors.get(b))
            for bar, y in zip(bars, ys, strict=True):
                if y:
                    ax.annotate(
                        _fmt(y),
                        (bar.get_x() + bar.get_width() / 2, y),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(entries)))
        ax.set_xticklabels([v for v, _ in entries], fontsize=8, rotation=12)
        ax.set_yscale("log")
        unit = "msgs/s (higher is better)" if metric == "msgs_per_s" else "ms (lower is better)"
        ax.set_title(f"{scenario}: {metric}", fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("lonnymq vs other Kombu brokers (median of runs; log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer messages (a smoke run)")
    p.add_argument("--only", choices=SCENARIOS, action="append", help="run only this scenario")
    p.add_argument(
        "--brokers",
        default="lonnymq,rabbitmq,redis,sqla,pgmq",
        help="comma-separated, of: " + ",".join(ALL_BROKERS),
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per scenario (default 3)")
    p.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="messages of the backlog comparison of the scale scenario (default: 1,000,000 "
        "with --only scale, else skipped; 100,000 with --quick)",
    )
    p.add_argument(
        "--churn-minutes",
        type=float,
        default=20.0,
        help="length of the churn scenario (--only churn; not in the default run)",
    )
    p.add_argument(
        "--churn-vacuum",
        type=float,
        default=None,
        metavar="SECONDS",
        help="during the churn, VACUUM lonnymq's tables this often (as autovacuum would; "
        "off on the dev server); table sizes are sampled every minute either way",
    )
    p.add_argument(
        "--churn-hold",
        action="store_true",
        help="during the churn, hold a snapshot (a session idle in a REPEATABLE READ "
        "transaction) for the middle half of the run",
    )
    p.add_argument(
        "--pickup-gap",
        type=float,
        default=0.5,
        help="seconds between the tasks of the pickup scenario (default 0.5)",
    )
    p.add_argument(
        "--pickup-idle",
        type=float,
        default=5.0,
        help="seconds a worker stays idle before the pickup scenario's tasks (default 5)",
    )
    p.add_argument(
        "--prefetch-multiplier",
        type=int,
        default=4,
        help="the celery scenario's workers' --prefetch-multiplier (default 4, Celery's)",
    )
    p.add_argument(
        "--lonnymq-options",
        type=json.loads,
        default={},
        help="JSON transport options added to lonnymq's (an A/B of one, e.g. "
        "'{\"handoff\": false}')",
    )
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "brokers.json")
    p.add_argument("--chart", type=Path, default=RESULTS_DIR / "brokers.png")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.backlog is None and args.only and "scale" in args.only:
        args.backlog = 100_000 if args.quick else 1_000_000
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    token = secrets.token_hex(4)
    names = [b.strip() for b in args.brokers.split(",") if b.strip()]
    brokers, missing = make_brokers(names, token)
    brokers = [
        replace(b, options={**b.options, **args.lonnymq_options}) if b.is_lonnymq else b
        for b in brokers
    ]
    if not brokers:
        print("no broker available", file=sys.stderr)
        return 2
    scenarios = args.only or list(DEFAULT_SCENARIOS)
    env = environment(brokers)
    bench = Bench(args, brokers)
    print(f"brokers: {', '.join(b.name for b in brokers)}; not available: {missing or 'none'}")
    pg = env["postgres"]
    print(
        f"{pg['version']}\nfsync={pg['fsync']} synchronous_commit={pg['synchronous_commit']} "
        f"autovacuum={pg['autovacuum']}; {os.cpu_count()} CPUs; load {os.getloadavg()}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        for scenario in SCENARIOS:
            if scenario in scenarios:
                getattr(bench, f"scenario_{scenario}")()
    finally:
        bench.cleanup()
    total_s = time.perf_counter() - started
    broker_names = [b.name for b in brokers]
    for floor in ("floor", "floor_flush_after"):  # Postgres itself, same work (bench_wakeup)
        if any(s.broker == floor for s in bench.results.series.values()):
            broker_names.append(floor)
    table = print_table(bench.results, broker_names)
    print(f"\ntotal {total_s:.0f}s; load at end {os.getloadavg()}")
    report = {
        "benchmark": "bench_brokers",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "environment": env,
        "brokers": {
            b.name: {"url": b.url, "transport_options": b.options, "count_scale": b.scale}
            for b in brokers
        },
        "not_available": missing,
        "settings": {
            "quick": args.quick,
            "repeat": args.repeat,
            "scenarios": scenarios,
            "backlog": args.backlog,
            "churn_minutes": args.churn_minutes if "churn" in scenarios else None,
            "body_bytes": BODY_BYTES,
            "durability": "delivery_mode=2, durable queues and exchange; RabbitMQ publisher "
            "confirms; Postgres server settings as recorded; Redis server config as recorded",
        },
        "lonnymq_src_sha256_at_end": src_digest(),
        "lonnymq_src_uncommitted_at_end": [
            x
            for x in (
                _run(["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src"]) or ""
            ).split("\n")
            if x
        ],
        "lonnymq_git_commit_at_end": _run(["git", "-C", str(HERE.parent), "rev-parse", "HEAD"]),
        "scenario_load_before": bench.results.scenario_load,
        "load_average_at_end": os.getloadavg(),
        "total_seconds": total_s,
        "notes": bench.results.notes,
        "table": table,
        "results": bench.results.to_json(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    draw_chart(bench.results, broker_names, args.chart)
    print(f"results written to {args.output} and {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
