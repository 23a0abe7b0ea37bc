#!/usr/bin/env python3
"""Hot-path benchmark of lonnymq next to what bare Postgres does for the same work (floors).

Run ``python benchmarks/bench_hot_path.py --help``; ``--quick --repeat 1`` is a smoke run.

Everything runs in a fresh schema (``bench_hot_<random>``) created at the start (lonnymq is
installed in it with ``lonnymq.install``, and the floor tables are created next to it) and
dropped at the end, also on failure (a killed run leaves it behind). pgqueuer, when it is
measured, gets a schema of its own (``bench_hot_<random>_pgq``), dropped at the end too.

Floors: the same work done with plain SQL on plain tables, measured in the same invocation,
interleaved with the lonnymq runs (each repetition runs every variant of a scenario once, lonnymq
and floor alike, before the next repetition starts), with the same commit settings:

* ``floor_t``: ``id bigint generated always as identity primary key, ch text not null,
  at timestamptz not null default clock_timestamp(), locked_until timestamptz,
  payload bytea not null``, with an index on ``(ch, at, id) WHERE locked_until IS NULL``;
  ``floor_m`` is ``LIKE floor_t INCLUDING ALL`` (same columns, identity and index).
* publish floor: one single-row ``INSERT INTO floor_t (ch, payload) VALUES (...)`` per call on
  an autocommit connection (one durable commit per message).
* consume floor (prefetch N): one round trip per call that deletes the rows the consumer holds
  and locks the next ones::

      WITH d AS (DELETE FROM floor_m WHERE id = ANY(%s::bigint[])),
           n AS (SELECT id FROM floor_m WHERE ch = %s AND locked_until IS NULL
                 ORDER BY at, id LIMIT %s FOR UPDATE SKIP LOCKED)
      UPDATE floor_m SET locked_until = now() + interval '1 minute'
      WHERE id = ANY (ARRAY(SELECT id FROM n)) RETURNING id, payload

  ``ch = %s`` (every message is in one channel) is there so that the partial index serves the
  ``ORDER BY at, id``: without it Postgres 15 seq-scans and sorts the whole table on every call,
  which is not a floor. The last rows held are deleted with one ``DELETE`` at the end.
* batch floor: one multi-row ``INSERT INTO floor_t (ch, payload) VALUES (...), (...), ...`` of
  ``--batch-size`` rows per call (one statement, one transaction, one commit).

lonnymq, for the same work: ``queue.channel(c).message.create(conn, payload)`` per message
(autocommit: one SQL function call, one durable commit); ``broker.dequeue(conn, [queue],
limit=N, lock_ms=120000, ack=held, listen=False)`` where ``held`` is what the previous call
returned (the acks travel with the next dequeue, in the same statement), the last batch acked
with ``broker.delete_many``; ``queue.batch()`` with ``--batch-size`` creates in one
``execute`` (one transaction). Every payload is 300 random bytes. Consumers (floor and lonnymq
alike) run with ``SET synchronous_commit = off`` (lonnymq's transport commits dequeues and acks
asynchronously by default); producers stay durable (the server's ``synchronous_commit``).

Scenarios (``--only NAME``, repeatable; default all but ``held``):

1. ``create``: ``--create-messages`` (default 2,000) creates per run, split over the producers:
   lonnymq with 1 producer, with 4 producers on ONE channel, with 4 producers on 4 channels
   (one each); the publish floor with 1 and 4 clients. Ratios ``lq_1/floor_1``,
   ``lq_4_one_channel/floor_4``, ``lq_4_one_channel/lq_4_four_channels``.
2. ``consume``: the queue (or ``floor_m``) is pre-filled with batches, then drained (ack + next
   dequeue in one call) at prefetch 1 (``--consume-p1-messages``, default 5,000) and prefetch
   100 (``--consume-p100-messages``, default 30,000), by 1 and 4 consumers on one channel;
   lonnymq and the consume floor. Ratios lq/floor for each of the four.
3. ``channels``: lonnymq only, prefetch 100 drain of ``--channels-messages`` (default 20,000)
   messages in 1 channel and in ``--many-channels`` (default 10,000) channels (2 each), by 1
   and 4 consumers. Ratios many/1 channel.
4. ``batch``: ``--batches`` (default 20) batches of ``--batch-size`` (default 1,000) creates,
   one producer, jobs/s; lonnymq ``queue.batch()``, the batch floor and, if ``import pgqueuer``
   works, pgqueuer's ``Queries.enqueue(entrypoints, payloads, priorities)`` with lists of
   ``--batch-size`` jobs per call (psycopg async driver ``PsycopgDriver``, autocommit, its
   schema installed with ``Queries.install()`` and its default, durable, tables). Ratios
   lq/floor and lq/pgqueuer. When pgqueuer cannot be imported the JSON says why.
5. ``held`` (only with ``--only held``): a producer process creates ``--held-messages`` (default
   100,000) messages at ``--held-rate`` (default 1,500 msgs/s, paced with ``time.sleep``) while
   consumers drain them: prefetch 1 with 2 consumers, and prefetch 100 with 1 consumer; through
   ONE channel, then round-robin over ``--held-channels`` (default 1,000) channels. Each flow
   runs twice per repetition (the order alternates between repetitions): *free*, and *held*: a
   separate session runs ``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM floor_t``
   before the workers start and stays idle in that transaction (holding back the xmin horizon,
   so no dead row can be pruned or vacuumed) until they are done, then rolls back. For the first
   10% and the last 10% of the messages (in the order they were handed out): consumer
   throughput (msgs/s), dequeue call latency p50/p99 (ms, every call of the window, empty ones
   included) and the producer's achieved rate (over the first and last 10% it created).
   Ratios held/free of the last-10% throughput and p99. Held consumers behave like the
   transport: a call that returns nothing with ``retry_ms`` None (nothing pending) waits for a
   NOTIFY on ``broker.wake_channel`` (at most 0.1 s: a wait that times out is counted), with
   ``retry_ms`` > 0 it sleeps that long (at most 0.1 s). The JSON also has the backlog when the
   producer finished, the dead rows of the schema's tables at the end (``pg_stat_user_tables``,
   approximate) and whether autovacuum was on (the server's ``autovacuum``).

An *empty dequeue* (create/consume/channels) is a dequeue call that returned nothing although,
once it had returned, some messages had not been handed out to any consumer yet (a counter
shared by the consumers of a run is below the number of messages). A consumer stops as soon as
every message has been handed out, so empty polls while the last ones are being acked are not
counted (they are reported apart, as tail polls). These consumers retry at once.

Method: workers are separate processes (``spawn``), each with its own connection. They connect
and warm up their session on something that is not measured (lonnymq: the queue
``bench_warmup``; floors: rows of the channel ``warm``, or a rolled-back call for the consume
floor; pgqueuer: the entrypoint ``warmup``), then start together on a barrier. Throughput is
messages / (last worker's end - first worker's start), ``time.perf_counter``, system-wide
(CLOCK_MONOTONIC) on Linux. Before each run the measured queue is deleted, the floor tables and
pgqueuer's are truncated and every table is ``VACUUM (ANALYZE)``d; after it the counts are
checked (``broker.status``, ``count(*)``): every message handled exactly once. A failed check
does not stop the benchmark: it is printed (with, for lonnymq, the status gauges again a second
later and a count of the message rows themselves), recorded in the run's ``check_failed`` and
the row is flagged ``!``. A run stops after ``--max-run-seconds`` (default 60; the held flows:
``--held-max-seconds``, default 3 x messages / rate + 60 s), or when its consumers have been
told "nothing" while no message was handed out for ``--stall-seconds`` (default 10: a stall,
``stalled`` in the JSON); it is then measured on what it handled and flagged partial (``*``).

Output: a table per scenario, each row ``median (min-max)`` over the ``--repeat`` runs (default
3), each ratio computed per repetition (runs of one repetition are interleaved) and given as
``median (min-max)``; JSON to ``--output`` (default ``benchmarks/results/hot_path.json``) with
every run, the server settings (fsync, synchronous_commit, autovacuum...), the machine's load
before each run and at the end, and the code measured (git commit, uncommitted changes under
``src/``, the schema SQL's sha256); and, if matplotlib imports, a bar chart of the ratios to
``--chart`` (default ``benchmarks/results/hot_path.png``), skipped silently otherwise.

``--quick`` makes every count small (a default run with ``--quick --repeat 1`` takes well under
a minute; ``--only held --quick``: 5,000 messages per flow); counts given explicitly win.
The DSN is ``--dsn``, else ``$LONNYMQ_BENCH_DSN``, else ``postgresql://postgres@127.0.0.1:5432/test``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import importlib
import json
import multiprocessing
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from multiprocessing.context import SpawnContext
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psycopg
from floors import install_floors
from psycopg import sql

import lonnymq
from lonnymq import DequeueResult, Message

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
QUEUE = "bench"
WARMUP_QUEUE = "bench_warmup"
CHANNEL = "ch00000"
WARM_CHANNEL = "warm"
PGQ_ENTRYPOINT = "bench"
PGQ_WARM_ENTRYPOINT = "warmup"
PAYLOAD_BYTES = 300
LOCK_MS = 120_000
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCENARIOS = ("create", "consume", "channels", "batch", "held")
DEFAULT_SCENARIOS = ("create", "consume", "channels", "batch")
#: longest wait for a NOTIFY (or sleep on retry_ms) of a held-flow consumer told "nothing"
WAKE_WAIT_S = 0.1

#: counts: (default, --quick)
COUNTS: dict[str, tuple[int, int]] = {
    "create_messages": (2000, 600),
    "consume_p1_messages": (5000, 1000),
    "consume_p100_messages": (30000, 6000),
    "channels_messages": (20000, 4000),
    "many_channels": (10000, 2000),
    "batches": (20, 5),
    "batch_size": (1000, 1000),
    "held_messages": (100_000, 5000),
    "held_channels": (1000, 1000),
}

_FLOOR_INSERT = "INSERT INTO {t} (ch, payload) VALUES (%s, %s)"
_FLOOR_STEP = (
    "WITH d AS (DELETE FROM {t} WHERE id = ANY(%s::bigint[])), "
    "n AS (SELECT id FROM {t} WHERE ch = %s AND locked_until IS NULL "
    "ORDER BY at, id LIMIT %s FOR UPDATE SKIP LOCKED) "
    "UPDATE {t} SET locked_until = now() + interval '1 minute' "
    "WHERE id = ANY (ARRAY(SELECT id FROM n)) RETURNING id, payload"
)
_FLOOR_DELETE = "DELETE FROM {t} WHERE id = ANY(%s::bigint[])"

Conn = psycopg.Connection[Any]


# --------------------------------------------------------------------------------------------
# Tasks and results


@dataclass(frozen=True)
class Task:
    """What one worker process does."""

    #: lq_create, floor_create, lq_drain, floor_drain, lq_batch, floor_batch, pgq_batch,
    #: held_produce, held_consume
    kind: str
    dsn: str
    schema: str
    index: int = 0
    #: workers of this kind in the run (a producer takes every workers-th message)
    workers: int = 1
    #: messages created, or drained, by all the workers of this kind together
    messages: int = 0
    #: messages go round-robin over this many channels
    channels: int = 1
    #: dequeue limit (prefetch)
    limit: int = 1
    batch_size: int = 1000
    #: held producer: messages per second
    rate: float = 0.0
    max_seconds: float = 60.0
    #: consumers stop when no message was handed out (by any of them) for this long
    stall_seconds: float = 10.0
    pgq_schema: str = ""

    @property
    def consumer(self) -> bool:
        return self.kind in ("lq_drain", "floor_drain", "held_consume")


@dataclass
class WorkerResult:
    index: int
    kind: str
    start: float = 0.0
    end: float = 0.0
    #: messages created, or dequeued and acked
    messages: int = 0
    #: create calls (batches for batch runs), or dequeue calls (empty ones included)
    calls: int = 0
    #: empty dequeues while messages were still waiting (held flows: every empty dequeue)
    empty: int = 0
    #: empty dequeues once every message had been handed out
    tail_polls: int = 0
    #: held consumers: waits for a NOTIFY, and those that timed out
    wake_waits: int = 0
    wake_timeouts: int = 0
    #: stopped because no message was handed out for stall_seconds
    stalled: bool = False
    latencies: list[float] = field(default_factory=list)
    #: held consumers: (return time, messages, latency) per dequeue call
    events: list[tuple[float, int, float]] = field(default_factory=list)
    #: held producer: the time each create returned
    publish_times: list[float] = field(default_factory=list)
    error: str | None = None


# --------------------------------------------------------------------------------------------
# Workers (run in child processes)


def _connect(task: Task) -> Conn:
    conn = psycopg.connect(task.dsn, autocommit=True)
    conn.execute("SET application_name = 'lonnymq-bench-hot'")
    if task.consumer:
        conn.execute("SET synchronous_commit = off")
    return conn


class _Progress:
    """Stall detection, checked after empty dequeues: the counter of messages handed out has
    not moved for ``stall_seconds``."""

    def __init__(self, claimed: Synchronized[int], stall_seconds: float) -> None:
        self.claimed = claimed
        self.limit = stall_seconds
        self.seen = claimed.value
        self.since = time.perf_counter()

    def stalled(self) -> bool:
        value = self.claimed.value
        now = time.perf_counter()
        if value != self.seen:
            self.seen, self.since = value, now
            return False
        return now - self.since > self.limit


def _channel_name(i: int, channels: int) -> str:
    return f"ch{i % channels:05d}"


def _floor_sql(template: str, schema: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(t=sql.Identifier(schema, table))


def _warm_lq_consumer(conn: Conn, broker: lonnymq.Broker) -> None:
    """Compile the dequeue and ack paths of this session on the warm-up queue."""
    held: list[Message] = []
    for _ in range(50):
        res = broker.dequeue(conn, [WARMUP_QUEUE], limit=1, lock_ms=LOCK_MS, listen=False)
        if res.messages:
            held = res.messages
            break
    res = broker.dequeue(conn, [WARMUP_QUEUE], limit=1, lock_ms=LOCK_MS, ack=held, listen=False)
    if res.messages:
        broker.delete_many(conn, res.messages)


def _check_acks(res: DequeueResult, held: Sequence[Message]) -> None:
    if held and (len(res.acked) != len(held) or not all(res.acked.values())):
        raise RuntimeError(f"acks carried by a dequeue failed: {res.acked}")


def _ack_last(conn: Conn, broker: lonnymq.Broker, held: Sequence[Message]) -> None:
    outcomes = broker.delete_many(conn, held)
    if len(outcomes) != len(held) or not all(outcomes.values()):
        raise RuntimeError(f"ack of the last batch failed: {outcomes}")


def _lq_create(conn: Conn, task: Task, barrier: Barrier, out: WorkerResult) -> None:
    broker = lonnymq.Broker(task.schema)
    broker.queue(WARMUP_QUEUE).channel(f"w{task.index}").message.create(conn, b"warm-up")
    queue = broker.queue(QUEUE)
    channels = [queue.channel(_channel_name(i, task.channels)) for i in range(task.channels)]
    payload = os.urandom(PAYLOAD_BYTES)
    barrier.wait(timeout=120)
    clock = time.perf_counter
    latencies = out.latencies
    out.start = clock()
    deadline = out.start + task.max_seconds
    for i in range(task.index, task.messages, task.workers):
        if clock() > deadline:
            break
        t0 = clock()
        channels[i % task.channels].message.create(conn, payload)
        latencies.append(clock() - t0)
        out.messages += 1
    out.end = clock()
    out.calls = out.messages


def _floor_create(conn: Conn, task: Task, barrier: Barrier, out: WorkerResult) -> None:
    stmt = _floor_sql(_FLOOR_INSERT, task.schema, "floor_t")
    payload = os.urandom(PAYLOAD_BYTES)
    conn.execute(stmt, (WARM_CHANNEL, payload))
    barrier.wait(timeout=120)
    clock = time.perf_counter
    latencies = out.latencies
    out.start = clock()
    deadline = out.start + task.max_seconds
    for _ in range(task.index, task.messages, task.workers):
        if clock() > deadline:
            break
        t0 = clock()
        conn.execute(stmt, (CHANNEL, payload))
        latencies.append(clock() - t0)
        out.messages += 1
    out.end = clock()
    out.calls = out.messages


def _lq_drain(
    conn: Conn, task: Task, barrier: Barrier, claimed: Synchronized[int], out: WorkerResult
) -> None:
    broker = lonnymq.Broker(task.schema)
    _warm_lq_consumer(conn, broker)
    barrier.wait(timeout=120)
    total = task.messages
    clock = time.perf_counter
    latencies = out.latencies
    held: list[Message] = []
    progress = _Progress(claimed, task.stall_seconds)
    out.start = clock()
    deadline = out.start + task.max_seconds
    while claimed.value < total and clock() <= deadline:
        t0 = clock()
        res = broker.dequeue(
            conn, [QUEUE], limit=task.limit, lock_ms=LOCK_MS, ack=held, listen=False
        )
        latencies.append(clock() - t0)
        out.calls += 1
        _check_acks(res, held)
        held = res.messages
        if not held:
            if claimed.value >= total:
                out.tail_polls += 1
            else:
                out.empty += 1
                if progress.stalled():
                    out.stalled = True
                    break
            continue
        with claimed.get_lock():
            claimed.value += len(held)
        out.messages += len(held)
    if held:
        _ack_last(conn, broker, held)
    out.end = clock()


def _floor_drain(
    conn: Conn, task: Task, barrier: Barrier, claimed: Synchronized[int], out: WorkerResult
) -> None:
    step = _floor_sql(_FLOOR_STEP, task.schema, "floor_m")
    with conn.transaction(force_rollback=True):
        conn.execute(step, ([], CHANNEL, task.limit)).fetchall()
    barrier.wait(timeout=120)
    total = task.messages
    clock = time.perf_counter
    latencies = out.latencies
    held: list[int] = []
    progress = _Progress(claimed, task.stall_seconds)
    out.start = clock()
    deadline = out.start + task.max_seconds
    while claimed.value < total and clock() <= deadline:
        t0 = clock()
        rows = conn.execute(step, (held, CHANNEL, task.limit)).fetchall()
        latencies.append(clock() - t0)
        out.calls += 1
        held = [int(r[0]) for r in rows]
        if not held:
            if claimed.value >= total:
                out.tail_polls += 1
            else:
                out.empty += 1
                if progress.stalled():
                    out.stalled = True
                    break
            continue
        with claimed.get_lock():
            claimed.value += len(held)
        out.messages += len(held)
    if held:
        conn.execute(_floor_sql(_FLOOR_DELETE, task.schema, "floor_m"), (held,))
    out.end = clock()


def _batch_loop(task: Task, out: WorkerResult, one_batch: Callable[[], None]) -> None:
    clock = time.perf_counter
    batches = task.messages // task.batch_size
    out.start = clock()
    deadline = out.start + task.max_seconds
    for _ in range(batches):
        if clock() > deadline:
            break
        t0 = clock()
        one_batch()
        out.latencies.append(clock() - t0)
        out.calls += 1
        out.messages += task.batch_size
    out.end = clock()


def _lq_batch(conn: Conn, task: Task, barrier: Barrier, out: WorkerResult) -> None:
    broker = lonnymq.Broker(task.schema)
    payload = os.urandom(PAYLOAD_BYTES)

    def run(queue: str) -> None:
        batch = broker.queue(queue).batch()
        channel = batch.channel(CHANNEL)
        for _ in range(task.batch_size):
            channel.message(payload)
        batch.execute(conn)

    run(WARMUP_QUEUE)
    barrier.wait(timeout=120)
    _batch_loop(task, out, lambda: run(QUEUE))


def _floor_batch(conn: Conn, task: Task, barrier: Barrier, out: WorkerResult) -> None:
    payload = os.urandom(PAYLOAD_BYTES)
    stmt = sql.SQL("INSERT INTO {} (ch, payload) VALUES {}").format(
        sql.Identifier(task.schema, "floor_t"),
        sql.SQL(", ").join([sql.SQL("(%s, %s)")] * task.batch_size),
    )

    def run(channel: str) -> None:
        params: list[Any] = []
        for _ in range(task.batch_size):
            params += (channel, payload)
        conn.execute(stmt, params)

    run(WARM_CHANNEL)
    barrier.wait(timeout=120)
    _batch_loop(task, out, lambda: run(CHANNEL))


def pgq_queries(driver_conn: Any, pgq_schema: str) -> Any:
    """pgqueuer's ``Queries`` on a psycopg AsyncConnection, for objects in ``pgq_schema``.

    Imported by name: pgqueuer is optional (not a dependency of the project)."""
    queries = importlib.import_module("pgqueuer.queries")
    qb = importlib.import_module("pgqueuer.adapters.persistence.qb")
    db = importlib.import_module("pgqueuer.db")
    settings = qb.DBSettings(db_schema=pgq_schema)
    return queries.Queries(
        db.PsycopgDriver(driver_conn),
        qbe=qb.QueryBuilderEnvironment(settings),
        qbq=qb.QueryQueueBuilder(settings),
        qbs=qb.QuerySchedulerBuilder(settings),
    )


async def _pgq_batch_async(task: Task, barrier: Barrier, out: WorkerResult) -> None:
    payload = os.urandom(PAYLOAD_BYTES)
    conn = await psycopg.AsyncConnection.connect(task.dsn, autocommit=True)
    try:
        await conn.execute("SET application_name = 'lonnymq-bench-hot'")
        queries = pgq_queries(conn, task.pgq_schema)
        payloads: list[bytes | None] = [payload] * task.batch_size
        priorities = [0] * task.batch_size
        await queries.enqueue([PGQ_WARM_ENTRYPOINT] * task.batch_size, payloads, priorities)
        entrypoints = [PGQ_ENTRYPOINT] * task.batch_size
        barrier.wait(timeout=120)  # nothing else runs in this event loop
        clock = time.perf_counter
        out.start = clock()
        deadline = out.start + task.max_seconds
        for _ in range(task.messages // task.batch_size):
            if clock() > deadline:
                break
            t0 = clock()
            ids = await queries.enqueue(entrypoints, payloads, priorities)
            out.latencies.append(clock() - t0)
            if len(ids) != task.batch_size:
                raise RuntimeError(f"pgqueuer enqueued {len(ids)} of {task.batch_size} jobs")
            out.calls += 1
            out.messages += task.batch_size
        out.end = clock()
    finally:
        await conn.close()


def _held_produce(conn: Conn, task: Task, barrier: Barrier, out: WorkerResult) -> None:
    broker = lonnymq.Broker(task.schema)
    broker.queue(WARMUP_QUEUE).channel("w-producer").message.create(conn, b"warm-up")
    queue = broker.queue(QUEUE)
    channels = [queue.channel(_channel_name(i, task.channels)) for i in range(task.channels)]
    payload = os.urandom(PAYLOAD_BYTES)
    barrier.wait(timeout=120)
    clock = time.perf_counter
    times = out.publish_times
    latencies = out.latencies
    interval = 1.0 / task.rate
    out.start = clock()
    deadline = out.start + task.max_seconds
    for i in range(task.messages):
        now = clock()
        if now > deadline:
            break
        due = out.start + i * interval
        if due > now:
            time.sleep(due - now)
        t0 = clock()
        channels[i % task.channels].message.create(conn, payload)
        t1 = clock()
        latencies.append(t1 - t0)
        times.append(t1)
        out.messages += 1
    out.end = clock()
    out.calls = out.messages


def _wait_for_wake(conn: Conn, out: WorkerResult) -> None:
    out.wake_waits += 1
    got = 0
    for _ in conn.notifies(timeout=WAKE_WAIT_S, stop_after=1):
        got += 1
    if not got:
        out.wake_timeouts += 1


def _held_consume(
    conn: Conn, task: Task, barrier: Barrier, claimed: Synchronized[int], out: WorkerResult
) -> None:
    broker = lonnymq.Broker(task.schema)
    _warm_lq_consumer(conn, broker)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(broker.wake_channel)))
    barrier.wait(timeout=120)
    total = task.messages
    clock = time.perf_counter
    events = out.events
    held: list[Message] = []
    progress = _Progress(claimed, task.stall_seconds)
    out.start = clock()
    deadline = out.start + task.max_seconds
    while claimed.value < total and clock() <= deadline:
        t0 = clock()
        res = broker.dequeue(conn, [QUEUE], limit=task.limit, lock_ms=LOCK_MS, ack=held)
        t1 = clock()
        events.append((t1, len(res.messages), t1 - t0))
        out.calls += 1
        _check_acks(res, held)
        held = res.messages
        if held:
            with claimed.get_lock():
                claimed.value += len(held)
            out.messages += len(held)
            continue
        if claimed.value >= total:
            out.tail_polls += 1
            break
        out.empty += 1
        if progress.stalled():
            out.stalled = True
            break
        if res.retry_ms is None:
            _wait_for_wake(conn, out)
        elif res.retry_ms > 0:
            time.sleep(min(res.retry_ms / 1000, WAKE_WAIT_S))
    if held:
        _ack_last(conn, broker, held)
    out.end = clock()


def worker_main(
    task: Task,
    barrier: Barrier,
    claimed: Synchronized[int],
    results: multiprocessing.Queue[WorkerResult],
) -> None:
    out = WorkerResult(task.index, task.kind)
    try:
        if task.kind == "pgq_batch":
            asyncio.run(_pgq_batch_async(task, barrier, out))
        else:
            with _connect(task) as conn:
                if task.kind == "lq_create":
                    _lq_create(conn, task, barrier, out)
                elif task.kind == "floor_create":
                    _floor_create(conn, task, barrier, out)
                elif task.kind == "lq_drain":
                    _lq_drain(conn, task, barrier, claimed, out)
                elif task.kind == "floor_drain":
                    _floor_drain(conn, task, barrier, claimed, out)
                elif task.kind == "lq_batch":
                    _lq_batch(conn, task, barrier, out)
                elif task.kind == "floor_batch":
                    _floor_batch(conn, task, barrier, out)
                elif task.kind == "held_produce":
                    _held_produce(conn, task, barrier, out)
                elif task.kind == "held_consume":
                    _held_consume(conn, task, barrier, claimed, out)
                else:
                    raise ValueError(f"unknown task kind {task.kind!r}")
    except Exception:
        out.error = traceback.format_exc()
        barrier.abort()
    results.put(out)


# --------------------------------------------------------------------------------------------
# Figures


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _ms(values: Sequence[float], q: float) -> float | None:
    return _percentile(values, q) * 1000 if values else None


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 and count > 0 else None


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def held_windows(
    events: list[tuple[float, int, float]],
    publish_times: list[float],
    start: float,
    producer_start: float,
    total: int,
) -> dict[str, float | int | None]:
    """The held-flow figures: consumers over the first and last 10% of the messages handed
    out, the producer over the first and last 10% it created."""
    events = sorted(events)
    tenth = max(1, total // 10)
    consumed = sum(n for _, n, _ in events)
    first: dict[str, Any] = {"calls": [], "end": None, "count": 0}
    last_from: tuple[float, int] | None = None
    last_calls: list[float] = []
    end_t = start
    cum = 0
    for t, n, lat in events:
        before = cum
        cum += n
        if first["end"] is None:
            first["calls"].append(lat)
            if cum >= tenth:
                first["end"] = t
                first["count"] = cum
        if last_from is not None and before < consumed:
            last_calls.append(lat)
        if last_from is None and cum >= max(tenth, consumed - tenth) and n:
            last_from = (t, cum)
        if n:
            end_t = t
    fig: dict[str, float | int | None] = {
        "first_msgs_per_s": (
            _rate(first["count"], first["end"] - start) if first["end"] is not None else None
        ),
        "first_call_ms_p50": _ms(first["calls"], 0.5),
        "first_call_ms_p99": _ms(first["calls"], 0.99),
        "last_msgs_per_s": (
            _rate(consumed - last_from[1], end_t - last_from[0]) if last_from else None
        ),
        "last_call_ms_p50": _ms(last_calls, 0.5),
        "last_call_ms_p99": _ms(last_calls, 0.99),
    }
    pt = sorted(publish_times)
    k = max(1, len(pt) // 10)
    fig["producer_first_rate"] = _rate(k, pt[k - 1] - producer_start) if pt else None
    fig["producer_last_rate"] = _rate(k, pt[-1] - pt[-k - 1]) if len(pt) > k else None
    fig["producer_rate"] = _rate(len(pt), pt[-1] - producer_start) if pt else None
    if pt:
        done = pt[-1]
        fig["backlog_at_producer_end"] = len(pt) - sum(n for t, n, _ in events if t <= done)
    else:
        fig["backlog_at_producer_end"] = None
    return fig


# --------------------------------------------------------------------------------------------
# Orchestration (parent process)


@dataclass(frozen=True)
class Variant:
    """One row of a scenario: the worker tasks of one run, and how to prepare and check it."""

    name: str
    tasks: tuple[Task, ...]
    #: "lq" (the lonnymq queue), "floor_t", "floor_m" or "pgq": where messages end up
    target: str
    #: messages pre-filled before the run (drains), over this many channels
    prefill: int = 0
    prefill_channels: int = 1
    #: held flows: hold a REPEATABLE READ snapshot open during the run
    held: bool = False

    @property
    def expected(self) -> int:
        """Messages a complete run handles (the first task's total is the run's)."""
        t = self.tasks[0]
        if t.kind.endswith("_batch"):
            return t.messages // t.batch_size * t.batch_size
        return t.messages


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dsn: str = args.dsn
        self.repeat: int = args.repeat
        self.max_seconds: float = args.max_run_seconds
        self.schema = f"bench_hot_{secrets.token_hex(4)}"
        self.pgq_schema = f"{self.schema}_pgq"
        #: the pgqueuer schema may exist (drop it at the end)
        self.pgq_created = False
        #: pgqueuer is installed and measured
        self.pgq_ready = False
        self.pgq_table = "pgqueuer"
        self.pgq: dict[str, Any] = {"available": False}
        self.broker = lonnymq.Broker(self.schema)
        self.queue = self.broker.queue(QUEUE)
        self.admin = psycopg.connect(self.dsn, autocommit=True)
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")

    # -- schema and data ---------------------------------------------------------------------

    def install(self) -> None:
        lonnymq.install(self.admin, schema=self.schema)
        install_floors(self.admin, self.schema)

    def install_pgqueuer(self) -> None:
        """Install pgqueuer in its own schema, or record why it cannot be measured."""
        try:
            pgqueuer = importlib.import_module("pgqueuer")
        except ImportError as exc:
            self.pgq = {"available": False, "error": f"import pgqueuer: {exc!r}"}
            return
        version = getattr(pgqueuer, "__version__", None)
        if version is None:
            try:
                from importlib.metadata import version as dist_version

                version = dist_version("pgqueuer")
            except Exception:
                version = None

        async def install() -> None:
            conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            try:
                queries = pgq_queries(conn, self.pgq_schema)
                self.pgq_table = str(queries.qbq.settings.queue_table)
                self.pgq_created = True
                await queries.install()
            finally:
                await conn.close()

        try:
            asyncio.run(install())
        except Exception as exc:
            self.pgq = {"available": False, "version": version, "error": f"install: {exc!r}"}
            return
        self.pgq_ready = True
        self.pgq = {"available": True, "version": version, "schema": self.pgq_schema}

    def drop(self) -> None:
        for schema in (self.schema, self.pgq_schema):
            if schema == self.pgq_schema and not self.pgq_created:
                continue
            self.admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
        self.admin.close()

    def _tables(self, schema: str) -> list[sql.Identifier]:
        rows = self.admin.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY tablename", (schema,)
        ).fetchall()
        return [sql.Identifier(schema, str(r[0])) for r in rows]

    def _vacuum(self) -> None:
        tables = self._tables(self.schema)
        if self.pgq_ready:
            tables += self._tables(self.pgq_schema)
        self.admin.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.SQL(", ").join(tables)))

    def _reset(self) -> None:
        """Empty what the runs fill and clean the tables, so that each run starts alike."""
        self.queue.delete(self.admin)
        self.broker.queue(WARMUP_QUEUE).delete(self.admin)
        floors = [sql.Identifier(self.schema, "floor_t"), sql.Identifier(self.schema, "floor_m")]
        if self.pgq_ready:
            floors += self._tables(self.pgq_schema)
        self.admin.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(floors)))

    def _prefill(self, v: Variant) -> None:
        payload = os.urandom(PAYLOAD_BYTES)
        consumers = sum(t.consumer for t in v.tasks)
        if v.target == "floor_m":
            self.admin.execute(
                sql.SQL(
                    "INSERT INTO {} (ch, payload) SELECT %s, %s FROM generate_series(1, %s)"
                ).format(sql.Identifier(self.schema, "floor_m")),
                (CHANNEL, payload, v.prefill),
            )
        elif v.prefill:
            step = 1000
            for start in range(0, v.prefill, step):
                batch = self.queue.batch()
                for i in range(start, min(v.prefill, start + step)):
                    batch.channel(_channel_name(i, v.prefill_channels)).message(payload)
                batch.execute(self.admin)
        if any(t.kind in ("lq_drain", "held_consume") for t in v.tasks):
            warm = self.broker.queue(WARMUP_QUEUE).batch()
            for i in range(consumers * 3):
                warm.channel(f"w{i}").message(b"warm-up")
            warm.execute(self.admin)

    def _left(self, target: str) -> tuple[int, int]:
        """(messages left, of which held by a consumer) where the run put or took them."""
        if target == "lq":
            for st in self.broker.status(self.admin, count_ready=False):
                if st.queue == QUEUE:
                    return st.total, st.in_flight
            return 0, 0
        if target == "pgq":
            table = sql.Identifier(self.pgq_schema, self.pgq_table)
            query = sql.SQL("SELECT count(*) FROM {} WHERE entrypoint = %s").format(table)
            row = self.admin.execute(query, (PGQ_ENTRYPOINT,)).fetchone()
            return (int(row[0]) if row else 0), 0
        query = sql.SQL(
            "SELECT count(*), count(*) FILTER (WHERE locked_until IS NOT NULL) FROM {} "
            "WHERE ch <> %s"
        ).format(sql.Identifier(self.schema, target))
        row = self.admin.execute(query, (WARM_CHANNEL,)).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def _verify(self, v: Variant, created: int, handled: int) -> str | None:
        """Every message handled exactly once: what is left agrees with what was handled.

        Returns None, or what disagrees (the run is kept, flagged ``!``: a benchmark that
        stops on the first anomaly of the system it measures reports nothing about it)."""
        left, locked = self._left(v.target)
        drain = any(t.consumer for t in v.tasks)
        expected = created - handled if drain else handled
        if left == expected and locked == 0:
            return None
        problem = (
            f"{v.name}: {created} created, {handled} handed out, expected {expected} left "
            f"(none locked); found {left} ({locked} locked)"
        )
        if v.target == "lq":
            # the status gauges against the rows themselves, a moment later
            time.sleep(1.0)
            left2, locked2 = self._left(v.target)
            row = self.admin.execute(
                sql.SQL(
                    "SELECT count(*), count(*) FILTER (WHERE locked_until IS NOT NULL) "
                    "FROM {} WHERE queue = %s"
                ).format(sql.Identifier(self.schema, "message")),
                (QUEUE,),
            ).fetchone()
            rows = (int(row[0]), int(row[1])) if row else (0, 0)
            problem += (
                f"; 1 s later: status {left2} ({locked2} locked), "
                f"message rows {rows[0]} ({rows[1]} locked)"
            )
        return problem

    def _dead_rows(self) -> int:
        self.admin.execute("SELECT pg_stat_clear_snapshot()")
        row = self.admin.execute(
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = %s",
            (self.schema,),
        ).fetchone()
        return int(row[0]) if row else 0

    # -- one run -----------------------------------------------------------------------------

    def _spawn(self, tasks: Sequence[Task]) -> list[WorkerResult]:
        barrier = self.ctx.Barrier(len(tasks))
        claimed = self.ctx.Value("q", 0)
        results: multiprocessing.Queue[WorkerResult] = self.ctx.Queue()
        procs = [
            self.ctx.Process(target=worker_main, args=(t, barrier, claimed, results)) for t in tasks
        ]
        for p in procs:
            p.start()
        timeout = max(t.max_seconds for t in tasks) + 300
        outs = [results.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join()
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"a worker failed:\n{errors[0]}")
        return outs

    def run_once(self, v: Variant) -> dict[str, Any]:
        self._reset()
        self._prefill(v)
        self._vacuum()
        snap: Conn | None = None
        snapshot_xmin: str | None = None
        if v.held:
            snap = psycopg.connect(self.dsn, autocommit=True)
            snap.execute("SET application_name = 'lonnymq-bench-hot-snapshot'")
            snap.execute("SET idle_in_transaction_session_timeout = 0")
            snap.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            snap.execute(
                sql.SQL("SELECT 1 FROM {} LIMIT 1").format(sql.Identifier(self.schema, "floor_t"))
            ).fetchall()
            row = self.admin.execute(
                "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = %s",
                (snap.info.backend_pid,),
            ).fetchone()
            snapshot_xmin = row[0] if row else None
        load_before = os.getloadavg()[0]
        try:
            outs = self._spawn(v.tasks)
        finally:
            if snap is not None:
                snap.execute("ROLLBACK")
                snap.close()
        load_after = os.getloadavg()[0]
        consumers = [o for o in outs if o.kind in ("lq_drain", "floor_drain", "held_consume")]
        measured = consumers or outs
        elapsed = max(o.end for o in measured) - min(o.start for o in measured)
        messages = sum(o.messages for o in measured)
        producers = [o for o in outs if o.kind == "held_produce"]
        created = sum(o.messages for o in producers) if producers else v.prefill
        partial = messages < v.expected
        problem = self._verify(v, created, messages)
        if problem:
            print(f"  WARNING: check failed: {problem}", flush=True)
        latencies = [x for o in measured for x in o.latencies]
        result: dict[str, Any] = {
            "elapsed_s": elapsed,
            "messages": messages,
            "partial": partial,
            #: consumers stopped: no message handed out for --stall-seconds
            "stalled": any(o.stalled for o in consumers),
            "msgs_per_s": messages / elapsed if elapsed > 0 else 0.0,
            "calls": sum(o.calls for o in measured),
            #: None, or how the counts after the run disagree with what was handled
            "check_failed": problem,
            "load_before": load_before,
            "load_after": load_after,
        }
        if producers:
            events = [e for o in consumers for e in o.events]
            start = min(o.start for o in outs)
            result.update(
                held_windows(
                    events,
                    [t for o in producers for t in o.publish_times],
                    start,
                    min(o.start for o in producers),
                    created,
                )
            )
            result["call_ms_p50"] = _ms([e[2] for e in events], 0.5)
            result["call_ms_p99"] = _ms([e[2] for e in events], 0.99)
            result["created"] = created
            result["empty_calls"] = sum(o.empty for o in consumers)
            result["wake_waits"] = sum(o.wake_waits for o in consumers)
            result["wake_timeouts"] = sum(o.wake_timeouts for o in consumers)
            result["create_ms_p50"] = _ms([x for o in producers for x in o.latencies], 0.5)
            result["create_ms_p99"] = _ms([x for o in producers for x in o.latencies], 0.99)
            result["dead_rows_end"] = self._dead_rows()
            result["held_snapshot"] = v.held
            result["snapshot_backend_xmin"] = snapshot_xmin
        else:
            result["call_ms_p50"] = _ms(latencies, 0.5)
            result["call_ms_p99"] = _ms(latencies, 0.99)
            if consumers:
                result["empty_dequeues"] = sum(o.empty for o in consumers)
                result["tail_polls"] = sum(o.tail_polls for o in consumers)
        return result


# --------------------------------------------------------------------------------------------
# Scenarios


@dataclass
class ScenarioPlan:
    name: str
    title: str
    variants: list[Variant]
    #: name -> (numerator row, denominator row, figure)
    ratios: dict[str, tuple[str, str, str]]
    #: the figure a row is reported by
    figure: str = "msgs_per_s"
    #: alternate the order of the variant pairs between repetitions (held/free)
    alternate: bool = False


def _tasks(kind: str, workers: int, dsn: str, schema: str, **kw: Any) -> tuple[Task, ...]:
    return tuple(Task(kind, dsn, schema, index=i, workers=workers, **kw) for i in range(workers))


def _words(n: int) -> str:
    names = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    return names[n] if n < len(names) else str(n)


def build_plans(args: argparse.Namespace, bench: Bench) -> list[ScenarioPlan]:
    dsn, schema, ms = args.dsn, bench.schema, args.max_run_seconds
    w = args.workers
    selected = args.only or list(DEFAULT_SCENARIOS)
    plans: list[ScenarioPlan] = []
    if "create" in selected:
        n = args.create_messages
        plans.append(
            ScenarioPlan(
                "create",
                f"create: {n} creates per run, one per call, durable commit",
                [
                    Variant(
                        "lq_1",
                        _tasks("lq_create", 1, dsn, schema, messages=n, max_seconds=ms),
                        "lq",
                    ),
                    Variant(
                        "floor_1",
                        _tasks("floor_create", 1, dsn, schema, messages=n, max_seconds=ms),
                        "floor_t",
                    ),
                    Variant(
                        f"lq_{w}_one_channel",
                        _tasks("lq_create", w, dsn, schema, messages=n, max_seconds=ms),
                        "lq",
                    ),
                    Variant(
                        f"floor_{w}",
                        _tasks("floor_create", w, dsn, schema, messages=n, max_seconds=ms),
                        "floor_t",
                    ),
                    Variant(
                        f"lq_{w}_{_words(w)}_channels",
                        _tasks("lq_create", w, dsn, schema, messages=n, channels=w, max_seconds=ms),
                        "lq",
                    ),
                ],
                {
                    "lq_1/floor_1": ("lq_1", "floor_1", "msgs_per_s"),
                    f"lq_{w}_one_channel/floor_{w}": (
                        f"lq_{w}_one_channel",
                        f"floor_{w}",
                        "msgs_per_s",
                    ),
                    f"lq_{w}_one_channel/lq_{w}_{_words(w)}_channels": (
                        f"lq_{w}_one_channel",
                        f"lq_{w}_{_words(w)}_channels",
                        "msgs_per_s",
                    ),
                },
            )
        )
    if "consume" in selected:
        variants: list[Variant] = []
        ratios: dict[str, tuple[str, str, str]] = {}
        for limit, n in ((1, args.consume_p1_messages), (100, args.consume_p100_messages)):
            for c in sorted({1, w}):
                key = f"p{limit}_c{c}"
                for kind, target in (("lq_drain", "lq"), ("floor_drain", "floor_m")):
                    side = "lq" if kind == "lq_drain" else "floor"
                    tasks = _tasks(kind, c, dsn, schema, messages=n, limit=limit, max_seconds=ms)
                    variants.append(Variant(f"{side}_{key}", tasks, target, prefill=n))
                ratios[f"lq/floor {key}"] = (f"lq_{key}", f"floor_{key}", "msgs_per_s")
        plans.append(
            ScenarioPlan(
                "consume",
                f"consume: pre-filled, ack + dequeue per call, prefetch 1 "
                f"({args.consume_p1_messages} msgs) and 100 ({args.consume_p100_messages} msgs), "
                "one channel",
                variants,
                ratios,
            )
        )
    if "channels" in selected:
        n, many = args.channels_messages, args.many_channels
        variants = []
        ratios = {}
        for c in sorted({1, w}):
            for chans in (1, many):
                tasks = _tasks("lq_drain", c, dsn, schema, messages=n, limit=100, max_seconds=ms)
                variants.append(
                    Variant(f"lq_{chans}ch_c{c}", tasks, "lq", prefill=n, prefill_channels=chans)
                )
            ratios[f"{many}ch/1ch c{c}"] = (f"lq_{many}ch_c{c}", f"lq_1ch_c{c}", "msgs_per_s")
        plans.append(
            ScenarioPlan(
                "channels",
                f"channels: lonnymq prefetch-100 drain of {n} msgs, 1 vs {many} channels",
                variants,
                ratios,
            )
        )
    if "batch" in selected:
        size = args.batch_size
        n = args.batches * size
        kw: dict[str, Any] = {"messages": n, "batch_size": size, "max_seconds": ms}
        variants = [
            Variant("lq_batch", _tasks("lq_batch", 1, dsn, schema, **kw), "lq"),
            Variant("floor_batch", _tasks("floor_batch", 1, dsn, schema, **kw), "floor_t"),
        ]
        ratios = {"lq/floor": ("lq_batch", "floor_batch", "msgs_per_s")}
        if bench.pgq_ready:
            pgq = _tasks("pgq_batch", 1, dsn, schema, pgq_schema=bench.pgq_schema, **kw)
            variants.append(Variant("pgqueuer_batch", pgq, "pgq"))
            ratios["lq/pgqueuer"] = ("lq_batch", "pgqueuer_batch", "msgs_per_s")
        plans.append(
            ScenarioPlan(
                "batch",
                f"batch: {args.batches} batches of {size} creates per run, one producer, jobs/s",
                variants,
                ratios,
            )
        )
    if "held" in selected:
        n, rate = args.held_messages, args.held_rate
        held_s = args.held_max_seconds or 3 * n / rate + 60
        variants = []
        ratios = {}
        for chans in (1, args.held_channels):
            for limit, consumers in ((1, 2), (100, 1)):
                key = f"{chans}ch_p{limit}x{consumers}"
                for held in (False, True):
                    tasks = (
                        Task(
                            "held_produce",
                            dsn,
                            schema,
                            messages=n,
                            channels=chans,
                            rate=rate,
                            max_seconds=held_s,
                        ),
                        *_tasks(
                            "held_consume",
                            consumers,
                            dsn,
                            schema,
                            messages=n,
                            limit=limit,
                            max_seconds=held_s,
                        ),
                    )
                    name = f"{key}_{'held' if held else 'free'}"
                    variants.append(Variant(name, tasks, "lq", held=held))
                ratios[f"held/free {key} last-10% msgs/s"] = (
                    f"{key}_held",
                    f"{key}_free",
                    "last_msgs_per_s",
                )
                ratios[f"held/free {key} last-10% p99"] = (
                    f"{key}_held",
                    f"{key}_free",
                    "last_call_ms_p99",
                )
        plans.append(
            ScenarioPlan(
                "held",
                f"held: producer at {rate:g} msgs/s, {n} msgs per flow, consumers draining; "
                "free vs a held REPEATABLE READ snapshot",
                variants,
                ratios,
                figure="last_msgs_per_s",
                alternate=True,
            )
        )
    for plan in plans:
        plan.variants = [
            dataclasses.replace(
                v,
                tasks=tuple(
                    dataclasses.replace(t, stall_seconds=args.stall_seconds) for t in v.tasks
                ),
            )
            for v in plan.variants
        ]
    return plans


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        if all(isinstance(x, bool) for x in values):
            out[key] = sum(bool(x) for x in values)
        elif all(x is None or isinstance(x, int | float) for x in values):
            out[key] = _spread([None if x is None else float(x) for x in values])
    return out


def run_plan(bench: Bench, plan: ScenarioPlan) -> dict[str, Any]:
    print(f"\n{plan.title}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in plan.variants}
    for r in range(bench.repeat):
        order = list(plan.variants)
        if plan.alternate and r % 2:
            # swap each (free, held) pair
            order = [order[i ^ 1] for i in range(len(order))]
        for v in order:
            res = bench.run_once(v)
            res["repetition"] = r
            runs[v.name].append(res)
            note = ""
            if "empty_dequeues" in res:
                note += f"  empty dequeues {res['empty_dequeues']}"
            if "last_msgs_per_s" in res:
                note += (
                    f"  first/last 10% {_fmt(res['first_msgs_per_s'], '.0f')}/"
                    f"{_fmt(res['last_msgs_per_s'], '.0f')} msg/s, p99 "
                    f"{_fmt(res['first_call_ms_p99'], '.2f')}/"
                    f"{_fmt(res['last_call_ms_p99'], '.2f')} ms, producer "
                    f"{_fmt(res['producer_rate'], '.0f')}/s"
                )
            if res["partial"]:
                note += f"  (partial: {res['messages']} messages"
                note += ", stalled)" if res["stalled"] else ")"
            print(
                f"  {v.name:<34} run {r + 1}/{bench.repeat}: {res['msgs_per_s']:8.0f} msg/s "
                f"in {res['elapsed_s']:6.2f}s{note}  [load {res['load_before']:.1f}]",
                flush=True,
            )
    ratios: dict[str, Any] = {}
    for name, (a, b, fig) in plan.ratios.items():
        values = [_ratio(ra.get(fig), rb.get(fig)) for ra, rb in zip(runs[a], runs[b], strict=True)]
        ratios[name] = {"numerator": a, "denominator": b, "figure": fig, "values": values}
        ratios[name].update(_spread(values))
    return {
        "scenario": plan.name,
        "title": plan.title,
        "figure": plan.figure,
        "rows": {
            v.name: {
                "tasks": [asdict(t) | {"dsn": None} for t in v.tasks if t.index == 0],
                "workers": len(v.tasks),
                "prefill": v.prefill,
                "prefill_channels": v.prefill_channels,
                "held_snapshot": v.held,
                "summary": _summary(runs[v.name]),
                "runs": runs[v.name],
            }
            for v in plan.variants
        },
        "ratios": ratios,
    }


# --------------------------------------------------------------------------------------------
# Environment


def server_info(conn: Conn) -> dict[str, Any]:
    info: dict[str, Any] = {}
    row = conn.execute("SELECT version()").fetchone()
    info["version"] = row[0] if row else None
    for name in (
        "fsync",
        "synchronous_commit",
        "autovacuum",
        "wal_sync_method",
        "shared_buffers",
        "commit_delay",
        "plan_cache_mode",
        "idle_in_transaction_session_timeout",
    ):
        row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
        info[name] = row[0] if row else None
    return info


def provenance() -> dict[str, Any]:
    """Which code was measured: the lonnymq schema SQL's digest and the git state, if any."""
    schema_sql = lonnymq.migrator.fresh_install_sql("lonnymq").encode()
    info: dict[str, Any] = {"schema_sql_sha256": hashlib.sha256(schema_sql).hexdigest()}
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return info
    info["git_commit"] = commit
    info["git_src_changes"] = [line for line in dirty if line]
    return info


# --------------------------------------------------------------------------------------------
# Report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mmm(s: dict[str, float | None] | None, spec: str) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{_fmt(s['median'], spec)} ({_fmt(s['min'], spec)}-{_fmt(s['max'], spec)})"


def print_tables(entries: list[dict[str, Any]]) -> None:
    for e in entries:
        print(f"\n== {e['title']}")
        if e["scenario"] == "held":
            _print_held(e)
        else:
            header = (
                f"{'row':<28} {'msgs/s median (min-max)':>26} {'call p50':>8} {'call p99':>8} "
                f"{'empty deq':>9} {'load':>4}"
            )
            print(header)
            print("-" * len(header))
            for name, row in e["rows"].items():
                s = row["summary"]
                partial = _flags(row)
                empty = s.get("empty_dequeues")
                print(
                    f"{name + partial:<28} {_mmm(s['msgs_per_s'], '.0f'):>26} "
                    f"{_fmt(s['call_ms_p50']['median'], '8.2f'):>8} "
                    f"{_fmt(s['call_ms_p99']['median'], '8.2f'):>8} "
                    f"{_fmt(empty['max'] if empty else None, '.0f'):>9} "
                    f"{s['load_before']['median']:>4.1f}"
                )
        print("ratios (per repetition):")
        for name, ratio in e["ratios"].items():
            print(f"  {name:<44} {_mmm(ratio, '.2f')}")
    print(
        "\nmedian (min-max) over the runs; * = some runs were partial (hit the time limit);\n"
        "! = the counts after some runs disagreed with what was handled (see anomalies).\n"
        "call p50/p99: ms per create or dequeue call (batch: per batch), medians over the runs.\n"
        "empty deq: most dequeues in a run that returned nothing while messages waited.\n"
        "load: 1-minute load average before the runs (median); above the CPU count, distrust."
    )
    anomalies = []
    for e in entries:
        for row_name, row in e["rows"].items():
            for r in row["runs"]:
                run = f"{row_name} run {r['repetition'] + 1}"
                if r.get("check_failed"):
                    anomalies.append(f"{run}: check failed: {r['check_failed']}")
                if r.get("stalled"):
                    anomalies.append(
                        f"{run}: stalled: {r['messages']} messages handed out, then none "
                        "for --stall-seconds while the rest waited"
                    )
    if anomalies:
        print("\nanomalies:")
        for line in anomalies:
            print(f"  {line}")


def _flags(row: dict[str, Any]) -> str:
    """``*``: some runs were partial; ``!``: some runs failed their check."""
    runs = row["runs"]
    return ("*" if any(r["partial"] for r in runs) else "") + (
        "!" if any(r.get("check_failed") for r in runs) else ""
    )


def _print_held(e: dict[str, Any]) -> None:
    header = (
        f"{'flow':<22} {'first 10% msgs/s':>20} {'p50':>6} {'p99':>7} {'prod/s':>6} | "
        f"{'last 10% msgs/s':>20} {'p50':>6} {'p99':>7} {'prod/s':>6} {'backlog':>7} "
        f"{'dead rows':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, row in e["rows"].items():
        s = row["summary"]
        partial = _flags(row)

        def med(key: str, spec: str, s: dict[str, Any] = s) -> str:
            return _fmt(s[key]["median"], spec) if key in s else "-"

        print(
            f"{name + partial:<22} {_mmm(s['first_msgs_per_s'], '.0f'):>20} "
            f"{med('first_call_ms_p50', '.2f'):>6} {med('first_call_ms_p99', '.2f'):>7} "
            f"{med('producer_first_rate', '.0f'):>6} | "
            f"{_mmm(s['last_msgs_per_s'], '.0f'):>20} "
            f"{med('last_call_ms_p50', '.2f'):>6} {med('last_call_ms_p99', '.2f'):>7} "
            f"{med('producer_last_rate', '.0f'):>6} {med('backlog_at_producer_end', '.0f'):>7} "
            f"{med('dead_rows_end', '.0f'):>9}"
        )
    print(
        "p50/p99: dequeue call latency (ms) over the window; prod/s: producer's achieved rate;\n"
        "backlog: messages not yet handed out when the producer finished; dead rows: dead rows\n"
        "of the schema's tables at the end (pg_stat_user_tables, approximate)."
    )


def write_chart(entries: list[dict[str, Any]], path: Path) -> bool:
    """A bar chart of the ratios (median, min-max whiskers); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    labels: list[str] = []
    medians: list[float] = []
    low: list[float] = []
    high: list[float] = []
    colors: list[str] = []
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, e in enumerate(entries):
        for name, r in e["ratios"].items():
            if r["median"] is None:
                continue
            labels.append(f"{e['scenario']}: {name}")
            medians.append(r["median"])
            low.append(r["median"] - r["min"])
            high.append(r["max"] - r["median"])
            colors.append(palette[i % len(palette)])
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(labels) + 1.5))
    y = list(range(len(labels)))
    ax.barh(y, medians, xerr=[low, high], color=colors, capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (median over repetitions; whiskers: min-max)")
    ax.set_title("lonnymq hot path: ratios")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_BENCH_DSN", DEFAULT_DSN),
        help="Postgres DSN (default: $LONNYMQ_BENCH_DSN, else %(default)s)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per row (default 3)")
    p.add_argument(
        "--only",
        action="append",
        choices=SCENARIOS,
        help="run only this scenario (repeatable; default all but held)",
    )
    p.add_argument("--quick", action="store_true", help="small counts everywhere (a smoke run)")
    p.add_argument("--workers", type=int, default=4, help="producers/consumers of the multi runs")
    for name, (default, quick) in COUNTS.items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"default {default:,} ({quick:,} with --quick)",
        )
    p.add_argument("--held-rate", type=float, default=1500.0, help="held producer msgs/s")
    p.add_argument(
        "--held-max-seconds",
        type=float,
        default=None,
        help="time limit of a held flow (default 3 x messages / rate + 60)",
    )
    p.add_argument(
        "--max-run-seconds",
        type=float,
        default=60.0,
        help="stop a run after this long and measure what it handled (default 60)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=10.0,
        help="stop a run when no message was handed out for this long (default 10)",
    )
    p.add_argument(
        "--output", type=Path, default=RESULTS_DIR / "hot_path.json", help="JSON results file"
    )
    p.add_argument(
        "--chart", type=Path, default=RESULTS_DIR / "hot_path.png", help="ratio chart (PNG)"
    )
    args = p.parse_args(argv)
    for name, (default, quick) in COUNTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    for name in ("repeat", "workers", *COUNTS):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch_size > 10_000:
        p.error("--batch-size must be at most 10000")
    if args.held_rate <= 0 or args.max_run_seconds <= 0 or args.stall_seconds <= 0:
        p.error("--held-rate, --max-run-seconds and --stall-seconds must be positive")
    if args.only:
        args.only = list(dict.fromkeys(args.only))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    code = provenance()
    bench = Bench(args)
    started = time.perf_counter()
    load_start = os.getloadavg()
    entries: list[dict[str, Any]] = []
    try:
        bench.install()
        server = server_info(bench.admin)
        selected = args.only or list(DEFAULT_SCENARIOS)
        if "batch" in selected:
            bench.install_pgqueuer()
            if not bench.pgq.get("available"):
                print(f"pgqueuer not measured: {bench.pgq.get('error')}", flush=True)
        plans = build_plans(args, bench)
        print(f"schema {bench.schema}; {server['version']}")
        print(
            f"fsync={server['fsync']} synchronous_commit={server['synchronous_commit']} "
            f"autovacuum={server['autovacuum']}; {os.cpu_count()} CPUs; load "
            f"{load_start[0]:.1f}; scenarios {', '.join(p.name for p in plans)} "
            f"x {args.repeat} runs",
            flush=True,
        )
        for plan in plans:
            entries.append(run_plan(bench, plan))
    finally:
        bench.drop()
    total_s = time.perf_counter() - started
    print_tables(entries)
    print(f"\ntotal benchmark time {total_s:.0f}s")
    report = {
        "benchmark": "bench_hot_path",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "lonnymq_version": lonnymq.__version__,
        "code": code,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "server": server,
        "autovacuum_on": server.get("autovacuum") == "on",
        "pgqueuer": bench.pgq,
        "settings": {
            "repeat": args.repeat,
            "quick": args.quick,
            "only": args.only or list(DEFAULT_SCENARIOS),
            "workers": args.workers,
            **{name: getattr(args, name) for name in COUNTS},
            "held_rate": args.held_rate,
            "held_max_seconds": args.held_max_seconds,
            "max_run_seconds": args.max_run_seconds,
            "stall_seconds": args.stall_seconds,
            "payload_bytes": PAYLOAD_BYTES,
            "lock_ms": LOCK_MS,
            "consumers_synchronous_commit": "off",
        },
        "total_seconds": total_s,
        "results": entries,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"results written to {args.output}")
    if write_chart(entries, args.chart):
        print(f"chart written to {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
