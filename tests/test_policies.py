"""Fairness between channels, channel policies, queue defaults, purge, stats, wake-ups."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import ChannelFull, Created, Dropped, Outcome, Policy
from tests.invariants import assert_consistent
from tests.test_plans import functions_ran

Conn = psycopg.Connection[Any]


def drain(queue: lonnymq.Queue, conn: Conn, *, limit: int = 1) -> list[lonnymq.Message]:
    out: list[lonnymq.Message] = []
    while result := queue.dequeue(conn, limit=limit, lock_ms=60_000):
        for message in result.messages:
            out.append(message)
            message.delete(conn)
    return out


def test_fairness_small_channel_not_stuck_behind_backlog(queue: lonnymq.Queue, conn: Conn) -> None:
    batch = queue.batch()
    for i in range(1000):
        batch.channel("A").message(f"A{i}")
    batch.execute(conn)
    for i in range(10):
        queue.channel("B").message.create(conn, f"B{i}")
    first = []
    for _ in range(20):
        message = queue.dequeue(conn, limit=1).messages[0]
        first.append(message.channel)
        message.delete(conn)
    assert first.count("B") == 10
    # order within a channel is kept
    rest = drain(queue, conn, limit=50)
    assert [m.content for m in rest] == [f"A{i}".encode() for i in range(10, 1000)]


def test_fairness_in_one_batch_dequeue(queue: lonnymq.Queue, conn: Conn) -> None:
    for name, count in [("A", 300), ("B", 5), ("C", 5)]:
        batch = queue.batch()
        for i in range(count):
            batch.channel(name).message(f"{name}{i}")
        batch.execute(conn)
    got = queue.dequeue(conn, limit=30).messages
    assert len(got) == 30
    assert [m.channel for m in got[:3]] == ["A", "B", "C"]  # round-robin, oldest waiting first
    assert sum(m.channel == "B" for m in got) == 5
    assert sum(m.channel == "C" for m in got) == 5


def test_round_robin_over_many_channels(queue: lonnymq.Queue, conn: Conn) -> None:
    batch = queue.batch()
    for c in range(50):
        for i in range(4):
            batch.channel(f"c{c:02d}").message(f"{c}-{i}")
    batch.execute(conn)
    order = [m.channel for m in drain(queue, conn, limit=7)]
    # every channel gets its k-th turn before any channel gets its (k+1)-th
    seen: dict[str, int] = {}
    rounds = []
    for channel in order:
        seen[channel] = seen.get(channel, 0) + 1
        rounds.append(seen[channel])
    assert rounds == sorted(rounds)
    assert len(order) == 200


def test_max_size_refuses_and_frees(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_size=2)
    assert isinstance(ch.message.create(conn, b"1"), Created)
    assert isinstance(ch.message.create(conn, b"2"), Created)
    with pytest.raises(ChannelFull) as err:
        ch.message.create(conn, b"3")
    assert (err.value.queue, err.value.channel) == ("default", "a")
    assert ch.message.create(conn, b"3", raise_if_dropped=False) == Dropped("default", "a")
    assert queue.stats(conn).total == 2
    # in-flight messages still count against max_size
    held = queue.dequeue(conn, lock_ms=60_000).messages[0]
    with pytest.raises(ChannelFull):
        ch.message.create(conn, b"3")
    held.delete(conn)
    assert isinstance(ch.message.create(conn, b"3"), Created)
    # other channels are unaffected
    assert isinstance(queue.channel("b").message.create(conn, b"x"), Created)


def test_max_size_zero_refuses_everything(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("closed").policy.set(conn, max_size=0)
    with pytest.raises(ChannelFull):
        queue.channel("closed").message.create(conn, b"x")


def test_dropped_create_leaves_no_channel_behind(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.policy.set(conn, max_size=0)
    with pytest.raises(ChannelFull):
        queue.channel("new").message.create(conn, b"x")
    count = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.channel").format(sql.Identifier(queue.schema))
    ).fetchone()
    assert count == (0,)


def test_max_concurrency_limits_deliveries(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=2)
    for i in range(5):
        ch.message.create(conn, f"a{i}")
    queue.channel("b").message.create(conn, b"b0")
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sorted(m.content for m in got) == [b"a0", b"a1", b"b0"]
    assert not queue.dequeue(conn, limit=10)
    got[0].delete(conn)
    again = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert [m.content for m in again] == [b"a2"]
    # a defer frees the slot too; the deferred message is due now, after a3 (due earlier)
    again[0].defer(conn)
    assert [m.content for m in queue.dequeue(conn, limit=10).messages] == [b"a3"]


def test_expired_lock_redelivered_even_at_max_concurrency(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=1)
    ch.message.create(conn, b"1")
    ch.message.create(conn, b"2")
    lost = queue.dequeue(conn, lock_ms=100).messages[0]
    assert not queue.dequeue(conn)
    time.sleep(0.15)
    again = queue.dequeue(conn, limit=5, lock_ms=60_000).messages
    assert [(m.id, m.attempts) for m in again] == [(lost.id, 2)]  # the slot it already had
    assert again[0].delete(conn)
    assert [m.content for m in queue.dequeue(conn, limit=5).messages] == [b"2"]


def test_queue_default_policy_and_channel_override(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.policy.set(conn, max_concurrency=1, max_size=3)
    assert queue.policy.get(conn) == Policy(1, 3)
    for c in "ab":
        for i in range(3):
            queue.channel(c).message.create(conn, f"{c}{i}")
        with pytest.raises(ChannelFull):
            queue.channel(c).message.create(conn, b"over")
    queue.channel("b").policy.set(conn, max_concurrency=None, max_size=None)
    queue.channel("b").message.create(conn, b"b3")
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sorted(m.content for m in got) == [b"a0", b"b0", b"b1", b"b2", b"b3"]
    info = queue.channel("b").info(conn)
    assert info.own == Policy(None, None) and info.default == Policy(1, 3)
    queue.channel("b").policy.clear(conn)
    assert queue.channel("b").info(conn).own is None
    assert queue.channel("b").info(conn).effective == Policy(1, 3)


def test_queue_default_change_applies_to_live_channels(queue: lonnymq.Queue, conn: Conn) -> None:
    for c in "abc":
        for i in range(3):
            queue.channel(c).message.create(conn, f"{c}{i}")
    queue.policy.set(conn, max_concurrency=1)
    assert len(queue.dequeue(conn, limit=10, lock_ms=60_000)) == 3
    assert not queue.dequeue(conn, limit=10)
    queue.policy.clear(conn)
    assert len(queue.dequeue(conn, limit=10, lock_ms=60_000)) == 6


def test_queue_default_counts_what_live_channels_hold_and_purge_gives_it_back(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    """A queue-wide default set on live channels (one statement per step for all of them,
    schema version 24) counts what each channel without a policy of its own holds, its
    messages in flight too; a channel with its own policy is left alone; a purge gives back
    what the purged messages held."""
    queue = broker.queue("q")
    for c in "abc":
        for i in range(3):
            queue.channel(c).message.create(conn, f"{c}{i}")
    queue.channel("c").policy.set(conn, max_concurrency=10)
    held = queue.dequeue(conn, limit=3, lock_ms=60_000).messages
    assert sorted(m.channel for m in held) == ["a", "b", "c"]
    queue.policy.set(conn, max_size=3, max_concurrency=1)
    assert_consistent(conn, broker.schema)
    for c in "ab":  # 3 messages each, one of them in flight: full, and at their concurrency
        with pytest.raises(ChannelFull):
            queue.channel(c).message.create(conn, b"more")
    queue.channel("c").message.create(conn, b"c3")  # its own policy has no max_size
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert [m.content for m in got] == [b"c1", b"c2", b"c3"]
    assert queue.purge(conn) == 4  # a1, a2, b1, b2
    assert_consistent(conn, broker.schema)
    queue.channel("a").message.create(conn, b"a3")  # room for 2 beside the one in flight
    queue.channel("a").message.create(conn, b"a4")
    with pytest.raises(ChannelFull):
        queue.channel("a").message.create(conn, b"a5")
    broker.delete_many(conn, held + got)
    queue.policy.clear(conn)
    assert [m.content for m in drain(queue, conn, limit=10)] == [b"a3", b"a4"]
    assert_consistent(conn, broker.schema)
    assert queue.stats(conn).channels == 0


def test_policy_persists_after_channel_empties(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_size=1)
    ch.message.create(conn, b"1")
    drain(queue, conn)
    ch.message.create(conn, b"2")
    with pytest.raises(ChannelFull):
        ch.message.create(conn, b"3")


def test_purge_keeps_in_flight_and_counters(queue: lonnymq.Queue, conn: Conn) -> None:
    for c in "ab":
        for i in range(4):
            queue.channel(c).message.create(conn, f"{c}{i}")
    queue.channel("a").message.create(conn, b"delayed", delay_ms=60_000)
    held = queue.dequeue(conn, limit=2, lock_ms=60_000).messages
    stats = queue.stats(conn)
    assert (stats.total, stats.in_flight, stats.ready, stats.delayed, stats.channels) == (
        9,
        2,
        6,
        1,
        2,
    )
    assert queue.size(conn) == 7
    assert queue.purge(conn) == 7
    stats = queue.stats(conn)
    assert (stats.total, stats.in_flight, stats.ready, stats.delayed) == (2, 2, 0, 0)
    assert not queue.dequeue(conn)
    for message in held:
        assert message.delete(conn)
    assert queue.stats(conn).total == 0
    assert queue.stats(conn).channels == 0


def test_delete_queue(broker: lonnymq.Broker, conn: Conn) -> None:
    q = broker.queue("doomed")
    q.policy.set(conn, max_size=10)
    q.channel("a").message.create(conn, b"x")
    held = q.dequeue(conn, lock_ms=60_000).messages[0]
    q.channel("a").message.create(conn, b"y")
    assert "doomed" in broker.queues(conn)
    assert q.delete(conn) == 2
    assert "doomed" not in broker.queues(conn)
    assert held.delete(conn) is lonnymq.Outcome.NOT_FOUND
    assert q.policy.get(conn) == Policy(None, None)


def _listen(connect: Callable[..., Conn], broker: lonnymq.Broker) -> Conn:
    listener = connect()
    listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(broker.wake_channel)))
    return listener


def _payloads(listener: Conn, timeout: float = 0.3) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=timeout, stop_after=50)]


@pytest.mark.slow
def test_notify_on_create_defer_and_freed_slot(
    broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn]
) -> None:
    """A NOTIFY wakes consumers that sleep (their last dequeue found nothing): on a create, a
    defer, a freed concurrency slot and a delayed message. While no consumer sleeps (they
    are all busy), producers send none: each NOTIFY costs a database-wide lock at commit."""
    listener = _listen(connect, broker)
    q = broker.queue("jobs")
    consumer = connect()
    assert not q.dequeue(consumer)  # sleeps on "jobs" until its next dequeue
    q.channel("a").message.create(conn, b"1")
    assert _payloads(listener) == ["jobs"]
    held = q.dequeue(consumer, limit=2, lock_ms=60_000).messages  # awake, and busy
    q.channel("a").message.create(conn, b"2")
    assert _payloads(listener, 0.2) == []  # nobody sleeps: no NOTIFY
    held += q.dequeue(consumer, limit=2, lock_ms=60_000).messages
    assert len(held) == 2
    assert not q.dequeue(consumer)  # sleeps again
    held[0].defer(conn)
    assert _payloads(listener) == ["jobs"]
    # a freed concurrency slot wakes consumers
    q.channel("a").policy.set(conn, max_concurrency=1)
    assert not q.dequeue(consumer)
    held[1].delete(conn)
    assert _payloads(listener) == ["jobs"]
    # a delayed message wakes consumers too, so they can set a timer (retry_ms)
    assert [m.content for m in q.dequeue(consumer, lock_ms=60_000).messages] == [b"1"]
    assert not q.dequeue(consumer)
    q.channel("z").message.create(conn, b"later", delay_ms=60_000)
    assert _payloads(listener) == ["jobs"]
    # a connection that does not listen is not counted as sleeping
    other = connect()
    assert q.dequeue(consumer).retry_ms is not None  # consumer sleeps, then...
    assert not q.dequeue(other, listen=False)
    q.dequeue(consumer, listen=False)  # ... wakes up without going back to sleep
    q.channel("b").message.create(conn, b"b")
    assert _payloads(listener, 0.2) == []


def test_wake_channel_is_per_schema(broker: lonnymq.Broker) -> None:
    assert broker.wake_channel == f"{broker.schema}_wake"


def test_several_queues_take_turns_in_the_usual_call(broker: lonnymq.Broker, conn: Conn) -> None:
    """A consumer of several queues (Celery's ``-Q a,b``) is served by the usual call (schema
    version 17; before, every such call took the general path) in the same round-robin order
    over the lanes of all its queues: each lane its k-th turn before any its (k+1)-th."""
    lanes_ = [("qa", "a1"), ("qb", "b1"), ("qa", "a2"), ("qb", "b2")]
    for i in range(5):
        for queue, channel in lanes_:
            broker.queue(queue).channel(channel).message.create(conn, f"{queue}.{channel}.{i}")
            time.sleep(0.002)  # (turns apart: the order below is the creation order)
    order: list[tuple[str, str]] = []
    general = 0
    held: list[lonnymq.Message] = []
    while True:
        result, ran = functions_ran(
            conn, broker.schema, partial(broker.dequeue, conn, ["qa", "qb"], ack=held, listen=False)
        )
        general += "dequeue_general_v1" in ran
        held = list(result.messages)
        if not held:
            break
        lane = (held[0].queue, held[0].channel)
        # (in order within its lane)
        assert held[0].content == f"{lane[0]}.{lane[1]}.{order.count(lane)}".encode()
        order.append(lane)
    assert len(order) == 20
    assert order[:4] == lanes_  # the oldest turn first, across the queues
    rounds = [order[: i + 1].count(lane) for i, lane in enumerate(order)]
    assert rounds == sorted(rounds)
    # the usual call served them (the first call ingests; the last finds nothing)
    assert general <= 3, general
    assert_consistent(conn, broker.schema)


def test_a_limited_lane_of_several_queues_keeps_its_limit(
    broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn]
) -> None:
    broker.queue("qb").channel("b1").policy.set(conn, max_concurrency=1)
    for i in range(3):
        broker.queue("qa").channel("a1").message.create(conn, f"a{i}")
        broker.queue("qb").channel("b1").message.create(conn, f"b{i}")
    held = []
    consumers = [connect(), connect()]
    for i in range(6):
        held += broker.dequeue(consumers[i % 2], ["qa", "qb"], limit=1, listen=False).messages
    assert sorted(m.content for m in held) == [b"a0", b"a1", b"a2", b"b0"]  # b1: one at a time
    for m in held:
        if m.channel == "b1":
            assert m.delete(conn) is Outcome.OK
    got = broker.dequeue(conn, ["qa", "qb"], limit=5, listen=False).messages
    assert [m.content for m in got] == [b"b1"]
    assert_consistent(conn, broker.schema)
