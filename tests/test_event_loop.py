# mypy: allow-untyped-calls
# (kombu is untyped)
"""The transport driven by an event loop (kombu's Hub, what a Celery worker runs) instead of
``drain_events``: deliveries, acks carried by the next look, NOTIFY and timer wake-ups, acks
from other threads, a lost LISTEN connection, acks still buffered at close."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from kombu.asynchronous import Hub
from kombu.connection import Connection
from kombu.entity import Queue

import lonnymq
from lonnymq.queue.operate import settings_op
from lonnymq.transport import Transport
from lonnymq.transport.loop import LoopConsumer
from tests.test_wakeup import asleep_on, swept

Conn = psycopg.Connection[Any]


@pytest.fixture
def kombu_defaults() -> dict[str, Any]:
    """make_connection's defaults here: no fallback poll hides a missed wake-up."""
    return {"visibility_timeout": 30, "polling_interval": 30}


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def in_loop(hub: Hub, connection: Connection) -> None:
    connection.connect()
    connection.transport.register_with_event_loop(connection.connection, hub)


def run_until(hub: Hub, until: Callable[[], bool], timeout: float = 10) -> float:
    """Run the loop until ``until()``; returns the seconds it took."""
    start = time.monotonic()
    loop = hub.create_loop()
    while not until():
        assert time.monotonic() - start < timeout, "timed out running the event loop"
        next(loop)
    return time.monotonic() - start


def run_for(hub: Hub, seconds: float) -> None:
    """Run the loop for ``seconds`` (and at least once)."""
    deadline = time.monotonic() + seconds
    run_until(hub, lambda: time.monotonic() > deadline)


def published(make_connection: Callable[..., Connection], name: str, n: int) -> Queue:
    """The queue ``name``, declared, with the messages 0 .. n-1 published to it."""
    queue = Queue(name)
    producer = make_connection().Producer()
    for i in range(n):
        producer.publish(i, routing_key=name, declare=[queue])
    return queue


def stats(conn: Conn, schema: str, queue: str) -> tuple[int, int]:
    s = lonnymq.Broker(schema).queue(queue).stats(conn)
    return s.total, s.in_flight


def settle(hub: Hub, conn: Conn, schema: str, queue: str) -> None:
    """Run the loop until its consumer sleeps on ``queue`` and has made the look it makes
    after taking the queue's sleep key (before the key, a publish sends no NOTIFY; before
    the look, the look may find the message, unhinted): a publish then wakes it."""
    run_until(hub, lambda: asleep_on(conn, schema, queue))
    run_for(hub, 0.3)  # (the look is made at once)
    assert asleep_on(conn, schema, queue)


def test_transport_is_asynchronous_unless_told_not_to(
    make_connection: Callable[..., Connection],
) -> None:
    assert make_connection().transport.implements.asynchronous is True
    off = make_connection(event_loop=False)
    assert off.transport.implements.asynchronous is False
    assert Transport.implements.asynchronous is True  # the option changes one instance only


def test_loop_delivers_and_acks_without_drain_events(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    connection = make_connection()
    queue = published(make_connection, "looped", 50)
    in_loop(hub, connection)
    received: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()  # on the loop's thread: goes with the next look

    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=10)
        run_until(hub, lambda: len(received) == 50 and stats(conn, schema, "looped") == (0, 0))
    assert received == list(range(50))


@pytest.mark.slow
def test_loop_wakes_on_notify(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    connection = make_connection()
    queue = Queue("wake")
    queue(connection.default_channel).declare()
    in_loop(hub, connection)
    received: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(time.monotonic())
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]):
        run_for(hub, 0.3)  # idle, LISTEN watched
        assert received == []
        sent = time.monotonic()
        make_connection().Producer().publish("hi", routing_key="wake")
        run_until(hub, lambda: bool(received), timeout=5)
        run_until(hub, lambda: stats(conn, schema, "wake") == (0, 0))
    assert received[0] - sent < 0.5


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_a_wake_up_fetches_on_the_loop_thread_and_a_busy_consumer_beside_it(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """An idle consumer woken by a NOTIFY dequeues on the loop's thread (no hand-over to the
    fetch thread and back: a wake-up's latency); while its fetches bring messages the loop
    drives them without waiting for their rows (sent, their socket watched: see
    lonnymq.transport.inloop), so it goes on meanwhile; idle again, it is back on its own."""
    connection = make_connection()
    queue = Queue("wake_inline")
    queue(connection.default_channel).declare()
    in_loop(hub, connection)
    transport = connection.transport
    fetched: list[tuple[str, int, bool]] = []  # (thread, messages, settled) of each dequeue
    plain = transport.ack_and_dequeue

    def recorded(queues: list[str], limit: int, **kw: Any) -> Any:
        result = plain(queues, limit, **kw)
        fetched.append((threading.current_thread().name, len(result.messages), result.settled))
        return result

    transport.ack_and_dequeue = recorded
    plain_dequeued = transport.dequeued

    def driven(acks: Any, result: Any, started: float) -> None:  # (a fetch the loop drove)
        name = f"{threading.current_thread().name} (driven)"
        fetched.append((name, len(result.messages), result.settled))
        plain_dequeued(acks, result, started)

    transport.dequeued = driven
    received: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    producer = swept(make_connection()).Producer()
    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=2)
        settle(hub, conn, schema, "wake_inline")
        assert received == []
        for turn in range(2):
            fetched.clear()
            producer.publish(0, routing_key="wake_inline")
            run_until(hub, lambda: received == [0], timeout=5)
            loop_thread = threading.current_thread().name
            # the wake-up's own fetch, which took all that waited: asleep again after it
            assert fetched[0] == (loop_thread, 1, True), fetched
            # a burst while it delivers: fetched beside the loop
            for i in range(1, 21):
                producer.publish(i, routing_key="wake_inline")
            run_until(hub, lambda: len(received) == 21, timeout=10)
            assert sorted(received) == list(range(21))
            run_until(hub, lambda: stats(conn, schema, "wake_inline") == (0, 0))
            # a fetch after one that brought messages and may have left more is driven by
            # the loop, or runs on the fetch thread when it delivers what publishes handed
            # (after one that took all that waited, the next is a wake-up's again)
            after_busy = [
                cur for prev, cur in itertools.pairwise(fetched) if prev[1] and not prev[2]
            ]
            names = {name for name, _, _ in after_busy}
            assert names <= {f"{loop_thread} (driven)", "lonnymq-fetch"}, (turn, fetched)
            assert f"{loop_thread} (driven)" in names, (turn, fetched)
            assert any(n for _, n, _ in after_busy), (turn, fetched)
            settle(hub, conn, schema, "wake_inline")  # idle again
            received.clear()


def test_a_wake_up_that_fills_the_prefetch_window_does_not_sleep_through_the_next_publish(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """A woken fetch that took all there was but filled the prefetch window stays awake: a
    NOTIFY read while the window is full fetches nothing, and the ack that frees it must
    bring the next message at once, not at the fallback poll (5 s)."""
    connection = make_connection()
    queue = Queue("window_full")
    queue(connection.default_channel).declare()
    in_loop(hub, connection)
    held: list[Any] = []
    received: list[str] = []
    at: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        held.append(message)  # acked later: the window (of 1) stays full meanwhile
        at.append(time.monotonic())

    producer = make_connection().Producer()
    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=1)
        settle(hub, conn, schema, "window_full")
        producer.publish("first", routing_key="window_full")
        run_until(hub, lambda: received == ["first"], timeout=5)
        producer.publish("second", routing_key="window_full")
        run_for(hub, 0.3)  # its NOTIFY read, window full
        assert received == ["first"]
        held.pop().ack()
        acked = time.monotonic()
        run_until(hub, lambda: received == ["first", "second"], timeout=15)
        assert at[1] - acked < 1.0  # (the defect: the fallback poll, 30 s here)
        held.pop().ack()


def test_a_consumer_asleep_with_most_of_its_window_held_wakes_after_its_refill_wait(
    make_connection: Callable[..., Connection], hub: Hub, pg_dsn: str, conn: Conn, schema: str
) -> None:
    """A channel asleep while it holds more than half its prefetch window is asked for by
    a NOTIFY: it waits its refill delay first, and is fetched when that is over, not left
    asleep until the next NOTIFY or the fallback poll."""
    connection = make_connection()
    queue = Queue("refill_asleep")
    queue(connection.default_channel).declare()
    in_loop(hub, connection)
    held: list[Any] = []
    at: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        held.append((body, message))  # not acked: the window stays 3 of 4 full
        at.append(time.monotonic())

    producer = make_connection().Producer()
    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=4)
        settle(hub, conn, schema, "refill_asleep")
        with psycopg.connect(pg_dsn) as caller, lonnymq.transaction(caller):
            for i in range(3):  # (one transaction: fetched together)
                producer.publish(i, routing_key="refill_asleep")
        run_until(hub, lambda: len(held) == 3, timeout=5)
        settle(hub, conn, schema, "refill_asleep")  # found nothing more: asleep
        producer.publish(3, routing_key="refill_asleep")
        sent = time.monotonic()
        run_until(hub, lambda: len(held) == 4, timeout=15)
        assert at[3] - sent < 1.0  # (the defect: the fallback poll, 30 s here)
        for _, message in held:
            message.ack()


def test_loop_wakes_for_a_delayed_message_by_timer(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    connection = make_connection()
    queue = Queue("timer")
    connection.Producer().publish(
        "later", routing_key="timer", declare=[queue], headers={"x-delay-ms": 500}
    )
    start = time.monotonic()
    in_loop(hub, connection)
    received: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(time.monotonic())
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]):
        run_until(hub, lambda: bool(received), timeout=5)
    assert 0.45 < received[0] - start < 2.0


def test_loop_takes_acks_from_other_threads(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """Celery's thread pool acks from its threads while the loop waits: an ack that frees room
    in a full prefetch window wakes the loop at once (not at the 30-second poll)."""
    connection = make_connection()
    queue = published(make_connection, "threaded", 60)
    in_loop(hub, connection)
    received: list[int] = []
    acked_in: set[int] = set()
    with ThreadPoolExecutor(4) as pool:

        def ack(message: Any) -> None:
            message.ack()
            acked_in.add(threading.get_ident())

        def on_message(body: Any, message: Any) -> None:
            received.append(body)
            pool.submit(ack, message)

        with connection.Consumer(queue, callbacks=[on_message]) as consumer:
            consumer.qos(prefetch_count=10)
            took = run_until(
                hub, lambda: len(received) == 60 and stats(conn, schema, "threaded") == (0, 0)
            )
    assert sorted(received) == list(range(60))
    assert threading.get_ident() not in acked_in
    assert took < 10


@pytest.mark.slow
def test_loop_survives_a_lost_listen_connection(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn
) -> None:
    connection = make_connection()
    queue = Queue("relisten")
    queue(connection.default_channel).declare()
    in_loop(hub, connection)
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]):
        run_for(hub, 0.3)
        listen = connection.transport.waiter.listening()[0]
        assert listen is not None
        pid = listen.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        run_for(hub, 0.5)  # notices, reconnects
        make_connection().Producer().publish("after", routing_key="relisten")
        took = run_until(hub, lambda: bool(received), timeout=10)
        relisten = connection.transport.waiter.listening()[0]
    assert received == ["after"]
    assert took < 3  # not the 30-second poll
    assert relisten is not None and relisten.info.backend_pid != pid


def test_acks_still_buffered_are_sent_at_close(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    connection = make_connection()
    queue = Queue("closing")
    connection.Producer().publish("x", routing_key="closing", declare=[queue])
    in_loop(hub, connection)
    messages: list[Any] = []
    consumer = connection.Consumer(
        queue, callbacks=[lambda body, message: messages.append(message)]
    )
    consumer.consume()
    looper = connection.transport._looper
    assert looper is not None
    run_until(hub, lambda: bool(messages) and not looper.fetcher.busy)
    messages[0].ack()  # buffered for the next look, which never comes
    assert stats(conn, schema, "closing") == (1, 1)
    connection.release()
    assert stats(conn, schema, "closing") == (0, 0)


@pytest.mark.slow
def test_loop_sends_an_ack_made_later_on_its_thread(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """Celery's prefork pool acks on the loop's thread when a pool process accepts the task,
    after the delivery: the ack wakes the loop, whose next look sends it."""
    connection = make_connection()
    queue = Queue("later_ack")
    connection.Producer().publish("x", routing_key="later_ack", declare=[queue])
    in_loop(hub, connection)
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, msg: messages.append(msg)]):
        run_until(hub, lambda: bool(messages))
        run_for(hub, 0.2)  # idle: nothing more to look for
        assert stats(conn, schema, "later_ack") == (1, 1)
        hub.call_soon(messages[0].ack)
        took = run_until(hub, lambda: stats(conn, schema, "later_ack") == (0, 0), timeout=5)
    assert took < 1  # not the 30-second poll


def test_acks_made_on_the_loops_thread_go_with_a_look_without_the_wake_up_pipe(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """Celery's prefork pool acks tasks on the loop's thread (its result handler's reads):
    the acks go with a look before the loop polls again, and none of them writes the
    wake-up pipe (two system calls and a round of the loop each, measured: 1.2 pipe writes
    and 1.1 looks a task in a prefork worker before)."""
    connection = make_connection()
    queue = published(make_connection, "round_acks", 10)
    in_loop(hub, connection)
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, msg: messages.append(msg)]) as c:
        c.qos(prefetch_count=10)
        run_until(hub, lambda: len(messages) == 10)
        run_for(hub, 0.2)  # idle: nothing more to look for
        assert stats(conn, schema, "round_acks") == (10, 10)
        looper = connection.transport._looper
        pipe: list[int] = []  # per write of the pipe: the looks made before it
        looks: list[int] = []
        wake, look = looper.waiter.wake, looper.look

        def counted_wake() -> None:
            pipe.append(len(looks))
            wake()

        def counted_look() -> None:
            looks.append(1)
            look()

        looper.waiter.wake, looper.look = counted_wake, counted_look
        hub.call_soon(lambda: [m.ack() for m in messages])
        took = run_until(hub, lambda: stats(conn, schema, "round_acks") == (0, 0), timeout=5)
        looper.waiter.wake, looper.look = wake, look
    assert took < 1
    assert looks  # the acks went with a look
    assert 0 not in pipe  # and none of them wrote the pipe (a wake-up after that look is
    # its own: a fetch it handed to the fetch thread came back)


@pytest.mark.parametrize("thread", ["loop", "other"])
def test_a_use_of_the_connection_while_the_loop_drives_a_fetch_completes_it_first(
    make_connection: Callable[..., Connection],
    hub: Hub,
    conn: Conn,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
    thread: str,
) -> None:
    """A busy consumer's fetch is sent and its rows read when the loop sees them come
    (lonnymq.transport.inloop); a statement on the command connection meanwhile, from the
    loop's thread (a reject in a callback) or another (the heartbeat), completes the fetch
    first, and the loop delivers what it brought soon after: every message once."""
    connection = make_connection()
    queue = published(make_connection, "driven", 60)
    in_loop(hub, connection)
    transport = connection.transport
    interrupted: list[int] = []
    plain = LoopConsumer._drive

    def drive_then_use(self: LoopConsumer, job: Any) -> bool:
        started = plain(self, job)
        if started and self.pending is not None and self.pending.outcome is None:
            use = lambda: transport.pg.run(settings_op(schema, "driven"))  # noqa: E731
            if thread == "loop":
                use()
            else:
                other = threading.Thread(target=use)
                other.start()
                other.join(10)
            interrupted.append(int(self.pending.outcome is not None))
        return started

    monkeypatch.setattr(LoopConsumer, "_drive", drive_then_use)
    received: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message]) as consumer:
        consumer.qos(prefetch_count=4)
        took = run_until(
            hub, lambda: len(received) == 60 and stats(conn, schema, "driven") == (0, 0)
        )
    assert sorted(received) == list(range(60))  # each once
    assert interrupted and all(interrupted)  # each completed by the statement that came
    assert took < 5  # (its outcome not left waiting for the fallback poll)


def test_messages_fetched_but_not_delivered_are_released_at_close(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    """The fetch thread dequeued (locked) messages that the loop never delivered: closing the
    connection unlocks them at once instead of leaving them to their visibility_timeout."""
    connection = make_connection()
    queue = published(make_connection, "undelivered", 5)
    in_loop(hub, connection)
    received: list[Any] = []
    consumer = connection.Consumer(queue, callbacks=[lambda body, m: received.append(body)])
    consumer.consume()
    looper = connection.transport._looper
    assert looper is not None
    looper.idle = False  # a busy consumer's fetch: on the fetch thread
    looper.look()  # starts a fetch; the loop is never run, so nothing is delivered
    deadline = time.monotonic() + 10
    while stats(conn, schema, "undelivered") != (5, 5):
        assert time.monotonic() < deadline, "the fetch thread did not dequeue"
        time.sleep(0.01)
    connection.release()
    assert received == []
    assert stats(conn, schema, "undelivered") == (5, 0)


def test_messages_fetched_for_a_channel_closed_meanwhile_are_released(
    make_connection: Callable[..., Connection], hub: Hub, conn: Conn, schema: str
) -> None:
    connection = make_connection()
    queue = published(make_connection, "closed_meanwhile", 5)
    in_loop(hub, connection)
    received: list[Any] = []
    channel = connection.channel()
    consumer = connection.Consumer(
        [queue], channel=channel, callbacks=[lambda b, m: received.append(b)]
    )
    consumer.consume()
    looper = connection.transport._looper
    assert looper is not None
    looper.idle = False  # a busy consumer's fetch: on the fetch thread
    looper.look()
    deadline = time.monotonic() + 10
    while stats(conn, schema, "closed_meanwhile") != (5, 5):
        assert time.monotonic() < deadline, "the fetch thread did not dequeue"
        time.sleep(0.01)
    channel.close()  # while its fetch is back and not yet taken by the loop
    run_until(hub, lambda: stats(conn, schema, "closed_meanwhile") == (5, 0), timeout=5)
    assert received == []
