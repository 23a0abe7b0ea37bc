"""Cumulative counters and gauges: broker.status and queue.channels. Counts are insert-only
tallies (one row per call and channel), folded into per-channel counts (and, for a channel
that emptied, per-queue counts) by the ingest and by housekeep, without changing any total;
the gauges derive from them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import Dropped, Outcome
from lonnymq.queue import Counters
from tests.conftest import created, status_of

Conn = psycopg.Connection[Any]

LOCK_MS = 60
EXPIRY_S = 0.1


def counters(broker: lonnymq.Broker, conn: Conn, queue: str) -> Counters:
    return status_of(broker, conn, queue).counters


def counter_rows(conn: Conn, schema: str, queue: str) -> int:
    """Rows that hold a queue's counts outside its channels' own: tallies not folded yet, and
    the folded counts of its channels that emptied."""
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {s}.tally t WHERE t.queue = %s) "
            "+ (SELECT count(*) FROM {s}.queue_count qc WHERE qc.queue = %s)"
        ).format(s=sql.Identifier(schema)),
        (queue, queue),
    ).fetchone()
    assert row is not None
    return int(row[0])


def prune_now(conn: Conn, schema: str) -> int:
    """What housekeeping does to channels empty for 5 minutes (their lanes and counts go, the
    counts to one row per queue), to those empty now."""
    query = sql.SQL("SELECT {}.lane_prune_v1(1000, interval '0 s')").format(sql.Identifier(schema))
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def all_counter_rows(conn: Conn, schema: str) -> int:
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {s}.tally) + (SELECT count(*) FROM {s}.queue_count)"
        ).format(s=sql.Identifier(schema))
    ).fetchone()
    assert row is not None
    return int(row[0])


def channel_rows(conn: Conn, schema: str) -> list[str]:
    """The channels the broker lists (holding messages, or with a policy of their own)."""
    rows = conn.execute(
        sql.SQL(
            "SELECT c.channel_name FROM {s}.queue q "
            "CROSS JOIN LATERAL {s}.channel_list_v3(q.name, 10000, NULL) AS c ORDER BY 1"
        ).format(s=sql.Identifier(schema))
    ).fetchall()
    return [r[0] for r in rows]


def test_fresh_queue_counts_nothing(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    assert broker.status(conn) == []
    queue.configure(conn, max_attempts=5)  # creates the queue
    status = status_of(broker, conn, "default")
    assert status.counters == Counters(0, 0, 0, 0, 0, 0, 0, 0)
    assert (status.total, status.in_flight, status.ready, status.delayed, status.dead) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert (status.channels, status.oldest_ready_at, status.waiting) == (0, None, 0)


def test_counters_exact_after_a_mixed_workload(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """Every kind of event, in channels that empty (their rows deleted, counters folded into
    the counter table) and channels that stay; housekeep's compaction changes no total; a
    deleted queue is gone from the status and leaves the other queue alone."""
    other = broker.queue("other")
    for i in range(3):
        other.channel(f"o{i}").message.create(conn, b"o")
    held_other = other.dequeue(conn, limit=2, lock_ms=10_000).messages
    assert held_other[0].delete(conn) is Outcome.OK

    for i in range(3):
        queue.channel("a").message.create(conn, f"a{i}")
    for i in range(2):
        queue.channel("b").message.create(conn, f"b{i}")
    queue.channel("c").message.create(conn, b"c")
    queue.channel("d").policy.set(conn, max_size=1)  # a row that stays: it has a policy
    queue.channel("d").message.create(conn, b"d")
    assert isinstance(
        queue.channel("d").message.create(conn, b"d2", raise_if_dropped=False), Dropped
    )
    queue.channel("e").message.create(conn, b"ttl", ttl_ms=1)
    queue.channel("f").message.create(conn, b"later", delay_ms=3_600_000)
    time.sleep(0.01)

    got = queue.dequeue(conn, limit=20, lock_ms=10_000).messages
    by_channel: dict[str, list[lonnymq.Message]] = {}
    for m in got:
        by_channel.setdefault(m.channel, []).append(m)
    assert {k: len(v) for k, v in by_channel.items()} == {"a": 3, "b": 2, "c": 1, "d": 1}
    # a: acked one by one, then the channel is empty: its row goes, its counters stay
    for m in by_channel["a"]:
        assert m.delete(conn) is Outcome.OK
    # b: deferred, delivered again, one rejected and one acked
    for m in by_channel["b"]:
        assert m.defer(conn) is Outcome.OK
    again = queue.dequeue(conn, limit=5, lock_ms=10_000).messages
    assert sorted(m.channel for m in again) == ["b", "b"]
    assert again[0].reject(conn) is Outcome.OK
    assert again[1].delete(conn) is Outcome.OK
    # c: its holder dies; delivered again after the lock expired, then acked
    assert by_channel["c"][0].heartbeat(conn, lock_ms=LOCK_MS)
    time.sleep(EXPIRY_S)
    redelivered = queue.dequeue(conn, limit=5, lock_ms=10_000).messages
    assert [(m.channel, m.lock_expired) for m in redelivered] == [("c", True)]
    assert redelivered[0].delete(conn) is Outcome.OK
    # d: acked in a batch
    assert broker.delete_many(conn, by_channel["d"]) == {by_channel["d"][0].id: Outcome.OK}

    expected = Counters(
        enqueued=9,  # a3 b2 c1 d1 e1 f1 (d2 dropped)
        delivered=10,  # a3 b2 c1 d1, b2 again, c again
        redelivered=1,
        acked=6,  # a3 b1 c1 d1
        deferred=2,
        dead=1,
        expired=1,  # e, dropped by the dequeue that found it past its time to live
        dropped=1,
    )
    status = status_of(broker, conn, "default")
    assert status.counters == expected
    assert (status.total, status.in_flight, status.ready, status.delayed, status.dead) == (
        1,
        0,
        0,
        1,
        1,
    )
    assert status.channels == 1  # f; d's row stays (a policy) but holds nothing
    assert channel_rows(conn, broker.schema) == ["d", "f", "o1", "o2"]
    # (the tallies may or may not be folded by now: a status folds them when the last fold is
    # a second old, which a loaded machine reaches within this test; the totals above and
    # below hold either way)
    other_before = counters(broker, conn, "other")
    assert other_before == Counters(3, 2, 0, 1, 0, 0, 0, 0)

    # compaction: the tallies folded (the emptied channels keep their counts and lanes for 5
    # minutes), the same totals
    assert broker.housekeep(conn) == 0
    assert counters(broker, conn, "default") == expected
    assert counter_rows(conn, broker.schema, "default") == 0
    assert counters(broker, conn, "other") == other_before
    # the channels empty for long enough go, their counts to one row per queue (housekeeping
    # does it after 5 minutes: here at once)
    # (the channels of both queues that emptied; d has a policy, f holds a delayed message)
    assert prune_now(conn, broker.schema) == 5
    assert counters(broker, conn, "default") == expected
    assert counter_rows(conn, broker.schema, "default") == 1
    assert broker.housekeep(conn) == 0  # and again: still the same
    assert counters(broker, conn, "default") == expected
    assert counter_rows(conn, broker.schema, "default") == 1

    # more work after the compaction adds to it
    queue.channel("a").message.create(conn, b"a-again")
    [m] = queue.dequeue(conn, limit=1, lock_ms=10_000).messages
    assert m.channel == "a" and m.delete(conn) is Outcome.OK
    after = counters(broker, conn, "default")
    assert (after.enqueued, after.delivered, after.acked) == (10, 11, 7)
    broker.housekeep(conn)
    assert counters(broker, conn, "default") == after

    # deleting the queue: gone from the status, its counter rows too; the other stays
    assert queue.delete(conn) == 1  # f
    assert [s.queue for s in broker.status(conn)] == ["other"]
    assert counters(broker, conn, "other") == other_before
    assert all_counter_rows(conn, broker.schema) == counter_rows(conn, broker.schema, "other")
    broker.housekeep(conn)
    assert counters(broker, conn, "other") == other_before
    # its dead letter outlives it; a queue of the same name starts from zero
    assert [m.queue for m in broker.messages(conn, state="dead")] == ["default"]
    queue.channel("a").message.create(conn, b"new")
    reborn = status_of(broker, conn, "default")
    assert reborn.counters == Counters(1, 0, 0, 0, 0, 0, 0, 0)
    assert (reborn.total, reborn.dead) == (1, 1)  # the old dead letter, by queue name


def test_status_gauges_and_settings(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.policy.set(conn, max_concurrency=4, max_size=100)
    queue.configure(conn, max_attempts=7, dead_retention_ms=60_000)
    before = datetime.now(timezone.utc) - timedelta(seconds=5)
    first = created(queue.channel("a").message.create(conn, b"1"))
    created(queue.channel("a").message.create(conn, b"2"))
    created(queue.channel("b").message.create(conn, b"3"))
    created(queue.channel("b").message.create(conn, b"4", delay_ms=3_600_000))
    created(queue.channel("c").message.create(conn, b"5", delay_ms=3_600_000))
    [held] = queue.dequeue(conn, limit=1, lock_ms=10_000).messages
    assert held.id == first
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.ready, status.delayed) == (5, 1, 2, 2)
    assert (status.waiting, status.channels, status.dead) == (4, 3, 0)
    assert (status.max_concurrency, status.max_size) == (4, 100)
    assert status.settings == lonnymq.queue.QueueSettings(True, 7, 60_000)
    assert status.oldest_ready_at is not None and status.oldest_ready_at > before
    age = status.oldest_ready_age(datetime.now(timezone.utc))
    assert age is not None and 0 <= age < 60
    assert status.oldest_ready_age(before) == 0.0
    [light] = broker.status(conn, count_ready=False)
    assert (light.ready, light.delayed, light.oldest_ready_at) == (None, None, None)
    assert (light.total, light.in_flight, light.counters) == (5, 1, status.counters)
    # agrees with the older stats call
    stats = queue.stats(conn)
    assert (stats.total, stats.in_flight, stats.ready, stats.delayed, stats.channels) == (
        5,
        1,
        2,
        2,
        3,
    )
    # queues come sorted by name
    broker.queue("aaa").channel("x").message.create(conn, b"x")
    assert [s.queue for s in broker.status(conn)] == ["aaa", "default"]


def test_channel_list_counters_order_and_limit(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    for name, n in (("small", 1), ("big", 3), ("mid", 2)):
        for i in range(n):
            queue.channel(name).message.create(conn, f"{name}{i}")
    queue.channel("mid").policy.set(conn, max_concurrency=1)
    got = queue.dequeue(conn, limit=10, lock_ms=10_000).messages
    assert sorted(m.channel for m in got) == ["big", "big", "big", "mid", "small"]
    held = {m.channel: m for m in got}
    assert held["small"].delete(conn) is Outcome.OK  # its row goes
    assert held["mid"].defer(conn, delay_ms=3_600_000) is Outcome.OK
    # every channel listed has been served (see test_channel_list_of_a_never_served_channel)
    channels = queue.channels(conn)
    assert [(c.channel, c.size, c.in_flight) for c in channels] == [("big", 3, 3), ("mid", 2, 0)]
    big, mid = channels
    assert (big.enqueued, big.delivered, big.acked, big.deferred, big.dead) == (3, 3, 0, 0, 0)
    assert (mid.enqueued, mid.delivered, mid.deferred) == (2, 1, 1)
    assert (big.has_policy, big.max_concurrency, mid.has_policy, mid.max_concurrency) == (
        False,
        None,
        True,
        1,
    )
    assert big.waiting_since is None  # nothing to hand out
    assert mid.waiting_since is not None  # the other message is ready
    assert big.served_at is not None and mid.served_at is not None
    assert [c.channel for c in queue.channels(conn, limit=1)] == ["big"]
    assert broker.queue("nope").channels(conn) == []
    with pytest.raises(lonnymq.InvalidArgument):
        queue.channels(conn, limit=0)


def test_channel_list_of_a_never_served_channel(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("fresh").message.create(conn, b"x")
    [channel] = queue.channels(conn)
    assert (channel.channel, channel.size, channel.served_at) == ("fresh", 1, None)


def test_expire_counts_expired_messages(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.channel("a").message.create(conn, b"x", ttl_ms=1)
    queue.channel("a").message.create(conn, b"y")
    time.sleep(0.01)
    assert broker.expire(conn) == (1, 0)
    status = status_of(broker, conn, "default")
    assert status.total == 1
    assert status.counters.expired == 1


def test_dequeue_counts_expired_messages(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.channel("a").message.create(conn, b"x", ttl_ms=1)
    keep = created(queue.channel("a").message.create(conn, b"y"))
    time.sleep(0.01)
    assert [m.id for m in queue.dequeue(conn, limit=5, lock_ms=10_000).messages] == [keep]
    status = status_of(broker, conn, "default")
    assert (status.total, status.counters.expired, status.counters.delivered) == (1, 1, 1)


def test_a_drop_in_a_new_channel_is_counted_and_leaves_no_row(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.policy.set(conn, max_size=0)
    assert isinstance(
        queue.channel("x").message.create(conn, b"x", raise_if_dropped=False), Dropped
    )
    with pytest.raises(lonnymq.ChannelFull):
        queue.channel("y").message.create(conn, b"y")
    # (ChannelFull is raised by the client, from the 'dropped' the committed call returned)
    assert channel_rows(conn, broker.schema) == []
    assert counters(broker, conn, "default") == Counters(0, 0, 0, 0, 0, 0, 0, 2)
    # in a transaction that rolls back, the drop is not counted
    with pytest.raises(lonnymq.ChannelFull), conn.transaction():
        queue.channel("z").message.create(conn, b"z")
    assert counters(broker, conn, "default") == Counters(0, 0, 0, 0, 0, 0, 0, 2)


def test_purge_and_policy_clear_keep_the_counters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=5)
    for i in range(3):
        ch.message.create(conn, f"{i}")
    [m] = queue.dequeue(conn, limit=1, lock_ms=10_000).messages
    assert queue.purge(conn) == 2
    assert m.delete(conn) is Outcome.OK
    assert channel_rows(conn, broker.schema) == ["a"]  # its policy keeps the row
    ch.policy.clear(conn)  # now empty and without a policy: the row goes
    assert channel_rows(conn, broker.schema) == []
    assert counters(broker, conn, "default") == Counters(3, 1, 0, 1, 0, 0, 0, 0)


def test_retry_and_remove_in_the_counters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """A retried dead letter is enqueued again; removing messages counts as no event."""
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"x"))
    [m] = queue.dequeue(conn, limit=1, lock_ms=10_000).messages
    assert m.reject(conn) is Outcome.OK
    [retried] = broker.retry(conn, [ident])
    assert retried.new_id is not None
    assert broker.remove(conn, [retried.new_id]) == {retried.new_id: "deleted"}
    status = status_of(broker, conn, "default")
    assert status.counters == Counters(2, 1, 0, 0, 0, 1, 0, 0)
    assert (status.total, status.in_flight, status.dead) == (0, 0, 0)


def test_counters_exact_under_concurrent_work_and_housekeeping(
    broker: lonnymq.Broker, queue: lonnymq.Queue, connect: Callable[..., Conn]
) -> None:
    """Producers, consumers (acking, deferring once, rejecting some) and housekeeping run
    at once, channels emptying and coming back all the time: the totals come out exact."""
    per_producer, producers, consumers = 40, 3, 3
    total = per_producer * producers
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[int] = []
    seen_lock = threading.Lock()

    def produce(i: int) -> None:
        conn = connect()
        try:
            for n in range(per_producer):
                queue.channel(f"c{n % 5}").message.create(conn, f"{i}-{n}")
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        conn = connect()
        try:
            while not done.is_set():
                for m in queue.dequeue(conn, limit=4, lock_ms=10_000).messages:
                    if m.attempts == 1 and m.id % 3 == 0:
                        assert m.defer(conn) is Outcome.OK
                        continue
                    with seen_lock:
                        seen.append(m.id)
                        if len(seen) >= total:
                            done.set()
                    if m.id % 7 == 0:
                        assert m.reject(conn) is Outcome.OK
                    else:
                        assert m.delete(conn) is Outcome.OK
        except BaseException as exc:
            errors.append(exc)
            done.set()

    def housekeep() -> None:
        conn = connect()
        try:
            while not done.is_set():
                broker.housekeep(conn)
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    threads += [threading.Thread(target=consume) for _ in range(consumers)]
    threads.append(threading.Thread(target=housekeep))
    for t in threads:
        t.start()
    done.wait(30)
    done.set()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(seen) == total and len(set(seen)) == total
    conn = connect()
    deferred = sum(1 for i in seen if i % 3 == 0)
    dead = sum(1 for i in seen if i % 7 == 0)
    expected = Counters(
        enqueued=total,
        delivered=total + deferred,
        redelivered=0,
        acked=total - dead,
        deferred=deferred,
        dead=dead,
        expired=0,
        dropped=0,
    )
    status = status_of(broker, conn, "default")
    assert status.counters == expected
    assert (status.total, status.in_flight, status.dead) == (0, 0, dead)
    broker.housekeep(conn)
    assert counters(broker, conn, "default") == expected
    assert counter_rows(conn, broker.schema, "default") == 0  # every tally folded
    assert channel_rows(conn, broker.schema) == []
    prune_now(conn, broker.schema)
    assert counters(broker, conn, "default") == expected
    assert counter_rows(conn, broker.schema, "default") == 1


def test_bulk_ack_across_channels_frees_slots_and_keeps_counters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """One delete_many over several channels: saturated channels get their turn back (and a
    NOTIFY), emptied channels go with their counters kept, the others keep theirs."""
    for name in ("a", "b"):
        queue.channel(name).policy.set(conn, max_concurrency=1)
        for n in range(2):
            queue.channel(name).message.create(conn, f"{name}{n}".encode())
    queue.channel("c").message.create(conn, b"c0")  # emptied by the ack below
    queue.channel("d").message.create(conn, b"d0")
    queue.channel("d").message.create(conn, b"d1")  # keeps one
    got = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sorted(m.channel for m in got) == ["a", "b", "c", "d", "d"]
    nothing = queue.dequeue(conn, limit=10, lock_ms=60_000)
    assert not nothing  # a and b are saturated, c and d have nothing left
    acked = [m for m in got if not (m.channel == "d" and m.content == b"d1")]
    listener = psycopg.connect(conn.info.dsn, autocommit=True)
    listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(broker.wake_channel)))
    outcomes = broker.delete_many(conn, acked)
    assert set(outcomes.values()) == {Outcome.OK}
    woken = list(listener.notifies(timeout=2, stop_after=1))
    listener.close()
    assert [n.payload for n in woken] == ["default"]
    again = queue.dequeue(conn, limit=10, lock_ms=60_000).messages
    assert sorted(m.channel for m in again) == ["a", "b"]
    assert {c.channel for c in queue.channels(conn)} == {"a", "b", "d"}  # c is gone
    status = status_of(broker, conn, "default")
    assert status.counters.acked == 4 and status.counters.enqueued == 7
    assert (status.total, status.in_flight) == (3, 3)
