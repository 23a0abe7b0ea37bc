"""One busy channel scales like Postgres, and a held snapshot does not slow it down.

* A producer transaction left open (in a new queue and channel, through the API, a Kombu
  publish or a Celery ``delay`` inside ``lonnymq.transaction``) makes no other producer or
  consumer of that channel wait: their calls stay fast and no session waits for a lock.
* Producers of a channel with a max_size take turns until they commit: the others wait at most
  5 s, then get :class:`lonnymq.ChannelBusy`; nothing is lost.
* Eight producers and eight consumers on one channel: nothing lost, nothing delivered twice
  while locks hold, counters and invariants exact throughout.
* Batches are set-based (one SQL call for a run of creates).
* No position skips a message: late commits, higher priorities arriving later, requeues in
  their old place, delayed messages, lock expiry, many channels.
* Under a snapshot held by another session, a dequeue reads no more than it does without one.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import celery
import psycopg
import pytest
from kombu.connection import Connection as KombuConnection
from kombu.entity import Exchange
from kombu.entity import Queue as KombuQueue
from kombu.messaging import Producer
from psycopg import sql

import lonnymq
from lonnymq import ChannelBusy, Created, Outcome
from lonnymq.metrics import DatabaseCollector
from tests import invariants
from tests.apps import close_app
from tests.conftest import function_calls
from tests.test_cli import cli
from tests.test_plans import Recorder

Conn = psycopg.Connection[Any]
Connect = Callable[..., Conn]

#: How long the producer transaction of the first test stays open (the issue's figure).
OPEN_S = 10.0
#: What a call may take at p99 while another transaction is held open for 2 s. A call that
#: waited for that transaction would take about as long as it stays open; a dequeue may also
#: wait up to 50 ms, by design, for an ingest another consumer is running (lock_timeout), and
#: the machine is shared with the rest of the suite (p99 of 60-77 ms seen in full runs of it).
P99_MS = 200.0
#: Calls of each thread left out of its latencies: a session's first calls plan the
#: statements of the functions they run (tens of ms on a loaded machine), which is not a wait
#: for anyone. They still run while the observer watches for waits.
WARM_CALLS = 3


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


def waiting_sessions(observer: Conn, pids: set[int]) -> list[tuple[Any, ...]]:
    """Sessions of ``pids`` waiting for a lock, now: (pid, lock type, mode, blocking pids)."""
    rows = observer.execute(
        "SELECT pid, locktype, mode, pg_blocking_pids(pid) FROM pg_locks "
        "WHERE NOT granted AND pid = ANY (%s)",
        (list(pids),),
    ).fetchall()
    return [tuple(r) for r in rows]


class Traffic:
    """Producer and consumer threads on one (queue, channel), each on its own connection,
    recording every call's latency, while an observer samples pg_locks for waits."""

    def __init__(self, broker: lonnymq.Broker, connect: Connect, queue: str, channel: str):
        self.broker = broker
        self.queue = broker.queue(queue)
        self.channel = channel
        self.stop = threading.Event()
        self.create_latency: list[float] = []
        self.dequeue_latency: list[float] = []
        self.created: list[int] = []
        self.delivered: list[int] = []
        self.waits: list[tuple[Any, ...]] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.conns = [connect() for _ in range(4)]
        self.observer = connect()
        self.pids = {c.info.backend_pid for c in self.conns}
        #: more sessions to watch (set before running)
        self.extra: set[int] = set()
        self.threads = [
            threading.Thread(target=self._produce, args=(self.conns[0],)),
            threading.Thread(target=self._produce, args=(self.conns[1],)),
            threading.Thread(target=self._consume, args=(self.conns[2],)),
            threading.Thread(target=self._consume, args=(self.conns[3],)),
            threading.Thread(target=self._observe),
        ]

    def _produce(self, conn: Conn) -> None:
        try:
            n = 0
            while not self.stop.is_set():
                start = time.perf_counter()
                result = self.queue.channel(self.channel).message.create(conn, f"p{n}")
                if n >= WARM_CALLS:
                    self.create_latency.append(time.perf_counter() - start)
                assert isinstance(result, Created)
                with self.lock:
                    self.created.append(result.id)
                n += 1
                time.sleep(0.002)
        except BaseException as exc:
            self.errors.append(exc)

    def _consume(self, conn: Conn) -> None:
        try:
            held: list[lonnymq.Message] = []
            calls = 0
            while not self.stop.is_set() or held:
                start = time.perf_counter()
                result = self.queue.dequeue(conn, limit=1, lock_ms=60_000, ack=held)
                if calls >= WARM_CALLS:
                    self.dequeue_latency.append(time.perf_counter() - start)
                calls += 1
                assert set(result.acked.values()) <= {Outcome.OK}
                held = result.messages
                with self.lock:
                    self.delivered.extend(m.id for m in held)
                if not held:
                    time.sleep(0.002)
        except BaseException as exc:
            self.errors.append(exc)

    def _observe(self) -> None:
        try:
            while not self.stop.is_set():
                self.waits.extend(waiting_sessions(self.observer, self.pids | self.extra))
                time.sleep(0.01)
        except BaseException as exc:
            self.errors.append(exc)

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        for t in self.threads:
            t.start()
        try:
            yield self
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(30)

    def drain(self, conn: Conn) -> list[int]:
        """Whatever is still queued, delivered and acked now (ids)."""
        out = []
        while result := self.queue.dequeue(conn, limit=100, lock_ms=60_000):
            out += [m.id for m in result.messages]
            self.broker.delete_many(conn, result.messages)
        return out

    def check(self, holder: Conn | None = None) -> None:
        """No error; no session waited for the open transaction (``holder``); fast calls.
        (Other waits are a moment long: producers that NOTIFY sleeping consumers take turns
        at commit for Postgres's notification lock, and an ack can wait for the dequeue that
        locked its row while skipping it, as any FOR UPDATE SKIP LOCKED queue does.)"""
        assert self.errors == []
        if holder is not None:
            pid = holder.info.backend_pid
            assert [w for w in self.waits if pid in w[3]] == [], "waited for the open transaction"
        assert len(self.create_latency) > 50 and len(self.dequeue_latency) > 50
        assert p99(self.create_latency) < P99_MS, p99(self.create_latency)
        assert p99(self.dequeue_latency) < P99_MS, p99(self.dequeue_latency)


@pytest.mark.slow
def test_open_producer_transaction_blocks_no_other_producer_or_consumer(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """The issue's scenario: a producer transaction creates the first message of a new queue
    and channel and stays open 10 s while other sessions create into that channel and
    consume from it. Their p99 stays under 50 ms and none of them waits for a lock; the held
    message is delivered once its transaction commits."""
    holder = connect(autocommit=False)
    held = broker.queue("fresh").channel("X").message.create(holder, b"held back")
    assert isinstance(held, Created)
    traffic = Traffic(broker, connect, "fresh", "X")
    with traffic.running():
        time.sleep(OPEN_S)
        assert held.id not in traffic.delivered
        holder.commit()
        deadline = time.monotonic() + 10
        while held.id not in traffic.delivered and time.monotonic() < deadline:
            time.sleep(0.01)
    traffic.check(holder)
    rest = traffic.drain(connect())
    delivered = traffic.delivered + rest
    assert held.id in delivered
    assert [i for i, k in Counter(delivered).items() if k > 1] == []
    assert sorted(delivered) == sorted([*traffic.created, held.id])
    invariants.assert_consistent(connect(), broker.schema)


@pytest.mark.slow
def test_open_kombu_and_celery_transactions_block_no_one(
    broker: lonnymq.Broker, connect: Connect, pg_dsn: str
) -> None:
    """The same with a Kombu publish and a Celery ``delay`` inside ``lonnymq.transaction``:
    while each transaction is open, Kombu producers, Celery callers and consumers of the
    same queue and channel do not wait."""
    url = pg_dsn.replace("postgresql://", "lonnymq://", 1)
    options = {"schema": broker.schema}
    app = celery.Celery("hot_path", broker=url, set_as_current=False)
    app.conf.broker_transport_options = options
    app.conf.task_ignore_result = True

    @app.task(name="hot_path.noop")  # type: ignore[untyped-decorator]
    def noop(n: int) -> None:
        return None

    try:
        exchange = Exchange("", type="direct")
        with KombuConnection(url, transport_options=options) as kconn:
            producer = Producer(kconn.channel(), exchange=exchange)
            declared = KombuQueue("kq", exchange=exchange, routing_key="kq")
            producer.publish({"warm": 1}, routing_key="kq", declare=[declared])
            for name, enqueue, before in (
                ("kq", lambda: producer.publish({"n": 0}, routing_key="kq"), 1),
                ("celery", lambda: noop.delay(0), 0),
            ):
                caller = connect(autocommit=False)
                with lonnymq.transaction(caller):
                    enqueue()  # in the caller's open transaction, not committed
                traffic = Traffic(broker, connect, name, name)
                with traffic.running():
                    time.sleep(2.0)
                    traffic.check(caller)
                    caller.commit()
                traffic.check()
                # every message is delivered once: the traffic's, the one committed late and
                # the one published before
                delivered = traffic.delivered + traffic.drain(connect())
                assert [i for i, k in Counter(delivered).items() if k > 1] == []
                assert len(delivered) == len(traffic.created) + 1 + before
    finally:  # (also when a check fails: its connections are not left behind)
        close_app(app)


@pytest.mark.slow
def test_limited_channel_producers_take_turns_and_fail_fast(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """A channel with a max_size: its producers serialise on its count until they commit.
    Another producer waits at most 5 s for an open one, then gets ChannelBusy (nothing
    written); consumers of the channel, and producers of other channels, do not wait."""
    queue = broker.queue("default")
    queue.channel("limited").policy.set(connect(), max_size=100)
    queue.channel("limited").message.create(connect(), b"ready")
    holder = connect(autocommit=False)
    queue.channel("limited").message.create(holder, b"open")
    other = connect()
    start = time.monotonic()
    with pytest.raises(ChannelBusy, match="max_size"):
        queue.channel("limited").message.create(other, b"waits")
    assert 4.5 < time.monotonic() - start < 8
    # meanwhile: other channels and the consumers are not held
    start = time.monotonic()
    assert isinstance(queue.channel("free").message.create(other, b"f"), Created)
    got = queue.dequeue(other, limit=10, lock_ms=60_000).messages
    assert time.monotonic() - start < 1
    assert sorted(m.content for m in got) == [b"f", b"ready"]
    holder.commit()
    assert isinstance(queue.channel("limited").message.create(other, b"after"), Created)
    assert queue.channel("limited").info(other).size == 3  # ready (held), open, after
    invariants.assert_consistent(other, broker.schema)


def test_max_concurrency_channel_with_an_open_producer_blocks_no_one(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """A max_concurrency needs no count at create: an open producer transaction in such a
    channel holds nothing anyone waits for."""
    queue = broker.queue("default")
    queue.channel("c").policy.set(connect(), max_concurrency=1)
    holder = connect(autocommit=False)
    queue.channel("c").message.create(holder, b"open")
    other = connect()
    start = time.monotonic()
    queue.channel("c").message.create(other, b"a")
    queue.channel("c").message.create(other, b"b")
    [first] = queue.dequeue(other, limit=10, lock_ms=60_000).messages
    assert not queue.dequeue(other, limit=10, lock_ms=60_000)  # at its limit
    assert first.delete(other) is Outcome.OK
    [second] = queue.dequeue(other, limit=10, lock_ms=60_000).messages
    assert time.monotonic() - start < 1
    assert (first.content, second.content) == (b"a", b"b")
    holder.commit()
    assert second.delete(other) is Outcome.OK
    assert [m.content for m in queue.dequeue(other, lock_ms=60_000).messages] == [b"open"]


@pytest.mark.slow
def test_eight_producers_and_eight_consumers_on_one_channel(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """30 s of 8 producers and 8 consumers (prefetch 1 to 4, acks carried with the next
    dequeue) on one channel: every message delivered once, none twice while locks hold,
    invariants exact in every sample and at rest, counters exact."""
    queue = broker.queue("default")
    stop = threading.Event()
    created: list[int] = []
    delivered: list[int] = []
    errors: list[BaseException] = []
    samples: list[list[tuple[Any, ...]]] = []
    lock = threading.Lock()

    def produce(conn: Conn, i: int) -> None:
        try:
            n = 0
            while not stop.is_set():
                if n % 5 == 4:
                    batch = queue.batch()
                    pending = [batch.channel("busy").message(f"{i}-{n}-{k}") for k in range(10)]
                    batch.execute(conn)
                    ids = [p.get() for p in pending]
                else:
                    ids = [queue.channel("busy").message.create(conn, f"{i}-{n}")]
                with lock:
                    created.extend(r.id for r in ids if isinstance(r, Created))
                n += 1
        except BaseException as exc:
            errors.append(exc)

    def consume(conn: Conn, limit: int) -> None:
        try:
            held: list[lonnymq.Message] = []
            producing = True
            while producing or held:
                producing = not stop.is_set()
                result = queue.dequeue(conn, limit=limit, lock_ms=120_000, ack=held)
                assert set(result.acked.values()) <= {Outcome.OK}
                held = result.messages
                with lock:
                    delivered.extend(m.id for m in held)
        except BaseException as exc:
            errors.append(exc)

    def observe(conn: Conn) -> None:
        try:
            while not stop.is_set():
                found = invariants.mismatches(conn, broker.schema)
                if found:
                    samples.append(found)
                time.sleep(0.2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(connect(), i)) for i in range(8)]
    threads += [threading.Thread(target=consume, args=(connect(), 1 + i % 4)) for i in range(8)]
    threads.append(threading.Thread(target=observe, args=(connect(),)))
    for t in threads:
        t.start()
    time.sleep(30)
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == []
    conn = connect()
    while result := queue.dequeue(conn, limit=100, lock_ms=60_000):
        delivered.extend(m.id for m in result.messages)
        broker.delete_many(conn, result.messages)
    assert samples == []
    assert [i for i, k in Counter(delivered).items() if k > 1] == []
    assert sorted(delivered) == sorted(created)
    assert len(created) > 1000
    invariants.assert_consistent(conn, broker.schema)
    [status] = broker.status(conn)
    c = status.counters
    assert (c.enqueued, c.delivered, c.acked, c.redelivered) == (len(created),) * 3 + (0,)
    assert (status.total, status.in_flight) == (0, 0)


def test_batch_is_one_call_for_its_creates(broker: lonnymq.Broker, connect: Connect) -> None:
    """1,000 creates in a batch are one SQL call (no function call per message), in input
    order, de-duplicated by name within the batch too, alongside a channel with a max_size."""
    conn = connect()
    conn.execute("SET track_functions = 'all'")
    queue = broker.queue("default")
    queue.channel("small").policy.set(conn, max_size=2)
    batch = queue.batch()
    pending = [batch.channel(f"c{i % 10}").message(f"m{i}") for i in range(1000)]
    dup_first = batch.channel("d").message(b"1", name="same")
    dup_second = batch.channel("d").message(b"2", name="same")
    small = [batch.channel("small").message(f"s{i}") for i in range(3)]
    batch.execute(conn, raise_if_dropped=False)
    results = [p.get() for p in pending]
    ids = [r.id for r in results if isinstance(r, Created)]
    assert len(set(ids)) == 1000
    for c in range(10):  # in input order within each channel (its FIFO order)
        assert ids[c::10] == sorted(ids[c::10])
    first = dup_first.get()
    assert isinstance(first, Created) and dup_second.get() == lonnymq.Deduplicated(first.id)
    assert [type(p.get()).__name__ for p in small] == ["Created", "Created", "Dropped"]
    calls = function_calls(conn, broker.schema, lambda c: c.get("message_create_sized_v1") == 3)
    assert calls.get("message_create_many_v1") == 1
    assert calls.get("message_create_sized_v1") == 3  # only the limited channel's rows
    assert "message_create_v1" not in calls
    assert queue.stats(conn).total == 1003


# --------------------------------------------------------------------------------------------
# Positions never skip a message


def _drain(queue: lonnymq.Queue, conn: Conn, limit: int = 1) -> list[bytes]:
    out: list[bytes] = []
    while result := queue.dequeue(conn, limit=limit, lock_ms=60_000):
        out += [m.content for m in result.messages]
        for m in result.messages:
            assert m.delete(conn) is Outcome.OK
    return out


def test_a_late_commit_is_not_passed_over(broker: lonnymq.Broker, connect: Connect) -> None:
    """A message created early in a transaction that commits late sorts before messages
    consumed meanwhile (its due time is its create's): the lane's position has moved past
    it, and the ingest, which sees every commit, brings it back."""
    queue = broker.queue("default")
    conn = connect()
    late = connect(autocommit=False)
    queue.channel("a").message.create(late, b"late")
    for i in range(20):
        queue.channel("a").message.create(conn, f"m{i}")
    assert _drain(queue, conn) == [f"m{i}".encode() for i in range(20)]
    late.commit()
    assert _drain(queue, conn) == [b"late"]
    invariants.assert_consistent(conn, broker.schema)


def test_a_higher_priority_arriving_later_goes_first(broker: lonnymq.Broker, conn: Conn) -> None:
    """After the lane's position moved past five low-priority messages, a higher-priority
    one (which sorts before all of them) is the next delivered."""
    queue = broker.queue("default")
    for i in range(10):
        queue.channel("a").message.create(conn, f"low{i}")
    got = [queue.dequeue(conn, lock_ms=60_000).messages[0] for _ in range(5)]
    queue.channel("a").message.create(conn, b"urgent", priority=9)
    for m in got:
        assert m.delete(conn) is Outcome.OK
    assert _drain(queue, conn) == [b"urgent"] + [f"low{i}".encode() for i in range(5, 10)]
    invariants.assert_consistent(conn, broker.schema)


def test_priorities_delays_requeues_and_expired_locks_keep_their_places(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    """In one channel, after its position moved on: a higher priority arriving later, a
    message requeued in its old place, a delayed one falling due and a lock expiring are all
    delivered, in their order; the same in 50 channels."""
    for channels in (1, 50):
        queue = broker.queue(f"q{channels}")
        names = [f"c{i}" for i in range(channels)]
        for i in range(40):
            queue.channel(names[i % channels]).message.create(conn, f"m{i:02d}")
        # (due after the first drain below, however slow the machine: 1.5 s)
        queue.channel(names[0]).message.create(conn, b"delayed", delay_ms=1500)
        due = time.monotonic() + 1.5
        first = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
        lost = queue.dequeue(conn, limit=1, lock_ms=50).messages
        requeued = first[0]
        for m in first[1:]:
            assert m.delete(conn) is Outcome.OK
        assert requeued.defer(conn, delay_ms=None) is Outcome.OK  # back in its old place
        queue.channel(names[0]).message.create(conn, b"urgent", priority=9)
        time.sleep(0.1)  # the 50 ms lock expires
        got = _drain(queue, conn, limit=1)
        assert got.count(b"urgent") == 1 and got.count(requeued.content) == 1
        assert got.count(lost[0].content) == 1
        if channels == 1:
            assert got[:2] == [lost[0].content, b"urgent"]  # expired lock first, then priority
            assert got[2] == requeued.content  # its old place: before the later ones
        assert time.monotonic() < due, "the first drain took longer than the delay"
        time.sleep(due + 0.05 - time.monotonic())
        assert _drain(queue, conn) == [b"delayed"]
        expected = {f"m{i:02d}".encode() for i in range(40)} - {m.content for m in first[1:]}
        assert set(got) - {b"urgent"} == expected
        invariants.assert_consistent(conn, broker.schema)


def test_a_dequeue_never_returns_more_than_its_limit(broker: lonnymq.Broker, conn: Conn) -> None:
    """Lanes share what a call has left in rounded-up quotas: with channels of uneven
    lengths and limits that do not divide evenly, a dequeue still returns at most ``limit``
    messages, and every message exactly once."""
    queue = broker.queue("default")
    lengths = [1, 4, 2, 3, 1, 1, 5, 2, 1, 3, 1, 2, 4]
    expected = []
    for c, n in enumerate(lengths):
        for i in range(n):
            queue.channel(f"c{c:02d}").message.create(conn, f"c{c:02d}-{i}")
            expected.append(f"c{c:02d}-{i}".encode())
    got: list[bytes] = []
    limits = [7, 3, 10, 4, 6, 8, 5]
    for step in range(40):
        limit = limits[step % len(limits)]
        messages = queue.dequeue(conn, limit=limit, lock_ms=60_000).messages
        assert len(messages) <= limit, (limit, [m.content for m in messages])
        if not messages:
            break
        got.extend(m.content for m in messages)
        assert set(broker.delete_many(conn, messages).values()) == {Outcome.OK}
    assert sorted(got) == sorted(expected)
    invariants.assert_consistent(conn, broker.schema)


def _cycle_buffers(queue: lonnymq.Queue, conn: Conn, recorder: Recorder) -> int:
    recorder.take()
    [message] = queue.dequeue(conn, limit=1, lock_ms=60_000).messages
    assert message.delete(conn) is Outcome.OK
    plans = recorder.take()
    tops = [p for p in plans if "message_dequeue_v3(" in p.text or "message_delete_v1(" in p.text]
    assert len(tops) == 2
    return sum(p.buffers for p in tops)


@pytest.mark.parametrize("channels", [1, 100])
def test_a_held_snapshot_does_not_make_dequeues_walk_what_was_consumed(
    broker: lonnymq.Broker, connect: Connect, channels: int
) -> None:
    """Another session holds a snapshot (REPEATABLE READ, idle in transaction) while 3,000
    messages are consumed: no row can be vacuumed, yet a dequeue + ack touches about as many
    buffers after as before (a dequeue that read the index from its start would walk all
    3,000 dead entries)."""
    queue = broker.queue("default")
    conn = connect()
    batch = queue.batch()
    for i in range(4000):
        batch.channel(f"c{i % channels}").message(f"m{i}")
    batch.execute(conn)
    holder = connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute(sql.SQL("SELECT count(*) FROM {}.queue").format(sql.Identifier(broker.schema)))
    probe = connect()
    recorder = Recorder(probe)
    for _ in range(10):  # warm up
        _cycle_buffers(queue, probe, recorder)
    before = statistics.median(_cycle_buffers(queue, probe, recorder) for _ in range(20))
    held: list[lonnymq.Message] = []
    for _ in range(30):
        held = queue.dequeue(conn, limit=100, lock_ms=60_000, ack=held).messages
    broker.delete_many(conn, held)
    after = statistics.median(_cycle_buffers(queue, probe, recorder) for _ in range(20))
    holder.rollback()
    assert after <= 2 * before + 20, (before, after)
    invariants.assert_consistent(conn, broker.schema)


def _empty_cycle_buffers(queue: lonnymq.Queue, conn: Conn, recorder: Recorder) -> int:
    """One message through a channel that is empty before and after: create, dequeue, ack,
    and a dequeue that finds nothing (it ingests, and folds when a second has passed)."""
    recorder.take()
    queue.channel("solo").message.create(conn, b"x")
    # (the lock of the loop below, the default: a shorter one here made each ingest after its
    # ack walk the dead lock entries of all the loop's messages, a case of its own, noted on
    # the issue "The usual dequeue")
    [message] = queue.dequeue(conn, limit=1, listen=False).messages
    assert message.delete(conn) is Outcome.OK
    assert not queue.dequeue(conn, limit=1, listen=False).messages
    plans = recorder.take()
    names = ("message_create_v1(", "message_dequeue_v3(", "message_delete_v1(")
    tops = [p for p in plans if any(n in p.text for n in names)]
    assert len(tops) == 4
    return sum(p.buffers for p in tops)


@pytest.mark.slow
def test_a_held_snapshot_does_not_slow_a_channel_that_empties_all_the_time(
    broker: lonnymq.Broker, connect: Connect
) -> None:
    """A channel that empties after each message (a queue at half load), under a held
    snapshot, with the tables vacuumed now and then (as autovacuum would): its lane is not
    deleted and looked up again through every dead version at each fold, and rows of lane
    and channel_count are found by their whole key (after a VACUUM the planner served a lane
    delete by id from a whole read of lane_latest_idx: 3,300 buffers a call). A message's
    round trip touches about as many buffers after 2,000 of them as before."""
    queue = broker.queue("default")
    conn = connect()
    holder = connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute(sql.SQL("SELECT count(*) FROM {}.queue").format(sql.Identifier(broker.schema)))
    probe = connect()
    recorder = Recorder(probe)
    for _ in range(10):  # warm up
        _empty_cycle_buffers(queue, probe, recorder)
    before = statistics.median(_empty_cycle_buffers(queue, probe, recorder) for _ in range(20))
    started = time.monotonic()
    for i in range(2000):
        queue.channel("solo").message.create(conn, b"x")
        held = queue.dequeue(conn, limit=1, listen=False).messages
        broker.delete_many(conn, held)
        queue.dequeue(conn, limit=1, listen=False)
        if i % 500 == 499:
            for table in ("lane", "channel_count", "message", "discovery", "tally"):
                conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(broker.schema, table)))
    assert time.monotonic() - started > 1.0  # (some folds ran)
    after = statistics.median(_empty_cycle_buffers(queue, probe, recorder) for _ in range(20))
    holder.rollback()
    assert after <= 2 * before + 20, (before, after)
    invariants.assert_consistent(conn, broker.schema)


@pytest.mark.slow
def test_status_and_metrics_name_the_session_that_holds_a_snapshot(
    broker: lonnymq.Broker, connect: Connect, pg_dsn: str
) -> None:
    """`lonnymq status` warns when a session has held a snapshot for longer than
    --snapshot-warn, naming it (pid, application name, state, age); the metrics carry its
    age; a session in READ COMMITTED idle in its transaction holds none."""
    queue = broker.queue("default")
    queue.channel("a").message.create(connect(), b"x")
    idle = connect(autocommit=False, application_name="idle-read-committed")
    idle.execute("SELECT 1")
    assert "warning" not in cli("status", "--dsn", pg_dsn, "--schema", broker.schema).stdout
    holder = connect(autocommit=False, application_name="nightly-report")
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")
    time.sleep(1.1)
    pid = holder.info.backend_pid
    quiet = cli("status", "--dsn", pg_dsn, "--schema", broker.schema)
    assert "warning" not in quiet.stdout  # under the default 60 s
    loud = cli("status", "--dsn", pg_dsn, "--schema", broker.schema, "--snapshot-warn", "1")
    assert loud.returncode == 0, loud.stderr
    assert f"session pid {pid} (application 'nightly-report', state idle in transaction)" in (
        loud.stdout
    )
    as_json = cli(
        "status", "--json", "--dsn", pg_dsn, "--schema", broker.schema, "--snapshot-warn", "1"
    )
    assert f"session pid {pid}" in as_json.stderr and '"queue": "default"' in as_json.stdout
    [top] = broker.horizon(connect())
    assert (top.kind, top.pid, top.application_name) == ("session", pid, "nightly-report")
    assert top.age_s is not None and top.age_s >= 1
    collector = DatabaseCollector(pg_dsn, broker.schema)
    try:
        metrics = {m.name: m for m in collector.collect()}
    finally:
        collector.close()
    [sample] = metrics["lonnymq_oldest_snapshot_age_seconds"].samples
    assert sample.value >= 1
    holder.rollback()
    assert broker.horizon(connect()) == []
