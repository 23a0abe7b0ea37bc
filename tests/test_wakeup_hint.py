# mypy: allow-untyped-calls
"""A woken consumer takes what woke it by its id (schema version 16; docs/design.md,
"Wake-ups", the hint).

A create of a message due now that wakes sleepers sends its id on ``<schema>_hint`` (once
per transaction) beside the plain notification; ``message_dequeue_hinted_v1`` takes the
hinted messages by their ids when nothing else of the call's queues waits, with the take's
rules, and otherwise hands the call to ``message_dequeue_v3``. Each test checks what the
plain dequeue would have kept (counts, limits, round robin, no message twice) and which of
the two served the call (the functions the call's transaction ran).
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from psycopg import sql

import lonnymq
from lonnymq.migrator import hint_channel, wake_channel
from lonnymq.queue._ops import run
from lonnymq.queue.dequeue import DEFAULT_LOCK_MS, DequeueResult, dequeue_op
from lonnymq.queue.operate import Counters
from lonnymq.transport import transport as transport_module
from lonnymq.transport.connection import MAX_HINTS
from tests.invariants import assert_consistent
from tests.test_counters import counters
from tests.test_plans import Recorder, functions_ran
from tests.test_wakeup import Driver, Received, declared
from tests.test_wakeup_take import asleep, discovery, lonnymq_id

Conn = psycopg.Connection[Any]


@pytest.fixture
def producer(connect: Callable[..., Conn]) -> Conn:
    return connect()


def hinted(
    broker: lonnymq.Broker,
    conn: Conn,
    hints: Sequence[int],
    *,
    queues: Sequence[str] = ("q",),
    limit: int = 1,
    ack: Sequence[tuple[int, uuid.UUID]] = (),
) -> tuple[DequeueResult, set[str]]:
    """A hinted dequeue, and the schema's functions its transaction ran."""
    op = dequeue_op(broker.schema, queues, limit=limit, ack=ack, listen=False, hints=hints)
    result, ran = functions_ran(conn, broker.schema, lambda: run(conn, op))
    return result, ran


def drain(broker: lonnymq.Broker, conn: Conn, held: list[lonnymq.Message]) -> list[int]:
    """Ack ``held`` and take the rest one by one (plain dequeues): the ids, in order."""
    got: list[int] = []
    while True:
        result = broker.dequeue(conn, ["q"], ack=held, listen=False)
        if not result:
            return got
        held = list(result.messages)
        got.extend(m.id for m in held)


def sleeper(connect: Callable[..., Conn], schema: str, queue: str = "q") -> Conn:
    """A session that sleeps on ``queue`` (holds its sleep key) and listens on both
    channels, as the transport's LISTEN session does."""
    listener = connect()
    for channel in (wake_channel(schema), hint_channel(schema)):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    listener.execute(
        sql.SQL("SELECT {}.sleep_v1(%s, '{{}}', '{{}}')").format(sql.Identifier(schema)),
        ([queue],),
    )
    return listener


def heard(listener: Conn) -> list[tuple[str, str]]:
    """(channel, payload) of the notifications that arrived, in order."""
    time.sleep(0.1)
    return [(n.channel, n.payload) for n in listener.notifies(timeout=0.2)]


def test_a_create_hints_its_message_to_sleepers_once_per_transaction(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, connect: Callable[..., Conn]
) -> None:
    wake, hint = wake_channel(broker.schema), hint_channel(broker.schema)
    channel = broker.queue("q").channel("a")
    # nobody sleeps: no notification at all
    listener = connect()
    listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(hint)))
    channel.message.create(producer, "alone")
    assert heard(listener) == []
    listener = sleeper(connect, broker.schema)
    one = lonnymq_id(channel.message.create(producer, "one"))
    assert heard(listener) == [(wake, "q"), (hint, f"{one} q")]
    with producer.transaction():
        ids = [lonnymq_id(channel.message.create(producer, f"m{i}")) for i in range(3)]
    assert heard(listener) == [(wake, "q"), (hint, f"{ids[0]} q")]  # the first only
    channel.message.create(producer, "later", delay_ms=60_000)
    assert heard(listener) == [(wake, "q")]  # not due now: no hint
    # a queue name with a space is the rest of the payload
    spaced = lonnymq_id(broker.queue("q x").channel("a").message.create(producer, "s"))
    assert heard(listener) == []  # nobody sleeps on it
    spaced_sleeper = sleeper(connect, broker.schema, "q x")
    spaced = lonnymq_id(broker.queue("q x").channel("a").message.create(producer, "s"))
    assert heard(spaced_sleeper) == [(wake, "q x"), (hint, f"{spaced} q x")]


def test_a_hinted_wake_up_is_taken_by_its_id_and_counted_once(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    for round_ in range(3):
        made = lonnymq_id(broker.queue("q").channel("a").message.create(producer, f"m{round_}"))
        before = discovery(conn, broker.schema)
        got, ran = hinted(broker, conn, [made], limit=4)
        assert [m.id for m in got.messages] == [made]
        assert got.messages[0].attempts == 1 and not got.messages[0].lock_expired
        assert "message_dequeue_v3" not in ran and "dequeue_take_v1" not in ran, ran
        assert discovery(conn, broker.schema) == before  # no ingest ran
        # (the next call acks it, finds nothing and ingests: nothing counted twice)
        assert not broker.dequeue(conn, ["q"], ack=got.messages, listen=False)
    assert counters(broker, conn, "q") == Counters(4, 4, 0, 4, 0, 0, 0, 0)
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY['q'], true, true)").format(sql.Identifier(broker.schema))
    )
    assert counters(broker, conn, "q") == Counters(4, 4, 0, 4, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_hinted_calls_follow_one_another_until_the_session_made_32_takes_since_an_ingest(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    """A hinted call takes again without an ingest while this session made fewer than 32
    takes since the newest ingest (schema version 20; 19 counted the database's
    transactions, which other work outruns; before, the call after a take always ingested
    first); then the call ingests first, as after a take, and the count starts again."""
    asleep(broker, conn)
    channel = broker.queue("q").channel("a")
    ingest = discovery(conn, broker.schema)
    held: list[tuple[int, uuid.UUID]] = []
    for turn in range(32):
        made = [lonnymq_id(channel.message.create(producer, f"{turn}.{i}")) for i in range(2)]
        for _ in range(150 if turn < 2 else 0):  # other sessions' transactions do not count
            producer.execute("SELECT pg_current_xact_id()")
        got, ran = hinted(broker, conn, made, limit=2, ack=held)
        assert [m.id for m in got.messages] == made and got.settled, turn
        assert got.retry_ms == DEFAULT_LOCK_MS  # (nothing else pending: when its locks expire)
        assert "message_dequeue_v3" not in ran and set(got.acked) == {i for i, _ in held}
        held = [(m.id, m.lock_token) for m in got.messages]
    assert discovery(conn, broker.schema) == ingest  # (no ingest meanwhile)
    last = lonnymq_id(channel.message.create(producer, "last"))
    got, ran = hinted(broker, conn, [last], ack=held)
    assert [m.id for m in got.messages] == [last] and not got.settled
    assert "message_dequeue_v3" in ran and discovery(conn, broker.schema) != ingest
    # counted again from the new ingest: the next wake-up's call is a take
    again = lonnymq_id(channel.message.create(producer, "again"))
    got2, ran = hinted(broker, conn, [again], ack=[(last, got.messages[0].lock_token)])
    assert [m.id for m in got2.messages] == [again] and got2.settled
    assert "message_dequeue_v3" not in ran
    assert drain(broker, conn, list(got2.messages)) == []
    assert counters(broker, conn, "q") == Counters(67, 67, 0, 67, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_a_hinted_call_that_took_all_that_waited_says_so_with_when_to_look_again(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    """``settled`` (schema version 19): the hinted call took every message that waited in
    its queues; with ``retry_ms``, when something may fall due, as a call that finds nothing
    is told. Not when it took fewer than waited, nor when the full dequeue did the call."""
    queue = broker.queue("q")
    queue.channel("b").message.create(producer, "later", delay_ms=3_000)
    asleep(broker, conn)  # (its ingest sees the delayed message: b's lane turns in 3 s)
    made = lonnymq_id(queue.channel("a").message.create(producer, "now"))
    got, _ = hinted(broker, conn, [made], limit=5)
    assert [m.id for m in got.messages] == [made] and got.settled
    assert got.retry_ms is not None and 2_000 < got.retry_ms <= 3_000, got.retry_ms
    # two waited, one asked for: more may be there
    pair = [lonnymq_id(queue.channel("a").message.create(producer, f"p{i}")) for i in range(2)]
    got2, ran = hinted(broker, conn, pair, limit=1, ack=[(made, got.messages[0].lock_token)])
    assert [m.id for m in got2.messages] == [pair[0]] and not got2.settled
    assert "message_dequeue_v3" not in ran
    # the full dequeue's call (another channel's unseen message waits) is never settled
    other = lonnymq_id(queue.channel("c").message.create(producer, "c"))
    mine = lonnymq_id(queue.channel("a").message.create(producer, "a"))
    got3, ran = hinted(broker, conn, [mine], limit=10, ack=[(pair[0], got2.messages[0].lock_token)])
    assert "message_dequeue_v3" in ran and not got3.settled
    assert sorted(m.id for m in got3.messages) == sorted([pair[1], other, mine])
    assert drain(broker, conn, list(got3.messages)) == []
    assert_consistent(conn, broker.schema)


def test_a_hint_gives_way_to_a_limited_lane_whose_slot_was_freed(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, connect: Callable[..., Conn]
) -> None:
    """An ack that frees a slot of a channel at its max_concurrency marks it freed; its lane
    gets its turn back at the next ingest. A hinted call then gives way to the full dequeue
    (which ingests) instead of taking alone and saying it took all there was (the look
    after a take, which ingested, went with schema version 19)."""
    queue = broker.queue("q")
    queue.channel("lim").policy.set(conn, max_concurrency=1)
    asleep(broker, conn)
    limited = [lonnymq_id(queue.channel("lim").message.create(producer, f"l{i}")) for i in (1, 2)]
    other = connect()
    first = broker.dequeue(other, ["q"], listen=False)
    assert [m.id for m in first.messages] == [limited[0]]
    assert not broker.dequeue(conn, ["q"], listen=False)  # lim at its limit: nothing
    assert first.messages[0].delete(other) == lonnymq.Outcome.OK  # frees lim's slot
    made = lonnymq_id(queue.channel("u").message.create(producer, "u"))
    got, ran = hinted(broker, conn, [made], limit=2)
    assert "message_dequeue_v3" in ran and not got.settled  # the caller looks again
    rest = drain(broker, conn, list(got.messages))
    assert sorted([m.id for m in got.messages] + rest) == sorted([limited[1], made])
    assert_consistent(conn, broker.schema)


def test_a_hint_gives_way_to_a_lane_whose_turn_came_first(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    older = [lonnymq_id(broker.queue("q").channel("b").message.create(producer, "b"))]
    older.append(lonnymq_id(broker.queue("q").channel("b").message.create(producer, "b2")))
    conn.execute(  # ingested: channel b's lane is due
        sql.SQL("SELECT {}.ingest_v1(ARRAY['q'], false, false)").format(
            sql.Identifier(broker.schema)
        )
    )
    # (a lone lane written less than 5 ms ago keeps its turn when served, docs/design.md:
    # b's lane must be older than that for the order asserted below)
    time.sleep(0.01)
    new = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "a"))
    got, ran = hinted(broker, conn, [new])
    assert [m.id for m in got.messages] == [older[0]]  # b's turn came first
    assert "message_dequeue_v3" in ran
    assert drain(broker, conn, list(got.messages)) == [new, older[1]]  # then round robin
    assert_consistent(conn, broker.schema)


def test_a_hint_gives_way_to_what_no_ingest_has_seen_of_another_channel(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    other = lonnymq_id(broker.queue("q").channel("b").message.create(producer, "b"))
    mine = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "a"))
    got, ran = hinted(broker, conn, [mine], limit=2)
    assert "message_dequeue_v3" in ran
    assert sorted(m.id for m in got.messages) == sorted([other, mine])  # one each, in turn
    assert drain(broker, conn, list(got.messages)) == []
    assert counters(broker, conn, "q") == Counters(3, 3, 0, 3, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


@pytest.mark.parametrize(
    "limits", [{"max_concurrency": 1}, {"rate": "1/h", "burst": 1}], ids=["concurrency", "rate"]
)
@pytest.mark.parametrize("whose", ["channel", "queue"])
def test_a_limit_holds_for_a_hinted_wake_up(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, limits: dict[str, Any], whose: str
) -> None:
    queue = broker.queue("q")
    (queue.channel("a") if whose == "channel" else queue).policy.set(conn, **limits)
    asleep(broker, conn)
    ids = [lonnymq_id(queue.channel("a").message.create(producer, f"m{i}")) for i in range(2)]
    got, ran = hinted(broker, conn, [ids[0]])
    assert [m.id for m in got.messages] == [ids[0]]
    assert "message_dequeue_v3" in ran  # a limited channel is the dequeue's
    again, _ = hinted(broker, conn, [ids[1]])
    assert not again.messages  # its one slot (or token) is taken
    assert_consistent(conn, broker.schema)


def test_a_hint_another_consumer_took_first_is_not_taken_twice(
    broker: lonnymq.Broker, conn: Conn, producer: Conn, connect: Callable[..., Conn]
) -> None:
    asleep(broker, conn)
    other = connect()
    made = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "once"))
    first, _ = hinted(broker, other, [made])
    second, ran = hinted(broker, conn, [made])
    assert [m.id for m in first.messages] == [made]
    assert not second.messages and "message_dequeue_v3" in ran
    assert drain(broker, other, list(first.messages)) == []
    assert counters(broker, conn, "q") == Counters(2, 2, 0, 2, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_a_hint_does_not_take_what_is_not_due_live_or_of_the_queue(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    asleep(broker, conn)
    asleep(broker, conn, "elsewhere")
    delayed = lonnymq_id(
        broker.queue("q").channel("a").message.create(producer, "later", delay_ms=60_000)
    )
    got, _ = hinted(broker, conn, [delayed])
    assert not got.messages
    dead = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "x", ttl_ms=1))
    time.sleep(0.01)
    got, _ = hinted(broker, conn, [dead])
    assert not got.messages  # past its time to live
    foreign = lonnymq_id(broker.queue("elsewhere").channel("a").message.create(producer, "f"))
    got, _ = hinted(broker, conn, [foreign])
    assert not got.messages  # not of the call's queues
    assert [m.id for m in broker.dequeue(conn, ["elsewhere"], listen=False).messages] == [foreign]
    assert_consistent(conn, broker.schema)


def test_acks_travel_with_a_hinted_call(broker: lonnymq.Broker, conn: Conn, producer: Conn) -> None:
    asleep(broker, conn)
    channel = broker.queue("q").channel("a")
    first = lonnymq_id(channel.message.create(producer, "first"))
    taken = broker.dequeue(conn, ["q"], listen=False).messages
    assert [m.id for m in taken] == [first]
    assert not broker.dequeue(conn, ["q"], listen=False)  # settled: the next call ingested
    made = lonnymq_id(channel.message.create(producer, "second"))
    # an ack under a stale token is refused, the hinted message taken all the same
    got, ran = hinted(broker, conn, [made], ack=[(first, uuid.uuid4())])
    assert got.acked == {first: lonnymq.Outcome.STATE_INVALID}
    assert [m.id for m in got.messages] == [made] and "message_dequeue_v3" not in ran
    # the right tokens: both acked
    done, _ = hinted(
        broker, conn, [], ack=[(first, taken[0].lock_token), (made, got.messages[0].lock_token)]
    )
    assert done.acked == {first: lonnymq.Outcome.OK, made: lonnymq.Outcome.OK}
    assert not done.messages
    assert counters(broker, conn, "q") == Counters(3, 3, 0, 3, 0, 0, 0, 0)
    assert_consistent(conn, broker.schema)


def test_a_kombu_consumer_woken_by_a_publish_takes_it_by_its_hint(
    make_connection: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    connect: Callable[..., Conn],
) -> None:
    """The transport's woken fetch carries the id of the message that woke it, and a busy
    channel's fetch none (with the hand-off off: it would deliver without a fetch)."""
    fetches: list[tuple[list[int], int]] = []  # (hints, messages) of each fetch of "hq"
    plain = dequeue_op

    def recorded(*args: Any, **kwargs: Any) -> Any:
        op = plain(*args, **kwargs)
        if list(args[1]) != ["hq"]:
            return op
        parse = op.parse

        def parsed(rows: Any) -> Any:
            result = parse(rows)
            fetches.append((list(kwargs.get("hints", ())), len(result.messages)))
            return result

        return type(op)(op.schema, op.query, op.params, parsed)

    monkeypatch.setattr(transport_module, "dequeue_op", recorded)
    consumer_conn = make_connection(handoff=False)
    (queue,) = declared(consumer_conn, "hq")
    received = Received()
    burst_published = threading.Event()

    def callback(body: Any, message: Any) -> None:
        if body == 10:  # the burst's first: busy until the rest waits (a consumer faster
            burst_published.wait(10)  # than its producer would find nothing in between)
        received(body, message)

    consumer_conn.Consumer([queue], callbacks=[callback], accept=["json"]).consume()
    driver = Driver(consumer_conn, hub=False)
    driver.start()
    try:
        producer = make_connection(handoff=False).Producer(serializer="json")
        time.sleep(0.5)  # idle, asleep
        for i in range(3):
            fetches.clear()
            sent = time.monotonic()
            producer.publish(i, routing_key="hq")
            assert received.wait(i) - sent < 0.1
            time.sleep(0.3)
            delivering = [hints for hints, n in fetches if n]
            assert len(delivering) == 1 and len(delivering[0]) == 1, fetches
        # a burst: the fetches after the first are of a busy channel, without hints. (Its
        # first two in one transaction: one hint for two messages, so the woken fetch,
        # the full dequeue's, takes both and does not find that it took all there was;
        # one alone would leave the channel asleep, its next fetch a hinted wake-up again)
        fetches.clear()
        caller = connect(autocommit=False)
        with lonnymq.transaction(caller):
            producer.publish(10, routing_key="hq")
            producer.publish(11, routing_key="hq")
        caller.commit()
        for i in range(12, 20):
            producer.publish(i, routing_key="hq")
        burst_published.set()
        for i in range(10, 20):
            received.wait(i)
        assert len([h for h, _ in fetches if h]) <= 1, fetches
    finally:
        driver.stop()


def test_hints_kept_for_a_queue_are_capped(
    make_connection: Callable[..., Connection], connect: Callable[..., Conn], schema: str
) -> None:
    """A consumer that does not fetch (its prefetch window full) while producers create
    keeps at most MAX_HINTS of their ids."""
    connection = make_connection()
    declared(connection, "cq")
    waiter = connection.transport.waiter
    listen, _ = waiter.listening()
    assert listen is not None
    listen.execute(
        sql.SQL("SELECT {}.sleep_v1(ARRAY['cq'], '{{}}', '{{}}')").format(sql.Identifier(schema))
    )
    producer = connect()
    made = [
        lonnymq_id(lonnymq.Queue("cq", schema=schema).channel("a").message.create(producer, "x"))
        for _ in range(MAX_HINTS + 6)
    ]
    time.sleep(0.2)
    assert waiter.notified({"cq"}) == {"cq"}
    assert waiter.hints(["cq"]) == made[:MAX_HINTS]
    assert waiter.hints(["cq"]) == []  # taken


def test_a_hint_of_a_message_an_ingest_has_seen_is_not_taken_by_id(
    broker: lonnymq.Broker, conn: Conn, producer: Conn
) -> None:
    """A stale hint (an ingest saw the message since) goes to the dequeue, which counts
    nothing twice; so does one for a message whose lane's turn is still to come."""
    asleep(broker, conn)
    made = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "seen"))
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY['q'], false, false)").format(
            sql.Identifier(broker.schema)
        )
    )
    got, ran = hinted(broker, conn, [made])
    assert [m.id for m in got.messages] == [made] and "message_dequeue_v3" in ran
    assert drain(broker, conn, list(got.messages)) == []
    assert counters(broker, conn, "q") == Counters(2, 2, 0, 2, 0, 0, 0, 0)
    # seen by an ingest, its lane's turn to come (as for a lane that stepped aside, then
    # lost its limit): not taken by its id, and not counted again
    later = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "later"))
    conn.execute(
        sql.SQL("SELECT {}.ingest_v1(ARRAY['q'], false, false)").format(
            sql.Identifier(broker.schema)
        )
    )
    conn.execute(
        sql.SQL(
            "UPDATE {}.lane SET turn_at = now() + interval '1 hour' WHERE channel = 'a'"
        ).format(sql.Identifier(broker.schema))
    )
    fresh = lonnymq_id(broker.queue("q").channel("a").message.create(producer, "fresh"))
    got, ran = hinted(broker, conn, [later, fresh], limit=2)
    assert [m.id for m in got.messages] == [fresh] and "message_dequeue_v3" not in ran
    assert counters(broker, conn, "q").enqueued == 4
    assert_consistent(conn, broker.schema)


def test_notifications_that_are_not_hints_are_dropped(
    make_connection: Callable[..., Connection], connect: Callable[..., Conn], schema: str
) -> None:
    """Any role may NOTIFY on the hint channel: what is not a message id of a consumed
    queue is dropped, without an error, and so are hints of queues no longer consumed."""
    connection = make_connection()
    declared(connection, "cq")
    waiter = connection.transport.waiter
    listen, _ = waiter.listening()
    assert listen is not None
    other = connect()
    channel = hint_channel(schema)
    for payload in ["\u00b2 cq", "0 cq", "99999999999999999999 cq", "x cq", " cq", "7", "8 zz"]:
        other.execute("SELECT pg_notify(%s, %s)", (channel, payload))
    other.execute("SELECT pg_notify(%s, %s)", (channel, "42 cq"))
    time.sleep(0.2)
    assert waiter.notified({"cq"}) == {"cq"}
    assert waiter.hints(["cq"]) == [42]
    other.execute("SELECT pg_notify(%s, %s)", (channel, "43 cq"))
    time.sleep(0.2)
    waiter.notified({"other"})  # cq no longer consumed: its hints go
    assert waiter.hints(["cq"]) == []


@pytest.mark.parametrize("hint", [False, True], ids=["take", "hint"])
def test_a_held_snapshot_does_not_make_a_wake_up_walk_what_was_consumed(
    broker: lonnymq.Broker, connect: Callable[..., Conn], hint: bool
) -> None:
    """Another session holds a snapshot while 3,000 messages are consumed: a wake-up's
    dequeue (the take, or the hinted one) touches about as many buffers after as before. Both
    read the messages they take by their ids; written with `lock_token IS NULL`, the generic
    plan read message_txid_idx whole for them instead of the primary key, every dead entry
    the held snapshot keeps (schema version 15: 76-80 buffers a wake-up after, against
    22-26 before and now)."""
    queue = broker.queue("q")
    producer, consumer, bulk = connect(), connect(), connect()
    asleep(broker, consumer)
    holder = connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute(sql.SQL("SELECT count(*) FROM {}.queue").format(sql.Identifier(broker.schema)))
    recorder = Recorder(consumer)

    def woken() -> int:
        made = lonnymq_id(queue.channel("a").message.create(producer, b"x"))
        state = discovery(bulk, broker.schema)
        recorder.take()
        op = dequeue_op(broker.schema, ["q"], limit=4, listen=False, hints=[made] if hint else ())
        got = run(consumer, op)
        [top] = [p for p in recorder.take() if p.text.lstrip().startswith("SELECT message_id")]
        assert [m.id for m in got.messages] == [made]
        assert discovery(bulk, broker.schema) == state  # a wake-up's dequeue: no ingest
        assert not broker.dequeue(consumer, ["q"], ack=got.messages, listen=False)  # ingests
        recorder.take()
        return top.buffers

    for _ in range(5):  # warm up
        woken()
    before = statistics.median(woken() for _ in range(15))
    batch = queue.batch()
    for i in range(3000):
        batch.channel(f"c{i % 10}").message(f"m{i}")
    batch.execute(bulk)
    held: list[lonnymq.Message] = []
    while True:
        held = list(broker.dequeue(bulk, ["q"], limit=100, ack=held, listen=False).messages)
        if not held:
            break
    after = statistics.median(woken() for _ in range(15))
    holder.rollback()
    assert after <= before + 20, (before, after)
    assert_consistent(consumer, broker.schema)


PARTIAL = (
    "message_ready_idx",
    "message_txid_idx",
    "message_locked_idx",
    "message_expires_idx",
    "message_name_idx",
)
#: Fragments of the statements that read `message` by ids, and how many of each must run:
#: the take's, the hinted dequeue's, the two of what a pass could not lock, a retry's.
BY_ID = {
    "ON m.id = ANY (v_ids)": 1,
    "ON m.id = ANY (p_hints)": 1,
    "m.id <> ALL (p_locked)": 2,
    "m.id = v_id": 2,
}


def test_reads_by_id_use_the_primary_key_when_the_partial_indexes_look_empty(
    broker: lonnymq.Broker, connect: Callable[..., Conn]
) -> None:
    """With the statistics taken while every message was locked, the partial indexes of
    `message` look empty, and a statement that finds messages by their ids and tests "not
    locked" with an index's own predicate was planned as a read of that whole index, dead
    entries and all: the wake-up take, the hinted dequeue and the read of what a pass could
    not lock (its delete of those past their time to live could be a range of the expiry
    index). Each of them runs here, and none reads a partial index of `message` (a retry of
    a delayed message, by one id, is checked too)."""
    queue = broker.queue("q")
    conn, producer, probe = connect(), connect(), connect()
    for i in range(30):
        queue.channel("held").message.create(conn, f"h{i}")
    assert len(broker.dequeue(conn, ["q"], limit=100, listen=False).messages) == 30
    conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(broker.schema, "message")))
    asleep(broker, probe, "w")
    recorder = Recorder(probe)
    # a wake-up: the take, then the hinted dequeue (neither ingests)
    for hint in (False, True):
        made = lonnymq_id(broker.queue("w").channel("a").message.create(producer, "x"))
        state = discovery(conn, broker.schema)
        op = dequeue_op(broker.schema, ["w"], listen=False, hints=[made] if hint else ())
        got = run(probe, op)
        assert [m.id for m in got.messages] == [made]
        assert discovery(conn, broker.schema) == state
        assert not broker.dequeue(probe, ["w"], ack=got.messages, listen=False)
    # a pass whose heads are past their time to live (the leftovers)
    gone = lonnymq_id(queue.channel("b").message.create(probe, "gone", ttl_ms=1))
    kept = lonnymq_id(queue.channel("b").message.create(probe, "kept"))
    time.sleep(0.01)
    got = broker.dequeue(probe, ["q"], limit=5, listen=False)  # (it created: it ingests first)
    assert [m.id for m in got.messages] == [kept], got
    assert not conn.execute(
        sql.SQL("SELECT 1 FROM {} WHERE id = %s").format(sql.Identifier(broker.schema, "message")),
        (gone,),
    ).fetchall()
    # a retry of a delayed message
    later = lonnymq_id(queue.channel("c").message.create(probe, "later", delay_ms=60_000))
    retried = probe.execute(
        sql.SQL("SELECT result_code FROM {}.message_retry_v1(%s)").format(
            sql.Identifier(broker.schema)
        ),
        ([later],),
    ).fetchall()
    assert retried == [("due_now",)]
    plans = recorder.take()
    ran = {
        fragment: [p for p in plans if fragment in " ".join(p.text.split())] for fragment in BY_ID
    }
    assert {f: len(ps) for f, ps in ran.items()} == BY_ID, {f: len(ps) for f, ps in ran.items()}
    # (the messages found by id on a partial index; the statements' other reads of those
    # indexes, by their own columns, are what they are for)
    by_id = re.compile(r"\bid (= |<> )")
    partial = [
        (fragment, node["Index Name"])
        for fragment, ps in ran.items()
        for p in ps
        for node in p.nodes()
        if node.get("Index Name") in PARTIAL
        and by_id.search(str(node.get("Filter", "")) + str(node.get("Index Cond", "")))
    ]
    assert not partial, partial
    assert_consistent(conn, broker.schema)
