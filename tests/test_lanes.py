"""Lanes kept while their channel is empty, and removed by housekeeping once it has stayed
empty (migration 8, docs/design.md "Lanes and round robin"); an ingest that meets more
channels than it may take lane keys for in one transaction.

Removal never loses a message: one made ready after its channel emptied (committed before the
removal, or still in its producer's transaction) is delivered, and the counters stay exact."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from tests.invariants import assert_consistent
from tests.test_concurrency import wait_blocked_by
from tests.test_counters import counters, prune_now

Conn = psycopg.Connection[Any]


def lanes(conn: Conn, schema: str) -> list[str]:
    rows = conn.execute(
        sql.SQL("SELECT channel FROM {}.lane ORDER BY channel").format(sql.Identifier(schema))
    ).fetchall()
    return [r[0] for r in rows]


def idle(conn: Conn, schema: str) -> list[str]:
    rows = conn.execute(
        sql.SQL("SELECT channel FROM {}.lane_idle ORDER BY channel").format(sql.Identifier(schema))
    ).fetchall()
    return [r[0] for r in rows]


def fold(broker: lonnymq.Broker, conn: Conn) -> None:
    """An ingest that folds (what a consumer's ingest does at most once a second)."""
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY[]::text[], true, true)").format(
            sql.Identifier(broker.schema)
        )
    )


def consume_all(broker: lonnymq.Broker, conn: Conn, queue: str = "q") -> list[lonnymq.Message]:
    got: list[lonnymq.Message] = []
    while True:
        result = broker.dequeue(conn, [queue], limit=100, listen=False)
        if not result.messages:
            return got
        got.extend(result.messages)
        broker.delete_many(conn, result.messages)


def test_an_emptied_channel_keeps_its_lane_until_housekeeping_removes_it(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    queue = broker.queue("q")
    for name in ("a", "b"):
        queue.channel(name).message.create(conn, name)
    queue.channel("b").message.create(conn, b"stays", delay_ms=3_600_000)
    assert len(consume_all(broker, conn)) == 2
    fold(broker, conn)
    # a's lane stays, noted as idle; b holds a delayed message
    assert lanes(conn, broker.schema) == ["a", "b"]
    assert idle(conn, broker.schema) == ["a"]
    before = counters(broker, conn, "q")
    # housekeeping leaves it for 5 minutes
    broker.housekeep(conn)
    assert lanes(conn, broker.schema) == ["a", "b"]
    # then it goes, its counts kept in the queue's
    assert prune_now(conn, broker.schema) == 1
    assert lanes(conn, broker.schema) == ["b"] and idle(conn, broker.schema) == []
    assert counters(broker, conn, "q") == before
    # and a new message in it is delivered as ever
    queue.channel("a").message.create(conn, b"again")
    assert [m.content for m in consume_all(broker, conn)] == [b"again"]
    assert counters(broker, conn, "q").acked == before.acked + 1
    assert_consistent(conn, broker.schema)


def test_a_channel_used_again_before_removal_is_left_alone(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    queue = broker.queue("q")
    queue.channel("a").message.create(conn, b"1")
    consume_all(broker, conn)
    fold(broker, conn)
    assert idle(conn, broker.schema) == ["a"]
    # a message comes (and waits): the lane is written after the channel emptied
    queue.channel("a").message.create(conn, b"2")
    fold(broker, conn)
    assert prune_now(conn, broker.schema) == 0
    assert lanes(conn, broker.schema) == ["a"] and idle(conn, broker.schema) == []
    assert [m.content for m in consume_all(broker, conn)] == [b"2"]
    # empty again: noted again
    fold(broker, conn)
    assert idle(conn, broker.schema) == ["a"]
    assert_consistent(conn, broker.schema)


def test_a_message_of_an_open_transaction_survives_the_removal(
    broker: lonnymq.Broker, connect: Callable[..., Conn]
) -> None:
    """A producer's transaction creates a message in a channel whose lane housekeeping removes
    meanwhile: it commits after the removal, and its message is delivered (the next ingest
    makes the lane again)."""
    conn = connect()
    queue = broker.queue("q")
    queue.channel("a").message.create(conn, b"1")
    consume_all(broker, conn)
    fold(broker, conn)
    producer = connect(autocommit=False)
    queue.channel("a").message.create(producer, b"late")
    fold(broker, conn)
    assert prune_now(conn, broker.schema) == 1
    assert lanes(conn, broker.schema) == []
    producer.commit()
    assert [m.content for m in consume_all(broker, conn)] == [b"late"]
    assert counters(broker, conn, "q").enqueued == 2
    assert_consistent(conn, broker.schema)


@pytest.mark.slow
def test_an_ingest_of_more_channels_than_the_lock_table_holds(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    """One batch across 10,000 channels (each new lane takes a lane key, a slot of the server's
    lock table until commit: 6,400 by default for every session together): the ingests take
    them 1,000 at a time and every message is delivered, once."""
    queue = broker.queue("q")
    batch = queue.batch()
    for i in range(10_000):
        batch.channel(f"c{i}").message(f"m{i}")
    batch.execute(conn)
    got = consume_all(broker, conn)
    assert len(got) == 10_000 and len({m.id for m in got}) == 10_000
    assert counters(broker, conn, "q").acked == 10_000
    assert_consistent(conn, broker.schema)


def test_an_ingest_of_more_lanes_than_its_key_budget(broker: lonnymq.Broker, conn: Conn) -> None:
    """1,500 channels whose lanes exist (each with a message delayed an hour) get a message
    each in one batch: an ingest takes the keys of at most 1,000 of them, the others wait in
    the pending arrays for the next one; every new message is delivered, once, in order."""
    queue = broker.queue("q")
    batch = queue.batch()
    for i in range(1500):
        batch.channel(f"c{i}").message(f"later{i}", delay_ms=3_600_000)
    batch.execute(conn)
    assert consume_all(broker, conn) == []  # (ingested: the lanes exist, with a later turn)
    assert len(lanes(conn, broker.schema)) == 1500
    batch = queue.batch()
    for i in range(1500):
        batch.channel(f"c{i}").message(f"now{i}")
    batch.execute(conn)
    fold(broker, conn)
    pending = conn.execute(
        sql.SQL("SELECT cardinality(pend_queue) FROM {}.discovery ORDER BY id DESC LIMIT 1").format(
            sql.Identifier(broker.schema)
        )
    ).fetchone()
    assert pending == (500,)
    got = consume_all(broker, conn)
    assert sorted(m.content for m in got) == sorted(f"now{i}".encode() for i in range(1500))
    assert_consistent(conn, broker.schema)


def test_a_dequeue_beside_an_open_policy_change_neither_waits_nor_overwrites_it(
    broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn]
) -> None:
    """A queue-wide policy change locks each lane's live version (schema version 11) until it
    commits: a dequeue that owns the lane meanwhile serves the version it read without
    waiting, and its rewrite of the lane gives way, so the change's version is the live one
    after the commit (one version, limited)."""
    queue = broker.queue("q")
    for i in range(10):
        queue.channel("a").message.create(conn, f"m{i}")
    consume = connect()
    held = queue.dequeue(consume, limit=1, lock_ms=60_000, listen=False).messages  # ingested
    admin = connect(autocommit=False)
    queue.policy.set(admin, max_concurrency=5)  # open: the lane's version is locked
    consume.execute("SET lock_timeout = '2s'")  # (a wait would fail the dequeue)
    held += queue.dequeue(consume, limit=2, lock_ms=60_000, listen=False).messages
    assert [m.content for m in held] == [b"m0", b"m1", b"m2"]
    admin.commit()
    rows = conn.execute(
        sql.SQL("SELECT limited FROM {}.lane WHERE queue = 'q' AND channel = 'a'").format(
            sql.Identifier(broker.schema)
        )
    ).fetchall()
    assert rows == [(True,)]
    broker.delete_many(consume, held)
    assert [m.content for m in consume_all(broker, consume)] == [
        f"m{i}".encode() for i in range(3, 10)
    ]
    assert_consistent(conn, broker.schema)


@pytest.mark.parametrize("change", ["policy", "purge"])
def test_a_queue_wide_change_waits_for_a_lane_being_replaced_and_takes_its_successor(
    change: str, broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn]
) -> None:
    """A queue-wide change (schema version 24: the live version of every lane locked in one
    statement) that meets a version its owner is replacing (lane_put_v1, as a dequeue that
    owns the lane does, in a transaction still open) waits for it, and then locks and
    rewrites the version written meanwhile: none of the queue's lanes is left out."""
    queue = broker.queue("q")
    for channel in "ab":
        for i in range(10):
            queue.channel(channel).message.create(conn, f"{channel}{i}")
    consume = connect()
    held = queue.dequeue(consume, limit=2, lock_ms=60_000, listen=False).messages  # ingested
    owner = connect(autocommit=False)
    owner.execute(
        sql.SQL(
            "SELECT {s}.lane_put_v1(l.id, l) FROM {s}.lane l WHERE queue = 'q' AND channel = 'a'"
        ).format(s=sql.Identifier(broker.schema))
    )
    admin = connect()
    with ThreadPoolExecutor(max_workers=1) as pool:
        if change == "policy":
            done: Future[int | None] = pool.submit(queue.policy.set, admin, max_concurrency=5)
        else:
            done = pool.submit(queue.purge, admin)
        wait_blocked_by(conn, admin, [owner])
        owner.commit()
        purged = done.result(timeout=30)
    live = conn.execute(
        sql.SQL(
            "SELECT channel, limited, turn_at IS NOT NULL, cardinality(prios) FROM {}.lane "
            "WHERE queue = 'q' ORDER BY channel"
        ).format(sql.Identifier(broker.schema))
    ).fetchall()
    if change == "policy":
        assert [(c, limited) for c, limited, _, _ in live] == [("a", True), ("b", True)]
    else:
        assert purged == 18
        assert [(c, turn, n) for c, _, turn, n in live] == [("a", False, 0), ("b", False, 0)]
    broker.delete_many(consume, held)
    assert sorted(m.content for m in consume_all(broker, consume)) == (
        []
        if change == "purge"
        else sorted(
            {f"{c}{i}".encode() for c in "ab" for i in range(10)} - {m.content for m in held}
        )
    )
    assert_consistent(conn, broker.schema)


@pytest.mark.parametrize("change", ["policy", "purge"])
def test_a_queue_wide_change_keeps_lane_times_whatever_the_sessions_date_style(
    change: str, broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn]
) -> None:
    """The lanes a queue-wide change rewrites keep their times exactly in a session whose
    DateStyle is not ISO (a timestamp written as text with a zone abbreviation, 'IST' here,
    read back as another zone's: a first version of schema version 24 read the lanes
    through text, and shifted them by hours)."""
    queue = broker.queue("q")
    for channel in "ab":
        for i in range(2):
            queue.channel(channel).message.create(conn, f"{channel}{i}")
    served = queue.dequeue(conn, limit=2, lock_ms=60_000, listen=False).messages
    assert sorted(m.channel for m in served) == ["a", "b"]  # (each lane served once)
    broker.delete_many(conn, served)
    times = sql.SQL(
        "SELECT channel, turn_at::text, served_at::text, pos_at::text, limited FROM {}.lane "
        "WHERE queue = 'q' ORDER BY channel"
    ).format(sql.Identifier(broker.schema))
    before = conn.execute(times).fetchall()  # (as text in this session's DateStyle, ISO)
    assert [c for c, *_ in before] == ["a", "b"]
    admin = connect()
    admin.execute("SET DateStyle = 'SQL, DMY'")
    admin.execute("SET TimeZone = 'Asia/Kolkata'")
    if change == "policy":
        queue.policy.set(admin, max_concurrency=5)  # (every lane rewritten: now limited)
        assert conn.execute(times).fetchall() == [(*row[:4], True) for row in before]
    else:
        assert queue.purge(admin) == 2
        assert [(c, turn, at) for c, turn, at, *_ in conn.execute(times).fetchall()] == [
            (c, None, at) for c, _, at, *_ in before
        ]
    assert_consistent(conn, broker.schema)
