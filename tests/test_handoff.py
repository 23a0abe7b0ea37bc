# mypy: allow-untyped-calls
# (kombu is untyped)
"""A publish hands its message to a consumer asleep on its queue (schema version 21;
docs/design.md, "The hand-off").

The message is created locked for one transport's LISTEN session and sent whole in a NOTIFY
on that session's channel: the consumer delivers it without a dequeue. Each test checks what
must hold whoever delivers (every message once, counters exact, the acks, limits and the
caller's transaction) and which path delivered (the dequeues the consumer ran, the lock
token's holder).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from kombu.messaging import Producer
from psycopg import sql

import lonnymq
from lonnymq.queue._ops import run
from lonnymq.queue.dequeue import dequeue_op
from lonnymq.queue.routing import publish_op
from lonnymq.transport import transport as transport_module
from tests.commit_modes import record_commit_modes, recorded_statements
from tests.invariants import assert_consistent
from tests.test_counters import counters
from tests.test_plans import Recorder
from tests.test_wakeup import LOOPS, Driver, Received, asleep_on, declared, swept
from tests.test_wakeup import drive as drive  # (a fixture)

Conn = psycopg.Connection[Any]


@pytest.fixture
def kombu_defaults() -> dict[str, Any]:
    """No fallback poll within a test: only a wake-up (or a hand-off) delivers in time."""
    return {"visibility_timeout": 30, "polling_interval": 30}


@pytest.fixture
def dequeues(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """The queues of every dequeue the transports of this test run."""
    seen: list[list[str]] = []
    plain = dequeue_op

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(list(args[1]))
        return plain(*args, **kwargs)

    monkeypatch.setattr(transport_module, "dequeue_op", recorded)
    yield seen


def wait_until(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def holders(conn: Conn, schema: str, queue: str) -> list[int]:
    """The hand-off ids of the LISTEN sessions registered for ``queue``."""
    rows = conn.execute(
        sql.SQL("SELECT holder FROM {}.sleeper WHERE %s = ANY (queues) ORDER BY holder").format(
            sql.Identifier(schema)
        ),
        [queue],
    ).fetchall()
    return [int(r[0]) for r in rows]


def locks(conn: Conn, schema: str, queue: str) -> list[tuple[int, str | None]]:
    """(id, lock token) of the queue's messages, by id."""
    rows = conn.execute(
        sql.SQL("SELECT id, lock_token::text FROM {}.message WHERE queue = %s ORDER BY id").format(
            sql.Identifier(schema)
        ),
        [queue],
    ).fetchall()
    return [(int(r[0]), r[1]) for r in rows]


def handed_to(token: str | None, holder: int) -> bool:
    """Whether a lock token is that of a hand-off to ``holder`` (it starts with its id)."""
    return token is not None and token.replace("-", "")[:16] == f"{holder:016x}"


def settle(conn: Conn, schema: str, queue: str) -> None:
    """Wait until a consumer sleeps on ``queue`` and stays asleep (its look after taking its
    keys done)."""
    wait_until(lambda: asleep_on(conn, schema, queue))
    time.sleep(0.3)
    assert asleep_on(conn, schema, queue)


def consumer_of_hq(
    make_connection: Callable[..., Connection], **options: Any
) -> tuple[Connection, Received]:
    """A kombu connection consuming the queue ``hq`` (declared), with the sweep its first
    publish would start done (see ``test_wakeup.swept``), and what its callback receives."""
    consumer_conn = swept(make_connection(**options))
    (queue,) = declared(consumer_conn, "hq")
    received = Received()
    consumer_conn.Consumer([queue], callbacks=[received], accept=["json"]).consume()
    return consumer_conn, received


def warm_then_idle(consumer_conn: Connection, producer: Producer) -> None:
    """A first message delivered (the queue is then in the ingest's state), then a look that
    finds nothing: the consumer (not driven by a thread) is asleep on ``hq``."""
    producer.publish("warm", routing_key="hq")
    consumer_conn.drain_events(timeout=5)
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)


@pytest.mark.parametrize("hub", LOOPS)
def test_an_idle_consumer_delivers_a_published_message_without_a_dequeue(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
    dequeues: list[list[str]],
    hub: bool,
) -> None:
    """Ten messages published to an idle consumer, one at a time: each is delivered, and
    the consumer ran no dequeue for any of them; every counter is exact."""
    consumer_conn, received = consumer_of_hq(make_connection)
    drive(consumer_conn, hub)
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")  # (the queue in the ingest's state)
    received.wait("warm")
    for i in range(10):
        settle(conn, schema, "hq")
        before = len(dequeues)
        producer.publish(i, routing_key="hq")
        received.wait(i)
        assert dequeues[before:] == [], f"message {i} was dequeued"
    assert received.order == ["warm", *range(10)]
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == 11)
    got = counters(broker, conn, "hq")
    assert (got.enqueued, got.delivered, got.redelivered, got.acked) == (11, 11, 0, 11)
    assert locks(conn, schema, "hq") == []
    assert_consistent(conn, schema)


def test_the_message_is_created_locked_for_the_sleeping_session(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer that does not read its notifications meanwhile: the message waits locked
    for its LISTEN session (the lock token names it), and is delivered at its next look,
    without a dequeue."""
    consumer_conn, received = consumer_of_hq(make_connection)
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    assert asleep_on(conn, schema, "hq")
    (holder,) = holders(conn, schema, "hq")
    producer.publish("handed", routing_key="hq")
    ((_, token),) = locks(conn, schema, "hq")
    assert handed_to(token, holder), token
    consumer_conn.drain_events(timeout=5)
    assert received.order == ["warm", "handed"]


@pytest.mark.parametrize("handoff", [True, False], ids=["handed", "hinted"])
def test_a_publish_that_wakes_a_consumer_commits_before_its_flush(
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
    handoff: bool,
) -> None:
    """``publish_commit="flush_after_wake"``, the default: a publish that hands its message
    to a consumer asleep on its queue (or, without the hand-off, wakes it with the message's
    id) commits without waiting for the WAL flush, so that the consumer is told at once, then
    flushes on the same session before it returns (see
    test_transport.test_the_flush_after_an_asynchronous_commit_makes_it_durable); one that
    wakes nobody commits durably in one statement. (The setting each insert's transaction
    commits with: tests/commit_modes.py.)"""
    consumer_conn, received = consumer_of_hq(make_connection)
    declared(consumer_conn, "cold")
    modes = record_commit_modes(conn, schema)
    producer_conn = make_connection(handoff=handoff)
    assert producer_conn.transport.options.publish_commit == "flush_after_wake"
    producer = producer_conn.Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    assert asleep_on(conn, schema, "hq")
    ran = recorded_statements(monkeypatch)
    producer.publish("woke", routing_key="hq")
    assert len(ran) == 2, ran
    assert b"lonnymq.hinted" in ran[0][1] and b"message_publish_v2" in ran[0][1]
    assert ran[1][1].startswith(b"SELECT pg_logical_emit_message(true")
    assert ran[0][0] == ran[1][0]  # the same session
    assert modes()[0] == ("off", True)  # flushed when the publish returned
    consumer_conn.drain_events(timeout=5)
    assert received.order == ["warm", "woke"]
    ran.clear()
    producer.publish("nobody asleep", routing_key="cold")
    assert len(ran) == 1, ran  # no flush: the publish was durable
    assert modes()[0] == ("on", True)


def test_two_consumers_never_get_one_message_twice(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
) -> None:
    """Two consumers asleep on one queue, messages published alone and in bursts: each is
    delivered once, some by hand-off to each consumer."""
    received = Received()
    for _ in range(2):
        consumer_conn = swept(make_connection())
        (queue,) = declared(consumer_conn, "hq")
        consumer_conn.Consumer(
            [queue], callbacks=[received], accept=["json"], prefetch_count=2
        ).consume()
        drive(consumer_conn, False)
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    received.wait("warm")
    wait_until(lambda: len(holders(conn, schema, "hq")) == 2)
    sent = []
    for burst in range(8):
        time.sleep(0.1)
        for j in range(1 + burst % 3):
            body = f"m{burst}-{j}"
            producer.publish(body, routing_key="hq")
            sent.append(body)
    for body in sent:
        received.wait(body)
    assert sorted(received.order) == sorted(["warm", *sent])  # each once
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == len(sent) + 1)
    assert counters(broker, conn, "hq").delivered == len(sent) + 1
    assert_consistent(conn, schema)


def test_no_hand_off_in_the_callers_transaction(
    make_connection: Callable[..., Connection],
    conn: Conn,
    connect: Callable[..., Conn],
    schema: str,
) -> None:
    """A publish inside ``lonnymq.transaction(conn)`` commits with the caller: its message is
    created ready (unlocked), as always, and delivered after the commit."""
    consumer_conn, received = consumer_of_hq(make_connection)
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    assert asleep_on(conn, schema, "hq")
    caller = connect()  # (autocommit: the block is one transaction, committed at its end)
    with lonnymq.transaction(caller):
        producer.publish("in-transaction", routing_key="hq")
        ((_, token),) = locks(caller, schema, "hq")
        assert token is None
    consumer_conn.drain_events(timeout=5)
    assert received.order == ["warm", "in-transaction"]


def test_a_limited_channel_and_a_large_message_are_not_handed(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
    dequeues: list[list[str]],
) -> None:
    """A channel with a max_concurrency (the slot is counted by the dequeue) and a message
    over 4,800 bytes (it would not fit a NOTIFY) go through the dequeue, as before."""
    broker = lonnymq.Broker(schema)
    consumer_conn = swept(make_connection())
    (queue,) = declared(consumer_conn, "hq")
    broker.queue("hq").channel("limited").policy.set(conn, max_concurrency=1)
    received = Received()
    consumer_conn.Consumer([queue], callbacks=[received], accept=["json"]).consume()
    drive(consumer_conn, False)
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    received.wait("warm")
    for body, headers in (("limited", {"x-channel": "limited"}), ("x" * 6000, {})):
        settle(conn, schema, "hq")
        before = len(dequeues)
        producer.publish(body, routing_key="hq", headers=headers)
        received.wait(body)
        assert dequeues[before:], "handed"
    settle(conn, schema, "hq")
    before = len(dequeues)
    producer.publish("free", routing_key="hq")
    received.wait("free")
    assert dequeues[before:] == []
    wait_until(lambda: counters(broker, conn, "hq").acked == 4)
    assert_consistent(conn, schema)


def test_what_the_prefetch_window_has_no_room_for_goes_back(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Three messages handed to a consumer with a prefetch window of one before it reads
    its notifications: it delivers the first, releases the others (back in their place, not
    at their lock's expiry), and delivers them in turn; counters exact."""
    consumer_conn = swept(make_connection())
    (queue,) = declared(consumer_conn, "hq")
    received: list[Any] = []
    held: list[Any] = []

    def keep(body: Any, message: Any) -> None:
        received.append(body)
        held.append(message)

    consumer_conn.Consumer([queue], callbacks=[keep], accept=["json"], prefetch_count=1).consume()
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    consumer_conn.drain_events(timeout=5)
    held.pop().ack()
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)
    (holder,) = holders(conn, schema, "hq")
    for i in range(3):
        producer.publish(i, routing_key="hq")
    assert all(handed_to(token, holder) for _, token in locks(conn, schema, "hq"))
    for i in range(3):
        consumer_conn.drain_events(timeout=5)
        assert received[-1] == i
        assert len(held) == 1
        held.pop().ack()
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == 4)
    got = counters(broker, conn, "hq")
    assert (got.delivered, got.redelivered) == (6, 0)  # two handed and released, taken again
    assert_consistent(conn, schema)


def test_messages_handed_to_a_consumer_that_closes_come_back_at_once(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer closed with messages handed to it and not delivered releases them: another
    consumer gets them at once, not at their lock's expiry."""
    first = swept(make_connection())
    (queue,) = declared(first, "hq")
    first.Consumer([queue], callbacks=[lambda b, m: m.ack()], accept=["json"]).consume()
    producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    first.drain_events(timeout=5)
    with contextlib.suppress(TimeoutError):
        first.drain_events(timeout=0.3)
    (holder,) = holders(conn, schema, "hq")
    producer.publish("orphan", routing_key="hq")
    ((_, token),) = locks(conn, schema, "hq")
    assert handed_to(token, holder)
    time.sleep(0.1)  # (its NOTIFY arrived, unread)
    first.release()
    ((_, token),) = locks(conn, schema, "hq")
    assert token is None  # released, not left locked for its lock's time
    second = make_connection()
    received = Received()
    second.Consumer([queue], callbacks=[received], accept=["json"]).consume()
    second.drain_events(timeout=5)
    assert received.order == ["orphan"]


def test_a_forged_hand_off_is_ignored(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    connect: Callable[..., Conn],
    schema: str,
) -> None:
    """Any role may NOTIFY: a payload on the session's channel not signed with its secret
    (or not a hand-off at all) delivers nothing, and the consumer goes on."""
    consumer_conn, received = consumer_of_hq(make_connection)
    drive(consumer_conn, True)
    producer: Producer = make_connection().Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    received.wait("warm")
    settle(conn, schema, "hq")
    (holder,) = holders(conn, schema, "hq")
    forger = connect()
    channel = f"lonnymq_hand_{holder}"
    body = "eyJib2R5IjogImZvcmdlZCJ9"  # base64 of a JSON body
    fields = f"99 00000000-0000-0000-0000-000000000001 0 0 inf 2 2 hqhq{body}"
    for payload in (
        f"{'0' * 64} {fields}",  # not signed with the session's secret
        f"\u00e9\u00e9 {fields}",  # (not even ASCII)
        "nonsense",
        "",
    ):
        forger.execute("SELECT pg_notify(%s, %s)", [channel, payload])
    time.sleep(0.3)
    assert received.order == ["warm"]
    producer.publish("real", routing_key="hq")
    received.wait("real")
    assert received.order == ["warm", "real"]


def test_handoff_off_wakes_and_dequeues(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
    dequeues: list[list[str]],
) -> None:
    """With the transport option ``handoff=False`` nothing registers for hand-offs, and a
    woken consumer dequeues what woke it, as before version 21."""
    consumer_conn, received = consumer_of_hq(make_connection, handoff=False)
    drive(consumer_conn, False)
    producer = make_connection(handoff=False).Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    received.wait("warm")
    settle(conn, schema, "hq")
    assert holders(conn, schema, "hq") == []
    before = len(dequeues)
    producer.publish("woken", routing_key="hq")
    received.wait("woken")
    assert dequeues[before:]


def test_a_publisher_without_handoff_wakes_a_registered_consumer(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
) -> None:
    """A registered consumer is still woken by a publish that does not hand off (a client of
    version 20, or ``handoff=False``): it sleeps on the queue's key as before."""
    consumer_conn, received = consumer_of_hq(make_connection)
    drive(consumer_conn, True)
    producer = make_connection(handoff=False).Producer(serializer="json")
    producer.publish("warm", routing_key="hq")
    received.wait("warm")
    settle(conn, schema, "hq")
    sent = time.monotonic()
    producer.publish("woken", routing_key="hq")
    assert received.wait("woken") - sent < 1.0


def test_a_hand_off_read_after_its_lock_expired_is_not_delivered(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer that reads its notifications late (a task of its own running, here: not
    driven): its lock (two heartbeats and 30 s at most; here the 2 s visibility timeout) has
    expired and another consumer took the message over. The late reader checks and drops it:
    the message runs once."""
    late, got_late = consumer_of_hq(make_connection, visibility_timeout=2)
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(late, producer)
    (holder,) = holders(conn, schema, "hq")
    producer.publish("once", routing_key="hq")
    ((_, token),) = locks(conn, schema, "hq")
    assert handed_to(token, holder)
    time.sleep(2.5)  # its lock expired
    other, got_other = consumer_of_hq(make_connection, visibility_timeout=30)
    other.drain_events(timeout=5)
    assert got_other.order == ["once"]
    with contextlib.suppress(TimeoutError):
        late.drain_events(timeout=1)
    assert got_late.order == ["warm"]
    broker = lonnymq.Broker(schema)
    wait_until(lambda: counters(broker, conn, "hq").acked == 2)
    assert_consistent(conn, schema)


def test_a_consumer_with_a_full_window_is_not_handed_anything(
    make_connection: Callable[..., Connection],
    drive: Callable[..., Driver],
    conn: Conn,
    schema: str,
) -> None:
    """A consumer holding a full prefetch window releases its hand-off key (RabbitMQ sends
    nothing past the prefetch count either): what is published meanwhile goes to the idle
    consumer beside it, every time, and the full one is handed nothing."""
    full = swept(make_connection())
    (queue,) = declared(full, "hq")
    held: list[Any] = []
    full.Consumer(
        [queue], callbacks=[lambda b, m: held.append((b, m))], accept=["json"], prefetch_count=1
    ).consume()
    drive(full, True)
    wait_until(lambda: len(holders(conn, schema, "hq")) == 1)  # registered, asleep
    settle(conn, schema, "hq")
    producer = make_connection().Producer(serializer="json")
    producer.publish("kept", routing_key="hq")  # (its window is full from now on)
    wait_until(lambda: len(held) == 1)
    idle, received = consumer_of_hq(make_connection)
    drive(idle, True)
    wait_until(lambda: len(holders(conn, schema, "hq")) == 2)
    time.sleep(0.3)  # (the full one's look after its delivery released its key)
    for i in range(8):
        settle(conn, schema, "hq")
        producer.publish(i, routing_key="hq")
        received.wait(i)
    assert [b for b, _ in held] == ["kept"]
    held[0][1].ack()


def test_what_is_handed_after_a_cancel_goes_back(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer cancelled while asleep, its connection kept: a publish before its next look
    still hands it a message, which it reads as for a queue it no longer consumes; its next
    heartbeat releases it (back in its place, unlocked), not its lock's expiry."""
    consumer_conn = swept(make_connection(visibility_timeout=4, heartbeat_interval=0.5))
    (queue,) = declared(consumer_conn, "hq")
    consumer = consumer_conn.Consumer([queue], callbacks=[lambda b, m: m.ack()], accept=["json"])
    consumer.consume()
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    (holder,) = holders(conn, schema, "hq")
    consumer.cancel()
    producer.publish("after-cancel", routing_key="hq")
    ((_, token),) = locks(conn, schema, "hq")
    assert handed_to(token, holder)
    with contextlib.suppress(TimeoutError):
        consumer_conn.drain_events(timeout=0.3)  # (reads it: for a queue not consumed)
    wait_until(lambda: locks(conn, schema, "hq")[0][1] is None, timeout=3)


def test_a_held_snapshot_does_not_slow_the_hand_off(
    make_connection: Callable[..., Connection],
    conn: Conn,
    connect: Callable[..., Conn],
    schema: str,
) -> None:
    """A publisher hands a message to the sleeping consumer (its session plans the hand-off
    then, on a small table); then, while another session holds a snapshot, 2,000 locks of
    the queue expire and go (acked messages leave their entries in the locked index until no
    snapshot can see them), all before the next ingest. The next publish is handed too, and
    its checks read from the queue's lock position, not those entries (version 21's plan
    read them all)."""
    consumer_conn, _ = consumer_of_hq(make_connection)
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    assert asleep_on(conn, schema, "hq")
    (holder,) = holders(conn, schema, "hq")
    publisher = connect()
    recorder = Recorder(publisher)
    run(publisher, publish_op(schema, "", "hq", b"first", handoff=True))
    recorder.take()
    table = sql.Identifier(schema, "message")
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (queue, channel, attempts, txid, dequeue_at, locked_until, "
            "lock_token, content) "
            "SELECT 'hq', 'gone', 1, pg_current_xact_id(), now() - interval '2 hours', "
            "now() - interval '1 hour' + g * interval '1 ms', gen_random_uuid(), 'x' "
            "FROM generate_series(1, 2000) AS g"
        ).format(table)
    )
    held = connect()
    held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    held.execute("SELECT 1")  # (its snapshot: the rows deleted next stay for it)
    try:
        conn.execute(sql.SQL("DELETE FROM {} WHERE channel = 'gone'").format(table))
        # (an ingest of the queue, as a consumer's look runs it: its lock position moves
        # past the expired locks, none of them live)
        conn.execute(
            sql.SQL("SELECT {}(ARRAY['hq'], true, true)").format(
                sql.Identifier(schema, "ingest_v1")
            )
        )
        run(publisher, publish_op(schema, "", "hq", b"second", handoff=True))
        plans = recorder.take()
    finally:
        held.execute("ROLLBACK")
    tokens = [token for _, token in locks(conn, schema, "hq")]
    assert len(tokens) == 2 and all(handed_to(t, holder) for t in tokens), tokens
    (checks,) = [p for p in plans if "quiet AS MATERIALIZED" in p.text]
    # (a read of the dead entries shows as heap fetches: 2,000 with version 21's plan)
    fetched = sum(int(node.get("Heap Fetches", 0)) for node in checks.nodes())
    assert fetched < 50, fetched


def test_housekeeping_moves_the_positions_of_the_queues_slept_on(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A consumer handed every message runs no dequeue, so no ingest of its own: the
    housekeeping's ingest moves the lock position of the queues a transport sleeps on, from
    which each hand-off's checks read."""
    consumer_conn, _ = consumer_of_hq(make_connection)
    producer = make_connection().Producer(serializer="json")
    warm_then_idle(consumer_conn, producer)
    assert holders(conn, schema, "hq")
    position = sql.SQL(
        "SELECT d.lock_from[array_position(d.queues, 'hq')] FROM {} d ORDER BY d.id DESC LIMIT 1"
    ).format(sql.Identifier(schema, "discovery"))
    before = conn.execute(position).fetchone()
    time.sleep(0.05)
    conn.execute(sql.SQL("SELECT {}(1000)").format(sql.Identifier(schema, "housekeep_v1")))
    after = conn.execute(position).fetchone()
    assert before is not None and after is not None and before[0] is not None
    assert after[0] > before[0]
