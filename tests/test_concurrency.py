"""Concurrency: many consumers and producers, each with its own connection (threads, and
processes started with multiprocessing 'spawn'), against the real Postgres.

Each test asserts on real observations: which message ids were delivered and how often, when
consumers held them (a hold interval runs from the return of dequeue to the call of delete,
so it lies inside the real lock interval), what a separate observer connection sees while
the workers run, and the counters left in the channel rows.

Worker connections use ``synchronous_commit=off``: commits do not wait for the WAL flush, which
keeps the tests fast; locking and visibility are unchanged.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import ChannelFull, Created, Deduplicated, Outcome
from tests import invariants

Conn = psycopg.Connection[Any]
Connect = Callable[..., Conn]
T = TypeVar("T")

LOCK_MS = 60_000  # far longer than any test: no lock expires, so no redelivery is legitimate
DEADLINE_S = 30.0  # a worker gives up (and its test fails) after this long
FAST = "-c synchronous_commit=off"


# --------------------------------------------------------------------------------------------
# Helpers


class Delivery(NamedTuple):
    """One message handled by a consumer. Times are time.monotonic() (system-wide on Linux,
    so comparable across processes): ``called`` before the dequeue call, ``start`` after it
    returned, ``end`` before the delete call."""

    id: int
    channel: str
    attempts: int
    called: float
    start: float
    end: float


@dataclass
class Report:
    """What a consumer did: the messages it handled, and the database errors it met and
    retried (a failed call's transaction is rolled back, so retrying is safe)."""

    deliveries: list[Delivery]
    errors: list[str]


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def run_concurrently(workers: Sequence[Callable[[], T]], timeout: float = 60.0) -> list[T]:
    """Run each worker in its own thread; their results in order (the first exception is
    re-raised)."""
    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        futures = [pool.submit(worker) for worker in workers]
        return [future.result(timeout=timeout) for future in futures]


def max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The largest number of intervals open at the same instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        current += step
        peak = max(peak, current)
    return peak


def ident(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def counter_mismatches(conn: Conn, schema: str) -> list[tuple[Any, ...]]:
    """Violations of the schema's invariants (counts, gauges, positions: tests/invariants.py),
    in one statement, so one snapshot: they must hold in every snapshot, not only at rest."""
    return invariants.mismatches(conn, schema)


def message_ids(conn: Conn, schema: str) -> list[int]:
    rows = conn.execute(
        sql.SQL("SELECT id FROM {} ORDER BY id").format(ident(schema, "message"))
    ).fetchall()
    return [int(r[0]) for r in rows]


def created_id(result: lonnymq.CreateResult) -> int:
    assert isinstance(result, Created), result
    return result.id


def consume(
    conn: Conn,
    queue: lonnymq.Queue,
    *,
    hold_s: dict[str, float] | None = None,
    limit: int = 1,
    start: threading.Barrier | multiprocessing.synchronize.Barrier | None = None,
    stop: Callable[[], bool] | None = None,
    abort: threading.Event | None = None,
) -> Report:
    """Dequeue, hold the messages ``hold_s[channel]`` seconds, delete them; until the queue
    is empty (no message at all, held ones included) and ``stop()`` agrees. Database errors
    are recorded and retried; with ``abort``, the first one also stops every consumer
    sharing it."""
    if start is not None:
        start.wait()
    report = Report([], [])
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if abort is not None and abort.is_set():
            return report
        called = time.monotonic()
        try:
            result = queue.dequeue(conn, limit=limit, lock_ms=LOCK_MS)
        except lonnymq.DatabaseError as exc:
            report.errors.append(first_line(exc))
            if abort is not None:
                abort.set()
            continue
        if not result:
            if (stop is None or stop()) and queue.stats(conn, count_ready=False).total == 0:
                return report
            time.sleep(0.001)
            continue
        begin = time.monotonic()
        for message in result.messages:
            hold = (hold_s or {}).get(message.channel, 0.0)
            if hold:
                time.sleep(hold)
        end = time.monotonic()
        for message in result.messages:
            outcome: Outcome | None = None
            for _ in range(10):
                try:
                    outcome = message.delete(conn)
                    break
                except lonnymq.DatabaseError as exc:
                    report.errors.append(first_line(exc))
                    if abort is not None:
                        abort.set()
            assert outcome is Outcome.OK, (message.id, outcome, report.errors)
            report.deliveries.append(
                Delivery(message.id, message.channel, message.attempts, called, begin, end)
            )
    raise AssertionError(f"consumer still running after {DEADLINE_S}s")


def _consume_in_process(
    dsn: str,
    schema: str,
    queue_name: str,
    hold_s: dict[str, float],
    threads: int,
    may_stop: multiprocessing.synchronize.Event,
    start: multiprocessing.synchronize.Barrier,
    out: multiprocessing.queues.Queue[Any],
) -> None:
    """Entry point of a consumer process (module level, for 'spawn'): ``threads`` consumers,
    each with its own connection, start once every process is ready and stop, once the queue
    is empty, if ``may_stop`` is set."""
    try:
        conns = [psycopg.connect(dsn, autocommit=True, options=FAST) for _ in range(threads)]
        try:
            queue = lonnymq.Broker(schema).queue(queue_name)
            start.wait()
            reports = run_concurrently(
                [partial(consume, c, queue, hold_s=hold_s, stop=may_stop.is_set) for c in conns]
            )
            out.put(("ok", reports))
        finally:
            for conn in conns:
                conn.close()
    except BaseException as exc:
        out.put(("error", repr(exc)))


def _install_in_process(
    dsn: str,
    schema: str,
    start: multiprocessing.synchronize.Barrier,
    out: multiprocessing.queues.Queue[Any],
) -> None:
    """Entry point of an installer process (module level, for 'spawn')."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            start.wait()
            out.put(("ok", lonnymq.install(conn, schema)))
    except BaseException as exc:
        out.put(("error", repr(exc)))


def run_processes(
    target: Callable[..., None],
    args_for: Callable[[multiprocessing.synchronize.Barrier, Any], tuple[Any, ...]],
    n: int,
) -> list[Any]:
    """Run ``target(*args_for(barrier, out))`` in ``n`` spawned processes, which all wait at
    ``barrier`` before working; returns what each put on ``out``."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n, timeout=60)
    out: multiprocessing.queues.Queue[Any] = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_for(barrier, out)) for _ in range(n)]
    for proc in procs:
        proc.start()
    results: list[Any] = []
    try:
        for _ in range(n):
            status, value = out.get(timeout=90)
            assert status == "ok", f"worker process failed: {value}"
            results.append(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [proc.exitcode for proc in procs] == [0] * n
    return results


class Sampler:
    """A background thread running ``probe`` on its own connection in a loop."""

    def __init__(self, conn: Conn, probe: Callable[[Conn], None]) -> None:
        self.samples = 0
        self._conn = conn
        self._probe = probe
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._probe(self._conn)
                self.samples += 1
        except BaseException as exc:
            self._error = exc

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._error is not None:
            raise self._error


# --------------------------------------------------------------------------------------------
# 1. max_concurrency under 8 concurrent consumers


@pytest.mark.parametrize("workers", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_max_concurrency_holds_under_concurrent_consumers(
    workers: str, broker: lonnymq.Broker, connect: Connect, pg_dsn: str
) -> None:
    """8 consumers (limit=1) drain a channel limited to 2 in flight (12 messages held 100 ms
    each) and an unlimited one (96 messages held 5 ms each, published once the limited channel
    is seen saturated), while an observer counts the limited channel's locked messages."""
    schema = broker.schema
    queue = broker.queue("default")
    conn = connect()
    queue.channel("limited").policy.set(conn, max_concurrency=2)
    batch = queue.batch()
    pending_limited = [batch.channel("limited").message(f"l{i}") for i in range(12)]
    batch.execute(conn)
    limited_ids = sorted(created_id(p.get()) for p in pending_limited)
    free_ids: list[int] = []
    locked_sql = sql.SQL(
        "SELECT count(*) FROM {} WHERE locked_until IS NOT NULL AND queue = %s AND channel = %s"
    ).format(ident(schema, "message"))
    sampled: list[int] = []
    saturated = threading.Event()
    may_stop = multiprocessing.get_context("spawn").Event()

    def probe(c: Conn) -> None:
        row = c.execute(locked_sql, ("default", "limited")).fetchone()
        assert row is not None
        sampled.append(int(row[0]))
        if row[0] >= 2:
            saturated.set()

    def publish_free() -> None:
        # The free channel's messages arrive while both slots of the limited channel are held
        # (for about 600 ms: 6 rounds of 2), so whatever the machine's load, the consumers have
        # both channels to choose from while the limited one is full; the consumers may stop
        # only once they are in.
        try:
            assert saturated.wait(30), sampled
            free = queue.batch()
            pending_free = [free.channel("free").message(f"f{i}") for i in range(96)]
            free.execute(connect())
            free_ids.extend(sorted(created_id(p.get()) for p in pending_free))
        finally:
            may_stop.set()

    hold_s = {"limited": 0.1, "free": 0.005}
    n = 8  # consumers: 8 threads, or 4 processes of 2 threads
    with Sampler(connect(), probe) as sampler:
        publisher = ThreadPoolExecutor(max_workers=1)
        published = publisher.submit(publish_free)
        try:
            if workers == "threads":
                barrier = threading.Barrier(n, timeout=30)
                reports: list[Report] = run_concurrently(
                    [
                        partial(
                            consume,
                            connect(options=FAST),
                            queue,
                            hold_s=hold_s,
                            start=barrier,
                            stop=may_stop.is_set,
                        )
                        for _ in range(n)
                    ]
                )
            else:
                per_process: list[list[Report]] = run_processes(
                    _consume_in_process,
                    lambda barrier, out: (
                        pg_dsn,
                        schema,
                        "default",
                        hold_s,
                        2,
                        may_stop,
                        barrier,
                        out,
                    ),
                    n // 2,
                )
                reports = [r for rs in per_process for r in rs]
        finally:
            may_stop.set()
            publisher.shutdown()
        published.result()
    assert len(reports) == n
    assert [e for r in reports for e in r.errors] == []  # no deadlock, no failed call
    deliveries = [d for r in reports for d in r.deliveries]
    limited = [d for d in deliveries if d.channel == "limited"]
    free = [d for d in deliveries if d.channel == "free"]

    # every message delivered exactly once, never redelivered
    assert sorted(d.id for d in limited) == limited_ids
    assert sorted(d.id for d in free) == free_ids
    assert {d.attempts for d in deliveries} == {1}
    # never more than 2 messages of the limited channel locked at once, seen from outside ...
    assert sampler.samples >= 10
    assert max(sampled) <= 2, Counter(sampled)
    # ... and from the consumers' hold intervals
    limited_spans = [(d.start, d.end) for d in limited]
    assert max_overlap(limited_spans) <= 2
    # the limit was reached, so the checks above could have failed
    assert max(max(sampled), max_overlap(limited_spans)) == 2
    # the unlimited channel was not held back: messages of it were dequeued by calls made
    # entirely while both slots of the limited channel were held
    served_while_saturated = [
        f for f in free if sum(1 for d in limited if d.start <= f.called and f.start <= d.end) >= 2
    ]
    t0 = min(d.called for d in deliveries)
    assert len(served_while_saturated) >= 10, (
        len(served_while_saturated),
        sorted(
            (round(d.called - t0, 3), round(d.start - t0, 3), round(d.end - t0, 3)) for d in limited
        ),
        sorted((round(d.called - t0, 3), round(d.start - t0, 3)) for d in free),
    )
    assert counter_mismatches(conn, schema) == []
    assert queue.stats(conn).total == 0


# --------------------------------------------------------------------------------------------
# 1b. A dequeue waiting for a busy channel does not deadlock


def wait_blocked_by(observer: Conn, waiter: Conn, blockers: Sequence[Conn]) -> None:
    """Wait until ``waiter``'s backend is blocked by one of ``blockers``' backends."""
    pids = {c.info.backend_pid for c in blockers}
    deadline = time.monotonic() + 10
    while True:
        row = observer.execute("SELECT pg_blocking_pids(%s)", (waiter.info.backend_pid,)).fetchone()
        if row is not None and pids & set(row[0]):
            return
        assert time.monotonic() < deadline, f"not blocked by {pids}: {row}"
        time.sleep(0.005)


def test_waiting_dequeue_does_not_deadlock_with_batch(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """Channels a and b have a max_size, so their producers take turns on their rows: two
    open producer transactions hold them while a batch takes a and waits for b. A dequeue
    meanwhile waits for none of them (it takes no lock a producer holds) and gets the ready
    messages at once (version 4 answered "nothing now, retry at once" here); once the holders
    commit, the batch goes through, and nobody deadlocks."""
    queue = broker.queue("default")
    observer = connect()
    for name in ("a", "b"):
        queue.channel(name).policy.set(observer, max_size=100)
    queue.channel("b").message.create(observer, b"b1")  # b has waited longest
    queue.channel("a").message.create(observer, b"a1")
    holds_b = connect(autocommit=False)
    queue.channel("b").message.create(holds_b, b"b0")
    holds_a = connect(autocommit=False)
    queue.channel("a").message.create(holds_a, b"a2")
    consumer, producer = connect(), connect()
    batch = queue.batch()
    batch.channel("a").message(b"a3")
    batch.channel("b").message(b"b2")
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            batched = pool.submit(batch.execute, producer)
            wait_blocked_by(observer, producer, [holds_a])  # the batch waits for a
            start = time.monotonic()
            got = queue.dequeue(consumer, limit=10, lock_ms=LOCK_MS)
            assert time.monotonic() - start < 2.0  # never stuck behind a lock
            assert [(m.channel, m.content) for m in got.messages] == [("b", b"b1"), ("a", b"a1")]
            holds_a.commit()
            wait_blocked_by(observer, producer, [holds_b])  # has a, waits for b
            holds_b.commit()
            results = batched.result(timeout=30)
        finally:  # if the scenario went wrong, do not leave the workers blocked
            holds_a.rollback()
            holds_b.rollback()
    assert all(isinstance(r, Created) for r in results)
    rest = queue.dequeue(consumer, limit=10, lock_ms=LOCK_MS).messages
    assert sorted(m.content for m in rest) == [b"a2", b"a3", b"b0", b"b2"]


def test_a_dequeue_passes_lanes_whose_heads_another_call_holds(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """Lanes a, b, c and d hold one message each, in that turn order. A consumer's dequeue
    takes a's and b's and stays open (its lanes not written yet); other consumers' dequeues
    find those heads held and take c's, then d's, instead of answering "nothing" while a
    message waits (for one message, the usual call, and for two); one more, with nothing
    left that is not held, answers "nothing"."""
    queue = broker.queue("default")
    conn = connect()
    for name in ("a", "b", "c", "d"):
        queue.channel(name).message.create(conn, name.encode())
    # (ingested, and committed: the lanes are not those of the open transaction's ingest)
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY['default'], true, false)").format(
            sql.Identifier(broker.schema)
        )
    )
    first = connect(autocommit=False)
    taken = queue.dequeue(first, limit=2, lock_ms=LOCK_MS, listen=False).messages
    assert [m.channel for m in taken] == ["a", "b"]
    try:
        for limit, expected in ((1, b"c"), (2, b"d")):
            start = time.monotonic()
            got = queue.dequeue(connect(), limit=limit, lock_ms=LOCK_MS, listen=False)
            assert time.monotonic() - start < 2.0
            assert [m.content for m in got.messages] == [expected], limit
        assert not queue.dequeue(connect(), limit=1, lock_ms=LOCK_MS, listen=False).messages
    finally:
        first.rollback()


# --------------------------------------------------------------------------------------------
# 2. Exactly once with many consumers and producers, exact counters


@pytest.mark.parametrize(
    ("channels", "per_producer"), [(1, 400), pytest.param(40, 1200, marks=pytest.mark.slow)]
)
def test_exactly_once_and_exact_counters(
    channels: int, per_producer: int, broker: lonnymq.Broker, connect: Connect
) -> None:
    """2 producers (batches) and 6 consumers (limit 1, 2 or 3) run at once; an observer checks
    the counters against the messages in every snapshot it takes.

    Database errors are retried (a failed batch or call is rolled back as a whole), as real
    workers would: they are not this test's subject (see
    test_waiting_dequeue_does_not_deadlock_with_batch)."""
    schema = broker.schema
    queue = broker.queue("default")
    setup = connect()
    names = [f"ch{i:02d}" for i in range(channels)]
    limited = set(names[::5]) if channels > 1 else set()
    for name in limited:
        queue.channel(name).policy.set(setup, max_concurrency=2)

    batch_size, n_producers, n_consumers = 40, 2, 6
    producers_left = [n_producers]
    producers_lock = threading.Lock()

    def done_producing() -> bool:
        with producers_lock:
            return producers_left[0] == 0

    def produce(conn: Conn, seed: int) -> list[int]:
        rng = random.Random(seed)
        ids: list[int] = []
        try:
            for start in range(0, per_producer, batch_size):
                plan = [(rng.choice(names), rng.choice([0, 0, 0, 5])) for _ in range(batch_size)]
                for _ in range(10):
                    batch = queue.batch()
                    pending = [
                        batch.channel(name).message(f"{seed}-{start + i}", priority=priority)
                        for i, (name, priority) in enumerate(plan)
                    ]
                    try:
                        batch.execute(conn)
                        break
                    except lonnymq.DatabaseError:
                        continue
                else:
                    raise AssertionError("a batch failed 10 times in a row")
                ids.extend(created_id(p.get()) for p in pending)
        finally:
            with producers_lock:
                producers_left[0] -= 1
        return ids

    mismatches: list[list[tuple[Any, ...]]] = []

    def probe(c: Conn) -> None:
        found = counter_mismatches(c, schema)
        if found:
            mismatches.append(found)
        time.sleep(0.005)

    workers: list[Callable[[], Any]] = [
        partial(produce, connect(options=FAST), i) for i in range(n_producers)
    ]
    workers += [
        partial(consume, connect(options=FAST), queue, limit=1 + i % 3, stop=done_producing)
        for i in range(n_consumers)
    ]
    with Sampler(connect(), probe) as sampler:
        results = run_concurrently(workers)
    created = sorted(i for ids in results[:n_producers] for i in ids)
    reports: list[Report] = results[n_producers:]
    assert [e for r in reports for e in r.errors] == []  # no deadlock, no failed call
    deliveries = [d for r in reports for d in r.deliveries]

    assert len(created) == n_producers * per_producer
    delivered = [d.id for d in deliveries]
    assert [i for i, k in Counter(delivered).items() if k > 1] == []  # no id twice
    assert sorted(delivered) == created  # every one
    assert {d.attempts for d in deliveries} == {1}
    assert sampler.samples > 0
    assert mismatches == []
    # at rest: empty, exact counters, empty channels without a policy gone
    assert message_ids(setup, schema) == []
    assert counter_mismatches(setup, schema) == []
    stats = queue.stats(setup)
    assert (stats.total, stats.in_flight, stats.ready, stats.delayed) == (0, 0, 0, 0)
    rows = setup.execute(
        sql.SQL(
            "SELECT name, has_policy, current_size, current_concurrency FROM {} ORDER BY name"
        ).format(ident(schema, "channel"))
    ).fetchall()
    assert rows == [(name, True, 0, 0) for name in sorted(limited)]


# --------------------------------------------------------------------------------------------
# 3. No "empty" answer while messages are ready


def test_no_false_empty_while_messages_are_ready(broker: lonnymq.Broker, connect: Connect) -> None:
    """4 consumers drain a channel of 600 messages; a dequeue that answers "empty" while
    messages are ready sends a real consumer to sleep. Fewer than 1 in 20 may."""
    queue = broker.queue("default")
    conn = connect()
    n = 600
    batch = queue.batch()
    for i in range(n):
        batch.channel("only").message(f"m{i}")
    batch.execute(conn)

    lock = threading.Lock()
    dequeued = [0]
    barrier = threading.Barrier(4, timeout=30)

    def consumer(c: Conn) -> tuple[int, int]:
        """(messages handled, empty answers while a message was ready)."""
        handled = false_empty = 0
        barrier.wait()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            result = queue.dequeue(c, limit=1, lock_ms=LOCK_MS)
            if result:
                with lock:
                    dequeued[0] += 1
                assert result.messages[0].delete(c) is Outcome.OK
                handled += 1
                continue
            with lock:
                left = n - dequeued[0]
            if left == 0:
                return handled, false_empty
            # Messages are only removed after being dequeued, so ``left`` messages were not
            # locked during the whole call (give or take the few dequeued by others and not
            # counted yet, which only happens at the very end).
            false_empty += 1
        raise AssertionError("consumer did not finish")

    results = run_concurrently([partial(consumer, connect(options=FAST)) for _ in range(4)])
    assert sum(h for h, _ in results) == n
    false_empty = sum(f for _, f in results)
    assert false_empty < n / 20, f"{false_empty} empty answers while messages were ready"


# --------------------------------------------------------------------------------------------
# 4. Concurrent batches do not deadlock


def test_concurrent_batches_do_not_deadlock(broker: lonnymq.Broker, connect: Connect) -> None:
    """6 threads each run 12 transactions: a batch creating messages in the same 20 channels
    (in shuffled order) with some channel and queue policy changes, then a create in a channel
    of their own."""
    schema = broker.schema
    queue = broker.queue("default")
    channels = [f"c{i:02d}" for i in range(20)]
    n_threads, n_batches = 6, 12

    def producer(seed: int) -> list[int]:
        rng = random.Random(seed)
        # half the producers: an autocommit connection and conn.transaction(); the others:
        # a connection in a transaction and commit()
        autocommit = seed % 2 == 0
        conn = connect(autocommit=autocommit, options=FAST)
        own = queue.channel(f"zz-own-{seed}")
        ids: list[int] = []
        for k in range(n_batches):
            batch = broker.batch()
            pending = []
            order = channels[:]
            rng.shuffle(order)
            for name in order:
                ch = batch.queue("default").channel(name)
                if rng.random() < 0.3:
                    ch.policy.set(max_concurrency=rng.randint(1, 5))
                for j in range(rng.randint(1, 2)):
                    pending.append(ch.message(f"{seed}-{k}-{j}", name=f"{seed}-{k}-{j}"))
            if rng.random() < 0.2:
                batch.queue("default").policy.set(max_concurrency=rng.randint(2, 6))
            if autocommit:
                with conn.transaction():
                    batch.execute(conn)
                    extra = own.message.create(conn, b"extra")
            else:
                batch.execute(conn)
                extra = own.message.create(conn, b"extra")
                conn.commit()
            ids.extend(created_id(p.get()) for p in pending)
            ids.append(created_id(extra))
        return ids

    results = run_concurrently([partial(producer, s) for s in range(n_threads)])
    created = sorted(i for ids in results for i in ids)  # a DeadlockDetected is raised above
    assert len(created) == len(set(created))
    conn = connect()
    assert message_ids(conn, schema) == created  # every message of every batch, no other
    assert counter_mismatches(conn, schema) == []
    assert queue.stats(conn).total == len(created)


# --------------------------------------------------------------------------------------------
# 5. Concurrent installs


@pytest.mark.parametrize("workers", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_concurrent_installs(workers: str, schema: str, connect: Connect, pg_dsn: str) -> None:
    """8 threads or 8 spawned processes install the same fresh schema at once."""
    n = 8
    if workers == "threads":
        barrier = threading.Barrier(n, timeout=30)

        def install(c: Conn) -> list[str]:
            barrier.wait()
            return lonnymq.install(c, schema)

        applied = run_concurrently([partial(install, connect()) for _ in range(n)])
    else:
        applied = run_processes(
            _install_in_process, lambda barrier, out: (pg_dsn, schema, barrier, out), n
        )
    every = [name for name, _ in lonnymq.migrations(schema)]
    assert sorted(applied, key=len) == [[]] * (n - 1) + [every]  # one installed, once
    conn = connect()
    rows = conn.execute(
        sql.SQL("SELECT version, count(*) FROM {} GROUP BY version ORDER BY version").format(
            ident(schema, "migration")
        )
    ).fetchall()
    assert rows == [(v, 1) for v in range(1, lonnymq.CURRENT_VERSION + 1)]
    broker = lonnymq.Broker(schema)
    assert broker.check(conn) == lonnymq.CURRENT_VERSION
    broker.queue("q").channel("c").message.create(conn, b"works")
    assert [m.content for m in broker.dequeue(conn, ["q"]).messages] == [b"works"]


# --------------------------------------------------------------------------------------------
# 6. Concurrent de-duplicated creates


def test_concurrent_dedup_creates_one_message(broker: lonnymq.Broker, connect: Connect) -> None:
    """10 threads create a message of the same name in the same channel at once, 16 times
    over: in a new channel every other round (its row is created concurrently too), in an
    existing channel in the others; a new queue every 4 rounds."""
    schema = broker.schema
    n, rounds = 10, 16
    barrier = threading.Barrier(n, timeout=30)

    def creator(c: Conn, who: int) -> list[lonnymq.CreateResult]:
        results: list[lonnymq.CreateResult] = []
        try:
            for r in range(rounds):
                channel = broker.queue(f"q{r // 4}").channel(f"ch{r // 2}")
                barrier.wait()
                results.append(channel.message.create(c, f"{who}", name=f"job{r}"))
        except BaseException:
            barrier.abort()  # the others stop waiting
            raise
        return results

    per_thread = run_concurrently([partial(creator, connect(options=FAST), w) for w in range(n)])
    conn = connect()
    ids = []
    for r in range(rounds):
        outcomes = [results[r] for results in per_thread]
        created = [o for o in outcomes if isinstance(o, Created)]
        assert len(created) == 1, outcomes
        assert Counter(outcomes) == {created[0]: 1, Deduplicated(created[0].id): n - 1}
        ids.append(created[0].id)
    assert message_ids(conn, schema) == sorted(ids)
    assert counter_mismatches(conn, schema) == []


# --------------------------------------------------------------------------------------------
# 7. max_size under concurrent producers


def test_max_size_under_concurrent_producers(broker: lonnymq.Broker, connect: Connect) -> None:
    """6 threads each try to create 20 messages at once in a channel with max_size=50."""
    schema = broker.schema
    queue = broker.queue("default")
    conn = connect()
    queue.channel("t").policy.set(conn, max_size=50)
    n, each = 6, 20
    barrier = threading.Barrier(n, timeout=30)

    def producer(c: Conn) -> tuple[list[int], int]:
        barrier.wait()
        ids: list[int] = []
        full = 0
        for i in range(each):
            try:
                ids.append(created_id(queue.channel("t").message.create(c, f"{i}")))
            except ChannelFull:
                full += 1
        return ids, full

    results = run_concurrently([partial(producer, connect(options=FAST)) for _ in range(n)])
    created = sorted(i for ids, _ in results for i in ids)
    assert len(created) == 50
    assert sum(full for _, full in results) == n * each - 50
    assert message_ids(conn, schema) == created
    assert counter_mismatches(conn, schema) == []
    info = queue.channel("t").info(conn)
    assert (info.size, info.in_flight) == (50, 0)


# --------------------------------------------------------------------------------------------
# 8. Policy change on a live channel


@dataclass
class Poll:
    start: float
    end: float
    got: list[lonnymq.Message]


class Pollers:
    """Threads dequeuing (limit=1) in a loop, keeping what they get."""

    def __init__(self, queue: lonnymq.Queue, conns: list[Conn]) -> None:
        self._polls: list[Poll] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._queue = queue
        self._pool = ThreadPoolExecutor(max_workers=len(conns))
        self._futures = [self._pool.submit(self._run, c) for c in conns]

    def _run(self, conn: Conn) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            result = self._queue.dequeue(conn, limit=1, lock_ms=LOCK_MS)
            with self._lock:
                self._polls.append(Poll(start, time.monotonic(), result.messages))
            time.sleep(0.001)

    def polls(self) -> list[Poll]:
        with self._lock:
            return list(self._polls)

    def wait_polls_after(self, t: float, count: int) -> None:
        """Wait until ``count`` polls that started after ``t`` have returned."""
        deadline = time.monotonic() + 10
        while sum(1 for p in self.polls() if p.start > t) < count:
            assert time.monotonic() < deadline, "pollers stalled"
            time.sleep(0.002)

    def received(self) -> list[tuple[float, lonnymq.Message]]:
        return [(p.end, m) for p in self.polls() for m in p.got]

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result(timeout=10)
        self._pool.shutdown()


def test_policy_change_on_live_channel(broker: lonnymq.Broker, connect: Connect) -> None:
    """max_concurrency lowered below the messages in flight, then raised, while other
    connections poll, and one waits on the wake channel."""
    queue = broker.queue("default")
    channel = queue.channel("t")
    main = connect()
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(broker.wake_channel))
    listener = connect()
    listener.execute(listen)
    channel.policy.set(main, max_concurrency=4)
    for i in range(10):
        channel.message.create(main, f"m{i}")
    held = queue.dequeue(main, limit=10, lock_ms=LOCK_MS).messages
    assert len(held) == 4

    # Lowered to 2 with 4 in flight: 3 pollers get nothing until acks bring it below 2.
    channel.policy.set(main, max_concurrency=2)
    pollers = Pollers(queue, [connect() for _ in range(3)])
    try:
        for message in held[:2]:  # 4 -> 3 -> 2 in flight: still at the limit
            assert message.delete(main) is Outcome.OK
            pollers.wait_polls_after(time.monotonic(), 6)
        assert pollers.received() == []
        assert channel.info(main).in_flight == 2
        freeing = time.monotonic()
        assert held[2].delete(main) is Outcome.OK  # 1 in flight: one more may go
        deadline = time.monotonic() + 10
        while not pollers.received():
            assert time.monotonic() < deadline, "no delivery after in-flight fell below the limit"
            time.sleep(0.002)
        pollers.wait_polls_after(max(t for t, _ in pollers.received()), 6)
    finally:
        pollers.stop()
    got = pollers.received()
    assert len(got) == 1  # back at the limit of 2
    assert got[0][0] > freeing  # and not before the ack that made room
    assert channel.info(main).in_flight == 2

    # Raised to 5: a consumer waiting on the wake channel is woken and gets 5 - 2 messages.
    waiter_conn = connect()
    waiter_conn.execute(listen)
    ready = threading.Event()

    def waiter() -> tuple[list[str], list[lonnymq.Message]]:
        assert not queue.dequeue(waiter_conn, limit=10, lock_ms=LOCK_MS)
        ready.set()
        payloads: list[str] = []
        for notify in waiter_conn.notifies(timeout=10):
            payloads.append(notify.payload)
            if notify.payload == queue.name:
                break
        return payloads, queue.dequeue(waiter_conn, limit=10, lock_ms=LOCK_MS).messages

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(waiter)
        assert ready.wait(10)
        list(listener.notifies(timeout=0.2))  # drop what the creates and acks announced
        channel.policy.set(main, max_concurrency=5)
        payloads, woken = future.result(timeout=20)
    assert payloads[-1:] == [queue.name]
    assert len(woken) == 3
    announced = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert announced == [queue.name]
    assert channel.info(main).in_flight == 5
    assert not queue.dequeue(main, limit=10, lock_ms=LOCK_MS)  # at the new limit
