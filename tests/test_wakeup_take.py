"""A wake-up's dequeue served without the ingest (docs/design.md, "Dequeue", step 1: the
wake-up): when a consumer of one queue finds nothing and no lane of the queue is due, what
woke it, if it is little and of one channel without limits, is taken in two statements
instead of an ingest and the usual call's statements.

Each test checks what the ingest path would have kept: counts exact (nothing counted twice,
nothing left out), limits and rates, round robin between channels, priorities within one,
lock expiry, time to live, and that the take is what served it (the ingest's state, the
newest discovery row, is the same before and after the call) or that it was not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq.queue.operate import Counters
from tests.conftest import hold_ingest_key
from tests.invariants import assert_consistent
from tests.test_counters import counters

Conn = psycopg.Connection[Any]


def discovery(conn: Conn, schema: str) -> int:
    """The id of the ingest's newest state: a new one for every ingest."""
    row = conn.execute(
        sql.SQL("SELECT max(id) FROM {}.discovery").format(sql.Identifier(schema))
    ).fetchone()
    assert row is not None
    return int(row[0])


def asleep(broker: lonnymq.Broker, consumer: Conn, queue: str = "q") -> None:
    """The queue is in use (its first message went through the ingest, which makes its row),
    and the consumer finds nothing (it ingests on the way), as before it sleeps."""
    broker.queue(queue).channel("first").message.create(consumer, b"first")
    first = broker.dequeue(consumer, [queue], listen=False)
    assert [m.channel for m in first.messages] == ["first"]
    assert not broker.dequeue(consumer, [queue], ack=first.messages, listen=False)


@pytest.fixture
def producer(connect: Callable[..., Conn]) -> Conn:
    return connect()


def test_a_wake_up_is_served_without_an_ingest_and_counted_once(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    for round_ in range(3):
        made = broker.queue("q").channel("a").message.create(producer, f"m{round_}")
        assert isinstance(made, lonnymq.Created)
        before = discovery(conn, broker.schema)
        got = broker.dequeue(conn, ["q"], listen=False)
        assert [m.id for m in got.messages] == [made.id]
        assert got.messages[0].attempts == 1 and not got.messages[0].lock_expired
        assert discovery(conn, broker.schema) == before  # no ingest ran
        # (the next call acks it, finds nothing and ingests: nothing counted twice)
        assert not broker.dequeue(conn, ["q"], ack=got.messages, listen=False)
    assert counters(broker, conn, "q") == Counters(4, 4, 0, 4, 0, 0, 0, 0)
    stats = broker.queue("q").stats(conn)
    assert (stats.total, stats.in_flight) == (0, 0)
    # and still once after a fold
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY['q'], true, true)").format(sql.Identifier(broker.schema))
    )
    assert counters(broker, conn, "q") == Counters(4, 4, 0, 4, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_what_one_take_leaves_is_delivered_after_it_in_order(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    channel = broker.queue("q").channel("a")
    with producer.transaction():
        ids = [lonnymq_id(channel.message.create(producer, f"m{i}")) for i in range(4)]
        urgent = lonnymq_id(channel.message.create(producer, "urgent", priority=5))
    before = discovery(conn, broker.schema)
    first = broker.dequeue(conn, ["q"], limit=2, listen=False)
    assert [m.id for m in first.messages] == [urgent, ids[0]]  # priority, then age
    assert discovery(conn, broker.schema) == before
    got = list(first.messages)
    held = list(first.messages)
    while True:
        result = broker.dequeue(conn, ["q"], ack=held, listen=False)
        if not result:
            break
        held = list(result.messages)
        got.extend(held)
    assert [m.id for m in got] == [urgent, *ids]
    assert counters(broker, conn, "q") == Counters(6, 6, 0, 6, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def lonnymq_id(result: lonnymq.CreateResult) -> int:
    assert isinstance(result, lonnymq.Created), result
    return result.id


@pytest.mark.parametrize(
    "limits", [{"max_concurrency": 1}, {"rate": "1/h", "burst": 1}], ids=["concurrency", "rate"]
)
@pytest.mark.parametrize("whose", ["channel", "queue"])
def test_a_limit_holds_for_a_wake_up(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, limits: dict[str, Any], whose: str
) -> None:
    queue = broker.queue("q")
    (queue.channel("a") if whose == "channel" else queue).policy.set(conn, **limits)
    asleep(broker, conn)
    for i in range(3):
        queue.channel("a").message.create(producer, f"m{i}")
    before = discovery(conn, broker.schema)
    got = broker.dequeue(conn, ["q"], limit=3, listen=False)
    assert len(got.messages) == 1
    assert discovery(conn, broker.schema) != before  # served by the ingest path
    assert not broker.dequeue(conn, ["q"], limit=3, listen=False)
    assert_consistent(conn, broker.schema)


def test_two_channels_woken_together_take_turns(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    queue = broker.queue("q")
    a1 = lonnymq_id(queue.channel("a").message.create(producer, "a1"))
    a2 = lonnymq_id(queue.channel("a").message.create(producer, "a2"))
    b1 = lonnymq_id(queue.channel("b").message.create(producer, "b1"))
    order: list[int] = []
    held: list[lonnymq.Message] = []
    while True:
        result = broker.dequeue(conn, ["q"], ack=held, listen=False)
        if not result:
            break
        held = list(result.messages)
        order.extend(m.id for m in held)
    assert order == [a1, b1, a2]
    assert counters(broker, conn, "q") == Counters(4, 4, 0, 4, 0, 0, 0, 0)


def test_much_unseen_elsewhere_is_left_to_the_ingest(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    other = broker.queue("other").channel("x")
    with producer.transaction():
        for i in range(70):
            other.message.create(producer, f"o{i}")
    mine = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "mine"))
    before = discovery(conn, broker.schema)
    got = broker.dequeue(conn, ["q"], listen=False)
    assert [m.id for m in got.messages] == [mine]
    assert discovery(conn, broker.schema) != before
    assert counters(broker, conn, "other").enqueued == 70


def test_a_lock_taken_at_a_wake_up_expires_and_is_taken_over(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, connect: Callable[..., Conn]
) -> None:
    asleep(broker, conn)
    made = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "job"))
    before = discovery(conn, broker.schema)
    first = broker.dequeue(conn, ["q"], lock_ms=300, listen=False)
    assert [m.id for m in first.messages] == [made]
    assert discovery(conn, broker.schema) == before
    # another consumer, which never ingested since, takes it over once the lock is past
    other = connect()
    assert not broker.dequeue(other, ["q"], listen=False)
    time.sleep(0.4)
    again = broker.dequeue(other, ["q"], listen=False)
    assert [(m.id, m.attempts, m.lock_expired) for m in again.messages] == [(made, 2, True)]
    # the first holder's late ack is refused; the counts are exact
    late = broker.dequeue(conn, ["q"], ack=first.messages, listen=False)
    assert late.acked == {made: lonnymq.Outcome.STATE_INVALID}
    broker.dequeue(other, ["q"], ack=again.messages, listen=False)
    assert counters(broker, conn, "q") == Counters(2, 3, 1, 2, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_a_message_past_its_time_to_live_is_not_taken(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    broker.queue("q").channel("a").message.create(producer, "stale", ttl_ms=1)
    time.sleep(0.01)
    assert not broker.dequeue(conn, ["q"], listen=False)
    assert counters(broker, conn, "q") == Counters(2, 1, 0, 1, 0, 0, 1, 0)
    assert broker.queue("q").stats(conn).total == 0


def test_no_take_while_an_ingest_runs_and_none_counts_twice(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, connect: Callable[..., Conn]
) -> None:
    asleep(broker, conn)
    made = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "job"))
    ingesting = connect(autocommit=False)
    hold_ingest_key(ingesting, broker.schema)
    try:
        held = broker.dequeue(conn, ["q"], listen=False)
    finally:
        ingesting.rollback()
    got = list(held.messages) or list(broker.dequeue(conn, ["q"], listen=False).messages)
    assert [m.id for m in got] == [made]
    broker.dequeue(conn, ["q"], ack=got, listen=False)
    assert counters(broker, conn, "q") == Counters(2, 2, 0, 2, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)
