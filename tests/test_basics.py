"""Create, dequeue, delete, defer, heartbeat: the message lifecycle."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psycopg
import pytest

import lonnymq
from lonnymq import Created, Deduplicated, Outcome
from tests.conftest import hold_ingest_key

Conn = psycopg.Connection[Any]


def test_create_dequeue_delete(queue: lonnymq.Queue, conn: Conn) -> None:
    result = queue.channel("a").message.create(conn, b"hello")
    assert isinstance(result, Created)
    got = queue.dequeue(conn, limit=10, lock_ms=10_000)
    assert [m.content for m in got.messages] == [b"hello"]
    message = got.messages[0]
    assert (message.id, message.queue, message.channel, message.attempts) == (
        result.id,
        "default",
        "a",
        1,
    )
    assert message.name is None and message.state is None
    assert message.delete(conn) is Outcome.OK
    assert message.delete(conn) is Outcome.NOT_FOUND
    empty = queue.dequeue(conn)
    assert not empty and empty.retry_ms is None
    assert queue.stats(conn).total == 0


def test_str_content_is_utf8(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, "héllo ☃")
    assert queue.dequeue(conn).messages[0].content == "héllo ☃".encode()


def test_dedup_while_never_dequeued(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    first = ch.message.create(conn, b"1", name="job")
    assert isinstance(first, Created)
    assert ch.message.create(conn, b"2", name="job") == Deduplicated(first.id)
    # another channel, another queue: independent names
    assert isinstance(queue.channel("b").message.create(conn, b"3", name="job"), Created)
    other = queue.broker.queue("other")
    assert isinstance(other.channel("a").message.create(conn, b"4", name="job"), Created)
    got = queue.dequeue(conn, limit=1, lock_ms=10_000).messages[0]
    assert got.id == first.id
    # once dequeued, the name is free again, even while the first is deferred
    third = ch.message.create(conn, b"5", name="job")
    assert isinstance(third, Created)
    assert got.defer(conn) is Outcome.OK
    assert ch.message.create(conn, b"6", name="job") == Deduplicated(third.id)


def test_defer_keeps_attempts_and_sets_state(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"work")
    m1 = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert m1.defer(conn, state=b"step-1") is Outcome.OK
    m2 = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert (m2.id, m2.attempts, m2.state) == (m1.id, 2, b"step-1")
    assert m2.defer(conn) is Outcome.OK  # state kept when not given
    m3 = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert (m3.attempts, m3.state) == (3, b"step-1")
    assert m3.defer(conn, state=None) is Outcome.OK
    m4 = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert m4.state is None


def test_defer_with_delay(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"x")
    m = queue.dequeue(conn, lock_ms=10_000).messages[0]
    m.defer(conn, delay_ms=400)
    empty = queue.dequeue(conn)
    assert not empty
    assert empty.retry_ms is not None and 200 < empty.retry_ms <= 400
    time.sleep(0.45)
    assert queue.dequeue(conn).messages[0].id == m.id


def test_defer_goes_behind_requeue_keeps_place(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    for body in (b"1", b"2", b"3"):
        ch.message.create(conn, body)
    first = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert first.defer(conn) is Outcome.OK  # a retry: behind the messages already due
    assert [m.content for m in queue.dequeue(conn, limit=10).messages] == [b"2", b"3", b"1"]
    ch.message.create(conn, b"4")
    ch.message.create(conn, b"5")
    four = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert four.content == b"4"
    assert four.defer(conn, delay_ms=None) is Outcome.OK  # a requeue: back in its place
    assert [m.content for m in queue.dequeue(conn, limit=10).messages] == [b"4", b"5"]


def test_delay_on_create(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"later", delay_ms=500)
    queue.channel("a").message.create(conn, b"now")
    got = queue.dequeue(conn, limit=10)
    assert [m.content for m in got.messages] == [b"now"]
    nothing = queue.dequeue(conn)
    assert nothing.retry_ms is not None and 0 < nothing.retry_ms <= 500
    time.sleep(0.55)
    assert [m.content for m in queue.dequeue(conn, limit=10).messages] == [b"later"]


def test_priority_within_channel(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    for priority in [0, 5, 9, 1, 9, 0]:
        ch.message.create(conn, str(priority), priority=priority)
    got = queue.dequeue(conn, limit=10)
    assert [m.content for m in got.messages] == [b"9", b"9", b"5", b"1", b"0", b"0"]
    ids = [m.id for m in got.messages]
    assert ids[0] < ids[1] and ids[4] < ids[5]  # oldest first within a priority


def test_stale_token_is_fenced(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"x")
    first = queue.dequeue(conn, lock_ms=50).messages[0]
    time.sleep(0.1)
    second = queue.dequeue(conn, lock_ms=10_000).messages[0]
    assert second.id == first.id and second.attempts == 2
    assert first.delete(conn) is Outcome.STATE_INVALID
    assert first.defer(conn) is Outcome.STATE_INVALID
    assert not first.heartbeat(conn, lock_ms=10_000)
    assert queue.broker.delete(conn, first.id, uuid.uuid4()) is Outcome.STATE_INVALID
    assert second.delete(conn) is Outcome.OK


def test_heartbeat_keeps_lock(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"x")
    held = queue.dequeue(conn, lock_ms=300).messages[0]
    for _ in range(4):
        time.sleep(0.15)
        assert queue.broker.heartbeat(conn, [held], lock_ms=300) == {held.id}
    assert not queue.dequeue(conn)  # never expired
    assert held.delete(conn) is Outcome.OK


def test_lock_expiry_redelivers_first(queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    ch.message.create(conn, b"first")
    # (500 ms: the next three calls must come before it passes, on a loaded machine too;
    # with 100 ms, CI's full suite once saw the lock expire before them)
    lost = queue.dequeue(conn, lock_ms=500).messages[0]
    ch.message.create(conn, b"second")
    nothing_yet = queue.dequeue(conn, limit=1, lock_ms=10_000).messages
    assert [m.content for m in nothing_yet] == [b"second"]
    assert not queue.dequeue(conn)
    time.sleep(0.55)
    again = queue.dequeue(conn, lock_ms=10_000).messages
    assert [(m.id, m.attempts) for m in again] == [(lost.id, 2)]


@pytest.mark.parametrize("fresh", [False, True], ids=["created_elsewhere", "created_here"])
def test_a_dequeue_that_waited_in_vain_for_an_ingest_says_look_again_soon(
    queue: lonnymq.Queue, conn: Conn, connect: Any, schema: str, fresh: bool
) -> None:
    """An empty answer while another session's ingest holds the key past the dequeue's wait
    (50 ms) is "look again in 20 ms", not "nothing pending": what that ingest brings in is
    not seen, and no NOTIFY will say when it commits (docs/design.md, "The dequeue", step 6).
    Also when this session created the message (the dequeue waits for an ingest first)."""
    queue.dequeue(conn)  # (the queue known to the ingest's state)
    holder = connect(autocommit=False)
    hold_ingest_key(holder, schema)
    queue.channel("a").message.create(conn if fresh else connect(), b"late")
    time.sleep(0.02)  # (the ingest's state older than its 10 ms tick)
    try:
        empty = queue.dequeue(conn, listen=False)
        assert not empty and empty.retry_ms is not None and empty.retry_ms <= 20
    finally:
        holder.commit()
    got = queue.dequeue(conn, listen=False)
    assert [m.content for m in got.messages] == [b"late"]


def test_retry_ms_reports_lock_expiry(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("a").message.create(conn, b"x")
    queue.dequeue(conn, lock_ms=2_000)
    empty = queue.dequeue(conn)
    assert empty.retry_ms is not None and 1_000 < empty.retry_ms <= 2_000


def test_unknown_queue_is_empty(broker: lonnymq.Broker, conn: Conn) -> None:
    result = broker.dequeue(conn, ["nope"])
    assert not result and result.retry_ms is None


def test_dequeue_across_queues(broker: lonnymq.Broker, conn: Conn) -> None:
    broker.queue("q1").channel("a").message.create(conn, b"1")
    broker.queue("q2").channel("a").message.create(conn, b"2")
    broker.queue("q3").channel("a").message.create(conn, b"3")
    got = broker.dequeue(conn, ["q1", "q2"], limit=10)
    assert sorted(m.content for m in got.messages) == [b"1", b"2"]
    assert {m.queue for m in got.messages} == {"q1", "q2"}


@pytest.mark.parametrize("queues", [["q1", "q2"], ["q1"]])
def test_large_and_small_contents_come_back_whole_in_order(
    broker: lonnymq.Broker, conn: Conn, queues: list[str]
) -> None:
    """Every path of the dequeue returns each message's content and state whole, large or
    small, in its order: several queues or channels take the general path, whose steps hand
    back small messages with their content and large ones (over 8 kB) without it, read by id
    at the end (schema version 17)."""
    sizes = [10, 9_000, 100, 300_000, 8_100, 5]
    made: dict[int, bytes] = {}
    for i, size in enumerate(sizes):
        content = os.urandom(size)  # (random: not compressed below the threshold)
        created = (
            broker.queue(queues[i % len(queues)]).channel(f"c{i % 3}").message.create(conn, content)
        )
        assert isinstance(created, Created)
        made[created.id] = content
    first = broker.dequeue(conn, queues, limit=3, lock_ms=60_000)
    states = {m.id: os.urandom(20_000 if i % 2 else 50) for i, m in enumerate(first.messages)}
    for m in first.messages:  # back with a state, large or small, and the others after them
        assert m.defer(conn, delay_ms=None, state=states[m.id]) is Outcome.OK
    seen: dict[int, tuple[bytes, bytes | None]] = {}
    while got := broker.dequeue(conn, queues, limit=4, lock_ms=60_000):
        for m in got.messages:
            seen[m.id] = (m.content, m.state)
        assert broker.delete_many(conn, got.messages)
    assert {i: c for i, (c, _) in seen.items()} == made
    assert {i: s for i, (_, s) in seen.items() if s is not None} == states


def test_create_is_part_of_the_caller_transaction(queue: lonnymq.Queue, connect: Any) -> None:
    tx = connect(autocommit=False)
    observer = connect()
    tx.execute("CREATE TEMP TABLE orders (id int)")
    tx.execute("INSERT INTO orders VALUES (1)")
    queue.channel("a").message.create(tx, b"rolled back")
    assert not queue.dequeue(observer)  # not visible before commit
    tx.rollback()
    assert not queue.dequeue(observer)
    assert queue.stats(observer).total == 0
    queue.channel("a").message.create(tx, b"committed")
    assert not queue.dequeue(observer)
    tx.commit()
    assert [m.content for m in queue.dequeue(observer, limit=5).messages] == [b"committed"]


def test_missing_schema_is_a_clear_error(conn: Conn) -> None:
    broker = lonnymq.Broker("lmq_not_installed_here")
    with pytest.raises(lonnymq.SchemaNotInstalled, match="lonnymq migrate"):
        broker.queue("q").channel("a").message.create(conn, b"x")
    with pytest.raises(lonnymq.SchemaNotInstalled):
        broker.dequeue(conn, ["q"])
    with pytest.raises(lonnymq.SchemaNotInstalled):
        broker.check(conn)


def test_ttl_expiry(broker: lonnymq.Broker, conn: Conn) -> None:
    q = broker.queue("ttl")
    q.channel("c").message.create(conn, b"held", ttl_ms=100)
    held = q.dequeue(conn, limit=1, lock_ms=60_000).messages
    assert [m.content for m in held] == [b"held"]
    q.channel("a").message.create(conn, b"short", ttl_ms=100)
    q.channel("a").message.create(conn, b"long", ttl_ms=60_000)
    q.channel("b").message.create(conn, b"forever")
    q.channel("d").message.create(conn, b"delayed", delay_ms=300, ttl_ms=200)
    time.sleep(0.15)
    assert broker.expire(conn) == (1, 0)  # "short"; the held one stays with its holder
    assert sorted(m.content for m in q.dequeue(conn, limit=10).messages) == [b"forever", b"long"]
    time.sleep(0.2)  # "delayed" is due; its TTL counts from then, not from its creation
    assert [m.content for m in q.dequeue(conn, limit=10).messages] == [b"delayed"]
    assert held[0].delete(conn) is Outcome.OK
    stats = q.stats(conn)
    assert stats.total == stats.in_flight == 3


def test_delete_many(queue: lonnymq.Queue, conn: Conn) -> None:
    for i in range(5):
        queue.channel(f"c{i % 2}").message.create(conn, str(i))
    held = queue.dequeue(conn, limit=5, lock_ms=60_000).messages
    stale = (held[0].id, uuid.uuid4())
    outcomes = queue.broker.delete_many(conn, [*held[1:], stale])
    assert outcomes == {m.id: Outcome.OK for m in held[1:]} | {held[0].id: Outcome.STATE_INVALID}
    assert queue.stats(conn).total == 1
    assert queue.broker.delete_many(conn, []) == {}


def test_the_queues_listed_include_those_only_created_in(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    """``Broker.queues`` (``lonnymq stats`` without a queue) lists a queue whose messages no
    consumer has looked at yet, as ``status`` does (it read the queue table, which gets the
    queue's row at its first ingest or declare)."""
    broker.queue("fresh").channel("c").message.create(conn, b"x")
    assert broker.queues(conn) == ["fresh"]
    assert [s.queue for s in broker.status(conn)] == ["fresh"]
