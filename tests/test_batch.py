"""Batches (sorted, pipelined, atomic) and the async producer side."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import ChannelFull, Created, Deduplicated, Dropped, Pending, Policy

Conn = psycopg.Connection[Any]


def test_batch_results_in_submission_order(queue: lonnymq.Queue, conn: Conn) -> None:
    batch = queue.batch()
    results: list[Pending[Any]] = [
        batch.channel("foo").message(b"hi"),
        batch.channel("bar").policy.clear(),
        batch.channel("bar").message(b"hi", name="foo"),
        batch.channel("bar").message(b"hi"),
        batch.channel("bar").message(b"again", name="foo"),
    ]
    out = batch.execute(conn)
    assert [type(r).__name__ for r in out] == [
        "Created",
        "NoneType",
        "Created",
        "Created",
        "Deduplicated",
    ]
    assert out == [r.get() for r in results]
    named = results[2].get()
    assert isinstance(named, Created)
    assert results[4].get() == Deduplicated(named.id)
    with pytest.raises(lonnymq.InvalidArgument):
        batch.channel("x").message(b"late")


def test_pending_before_execute(queue: lonnymq.Queue) -> None:
    pending = queue.batch().channel("a").message(b"x")
    with pytest.raises(lonnymq.InvalidArgument, match="not been executed"):
        pending.get()


def test_batch_across_queues_and_policies(broker: lonnymq.Broker, conn: Conn) -> None:
    batch = broker.batch()
    batch.queue("q2").channel("a").message(b"2")
    batch.queue("q1").policy.set(max_size=5)
    batch.queue("q1").channel("a").policy.set(max_concurrency=1)
    batch.queue("q1").channel("a").message(b"1")
    batch.execute(conn)
    assert broker.queue("q1").policy.get(conn) == Policy(None, 5)
    assert broker.queue("q1").channel("a").info(conn).own == Policy(1, None)
    assert sorted(m.content for m in broker.dequeue(conn, ["q1", "q2"], limit=5).messages) == [
        b"1",
        b"2",
    ]


def test_batch_full_channel_rolls_back_everything(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("small").policy.set(conn, max_size=1)
    batch = queue.batch()
    batch.channel("other").message(b"x")
    batch.channel("small").message(b"1")
    batch.channel("small").message(b"2")
    with pytest.raises(ChannelFull):
        batch.execute(conn)
    assert queue.stats(conn).total == 0


def test_batch_full_channel_without_raising(queue: lonnymq.Queue, conn: Conn) -> None:
    queue.channel("small").policy.set(conn, max_size=1)
    batch = queue.batch()
    ok = batch.channel("small").message(b"1")
    dropped = batch.channel("small").message(b"2")
    batch.execute(conn, raise_if_dropped=False)
    assert isinstance(ok.get(), Created)
    assert dropped.get() == Dropped("default", "small")
    assert queue.stats(conn).total == 1


def test_batch_applies_each_channels_own_max_size_else_the_queues(
    queue: lonnymq.Queue, conn: Conn
) -> None:
    """A batch over channels of every kind (the queue's default max_size, a max_size of the
    channel's own, an own policy without one, which lifts the default) refuses exactly what
    one create at a time would, in submission order, and counts the sized ones."""
    queue.policy.set(conn, max_size=2)
    queue.channel("own").policy.set(conn, max_size=1)
    queue.channel("free").policy.set(conn, max_concurrency=5)
    batch = queue.batch()
    order = ["d", "own", "free", "d", "own", "free", "d", "free"] + ["free"] * 20
    pending = [batch.channel(c).message(f"{c}{i}".encode()) for i, c in enumerate(order)]
    batch.execute(conn, raise_if_dropped=False)
    kinds = [(c, type(p.get()).__name__) for c, p in zip(order, pending, strict=True)]
    dropped = [(c, i) for i, (c, kind) in enumerate(kinds) if kind == "Dropped"]
    assert dropped == [("own", 4), ("d", 6)], kinds
    assert queue.stats(conn).total == len(order) - 2
    sizes = dict(
        conn.execute(
            sql.SQL("SELECT name, current_size FROM {} WHERE queue = %s").format(
                sql.Identifier(queue.schema, "channel")
            ),
            (queue.name,),
        ).fetchall()
    )
    assert sizes == {"d": 2, "own": 1, "free": 0}


def test_batch_in_caller_transaction(queue: lonnymq.Queue, connect: Any) -> None:
    tx = connect(autocommit=False)
    observer = connect()
    batch = queue.batch()
    batch.channel("a").message(b"1")
    batch.channel("b").message(b"2")
    batch.execute(tx)
    assert tx.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # not committed
    assert queue.stats(observer).total == 0
    tx.rollback()
    assert queue.stats(observer).total == 0
    batch = queue.batch()
    batch.channel("a").message(b"3")
    batch.execute(tx)
    tx.commit()
    assert queue.stats(observer).total == 1


def test_failed_batch_leaves_caller_transaction_usable(queue: lonnymq.Queue, connect: Any) -> None:
    tx = connect(autocommit=False)
    queue.channel("full").policy.set(tx, max_size=0)
    queue.channel("a").message.create(tx, b"before")
    batch = queue.batch()
    batch.channel("a").message(b"in batch")
    batch.channel("full").message(b"refused")
    with pytest.raises(ChannelFull):
        batch.execute(tx)
    queue.channel("a").message.create(tx, b"after")
    tx.commit()
    contents = sorted(m.content for m in queue.dequeue(connect(), limit=10).messages)
    assert contents == [b"after", b"before"]


def test_empty_batch(queue: lonnymq.Queue, conn: Conn) -> None:
    assert queue.batch().execute(conn) == []


def test_batch_without_queue_needs_one(broker: lonnymq.Broker) -> None:
    with pytest.raises(lonnymq.InvalidArgument):
        broker.batch().channel("a")


def test_async_producer(queue: lonnymq.Queue, pg_dsn: str, conn: Conn) -> None:
    async def produce() -> list[Any]:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            ch = queue.channel("a")
            created = await ch.message.create(aconn, b"async", name="n")
            dedup = await ch.message.create(aconn, b"async", name="n")
            await ch.policy.set(aconn, max_size=3)
            await queue.policy.set(aconn, max_concurrency=4)
            batch = queue.batch()
            batch.channel("b").message(b"b1")
            batch.channel("b").message(b"b2")
            out = await batch.execute(aconn)
            async with aconn.transaction():
                await ch.message.create(aconn, b"rolled back")
                raise psycopg.Rollback()
            with pytest.raises(ChannelFull):
                await ch.message.create(aconn, b"2")
                await ch.message.create(aconn, b"3")
                await ch.message.create(aconn, b"4")
            await ch.policy.clear(aconn)
            await queue.policy.clear(aconn)
            return [created, dedup, *out]
        finally:
            await aconn.close()

    created, dedup, b1, b2 = asyncio.run(produce())
    assert isinstance(created, Created) and dedup == Deduplicated(created.id)
    assert isinstance(b1, Created) and isinstance(b2, Created)
    contents = sorted(m.content for m in queue.dequeue(conn, limit=20).messages)
    assert contents == [b"2", b"3", b"async", b"b1", b"b2"]
    assert queue.policy.get(conn) == Policy(None, None)


def test_async_errors_are_translated(pg_dsn: str) -> None:
    async def go() -> None:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            await lonnymq.Queue("q", schema="lmq_absent").channel("a").message.create(aconn, b"x")
        finally:
            await aconn.close()

    with pytest.raises(lonnymq.SchemaNotInstalled):
        asyncio.run(go())
