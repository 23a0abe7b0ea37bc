# mypy: allow-untyped-calls
# (kombu is untyped)
"""A consumer that takes its queue without acks is handed a message without a row (schema
version 23; docs/design.md, "The hand-off").

Celery's ``rpc://`` replies, its events, gossip and broadcasts are consumed with
``no_ack=True``: a message handed to such a consumer used to be created locked for it, then
deleted by it before delivery. Now the publish writes no message row: the message is in the
NOTIFY, delivered at the commit (as RabbitMQ's delivery to a no-ack consumer is at the socket
write), tallied as created, delivered and acked. What such a consumer cannot deliver (its
queue no longer consumed, consumed with acks by now, the connection closing) is created
again, not lost.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from psycopg import sql

import lonnymq
from lonnymq.queue._ops import run
from lonnymq.queue.dequeue import dequeue_op
from lonnymq.queue.queues import queue_declare_op
from tests.invariants import assert_consistent
from tests.test_counters import counters
from tests.test_handoff import dequeues as dequeues  # (a fixture)
from tests.test_handoff import handed_to, kombu_defaults, locks, settle, wait_until
from tests.test_wakeup import LOOPS, Driver, asleep_on, declared, swept
from tests.test_wakeup import drive as drive  # (a fixture)

Conn = psycopg.Connection[Any]

kombu_defaults = kombu_defaults  # (the fixture: no fallback poll within a test)


class Got:
    """What a consumer's callback received (any thread), without acking: body -> message."""

    def __init__(self) -> None:
        self.messages: dict[Any, Any] = {}
        self.order: list[Any] = []
        self.cond = threading.Condition()

    def __call__(self, body: Any, message: Any) -> None:
        with self.cond:
            self.messages[body] = message
            self.order.append(body)
            self.cond.notify_all()

    def wait(self, body: Any, timeout: float = 10) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: body in self.messages, timeout), body
            return self.messages[body]


def registration(conn: Conn, schema: str) -> list[tuple[list[str], list[str]]]:
    """(queues, no_ack) of every sleeper row."""
    rows = conn.execute(
        sql.SQL("SELECT queues, no_ack FROM {}.sleeper ORDER BY holder").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return [(list(r[0]), list(r[1])) for r in rows]


def idle_no_ack_consumer(
    make_connection: Callable[..., Connection], **options: Any
) -> tuple[Connection, Any, Got]:
    """A kombu connection consuming ``hq`` without acks, a first message delivered, then a
    look that found nothing: asleep on it (not driven by a thread). Returns the connection,
    its Consumer and what it received."""
    consumer_conn = swept(make_connection(**options))
    (queue,) = declared(consumer_conn, "hq")
    got = Got()
    consumer = consumer_conn.Consumer([queue], callbacks=[got], accept=["json"], no_ack=True)
    consumer.consume()
    make_connection().Producer(serializer="json").publish("warm", routing_key="hq")
    consumer_conn.drain_events(timeout=5)
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)
    return consumer_conn, consumer, got


@pytest.mark.parametrize("hub", LOOPS)
def test_a_consumer_without_acks_is_handed_messages_without_a_row(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
    dequeues: list[list[str]],
    hub: bool,
) -> None:
    """Ten messages published to an idle consumer without acks, one at a time: each is
    delivered once, without a dequeue and without a message row ever written (the table's
    inserts do not move); every counter is exact."""
    consumer_conn = swept(make_connection())
    (queue,) = declared(consumer_conn, "hq")
    got = Got()
    consumer_conn.Consumer([queue], callbacks=[got], accept=["json"], no_ack=True).consume()
    drive(consumer_conn, hub)
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    got.wait("warm")
    inserts = count_inserts(conn, schema)
    for i in range(10):
        settle(conn, schema, "hq")
        before = len(dequeues)
        producer.publish(i, routing_key="hq")
        got.wait(i)
        assert dequeues[before:] == [], f"message {i} was dequeued"
    assert got.order == ["warm", *range(10)]
    assert inserts() == 0
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == 11)
    found = counters(broker, conn, "hq")
    assert (found.enqueued, found.delivered, found.redelivered, found.acked) == (11, 11, 0, 11)
    assert locks(conn, schema, "hq") == []
    assert_consistent(conn, schema)


def count_inserts(conn: Conn, schema: str) -> Callable[[], int]:
    """Count the rows inserted into the schema's message table from now on (a trigger of
    the test's own); returns how to read the count."""
    s = sql.Identifier(schema)
    conn.execute(sql.SQL("CREATE TABLE {}.test_inserts (id bigint)").format(s))
    conn.execute(
        sql.SQL(
            "CREATE FUNCTION {s}.test_log_insert() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN INSERT INTO {s}.test_inserts VALUES (NEW.id); RETURN NULL; END $$"
        ).format(s=s)
    )
    conn.execute(
        sql.SQL(
            "CREATE TRIGGER test_log_insert AFTER INSERT ON {s}.message "
            "FOR EACH ROW EXECUTE FUNCTION {s}.test_log_insert()"
        ).format(s=s)
    )

    def count() -> int:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}.test_inserts").format(s)).fetchone()
        assert row is not None
        return int(row[0])

    return count


def test_the_message_is_in_the_notify_only(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer without acks that does not read its notifications meanwhile: the publish
    leaves no row (a consumer with acks would find one locked for it), and the next look
    delivers the message, with its properties."""
    consumer_conn, _, got = idle_no_ack_consumer(make_connection)
    assert asleep_on(conn, schema, "hq")
    producer = make_connection().Producer(serializer="json")
    producer.publish("p", routing_key="hq", priority=3, headers={"h": "v"})
    assert locks(conn, schema, "hq") == []
    consumer_conn.drain_events(timeout=5)
    assert got.order == ["warm", "p"]
    message = got.messages["p"]
    assert message.headers.get("h") == "v"
    assert message.properties.get("priority") == 3


def test_the_registration_names_the_queues_taken_without_acks(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """One kombu channel consuming ``a`` without acks and ``b`` with acks: its sleeper row
    names both, and only ``a`` as taken without acks; a queue that one channel takes with
    acks and another without is handed with a row; after a cancel the row follows."""
    consumer_conn = swept(make_connection())
    a, b = declared(consumer_conn, "a", "b")
    channel = consumer_conn.default_channel
    without = consumer_conn.Consumer([a], channel=channel, callbacks=[Got()], no_ack=True)
    with_acks = consumer_conn.Consumer([b], channel=channel, callbacks=[Got()])
    without.consume()
    with_acks.consume()
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)
    assert registration(conn, schema) == [(["a", "b"], ["a"])]
    other = consumer_conn.channel()
    consumer_conn.Consumer([a], channel=other, callbacks=[Got()]).consume()
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)
    assert registration(conn, schema) == [(["a", "b"], [])]
    other.close()
    with_acks.cancel()
    # (a cancel changes no key at once: the next round, here a message's, writes the row)
    make_connection().Producer(serializer="json").publish("next", routing_key="a")
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.5)
    assert registration(conn, schema) == [(["a"], ["a"])]


def test_what_a_cancelled_consumer_was_handed_without_a_row_is_created_again(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer without acks cancelled while asleep, its connection kept: a publish before
    its next look still hands it a message (no row), which it reads as for a queue it no
    longer consumes; its next heartbeat creates the message again, ready, and another
    consumer gets it."""
    consumer_conn, consumer, _ = idle_no_ack_consumer(make_connection, heartbeat_interval=0.5)
    consumer.cancel()
    make_connection().Producer(serializer="json").publish("after-cancel", routing_key="hq")
    assert locks(conn, schema, "hq") == []
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)  # (reads it: for a queue not consumed)
    wait_until(lambda: len(locks(conn, schema, "hq")) == 1, timeout=5)
    ((_, token),) = locks(conn, schema, "hq")
    assert token is None  # ready, not locked
    second = make_connection()
    got = Got()
    second.Consumer([declared(second, "hq")[0]], callbacks=[got], accept=["json"]).consume()
    second.drain_events(timeout=5)
    assert got.order == ["after-cancel"]
    got.messages["after-cancel"].ack()
    assert_consistent(conn, schema)


def test_what_a_closing_consumer_was_handed_without_a_row_is_created_again(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer without acks closed with a message handed to it and not delivered: the
    message is created again in its queue, with what was left of its time to live, and its
    properties; another consumer gets it."""
    first, _, _ = idle_no_ack_consumer(make_connection)
    producer = make_connection().Producer(serializer="json")
    producer.publish("orphan", routing_key="hq", expiration=60, priority=2)
    assert locks(conn, schema, "hq") == []
    time.sleep(0.1)  # (its NOTIFY arrived, unread)
    first.release()
    ((message_id, token),) = locks(conn, schema, "hq")
    assert token is None
    row = conn.execute(
        sql.SQL(
            "SELECT extract(epoch FROM expires_at - clock_timestamp()), priority "
            "FROM {}.message WHERE id = %s"
        ).format(sql.Identifier(schema)),
        [message_id],
    ).fetchone()
    assert row is not None
    assert 50 < float(row[0]) <= 60, row
    assert row[1] == 2
    second = make_connection()
    got = Got()
    second.Consumer([declared(second, "hq")[0]], callbacks=[got], accept=["json"]).consume()
    second.drain_events(timeout=5)
    assert got.order == ["orphan"]
    got.messages["orphan"].ack()
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == 3)
    assert_consistent(conn, schema)


def test_a_queue_consumed_with_acks_by_now_gets_what_was_handed_without_a_row(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Handed a message without a row, the consumer takes the queue with acks before it
    reads it: the message is created again and delivered to be acked (an ack of a message
    that has no row would be lost on it), once."""
    consumer_conn, consumer, _ = idle_no_ack_consumer(make_connection)
    make_connection().Producer(serializer="json").publish("switched", routing_key="hq")
    assert locks(conn, schema, "hq") == []
    consumer.cancel()
    got = Got()
    (queue,) = declared(consumer_conn, "hq")
    consumer_conn.Consumer([queue], callbacks=[got], accept=["json"]).consume()
    deadline = time.monotonic() + 5
    while "switched" not in got.messages and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            consumer_conn.drain_events(timeout=0.5)
    assert got.order == ["switched"]
    ((_, token),) = locks(conn, schema, "hq")
    assert token is not None  # held for its ack
    got.messages["switched"].ack()
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)  # (the ack goes with the next look)
    wait_until(lambda: locks(conn, schema, "hq") == [])
    assert_consistent(conn, schema)


def test_a_client_of_version_22_is_handed_messages_with_a_row(
    connect: Callable[..., Conn], conn: Conn, schema: str, broker: lonnymq.Broker
) -> None:
    """``sleep_v2`` (kept for clients of version 22) registers no queue as taken without
    acks, so what a publish hands that session has a row, locked for it, as before; the
    same session registered by ``sleep_v3`` with the queue taken without acks gets none."""
    run(conn, queue_declare_op(schema, "hq"))
    run(conn, dequeue_op(schema, ["hq"], limit=1, listen=False))  # (hq in the ingest's state)
    session = connect()
    holder = 12345
    s = sql.Identifier(schema)
    session.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"lonnymq_hand_{holder}")))
    for function, extra, rows in (("sleep_v2", "", 1), ("sleep_v3", ", ARRAY['hq']", 0)):
        session.execute(
            sql.SQL(
                "SELECT {s}.{f}(ARRAY['hq'], '{{}}', '{{}}', ARRAY['hq'], '{{}}', %s, 'secret', "
                "60000, ARRAY['hq']" + extra + ")"
            ).format(s=s, f=sql.Identifier(function)),
            [holder],
        )
        before = {i for i, _ in locks(conn, schema, "hq")}
        conn.execute(
            sql.SQL(
                "SELECT * FROM {}.message_publish_v2('', 'hq', NULL, NULL, 'x'::bytea, 0, 0, "
                "NULL, true)"
            ).format(s)
        )
        made = [(i, t) for i, t in locks(conn, schema, "hq") if i not in before]
        assert len(made) == rows, function
        assert all(handed_to(t, holder) for _, t in made)
        (note,) = list(session.notifies(timeout=2, stop_after=1))
        token = note.payload.split(" ")[2]
        assert (token == "-") == (rows == 0), note.payload
        # (asleep again for the next round: the keys a hand-off needs are still held)


@pytest.mark.parametrize("no_ack", [True, False], ids=["without-acks", "with-acks"])
def test_the_hand_offs_helpers_cost_no_call(
    make_connection: Callable[..., Connection], conn: Conn, schema: str, no_ack: bool
) -> None:
    """The SQL functions that build and sign a hand-off's payload are inlined into
    ``handoff_v1``'s statements: with ``track_functions`` on the publisher's session, a hand-off
    counts calls of the publish's four plpgsql functions and of nothing else (a helper that
    used its body argument twice was not inlined, and cost 120 us a call, planned at each)."""
    consumer_conn = swept(make_connection())
    (queue,) = declared(consumer_conn, "hq")
    got = Got()
    consumer_conn.Consumer([queue], callbacks=[got], accept=["json"], no_ack=no_ack).consume()
    producer_conn = make_connection()
    producer = producer_conn.Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    consumer_conn.drain_events(timeout=5)
    if not no_ack:
        got.messages["warm"].ack()
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)
    assert asleep_on(conn, schema, "hq")
    with producer_conn.default_channel.connection.pg.locked() as session:
        session.execute("SET track_functions = 'all'")
    producer.publish("handed", routing_key="hq")
    consumer_conn.drain_events(timeout=5)
    assert got.order == ["warm", "handed"]

    def calls() -> dict[str, int]:
        # (before Postgres 15 a session sends its counts only as a statement ends, at most
        # every 0.5 s: one more statement of it sends what the publish counted)
        with producer_conn.default_channel.connection.pg.locked() as session:
            session.execute("SELECT 1")
        time.sleep(0.1)
        conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = conn.execute(
            "SELECT funcname, calls FROM pg_stat_user_functions WHERE schemaname = %s",
            [schema],
        ).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    wait_until(lambda: calls().get("handoff_v1", 0) >= 1)
    assert set(calls()) == {"message_publish_v2", "route_v1", "message_create_v1", "handoff_v1"}
