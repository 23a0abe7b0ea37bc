"""The Kombu transport in one process: URL, options, routing, delivery semantics."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import kombu
import kombu.exceptions
import kombu.messaging
import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from psycopg import sql

import lonnymq
from lonnymq.transport import Transport
from tests.commit_modes import record_commit_modes, recorded_statements
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


@pytest.fixture
def connection(make_connection: Callable[..., Connection]) -> Connection:
    return make_connection()


def drain(connection: Connection, until: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out waiting for messages"
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=0.5)


def test_alias_url_and_class_path(pg_dsn: str, schema: str) -> None:
    url = lonnymq_url(pg_dsn)
    with Connection(url, transport_options={"schema": schema}) as c:
        assert isinstance(c.transport, Transport)
        c.connect()
    with Connection(url, transport=lonnymq.TRANSPORT, transport_options={"schema": schema}) as c:
        assert isinstance(c.transport, Transport)


def test_as_uri_masks_password() -> None:
    c = Connection("lonnymq://alice:s3cr3t@db.example:5432/app?sslmode=require")
    assert c.as_uri() == "lonnymq://alice:**@db.example:5432/app?sslmode=require"
    assert "s3cr3t" in c.as_uri(include_password=True)
    assert "s3cr3t" not in repr(c)


def test_libpq_parameters_pass_through(pg_dsn: str, schema: str) -> None:
    url = lonnymq_url(pg_dsn) + "?application_name=from-url&connect_timeout=5"
    with Connection(url, transport_options={"schema": schema}) as c:
        c.connect()
        pg = c.transport.pg.connection()
        assert pg.info.get_parameters()["connect_timeout"] == "5"


def test_separate_fields(pg_dsn: str, schema: str) -> None:
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    with Connection(
        hostname=str(info.get("host", "localhost")),
        port=int(str(info.get("port", 5432))),
        userid=str(info.get("user", "postgres")),
        virtual_host=str(info.get("dbname", "postgres")),
        transport="lonnymq",
        transport_options={"schema": schema},
    ) as c:
        c.connect()
        queue = c.SimpleQueue("fields")
        queue.put({"ok": 1})
        assert queue.get(timeout=5).payload == {"ok": 1}
        queue.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"visibility_timout": 5}, "unknown lonnymq transport option"),
        ({"schema": "Bad-Name"}, "invalid schema name"),
        ({"visibility_timeout": -1}, "visibility_timeout"),
        ({"visibility_timeout": "soon"}, "visibility_timeout"),
        ({"batch_size": 0}, "batch_size"),
        ({"use_listen": "yes"}, "use_listen"),
        ({"event_loop": "yes"}, "event_loop"),
        ({"refill_delay": -1}, "refill_delay"),
        ({"refill_delay": 2}, "refill_delay"),
        ({"consumer_commit": "maybe"}, "consumer_commit"),
        ({"publish_commit": "later"}, "publish_commit"),
        ({"heartbeat_interval": 10, "visibility_timeout": 5}, "heartbeat_interval"),
    ],
)
def test_bad_options(pg_dsn: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(lonnymq.ConfigurationError, match=match):
        Connection(lonnymq_url(pg_dsn), transport_options=options).connect()


def test_bad_url() -> None:
    with pytest.raises(lonnymq.ConfigurationError):
        Connection("lonnymq://u:p@host:notaport/db").connect()


def test_unreachable_server_is_a_connection_error(schema: str) -> None:
    c = Connection("lonnymq://u:secret@127.0.0.1:1/db", transport_options={"schema": schema})
    with pytest.raises((kombu.exceptions.OperationalError, *c.connection_errors)) as err:
        c.ensure_connection(max_retries=1, interval_start=0)
    assert "secret" not in str(err.value)


def test_schema_installed_on_first_use(connection: Connection, conn: Conn, schema: str) -> None:
    connection.connect()
    assert lonnymq.Broker(schema).check(conn) == lonnymq.CURRENT_VERSION


def test_auto_install_off(make_connection: Callable[..., Connection]) -> None:
    c = make_connection(auto_install=False)
    with pytest.raises(lonnymq.SchemaNotInstalled, match="lonnymq migrate"):
        c.connect()


def test_direct_topic_fanout_routing(connection: Connection) -> None:
    direct = Exchange("d", type="direct")
    topic = Exchange("t", type="topic")
    fanout = Exchange("f", type="fanout")
    queues = [
        Queue("d1", direct, routing_key="one"),
        Queue("d2", direct, routing_key="two"),
        Queue("t_all", topic, routing_key="stock.#"),
        Queue("t_usd", topic, routing_key="stock.*.usd"),
        Queue("f1", fanout),
        Queue("f2", fanout),
    ]
    got: dict[str, list[Any]] = {q.name: [] for q in queues}

    def collect(queue: str) -> Callable[[Any, Any], None]:
        def on_message(body: Any, message: Any) -> None:
            got[queue].append(body)
            message.ack()

        return on_message

    with connection.Producer() as producer:
        for q in queues:
            q(connection.default_channel).declare()
        producer.publish("to-one", exchange=direct, routing_key="one")
        producer.publish("to-two", exchange=direct, routing_key="two")
        producer.publish("nobody", exchange=direct, routing_key="three")
        producer.publish("eur", exchange=topic, routing_key="stock.nyse.eur")
        producer.publish("usd", exchange=topic, routing_key="stock.nyse.usd")
        producer.publish("deep", exchange=topic, routing_key="stock.a.b.c")
        producer.publish("bond", exchange=topic, routing_key="bond.x.usd")
        producer.publish("all", exchange=fanout, routing_key="")
    consumers = [connection.Consumer(q, callbacks=[collect(q.name)]) for q in queues]
    for c in consumers:
        c.consume()
    drain(connection, lambda: sum(len(v) for v in got.values()) >= 8)
    assert got["d1"] == ["to-one"] and got["d2"] == ["to-two"]
    assert sorted(got["t_all"]) == ["deep", "eur", "usd"]
    assert got["t_usd"] == ["usd"]
    assert got["f1"] == ["all"] and got["f2"] == ["all"]


def test_bindings_persist_across_connections(
    make_connection: Callable[..., Connection],
) -> None:
    exchange = Exchange("shared", type="topic")
    first = make_connection()
    Queue("sq", exchange, routing_key="a.*")(first.default_channel).declare()
    first.release()
    second = make_connection()  # another connection: no in-memory state shared
    with second.Producer() as producer:
        producer.publish({"n": 1}, exchange=exchange, routing_key="a.b")
    simple = second.SimpleQueue(Queue("sq", exchange, routing_key="a.*"))
    assert simple.get(timeout=5).payload == {"n": 1}
    channel = second.default_channel
    assert ("a.*", "^a\\.[^.]*$", "sq") in channel.get_table("shared")
    simple.close()


def test_ack_reject_requeue(connection: Connection, conn: Conn, schema: str) -> None:
    queue = connection.SimpleQueue("acks")
    for i in range(3):
        queue.put(i)
    first = queue.get(timeout=5)
    first.reject(requeue=True)  # unlocks the same row: redelivered, not copied
    stats = lonnymq.Broker(schema).queue("acks").stats(conn)
    assert stats.total == 3
    seen = []
    for _ in range(3):
        message = queue.get(timeout=5)
        seen.append((message.payload, message.delivery_info["redelivered"]))
        message.ack()
    assert sorted(seen) == [(0, True), (1, False), (2, False)]
    queue.put("dropped")
    queue.get(timeout=5).reject(requeue=False)
    assert lonnymq.Broker(schema).queue("acks").stats(conn).total == 0
    with pytest.raises(queue.Empty):
        queue.get(timeout=0.3)
    queue.close()


def test_requeue_keeps_the_message_in_its_place(connection: Connection) -> None:
    """As on RabbitMQ, a requeued message goes back where it was, ahead of later ones.
    Celery's rpc:// result backend relies on it: it gets every state message of a reply
    queue, acks the older ones and requeues the latest; were the latest put behind an older
    one, the next poll would keep the older state and ack (lose) the result."""
    channel = connection.default_channel
    exchange = Exchange("replies", "direct")
    queue = Queue("replies", exchange, "replies", channel=channel)
    queue.declare()
    producer = kombu.messaging.Producer(channel, exchange=exchange, routing_key="replies")
    for state in ("PENDING", "RETRY", "SUCCESS"):
        producer.publish({"state": state})
    got = [queue.get(no_ack=False) for _ in range(3)]
    assert [m.payload["state"] for m in got] == ["PENDING", "RETRY", "SUCCESS"]
    got[0].ack()
    got[2].requeue()  # the latest first (as Celery does), then an older one
    got[1].requeue()
    again = [queue.get(no_ack=False) for _ in range(2)]
    assert [m.payload["state"] for m in again] == ["RETRY", "SUCCESS"]
    for message in again:
        message.ack()
    assert queue.get() is None


def test_late_ack_after_redelivery_is_harmless(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    a = make_connection(visibility_timeout=0.2, heartbeat_interval=0.1)
    b = make_connection(visibility_timeout=30)
    qa, qb = a.SimpleQueue("late"), b.SimpleQueue("late")
    qa.put("x")
    held = qa.get(timeout=5)
    a.transport._heartbeat.stopped.set()  # as if a were frozen: its lock expires
    time.sleep(0.4)
    again = qb.get(timeout=5)
    assert again.delivery_info["redelivered"]
    held.ack()  # stale token: logged, does not delete b's delivery
    assert "ack of message" in caplog.text
    again.ack()
    qa.close()
    qb.close()


@pytest.mark.slow
def test_prefetch_limits_deliveries(connection: Connection) -> None:
    queue = Queue("prefetch")
    producer = connection.Producer()
    for i in range(20):
        producer.publish(i, routing_key="prefetch", declare=[queue])
    received: list[Any] = []
    consumer = connection.Consumer(queue, callbacks=[lambda body, m: received.append(m)])
    consumer.qos(prefetch_count=5)
    consumer.consume()
    for _ in range(5):
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=0.3)
    assert len(received) == 5  # the window is full: nothing more until acks
    for message in received[:3]:
        message.ack()
    drain(connection, lambda: len(received) >= 8)
    assert len(received) == 8
    consumer.cancel()


def test_priority_order(connection: Connection) -> None:
    queue = Queue("prio")
    producer = connection.Producer()
    for priority in [1, 5, 9, 0, 7]:
        producer.publish(priority, routing_key="prio", priority=priority, declare=[queue])
    simple = connection.SimpleQueue(queue)
    order = []
    for _ in range(5):
        message = simple.get(timeout=5)
        order.append(message.payload)
        message.ack()
    assert order == [9, 7, 5, 1, 0]
    simple.close()


def test_delay_headers(connection: Connection) -> None:
    from datetime import datetime, timedelta, timezone

    simple = connection.SimpleQueue("delays")
    eta = (datetime.now(timezone.utc) + timedelta(milliseconds=700)).isoformat()
    simple.put("eta", headers={"eta": eta})
    simple.put("delay", headers={"x-delay-ms": 400})
    simple.put("now")
    first = simple.get(timeout=5)
    assert first.payload == "now"
    first.ack()
    start = time.monotonic()
    second = simple.get(timeout=5)
    assert second.payload == "delay" and time.monotonic() - start > 0.2
    second.ack()
    third = simple.get(timeout=5)
    assert third.payload == "eta"
    third.ack()
    simple.close()


def test_dedup_header(connection: Connection, conn: Conn, schema: str) -> None:
    simple = connection.SimpleQueue("dedup")
    for _ in range(3):
        simple.put("job", headers={"x-dedup-name": "job-1"})
    assert lonnymq.Broker(schema).queue("dedup").stats(conn).total == 1
    simple.get(timeout=5).ack()
    simple.close()


def test_channel_header_and_fairness(connection: Connection) -> None:
    simple = connection.SimpleQueue("tenants")
    for i in range(50):
        simple.put(f"big-{i}", headers={"x-channel": "big"})
    for i in range(3):
        simple.put(f"small-{i}", headers={"x-channel": "small"})
    first = []
    for _ in range(6):
        message = simple.get(timeout=5)
        first.append(message.payload)
        message.ack()
    assert sum(p.startswith("small") for p in first) == 3
    simple.close()


def test_full_channel_raises_at_publish(connection: Connection, conn: Conn, schema: str) -> None:
    simple = connection.SimpleQueue("bounded")
    lonnymq.Broker(schema).queue("bounded").channel("t").policy.set(conn, max_size=1)
    simple.put(1, headers={"x-channel": "t"})
    with pytest.raises(lonnymq.ChannelFull):
        simple.put(2, headers={"x-channel": "t"})
    simple.close()


def test_a_declare_answers_what_waits_in_every_state(
    connection: Connection, connect: Callable[..., Conn], schema: str
) -> None:
    """A declare's message_count (and in-flight count) read from every source the counts
    have: messages not ingested yet (committed after the ingest's snapshot, and in a
    transaction that was running in it), tallies not folded yet, folded counts; the same
    as the sums of channel_totals_v1 at each step."""
    s = sql.Identifier(schema)
    admin = connect()
    reference = sql.SQL(
        "SELECT coalesce(sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged"
        " - (t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held"
        " - t.removed_held)), 0), coalesce(sum(t.delivered - t.redelivered - t.acked"
        " - t.deferred - t.dead_held - t.removed_held), 0) FROM {}.channel_totals_v1('counted') t"
    ).format(s)
    declare = sql.SQL(
        "SELECT * FROM {}.queue_declare_v2('counted', NULL, NULL, false, NULL)"
    ).format(s)

    def both(expected: tuple[int, int]) -> None:
        assert connection.default_channel.queue_declare("counted").message_count == expected[0]
        assert admin.execute(declare).fetchone() == expected
        assert admin.execute(reference).fetchone() == expected

    both((0, 0))
    producer = connection.Producer()
    for i in range(3):  # not ingested yet
        producer.publish(i, routing_key="counted", headers={"x-channel": f"t{i % 2}"})
    both((3, 0))
    held = connection.default_channel.basic_get("counted", no_ack=False)  # ingested, one held
    assert held is not None
    both((2, 1))
    # a publish in a transaction that is running while an ingest takes its snapshot
    publisher = connect()
    with lonnymq.transaction(publisher):
        producer.publish("late", routing_key="counted")  # (on the caller's connection)
        admin.execute(sql.SQL("SELECT {}.ingest_v1(ARRAY['counted'], true, false)").format(s))
        both((2, 1))
    both((3, 1))
    admin.execute(sql.SQL("SELECT {}.ingest_v1(ARRAY['counted'], true, true)").format(s))
    both((3, 1))  # folded
    held.ack()
    connection.default_channel.basic_get("counted", no_ack=True)
    both((2, 0))


def test_purge_size_delete(connection: Connection) -> None:
    channel = connection.default_channel
    channel.queue_declare("admin")
    producer = connection.Producer()
    for i in range(4):
        producer.publish(i, routing_key="admin")
    assert channel.queue_declare("admin", passive=True).message_count == 4
    assert channel.queue_purge("admin") == 4
    assert channel.queue_declare("admin", passive=True).message_count == 0
    channel.queue_delete("admin")
    with pytest.raises(connection.channel_errors):
        channel.queue_declare("never-declared", passive=True)


def test_no_ack_consumer_deletes_on_delivery(
    connection: Connection, conn: Conn, schema: str
) -> None:
    queue = Queue("noack", no_ack=True)
    producer = connection.Producer()
    producer.publish("x", routing_key="noack", declare=[queue])
    received: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda b, m: received.append(b)], no_ack=True):
        drain(connection, lambda: len(received) == 1)
    assert lonnymq.Broker(schema).queue("noack").stats(conn).total == 0


def test_restore_unacked_on_close(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    c = make_connection()
    queue = Queue("restore")
    c.Producer().publish("x", routing_key="restore", declare=[queue])
    received: list[Any] = []
    consumer = c.Consumer(queue, callbacks=[lambda b, m: received.append(m)])
    consumer.consume()
    drain(c, lambda: len(received) == 1)
    c.release()  # closes channels: unacked messages are unlocked, not copied
    stats = lonnymq.Broker(schema).queue("restore").stats(conn)
    assert (stats.total, stats.in_flight) == (1, 0)


def _recorder(received: list[float]) -> Callable[[Any, Any], None]:
    def on_message(body: Any, message: Any) -> None:
        received.append(time.monotonic())
        message.ack()

    return on_message


def test_idle_consumer_wakes_on_notify(
    make_connection: Callable[..., Connection],
) -> None:
    consumer_conn = make_connection(polling_interval=30)
    producer_conn = make_connection()
    queue = Queue("wake")
    queue(consumer_conn.default_channel).declare()
    received: list[float] = []
    with consumer_conn.Consumer(queue, callbacks=[_recorder(received)]):
        with contextlib.suppress(TimeoutError):
            consumer_conn.drain_events(timeout=0.2)  # idle, LISTEN set up

        sent: list[float] = []

        def publish() -> None:
            time.sleep(0.3)
            sent.append(time.monotonic())
            producer_conn.Producer().publish("hi", routing_key="wake")

        thread = threading.Thread(target=publish)
        thread.start()
        consumer_conn.drain_events(timeout=5)
        thread.join()
    assert received and received[0] - sent[0] < 0.5


def test_wakes_for_delayed_message_without_notify(
    make_connection: Callable[..., Connection],
) -> None:
    c = make_connection(polling_interval=30)
    queue = Queue("timer")
    c.Producer().publish("later", routing_key="timer", declare=[queue], headers={"x-delay-ms": 500})
    received: list[float] = []
    start = time.monotonic()
    with c.Consumer(queue, callbacks=[_recorder(received)]):
        c.drain_events(timeout=5)
    assert 0.45 < received[0] - start < 2.0


@pytest.mark.slow
def test_celery_cli_knows_the_url_without_an_app(pg_dsn: str, conn: Conn) -> None:
    """The celery.commands entry point imports lonnymq, so `celery -b lonnymq://...` works
    without -A: with no worker running, inspect reaches the broker and finds no node. (Run in
    a database of its own: without an app there is no way to name a schema.)"""
    import os
    import shutil
    import subprocess
    import sys
    import uuid

    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    dbname = f"lmq_cli_{uuid.uuid4().hex[:10]}"
    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        params = conninfo_to_dict(pg_dsn) | {"dbname": dbname}
        dsn = make_conninfo("", **params)
        url = "lonnymq://{user}@{host}:{port}/{dbname}".format(
            user=params.get("user", "postgres"),
            host=params.get("host", "localhost"),
            port=params.get("port", 5432),
            dbname=dbname,
        )
        celery = shutil.which("celery", path=os.path.dirname(sys.executable)) or "celery"
        out = subprocess.run(
            [celery, "-b", url, "inspect", "ping", "--timeout", "0.5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "No nodes replied" in out.stdout + out.stderr, out.stderr
        assert out.returncode == 69
        help_out = subprocess.run(
            [celery, "lonnymq", "stats", "--dsn", dsn], capture_output=True, text=True, timeout=60
        )
        assert help_out.returncode == 0, help_out.stderr
        assert "in_flight" in help_out.stdout
    finally:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(dbname)))


def test_polling_without_listen(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="lonnymq.transport")
    consumer_conn = make_connection(use_listen=False, polling_interval=0.2)
    queue = Queue("polled")
    queue(consumer_conn.default_channel).declare()
    received: list[float] = []
    with consumer_conn.Consumer(queue, callbacks=[_recorder(received)]):
        with contextlib.suppress(TimeoutError):
            consumer_conn.drain_events(timeout=0.3)
        make_connection().Producer().publish("x", routing_key="polled")
        sent = time.monotonic()
        consumer_conn.drain_events(timeout=5)
    assert received and received[0] - sent < 1.0
    assert "use_listen is off" in caplog.text
    assert consumer_conn.transport._waiter._conn is None  # no LISTEN connection was opened


def test_message_expiration_and_queue_ttl(connection: Connection, conn: Conn, schema: str) -> None:
    """An expired message is never delivered (dropped at dequeue even before a sweep)."""
    simple = connection.SimpleQueue("ttl")
    simple.producer.publish("short", routing_key="ttl", expiration=0.1)
    simple.put("kept")
    time.sleep(0.2)
    message = simple.get(timeout=5)
    assert message.payload == "kept"
    message.ack()
    with pytest.raises(simple.Empty):
        simple.get(timeout=0.3)
    assert lonnymq.Broker(schema).queue("ttl").stats(conn).total == 0
    channel = connection.default_channel
    channel.queue_declare("ttl_queue", arguments={"x-message-ttl": 100})
    connection.Producer().publish("old", routing_key="ttl_queue")
    time.sleep(0.2)
    assert channel.basic_get("ttl_queue") is None
    simple.close()


def test_pickle_and_headers_round_trip(connection: Connection) -> None:
    queue = Queue("roundtrip", routing_key="roundtrip")
    seen: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        seen.append(
            (
                body,
                message.content_type,
                message.headers.get("k1"),
                message.delivery_info["routing_key"],
                message.delivery_info["exchange"],
            )
        )
        message.ack()

    producer = connection.Producer()
    producer.publish(
        {"hello": b"bytes"},
        routing_key="roundtrip",
        declare=[queue],
        serializer="pickle",
        headers={"k1": "v1"},
        retry=True,
    )
    with connection.Consumer(queue, callbacks=[on_message], accept=["pickle"]):
        connection.drain_events(timeout=5)
    assert seen == [({"hello": b"bytes"}, "application/x-python-serialize", "v1", "roundtrip", "")]


def test_simple_buffer_is_no_ack(connection: Connection, conn: Conn, schema: str) -> None:
    buffer = connection.SimpleBuffer("buffer")
    buffer.put({"Hello": "World"}, headers={"k1": "v1"})
    message = buffer.get(timeout=5)
    assert (message.payload, message.headers) == ({"Hello": "World"}, {"k1": "v1"})
    assert lonnymq.Broker(schema).queue("buffer").stats(conn).total == 0
    buffer.close()


def test_full_channel_is_not_retried_forever(
    connection: Connection, conn: Conn, schema: str
) -> None:
    connection.connect()  # installs the schema
    lonnymq.Broker(schema).queue("capped").channel("t").policy.set(conn, max_size=0)
    producer = connection.Producer()
    start = time.monotonic()
    with pytest.raises(lonnymq.ChannelFull):
        producer.publish(
            "x",
            routing_key="capped",
            declare=[Queue("capped")],
            headers={"x-channel": "t"},
            retry=True,
            retry_policy={"max_retries": 100, "interval_start": 1},
        )
    assert time.monotonic() - start < 5
    assert not issubclass(lonnymq.ChannelFull, connection.recoverable_channel_errors)


def test_several_hosts_in_the_url(pg_dsn: str, schema: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(pg_dsn)
    host, port = params.get("host", "localhost"), params.get("port", 5432)
    if str(host).startswith("/"):
        pytest.skip("the test server listens on a unix socket only")
    url = (
        f"lonnymq://{params.get('user', 'postgres')}@127.0.0.1:1,{host}:{port}/"
        f"{params.get('dbname', 'postgres')}?connect_timeout=2"
    )
    with Connection(url, transport_options={"schema": schema}) as c:
        simple = c.SimpleQueue("multi")
        simple.put("via the second host")
        message = simple.get(timeout=5)
        assert message.payload == "via the second host"
        message.ack()
        simple.close()


def test_fork_safety(connection: Connection, conn: Conn, schema: str) -> None:
    """A forked child (Celery prefork) publishing through the parent's kombu connection opens
    its own Postgres connection and leaves the parent's untouched."""
    import os

    simple = connection.SimpleQueue("forked")
    simple.put("parent-1")
    parent_pg = connection.transport.pg.connection()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            simple.put("child")
            assert connection.transport.pg.connection() is not parent_pg
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    simple.put("parent-2")  # the parent's connection still works
    assert connection.transport.pg.connection() is parent_pg
    got = sorted(simple.get(timeout=5).payload for _ in range(3))
    assert got == ["child", "parent-1", "parent-2"]
    simple.close()


def test_acks_from_other_threads(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Celery's pools ack from other threads while the consumer keeps draining; an ack that
    frees room in a full prefetch window wakes the consumer at once (not at the next poll)."""
    from concurrent.futures import ThreadPoolExecutor

    connection = make_connection(polling_interval=30)
    start = time.monotonic()

    queue = Queue("threaded")
    producer = connection.Producer()
    for i in range(60):
        producer.publish(i, routing_key="threaded", declare=[queue])
    received: list[Any] = []
    with ThreadPoolExecutor(4) as pool:

        def on_message(body: Any, message: Any) -> None:
            received.append(body)
            pool.submit(message.ack)

        with connection.Consumer(queue, callbacks=[on_message]) as consumer:
            consumer.qos(prefetch_count=10)
            drain(connection, lambda: len(received) == 60)
    assert sorted(received) == list(range(60))
    assert time.monotonic() - start < 10  # six windows of 10, no 30-second poll in between
    stats = lonnymq.Broker(schema).queue("threaded").stats(conn)
    assert (stats.total, stats.in_flight) == (0, 0)


def test_policies_from_transport_options(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    policies = {
        "jobs": {
            "default": {"max_concurrency": 3},
            "channels": {"vip": {"max_concurrency": None, "max_size": None}, "t1": {"max_size": 2}},
        }
    }
    c = make_connection(policies=policies)
    c.connect()
    queue = lonnymq.Broker(schema).queue("jobs")
    assert queue.policy.get(conn) == lonnymq.Policy(3, None)
    assert queue.channel("vip").info(conn).own == lonnymq.Policy(None, None)
    assert queue.channel("t1").info(conn).effective == lonnymq.Policy(None, 2)
    simple = c.SimpleQueue("jobs")
    simple.put(1, headers={"x-channel": "t1"})
    simple.put(2, headers={"x-channel": "t1"})
    with pytest.raises(lonnymq.ChannelFull):
        simple.put(3, headers={"x-channel": "t1"})
    simple.close()


@pytest.mark.parametrize(
    "policies",
    [
        ["not", "a", "dict"],
        {"q": {"default": {"max_concurency": 1}}},
        {"q": {"channels": {"a": {"max_size": -1}}}},
        {"q": {"defaults": {}}},
        {"q": {"channels": ["a"]}},
    ],
)
def test_bad_policies_option(pg_dsn: str, policies: Any) -> None:
    with pytest.raises(lonnymq.ConfigurationError, match="policies"):
        Connection(lonnymq_url(pg_dsn), transport_options={"policies": policies}).connect()


def test_undecodable_message_is_put_aside(
    connection: Connection, conn: Conn, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = Queue("garbage")
    queue(connection.default_channel).declare()
    bad = (
        lonnymq.Broker(schema)
        .queue("garbage")
        .channel("garbage")
        .message.create(conn, b"\xff not json")
    )
    assert isinstance(bad, lonnymq.Created)
    connection.Producer().publish("good", routing_key="garbage")
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]):
        drain(connection, lambda: received == ["good"])
    assert f"message {bad.id} in queue 'garbage' is not a kombu message" in caplog.text
    broker = lonnymq.Broker(schema)
    stats = broker.queue("garbage").stats(conn)
    assert stats.total == 0  # out of the way: not redelivered again and again
    # kept, not lost: a dead letter a person can look at
    [dead] = broker.messages(conn, queue="garbage", state="dead")
    assert (dead.id, dead.reason) == (bad.id, "undecodable")
    shown = broker.message(conn, bad.id)
    assert shown is not None and shown.content == b"\xff not json"


def test_undecodable_message_where_no_dead_letters_are_kept_waits_an_hour(
    connection: Connection, conn: Conn, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = lonnymq.Broker(schema)
    queue = Queue("garbage")
    queue(connection.default_channel).declare()  # installs the schema
    broker.queue("garbage").configure(conn, dead_letter=False)
    bad = broker.queue("garbage").channel("garbage").message.create(conn, b"\xff not json")
    assert isinstance(bad, lonnymq.Created)
    connection.Producer().publish("good", routing_key="garbage")
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]):
        drain(connection, lambda: received == ["good"])
    stats = broker.queue("garbage").stats(conn)
    assert (stats.total, stats.delayed) == (1, 1)  # kept, not lost, not redelivered at once


def test_consumer_commit_async_is_transaction_local(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Dequeue and ack skip the WAL-flush wait only for their own transactions: the
    session's setting (and so every publish) stays durable."""
    for mode in ("async", "sync"):
        c = make_connection(consumer_commit=mode)
        simple = c.SimpleQueue(f"commit-{mode}")
        simple.put("x")
        message = simple.get(timeout=5)
        message.ack()
        pg = c.transport.pg.connection()
        assert pg.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert lonnymq.Broker(schema).queue(f"commit-{mode}").stats(conn).total == 0
        simple.close()


def test_the_flush_after_an_asynchronous_commit_makes_it_durable(
    make_connection: Callable[..., Connection], schema: str
) -> None:
    """What ``publish_commit="flush_after"`` relies on: once the flush statement returns,
    the WAL is flushed past the asynchronous commit before it. (A transaction that only
    takes a transaction ID, ``SELECT pg_current_xact_id()``, commits without waiting for the
    flush: this caught it.) Ten times, each right after the asynchronous commit, before
    the WAL writer's own flush."""
    from lonnymq.queue._ops import async_commit, flush_op, run
    from lonnymq.queue.routing import publish_op

    connection = make_connection()
    connection.SimpleQueue("flushed").close()  # declared, the schema installed
    pg = connection.transport.pg.connection()
    for i in range(10):
        op = publish_op(schema, "", "flushed", b'{"body": "x"}', max_message_bytes=1 << 20)
        run(pg, async_commit(op))
        row = pg.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        assert row is not None
        run(pg, flush_op(schema))
        flushed = pg.execute(
            "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (str(row[0]),)
        ).fetchone()
        assert flushed == (True,), i


def test_a_publish_commits_asynchronously_only_when_its_transaction_woke_a_consumer(
    make_connection: Callable[..., Connection], schema: str
) -> None:
    """``async_commit_if_woke`` (publish_commit="flush_after_wake") reads the setting the
    publish's own transaction left: ``lonnymq.hinted`` on (as a hand-off or a hint leaves
    it; here set for the session) means it woke a consumer and commits with
    synchronous_commit off, which the caller then flushes; off, it commits durably and says
    so. The session's own setting stays durable."""
    from lonnymq.queue._ops import async_commit_if_woke, run
    from lonnymq.queue.routing import publish_op

    connection = make_connection()
    connection.SimpleQueue("woke").close()  # declared, the schema installed
    pg = connection.transport.pg.connection()
    modes = record_commit_modes(pg, schema)
    for hinted in ("", "on"):
        pg.execute("SELECT set_config('lonnymq.hinted', %s, false)", [hinted])
        op = publish_op(schema, "", "woke", b'{"body": "x"}', max_message_bytes=1 << 20)
        routed, woke = run(pg, async_commit_if_woke(op))
        assert [r[:2] for r in routed.results] == [("woke", "created")]
        assert woke is bool(hinted)
        assert modes()[0][0] == ("off" if hinted else "on")
    pg.execute("SELECT set_config('lonnymq.hinted', '', false)")
    assert pg.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_publish_commit_flush_after_commits_then_flushes_on_the_same_session(
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``publish_commit="flush_after"``: the publish commits without the WAL flush's wait
    (visible to consumers at once), then a flushing transaction commits on the same session
    (see test_the_flush_after_an_asynchronous_commit_makes_it_durable) before the publish
    returns; ``"flush_first"``: one durable statement (as ``"flush_after_wake"``, the
    default, when the publish wakes nobody: test_handoff). Transient messages commit
    asynchronously either way, and the session's own setting stays durable."""
    ran = recorded_statements(monkeypatch)
    for mode in ("flush_after", "flush_first"):
        c = make_connection(publish_commit=mode)
        producer = c.Producer()
        queue = Queue(f"pc-{mode}")
        producer.publish("warm", routing_key=queue.name, declare=[queue])
        ran.clear()
        producer.publish("x", routing_key=queue.name)
        steps = [query for _, query in ran]
        if mode == "flush_after":
            assert len(steps) == 2, steps
            assert b"synchronous_commit', 'off'" in steps[0] and b"publish" in steps[0]
            assert steps[1].startswith(b"SELECT pg_logical_emit_message(true")
            assert ran[0][0] == ran[1][0]  # the same session
        else:
            assert len(steps) == 1 and b"synchronous_commit" not in steps[0], steps
        ran.clear()
        producer.publish("t", routing_key=queue.name, delivery_mode=1)  # transient
        assert [b"synchronous_commit', 'off'" in q for _, q in ran] == [True]
        assert c.transport.pg.connection().execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert lonnymq.Broker(schema).queue(queue.name).stats(conn).total == 3
        c.release()


# --------------------------------------------------------------------------------------------
# Acks sent with the next dequeue (lonnymq.transport.acks)


def _count(conn: Conn, schema: str, queue: str) -> int:
    return lonnymq.Broker(schema).queue(queue).stats(conn).total


def test_callback_acks_are_applied_when_drain_events_returns(
    connection: Connection, conn: Conn, schema: str
) -> None:
    """Acks made in callbacks ride with the next dequeue; none is left unsent once
    drain_events returns, whatever the prefetch window."""
    queue = Queue("ridealong")
    producer = connection.Producer()
    for i in range(30):
        producer.publish(i, routing_key="ridealong", declare=[queue])
    received: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=1)
        while len(received) < 30:
            connection.drain_events(timeout=5)
            # every message delivered so far is acked in Postgres already
            assert _count(conn, schema, "ridealong") == 30 - len(received)
    assert received == list(range(30))


def test_ack_from_another_thread_returns_after_the_delete(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """While the consumer waits in drain_events, an ack from another thread is sent by the
    consumer (with its next dequeue), and ack() returns once the row is gone."""
    connection = make_connection(polling_interval=30)
    queue = Queue("handoff")
    connection.Producer().publish("only", routing_key="handoff", declare=[queue])
    held: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: held.append(message)]):
        drain(connection, lambda: len(held) == 1)
        stop = threading.Event()

        def consume() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    connection.drain_events(timeout=0.3)

        consumer = threading.Thread(target=consume)
        consumer.start()
        try:
            time.sleep(0.2)  # the consumer is waiting now (queue empty, window full)
            started = time.monotonic()
            held[0].ack()
            took = time.monotonic() - started
            assert _count(conn, schema, "handoff") == 0
            assert took < 2, took
        finally:
            stop.set()
            consumer.join(timeout=10)


def test_ack_from_another_thread_during_a_long_callback(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """An ack from another thread while the consumer is busy in a callback does not wait
    for the callback: it is sent by the acking thread."""
    connection = make_connection(polling_interval=30)
    queue = Queue("busy")
    producer = connection.Producer()
    for i in range(2):
        producer.publish(i, routing_key="busy", declare=[queue])
    release = threading.Event()
    acked_in: list[float] = []
    messages: list[Any] = []

    def ack_first() -> None:
        started = time.monotonic()
        messages[0].ack()
        acked_in.append(time.monotonic() - started)
        assert _count(conn, schema, "busy") == 1
        release.set()

    def on_message(body: Any, message: Any) -> None:
        messages.append(message)
        if body == 1:  # the second message: ack the first from another thread, wait for it
            thread = threading.Thread(target=ack_first)
            thread.start()
            assert release.wait(10), "the ack from the other thread hung"
            thread.join()
            message.ack()

    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=2)
        drain(connection, lambda: len(messages) == 2)
    assert acked_in and acked_in[0] < 2
    assert _count(conn, schema, "busy") == 0


def test_buffered_acks_survive_a_lost_connection(
    connection: Connection, conn: Conn, schema: str
) -> None:
    """If the round trip carrying buffered acks fails (the backend was killed), the acks are
    kept and sent on the next call, on a new connection: no redelivery."""
    queue = Queue("cut")
    producer = connection.Producer()
    for i in range(3):
        producer.publish(i, routing_key="cut", declare=[queue])
    received: list[int] = []
    transport = connection.transport

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()
        if body == 0:  # the ack is buffered: kill the connection that would send it
            pid = transport.pg.connection().info.backend_pid
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=1)
        deadline = time.monotonic() + 20
        while len(received) < 3 or _count(conn, schema, "cut") > 0:
            assert time.monotonic() < deadline, (received, _count(conn, schema, "cut"))
            with contextlib.suppress(TimeoutError, *connection.connection_errors):
                connection.drain_events(timeout=0.5)
    assert received == [0, 1, 2]  # each once: the ack of 0 was not lost


TOPIC_CASES = [
    ("a.b", {"a.b": True, "a.c": False, "a.b.c": False}),
    ("a.*", {"a.b": True, "a": False, "a.b.c": False}),
    ("a.#", {"a": True, "a.b": True, "a.b.c": True, "ab": False}),
    ("#.b", {"b": True, "a.b": True, "x.y.b": True, "ab": False}),
    ("a.#.b", {"a.b": True, "a.x.b": True, "a.x.y.b": True, "a.xb": False}),
    ("#", {"": True, "a": True, "a.b.c": True}),
    ("a.#.#.b", {"a.b": True, "a.x.y.b": True, "b": False}),
    ("*.*", {"a.b": True, "a": False, "a.b.c": False}),
    ("*0", {"*0": True, "x0": False}),  # a wildcard inside a word is literal
    ("0*", {"0*": True, "00": False, "0": False}),
    ("p.(x)|[y]+?\\d^$", {"p.(x)|[y]+?\\d^$": True, "p.x": False}),
    ("usd.€+é", {"usd.€+é": True, "usd.€é": False}),
]


@pytest.mark.parametrize(("key", "expected"), TOPIC_CASES, ids=[k for k, _ in TOPIC_CASES])
def test_topic_patterns_in_postgres(conn: Conn, key: str, expected: dict[str, bool]) -> None:
    """Topic binding keys as Postgres regular expressions: AMQP's * (one word) and # (zero or
    more words) as whole words; every other character literal."""
    from lonnymq.queue.routing import topic_pattern

    pattern = topic_pattern(key)
    for routing_key, matches in expected.items():
        row = conn.execute("SELECT %s::text ~ %s::text", (routing_key, pattern)).fetchone()
        assert row is not None and row[0] is matches, (key, pattern, routing_key)


def test_ack_offered_before_a_blocking_callback_is_handed_back(
    make_connection: Callable[..., Connection], conn: Conn, schema: str, monkeypatch: Any
) -> None:
    """An ack from another thread that the consumer has not taken when it goes into a
    callback goes back to the acking thread at once: the callback may be waiting for it
    (Celery's prefork pool blocks for a free process, freed by such an ack)."""
    import lonnymq.transport.acks

    monkeypatch.setattr(lonnymq.transport.acks, "HANDOFF_SECONDS", 30.0)  # only the hand-back helps
    connection = make_connection(polling_interval=30)
    queue = Queue("handback")
    producer = connection.Producer()
    producer.publish("first", routing_key="handback", declare=[queue])
    messages: list[Any] = []
    acked = threading.Event()
    waited: list[bool] = []

    def on_message(body: Any, message: Any) -> None:
        messages.append(message)
        if body == "second":  # blocks until the first one's ack, made by another thread
            waited.append(acked.wait(10))
            message.ack()

    transport = connection.transport
    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=2)
        drain(connection, lambda: len(messages) == 1)
        producer.publish("second", routing_key="handback", declare=[queue])
        # the consumer's next fetch takes the (empty) ack buffer, then waits for the client
        # lock held here; meanwhile another thread acks "first" (buffered, not taken)
        with transport.pg._lock:
            consumer_thread = threading.Thread(
                target=lambda: drain(connection, lambda: len(messages) == 2)
            )
            consumer_thread.start()
            time.sleep(0.3)

            def ack_first() -> None:
                messages[0].ack()
                acked.set()

            acker = threading.Thread(target=ack_first)
            acker.start()
            time.sleep(0.3)
        consumer_thread.join(timeout=20)
        acker.join(timeout=20)
    assert waited == [True], "the ack waited for the callback that waited for it"
    assert _count(conn, schema, "handback") == 0


@pytest.mark.parametrize("delay", [0.3, 0.0])
def test_refill_waits_refill_delay_only_when_holding_more_than_half(
    make_connection: Callable[..., Connection], delay: float
) -> None:
    """A consumer holding more than half its prefetch window waits ``refill_delay`` before it
    refills (so that more of the window comes free per dequeue); holding half or less, it
    refills at once."""
    connection = make_connection(refill_delay=delay, polling_interval=30)
    queue = Queue("refill")
    producer = connection.Producer()
    for i in range(30):
        producer.publish(i, routing_key="refill", declare=[queue])
    held: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, m: held.append(m)]) as consumer:
        consumer.qos(prefetch_count=10)
        drain(connection, lambda: len(held) == 10)
        for message in held[:2]:
            message.ack()  # holds 8 of 10
        started = time.monotonic()
        drain(connection, lambda: len(held) == 12)
        more_than_half = time.monotonic() - started
        for message in held[2:8]:
            message.ack()  # holds 4 of 10
        started = time.monotonic()
        drain(connection, lambda: len(held) == 18)
        half_or_less = time.monotonic() - started
    assert half_or_less < 0.15
    if delay:
        assert more_than_half >= delay * 0.9
    else:
        assert more_than_half < 0.15


@pytest.mark.parametrize(
    ("publish_commit", "expected"),
    [
        ("flush_first", ["off", "on", "on", "on"]),
        ("flush_after_wake", ["off", "on", "on", "on"]),
        ("flush_after", ["off", "off", "off", "on"]),
    ],
)
def test_transient_messages_do_not_wait_for_the_wal_flush(
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
    pg_dsn: str,
    publish_commit: str,
    expected: list[str],
) -> None:
    """A message published as transient (kombu's delivery_mode 1: Celery's rpc:// replies,
    its events, pidbox broadcasts) commits with synchronous_commit off; a persistent one (the
    default, or delivery_mode 2) durably in one transaction with ``publish_commit=
    "flush_first"``, with it off and then flushed with ``"flush_after"`` (see
    test_publish_commit_flush_after_commits_then_flushes_on_the_same_session), and one
    published in the caller's transaction with the caller's setting. Each is delivered
    alike; with ``"flush_after_wake"`` (the default) as with ``"flush_first"`` when, as
    here, no consumer sleeps on the queue. (Seen by a trigger on the message table, deferred
    to the commit: tests/commit_modes.py.)"""
    connection = make_connection(publish_commit=publish_commit)
    with connection.SimpleQueue("modes") as simple:  # declares it, and installs the schema
        modes = record_commit_modes(conn, schema)
        producer = connection.Producer(serializer="json")
        for body, mode in (("t", "transient"), ("p", "persistent"), ("d", None)):
            producer.publish(body, routing_key="modes", delivery_mode=mode)
        with psycopg.connect(pg_dsn) as caller, lonnymq.transaction(caller):
            producer.publish("in-txn", routing_key="modes", delivery_mode="transient")
        got = []
        for _ in range(4):
            message = simple.get(timeout=5)
            got.append(message.payload)
            message.ack()
    assert sorted(got) == sorted(["t", "p", "d", "in-txn"])
    # (in the order published: t, p, d, in-txn)
    assert [mode for mode, _ in reversed(modes())] == expected
