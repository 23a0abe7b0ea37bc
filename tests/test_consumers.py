# mypy: allow-untyped-calls
# (kombu is untyped)
"""Kombu consumers as every process sees them, and the queue arguments that depend on them or
on a queue's settings: ``auto_delete`` queues go when their last consumer cancels, its
connection closes, its process exits or is killed, as on RabbitMQ; ``max_priority`` caps
higher priorities to it; a queue that went is not re-created by a publish to its name. Real
Postgres, real kombu connections (several, as several processes would be) and processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from psycopg import sql

import lonnymq
from lonnymq.transport import registry
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


def queue_row(conn: Conn, schema: str, queue: str) -> tuple[Any, ...] | None:
    """The queue's (auto_delete, max_priority, expires_ms), or None."""
    return conn.execute(
        sql.SQL("SELECT auto_delete, max_priority, expires_ms FROM {} WHERE name = %s").format(
            sql.Identifier(schema, "queue")
        ),
        (queue,),
    ).fetchone()


def messages_of(conn: Conn, schema: str, queue: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        sql.SQL("SELECT priority, content FROM {} WHERE queue = %s ORDER BY id").format(
            sql.Identifier(schema, "message")
        ),
        (queue,),
    ).fetchall()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def ignore(body: Any, message: Any) -> None:
    message.ack()


# --------------------------------------------------------------------------------------------
# who consumes


def test_consumers_are_registered_with_who_since_when_and_last_delivery(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    broker = lonnymq.Broker(schema)
    registry.set_node(None)  # (a worker started in this process would have named it)
    with make_connection() as c:
        q = Queue("reg")
        got: list[Any] = []

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.ack()

        with c.Consumer(q, callbacks=[on_message]):
            [info] = broker.consumers(conn, "reg")
            assert (info.queue, info.host, info.pid) == ("reg", socket.gethostname(), os.getpid())
            assert info.alive and info.node is None and info.delivered_at is None
            assert info.no_ack is False
            c.Producer().publish({"n": 1}, routing_key="reg")
            c.drain_events(timeout=10)
            assert got == [{"n": 1}]
            c.transport.registry.sync()  # what the heartbeat does every few seconds
            [info] = broker.consumers(conn, "reg")
            assert info.delivered_at is not None and info.seen_at >= info.started_at
            # a second consumer of the connection, without acks
            with c.Consumer(Queue("reg2"), callbacks=[ignore], no_ack=True):
                listed = broker.consumers(conn)
                assert [(i.queue, i.no_ack) for i in listed] == [("reg", False), ("reg2", True)]
                assert len({i.client for i in listed}) == 1
            assert [i.queue for i in broker.consumers(conn)] == ["reg"]
        assert broker.consumers(conn) == []  # cancelled


def test_the_celery_node_name_is_shown_when_known(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    registry.set_node("w1@box")
    try:
        with make_connection() as c, c.Consumer(Queue("node"), callbacks=[ignore]):
            [info] = lonnymq.Broker(schema).consumers(conn, "node")
            assert info.node == "w1@box"
    finally:
        registry.set_node(None)


# --------------------------------------------------------------------------------------------
# auto_delete


def test_a_passive_declare_counts_consumers_and_delete_if_unused_keeps_a_consumed_queue(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A passive declare (to look at a queue) says how many consumers it has, of any process,
    as RabbitMQ does (it said 0); ``queue_delete(if_unused=True)`` leaves a queue that has a
    consumer (it deleted it under its consumer), returning None as a refused ``if_empty``
    does, and deletes it once nobody consumes it."""
    with make_connection() as watcher, make_connection() as worker:
        Queue("busy")(watcher.default_channel).declare()
        assert watcher.default_channel.queue_declare("busy", passive=True).consumer_count == 0
        consumer = worker.Consumer(Queue("busy"), callbacks=[ignore])
        consumer.consume()
        ok = watcher.default_channel.queue_declare("busy", passive=True)
        assert (ok.queue, ok.message_count, ok.consumer_count) == ("busy", 0, 1)
        assert watcher.default_channel.queue_delete("busy", if_unused=True) is None
        assert queue_row(conn, schema, "busy") is not None
        consumer.cancel()
        assert watcher.default_channel.queue_delete("busy", if_unused=True) == 0
        assert queue_row(conn, schema, "busy") is None


def test_a_consumer_cancelled_after_its_channel_closed(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Celery cancels its consumers after their channel closed when it restarts them on a
    lost connection: the cancel is a no-op there as on kombu's other transports (it raised
    ``AttributeError`` on the closed channel's ``connection``, logged by Celery as "Error on
    restarting" with a traceback), and the consumer is unregistered with the next sync."""
    with make_connection() as kc:
        channel = kc.channel()
        consumer = kc.Consumer(Queue("cc"), channel=channel, callbacks=[ignore])
        consumer.consume()
        assert len(lonnymq.Broker(schema).consumers(conn, "cc")) == 1
        channel.close()
        consumer.cancel()
        kc.transport.registry.sync()
        assert lonnymq.Broker(schema).consumers(conn, "cc") == []


def test_an_auto_delete_queue_goes_when_its_last_consumer_cancels(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Two connections (as two processes) consume it: it stays while one does, and goes, with
    its messages and bindings, when the last one cancels. A publish to its name afterwards is
    dropped (it does not re-create the queue); a declare brings it back."""
    q = Queue("ad", auto_delete=True, exchange="ad.x", routing_key="k")
    with make_connection() as a, make_connection() as b:
        ca = a.Consumer(q, callbacks=[ignore])
        ca.consume()
        cb = b.Consumer(q, callbacks=[ignore])
        cb.consume()
        assert queue_row(conn, schema, "ad") == (True, None, None)
        assert len(lonnymq.Broker(schema).consumers(conn, "ad")) == 2
        ca.cancel()
        assert queue_row(conn, schema, "ad") is not None  # b still consumes
        a.Producer().publish("waiting", exchange="ad.x", routing_key="k")
        assert len(messages_of(conn, schema, "ad")) == 1
        cb.cancel()
        assert queue_row(conn, schema, "ad") is None
        assert messages_of(conn, schema, "ad") == []
        # gone: a publish by its name is dropped; by its exchange, unroutable
        a.Producer().publish("late", routing_key="ad")
        a.Producer().publish("late", exchange="ad.x", routing_key="k")
        assert queue_row(conn, schema, "ad") is None and messages_of(conn, schema, "ad") == []
        # a declare brings it back
        q(a.default_channel).declare()
        a.Producer().publish("again", routing_key="ad")
        assert len(messages_of(conn, schema, "ad")) == 1


def test_an_auto_delete_queue_goes_when_its_consumers_connection_closes(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    c = make_connection()
    consumer = c.Consumer(Queue("ad-close", auto_delete=True), callbacks=[ignore])
    consumer.consume()
    assert queue_row(conn, schema, "ad-close") is not None
    c.release()  # no cancel: the connection ends
    assert queue_row(conn, schema, "ad-close") is None


def test_an_auto_delete_queue_that_never_had_a_consumer_stays(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    with make_connection() as c:
        Queue("ad-idle", auto_delete=True)(c.default_channel).declare()
        c.Producer().publish("x", routing_key="ad-idle")
        with c.Consumer(Queue("other"), callbacks=[ignore]):
            pass
    assert queue_row(conn, schema, "ad-idle") == (True, None, None)
    assert len(messages_of(conn, schema, "ad-idle")) == 1


CONSUMER = r"""
import sys, time
import kombu
import lonnymq  # noqa: F401

url, schema, queue, mode = sys.argv[1:5]
c = kombu.Connection(url, transport_options={"schema": schema})
consumer = c.Consumer(kombu.Queue(queue, auto_delete=True), callbacks=[lambda b, m: m.ack()])
consumer.consume()
print("consuming", flush=True)
if mode == "exit":
    sys.exit(0)  # without closing the connection
while True:
    try:
        c.drain_events(timeout=1)
    except TimeoutError:
        pass
"""


@pytest.fixture
def consumer_process(
    tmp_path: Path, pg_dsn: str, schema: str
) -> Iterator[Callable[[str, str], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)

    def start(queue: str, mode: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(script), lonnymq_url(pg_dsn), schema, queue, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "consuming", proc.stdout.read()
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_an_auto_delete_queue_goes_when_its_consumers_process_exits(
    consumer_process: Callable[[str, str], subprocess.Popen[str]], conn: Conn, schema: str
) -> None:
    """A script that exits without closing its connection (most do)."""
    proc = consumer_process("ad-exit", "exit")
    assert proc.wait(timeout=30) == 0
    assert queue_row(conn, schema, "ad-exit") is None


@pytest.mark.slow  # a killed consumer is presumed gone after 15 s
def test_an_auto_delete_queue_goes_when_its_consumers_process_is_killed(
    consumer_process: Callable[[str, str], subprocess.Popen[str]],
    conn: Conn,
    schema: str,
) -> None:
    """SIGKILL: nothing unregisters the consumer. It is presumed gone once it has not been
    heard of for three beats (15 s), and the next sweep of any client removes it and the
    queue. Meanwhile the queue stays (its consumer may only be slow)."""
    proc = consumer_process("ad-kill", "run")
    broker = lonnymq.Broker(schema)
    assert [c.pid for c in broker.consumers(conn, "ad-kill")] == [proc.pid]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    killed = time.monotonic()
    time.sleep(3)
    broker.expire(conn)  # another client's sweep
    assert queue_row(conn, schema, "ad-kill") is not None
    [info] = broker.consumers(conn, "ad-kill")
    assert info.alive

    def swept() -> bool:
        broker.expire(conn)
        return queue_row(conn, schema, "ad-kill") is None

    wait_for(swept, 30, "the killed consumer's queue to go")
    took = time.monotonic() - killed
    assert 3 * registry.BEAT_S - 5 <= took <= 3 * registry.BEAT_S + registry.BEAT_S + 5, took
    assert broker.consumers(conn) == []


@pytest.mark.slow  # 20 s of a consumer's life
def test_a_live_consumer_is_not_presumed_gone(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """The heartbeat thread keeps the consumer's row fresh: 20 s (past three beats) of
    sweeps by another client leave its auto_delete queue alone."""
    broker = lonnymq.Broker(schema)
    with make_connection() as c, c.Consumer(Queue("ad-live", auto_delete=True), callbacks=[ignore]):
        deadline = time.monotonic() + 4 * registry.BEAT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                c.drain_events(timeout=1)
            broker.expire(conn)
            assert queue_row(conn, schema, "ad-live") is not None
        [info] = broker.consumers(conn, "ad-live")
        assert info.alive


# --------------------------------------------------------------------------------------------
# max_priority


def test_max_priority_caps_higher_priorities_to_it(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """As RabbitMQ does: with ``max_priority=5``, a priority-9 message is a priority-5 one,
    so it does not overtake an earlier priority-5 message. Priorities below it keep their
    order; a queue without one honours 0-255."""
    with make_connection() as c:
        q = Queue("mp", max_priority=5)
        q(c.default_channel).declare()
        assert queue_row(conn, schema, "mp") == (False, 5, None)
        producer = c.Producer()
        producer.publish("five", routing_key="mp", priority=5)
        producer.publish("nine", routing_key="mp", priority=9)
        producer.publish("one", routing_key="mp", priority=1)
        assert [p for p, _ in messages_of(conn, schema, "mp")] == [5, 5, 1]
        got = []
        for _ in range(3):
            message = q(c.default_channel).get(no_ack=True)
            assert message is not None
            got.append(message.payload)
        assert got == ["five", "nine", "one"]
        # the queue API and batches cap too
        queue = lonnymq.Broker(schema).queue("mp")
        queue.channel("mp").message.create(conn, b"api", priority=200)
        batch = queue.batch()
        batch.channel("mp").message(b"batch", priority=7)
        batch.channel("mp").message(b"low", priority=2)
        batch.execute(conn)
        assert [p for p, _ in messages_of(conn, schema, "mp")] == [5, 5, 2]
        # without max_priority: 0-255 as before
        producer.publish("high", routing_key="free", priority=200)
        assert [p for p, _ in messages_of(conn, schema, "free")] == [200]


def test_a_consumer_presumed_gone_that_comes_back_declares_its_queue_again(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A process cut off from the database for longer than three beats: its consumers are
    presumed gone and its auto_delete queue goes, bindings and all (as RabbitMQ drops such a
    queue with a connection it lost). When the process is heard of again, it declares and
    binds the queue again, as a RabbitMQ client does when it reconnects."""
    broker = lonnymq.Broker(schema)
    q = Queue(
        "ad-back", auto_delete=True, exchange=Exchange("back.x", type="direct"), routing_key="k"
    )
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with make_connection() as c, c.Consumer(q, callbacks=[on_message]):
        # not heard of for an hour, with a beat of 1 ms: presumed gone also on a server
        # started less than three (real) beats ago, whose start counts as a beat
        conn.execute(
            sql.SQL("UPDATE {} SET seen_at = seen_at - interval '1 hour', beat_ms = 1").format(
                sql.Identifier(schema, "consumer")
            )
        )
        broker.expire(conn)  # a sweep: the consumer presumed gone, its queue with it
        assert queue_row(conn, schema, "ad-back") is None
        c.transport.registry.sync()  # its heartbeat: it is back
        assert queue_row(conn, schema, "ad-back") == (True, None, None)
        assert [i.alive for i in broker.consumers(conn, "ad-back")] == [True]
        c.Producer().publish("after", exchange="back.x", routing_key="k")
        c.drain_events(timeout=10)
        assert got == ["after"]
