"""Transactional enqueue: Kombu publishes and Celery tasks in the caller's transaction."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Queue
from psycopg.rows import dict_row, namedtuple_row

import lonnymq
from tests.apps import close_app
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


@pytest.fixture
def kombu_conn(pg_dsn: str, schema: str) -> Iterator[Connection]:
    url = lonnymq_url(pg_dsn)
    with Connection(url, transport_options={"schema": schema}) as connection:
        connection.connect()
        yield connection


def total(conn: Conn, schema: str, queue: str) -> int:
    return lonnymq.Broker(schema).queue(queue).stats(conn, count_ready=False).total


def test_kombu_publish_in_caller_transaction(
    kombu_conn: Connection, connect: Callable[..., Conn], conn: Conn, schema: str
) -> None:
    queue = Queue("txq")
    queue(kombu_conn.default_channel).declare()
    producer = kombu_conn.Producer()
    tx = connect(autocommit=False)
    tx.execute("CREATE TEMP TABLE orders (id int)")
    with lonnymq.transaction(tx):
        tx.execute("INSERT INTO orders VALUES (1)")
        producer.publish({"order": 1}, routing_key="txq")
        assert total(conn, schema, "txq") == 0  # not visible before commit
    assert tx.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # not committed
    tx.rollback()
    assert total(conn, schema, "txq") == 0  # the message never existed
    with lonnymq.transaction(tx):
        producer.publish({"order": 2}, routing_key="txq")
    tx.commit()
    simple = kombu_conn.SimpleQueue(queue)
    message = simple.get(timeout=5)
    assert message.payload == {"order": 2}
    message.ack()
    simple.close()
    # outside the block, publishes use the transport's own connection again
    producer.publish({"order": 3}, routing_key="txq")
    tx.rollback()
    assert total(conn, schema, "txq") == 1


def test_autocommit_connection_gets_a_transaction_of_its_own(
    kombu_conn: Connection, conn: Conn, connect: Callable[..., Conn], schema: str
) -> None:
    queue = Queue("txa")
    queue(kombu_conn.default_channel).declare()
    producer = kombu_conn.Producer()
    caller = connect()  # autocommit
    caller.execute("CREATE TEMP TABLE t (id int)")
    with pytest.raises(RuntimeError), lonnymq.transaction(caller):
        caller.execute("INSERT INTO t VALUES (1)")
        producer.publish("lost", routing_key="txa")
        raise RuntimeError("the caller fails after publishing")
    assert total(conn, schema, "txa") == 0
    assert caller.execute("SELECT count(*) FROM t").fetchone() == (0,)
    with lonnymq.transaction(caller):
        caller.execute("INSERT INTO t VALUES (2)")
        producer.publish("kept", routing_key="txa")
    assert total(conn, schema, "txa") == 1
    assert caller.execute("SELECT count(*) FROM t").fetchone() == (1,)


def test_celery_task_in_caller_transaction(
    pg_dsn: str, schema: str, conn: Conn, connect: Callable[..., Conn]
) -> None:
    from celery import Celery

    app = Celery("txapp", broker=lonnymq_url(pg_dsn))
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="txapp.send_invoice")  # type: ignore[untyped-decorator]
    def send_invoice(order_id: int) -> int:
        return order_id

    send_invoice.delay(0)  # first publish declares the queue and its binding
    assert total(conn, schema, "celery") == 1
    tx = connect(autocommit=False)
    with lonnymq.transaction(tx):
        send_invoice.delay(1)
    tx.rollback()
    assert total(conn, schema, "celery") == 1
    with lonnymq.transaction(tx):
        send_invoice.apply_async((2,), countdown=60)
    tx.commit()
    stats = lonnymq.Broker(schema).queue("celery").stats(conn)
    assert (stats.total, stats.delayed) == (2, 1)
    close_app(app)


def test_bad_connections(pg_dsn: str) -> None:
    with pytest.raises(lonnymq.InvalidArgument), lonnymq.transaction("postgresql://x"):
        pass

    async def go() -> None:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn)
        try:
            with (
                pytest.raises(lonnymq.InvalidArgument, match="sync psycopg"),
                lonnymq.transaction(aconn),
            ):
                pass
        finally:
            await aconn.close()

    import asyncio

    asyncio.run(go())


def test_async_publish_of_a_celery_task(
    pg_dsn: str, schema: str, conn: Conn, kombu_conn: Connection
) -> None:
    """apublish writes the task apply_async would, on the caller's AsyncConnection."""
    import asyncio

    from celery import Celery

    import lonnymq.celery

    app = Celery("asyncapp", broker=lonnymq_url(pg_dsn))
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="asyncapp.mul")  # type: ignore[untyped-decorator]
    def mul(x: int, y: int) -> int:
        return x * y

    async def go() -> str:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn)
        try:
            async with aconn.transaction():
                await lonnymq.celery.apublish(aconn, mul, (2, 3))
                raise psycopg.Rollback()
            async with aconn.transaction():
                await lonnymq.celery.apublish(aconn, mul, (4, 5), countdown=60)
                return await lonnymq.celery.apublish(aconn, mul, (6, 7), headers={"x-channel": "t"})
        finally:
            await aconn.close()

    task_id = asyncio.run(go())
    stats = lonnymq.Broker(schema).queue("celery").stats(conn)
    assert (stats.total, stats.delayed) == (2, 1)
    simple = kombu_conn.SimpleQueue("celery")
    message = simple.get(timeout=5)
    assert message.headers["task"] == "asyncapp.mul" and message.headers["id"] == task_id
    args, kwargs, _ = message.decode()
    assert (args, kwargs) == ([6, 7], {})
    message.ack()
    simple.close()
    close_app(app)


def test_async_publish_follows_the_tasks_routes(pg_dsn: str, schema: str, conn: Conn) -> None:
    """apublish sends the task where ``apply_async`` does: the queue ``task_routes`` names
    (it went to ``task_default_queue``), the queue given to it before a route; a non-task is
    refused with a ``TypeError``. (A task's own ``queue`` attribute, which Celery 5.6
    deprecates, goes before a route too, as in ``apply_async``.)"""
    import asyncio

    from celery import Celery

    import lonnymq.celery

    app = Celery("routedapp", broker=lonnymq_url(pg_dsn))
    app.conf.broker_transport_options = {"schema": schema}
    app.conf.task_routes = {"routedapp.*": {"queue": "emails"}}
    lonnymq.install(conn, schema)  # (apublish needs the schema installed)

    @app.task(name="routedapp.send")  # type: ignore[untyped-decorator]
    def send(to: str) -> None:
        return None

    async def go() -> None:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn)
        try:
            async with aconn.transaction():
                await lonnymq.celery.apublish(aconn, send, ("a@example.com",))
                await lonnymq.celery.apublish(aconn, send, ("b@example.com",), queue="given")
            with pytest.raises(TypeError, match="a Celery task"):
                await lonnymq.celery.apublish(aconn, "routedapp.send")
        finally:
            await aconn.close()

    asyncio.run(go())
    broker = lonnymq.Broker(schema)
    sizes = {q: broker.queue(q).stats(conn).total for q in ("emails", "given", "celery")}
    assert sizes == {"emails": 1, "given": 1, "celery": 0}
    close_app(app)


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("dict_row", {"row_factory": dict_row}),
        ("namedtuple_row", {"row_factory": namedtuple_row}),
        ("client_cursor", {}),
    ],
    ids=["dict_row", "namedtuple_row", "client_cursor"],
)
def test_a_connection_of_the_applications_kind(
    kombu_conn: Connection, pg_dsn: str, schema: str, kind: str, options: dict[str, Any]
) -> None:
    """An application's connection whose ``row_factory`` makes dicts or named tuples (psycopg
    3's ``dict_row``, common in applications), or whose cursors bind parameters on the client
    (``psycopg.ClientCursor``, as Django's do, and no binary rows), runs every lonnymq call
    made on it: the install, a create, a batch, a transactional publish, a dequeue and its ack,
    a status, and an async create. (Rows were read by position: a ``KeyError`` at the
    install; the dequeue's rows come in binary: "client-side cursors don't support binary
    results".)"""
    sync_options = dict(options)
    async_options = dict(options)
    if kind == "client_cursor":
        sync_options["cursor_factory"] = psycopg.ClientCursor
        async_options["cursor_factory"] = psycopg.AsyncClientCursor
    broker = lonnymq.Broker(schema)
    channel = broker.queue("rf").channel("c")
    with psycopg.connect(pg_dsn, autocommit=True, **sync_options) as app:
        broker.install(app)
        assert isinstance(channel.message.create(app, b"one"), lonnymq.Created)
        batch = broker.queue("rf").batch()
        made = batch.channel("c").message(b"two")
        batch.execute(app)
        assert isinstance(made.get(), lonnymq.Created)
        Queue("rf")(kombu_conn.default_channel).declare()
        with lonnymq.transaction(app):
            kombu_conn.Producer().publish({"three": 3}, routing_key="rf")
        got = broker.dequeue(app, ["rf"], limit=10)
        assert sorted(m.content for m in got.messages)[:2] == [b"one", b"two"]
        assert len(got.messages) == 3
        broker.dequeue(app, ["rf"], limit=1, ack=got.messages)
        assert [(s.queue, s.total) for s in broker.status(app)] == [("rf", 0)]

    async def create_async() -> object:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, **async_options)
        async with aconn:
            return await channel.message.create(aconn, b"four")

    assert isinstance(asyncio.run(create_async()), lonnymq.Created)
