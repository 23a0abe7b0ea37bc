# mypy: allow-untyped-calls
# (kombu is untyped)
"""Dead letters (migration 3): reject, max_attempts (poison messages, by expired locks and by
defer/requeue), queue settings, retry, remove, the message listing, retention, the version 1
dequeue wrapper, the rights of each kind of role, and the upgrade from schema version 2."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from psycopg import sql

import lonnymq
from lonnymq import Created, Deduplicated, InvalidArgument, Outcome, PermissionDenied
from lonnymq.queue import (
    DeadLettered,
    MessageDetail,
    QueueSettings,
    RetryResult,
)
from lonnymq.roles import FUNCTIONS, KINDS, Kind
from tests import invariants
from tests.conftest import created, dsn_as, kombu_as, lonnymq_url, status_of

Conn = psycopg.Connection[Any]

#: short locks, so that an expired lock costs a tenth of a second
LOCK_MS = 60
EXPIRY_S = 0.1
DEFAULTS = QueueSettings(dead_letter=True, max_attempts=20, dead_retention_ms=14 * 86_400_000)


# --- helpers -----------------------------------------------------------------------------------

#: What the roles of a kind were granted before migration 12 dropped it (superseded functions
#: that no supported client calls); clients of version 2 call them.
_WORKER_DROPPED = ("message_dequeue_v1", "message_dequeue_v2", "message_ack_dequeue_v1")
DROPPED: dict[Kind, tuple[str, ...]] = {
    "producer": (),
    "worker": _WORKER_DROPPED,
    "admin": (*_WORKER_DROPPED, "channel_policy_set_v1", "queue_policy_set_v1", "channel_list_v1"),
}


def detail(broker: lonnymq.Broker, conn: Conn, message_id: int) -> MessageDetail:
    found = broker.message(conn, message_id)
    assert found is not None, message_id
    return found


def one(result: lonnymq.DequeueResult) -> lonnymq.Message:
    assert len(result.messages) == 1, result
    return result.messages[0]


def fetch(conn: Conn, query: str, schema: str, *params: Any) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)), params).fetchall()


def assert_channels_exact(conn: Conn, schema: str) -> None:
    """The schema's invariants hold (tests/invariants.py): channel rows count exactly their
    messages, the gauges are what the channels hold, no position skips a message, and a lane
    with something to hand out has a turn."""
    invariants.assert_consistent(conn, schema)


def expire_locks() -> None:
    time.sleep(EXPIRY_S)


# --- settings ----------------------------------------------------------------------------------


def test_settings_defaults_and_configure(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    assert queue.settings(conn) == DEFAULTS  # not created yet: the defaults
    assert broker.queues(conn) == []  # and reading them created nothing
    queue.configure(conn, dead_letter=False)
    assert queue.settings(conn) == QueueSettings(False, 20, DEFAULTS.dead_retention_ms)
    queue.configure(conn, max_attempts=3)
    assert queue.settings(conn) == QueueSettings(False, 3, DEFAULTS.dead_retention_ms)
    queue.configure(conn, max_attempts=None, dead_retention_ms=1500.2)  # rounded up
    assert queue.settings(conn) == QueueSettings(False, None, 1501)
    queue.configure(conn, dead_letter=True)
    assert queue.settings(conn) == QueueSettings(True, None, 1501)
    queue.configure(conn)  # nothing given: nothing changes
    assert queue.settings(conn) == QueueSettings(True, None, 1501)
    status = status_of(broker, conn, "default")
    assert status.settings == QueueSettings(True, None, 1501)
    # another queue keeps the defaults
    assert broker.queue("other").settings(conn) == DEFAULTS
    bad_settings: list[dict[str, Any]] = [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"max_attempts": 1.5},
        {"max_attempts": True},
        {"dead_retention_ms": 0},
        {"dead_letter": 1},
        {"dead_letter": None},
    ]
    for bad in bad_settings:
        with pytest.raises(InvalidArgument):
            queue.configure(conn, **bad)
    assert queue.settings(conn) == QueueSettings(True, None, 1501)


def test_configure_refuses_unknown_settings_in_sql(broker: lonnymq.Broker, conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="unknown queue setting"):
        conn.execute(
            sql.SQL("SELECT {}.queue_configure_v1('q', '{{\"max_attempt\": 3}}')").format(
                sql.Identifier(broker.schema)
            )
        )
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must be an object"):
        conn.execute(
            sql.SQL("SELECT {}.queue_configure_v1('q', '[]')").format(sql.Identifier(broker.schema))
        )


# --- reject ------------------------------------------------------------------------------------


def test_reject_moves_the_message_to_the_dead_letters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"payload", name="job-1", priority=7))
    other = created(ch.message.create(conn, b"stays"))
    first = one(queue.dequeue(conn, lock_ms=10_000))
    assert first.id == ident
    assert first.defer(conn, delay_ms=0, state=b"progress") is Outcome.OK
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert (held.id, held.attempts, held.state) == (ident, 2, b"progress")
    assert ch.info(conn).in_flight == 1

    # a stale token, and a message nobody holds, cannot be rejected
    assert broker.reject(conn, ident, uuid.uuid4()) is Outcome.STATE_INVALID
    assert broker.reject(conn, other, uuid.uuid4()) is Outcome.STATE_INVALID

    assert held.reject(conn, reason="bad input") is Outcome.OK
    dead = detail(broker, conn, ident)
    assert (dead.state, dead.reason, dead.attempts) == ("dead", "bad input", 2)
    assert (dead.queue, dead.channel, dead.name, dead.priority) == ("default", "a", "job-1", 7)
    assert (dead.content, dead.saved_state) == (b"payload", b"progress")
    assert dead.created_at == held.created_at
    assert dead.dead_at is not None and dead.dead_at >= dead.created_at
    assert dead.dequeue_at is None and dead.locked_until is None and dead.expires_at is None

    # the channel counts only the message left in it, held by nobody
    info = ch.info(conn)
    assert (info.size, info.in_flight) == (1, 0)
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (1, 0, 1)
    assert status.counters.dead == 1 and status.counters.acked == 0
    assert_channels_exact(conn, broker.schema)

    # finished with: a second reject, an ack, a defer or a heartbeat find nothing
    assert held.reject(conn) is Outcome.NOT_FOUND
    assert held.delete(conn) is Outcome.NOT_FOUND
    assert held.defer(conn) is Outcome.NOT_FOUND
    assert not held.heartbeat(conn, lock_ms=10_000)
    # the name is free again
    assert isinstance(ch.message.create(conn, b"again", name="job-1"), Created)


def test_reject_default_reason_and_last_message_of_a_channel(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ident = created(queue.channel("solo").message.create(conn, b"x"))
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert broker.reject(conn, held.id, held.lock_token) is Outcome.OK
    assert detail(broker, conn, ident).reason == "rejected"
    # the channel emptied: its row is gone, its counters are kept
    assert fetch(conn, "SELECT count(*) FROM {s}.channel", broker.schema) == [(0,)]
    assert queue.channel("solo").info(conn) == lonnymq.ChannelInfo(None, lonnymq.Policy(), 0, 0)
    counters = status_of(broker, conn, "default").counters
    assert (counters.enqueued, counters.delivered, counters.dead) == (1, 1, 1)
    with pytest.raises(lonnymq.InvalidName):
        held.reject(conn, reason="")


def test_reject_deletes_where_the_queue_keeps_no_dead_letters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.configure(conn, dead_letter=False)
    ident = created(queue.channel("a").message.create(conn, b"x"))
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert held.reject(conn, reason="nope") is Outcome.OK
    assert broker.message(conn, ident) is None
    assert broker.messages(conn, state="dead") == []
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (0, 0, 0)
    assert held.reject(conn) is Outcome.NOT_FOUND
    assert_channels_exact(conn, broker.schema)


# --- max_attempts ------------------------------------------------------------------------------


def test_poison_message_by_expired_locks(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """A message whose holder dies every time is delivered max_attempts times, then goes to
    the dead letters instead of being delivered again; the dequeue reports it."""
    queue.configure(conn, max_attempts=3)
    ident = created(queue.channel("a").message.create(conn, b"poison", name="p"))
    holders = []
    for attempt in (1, 2, 3):
        delivery = queue.dequeue(conn, limit=5, lock_ms=LOCK_MS)
        assert delivery.dead == []
        got = one(delivery)
        assert (got.id, got.attempts, got.lock_expired) == (ident, attempt, attempt > 1)
        holders.append(got)
        expire_locks()
    result = queue.dequeue(conn, limit=5, lock_ms=LOCK_MS)
    assert result.messages == []
    assert result.dead == [DeadLettered(ident, "default", "a", "p", 3, holders[0].created_at)]
    assert result.retry_ms == 0  # something happened: look again at once
    dead = detail(broker, conn, ident)
    assert (dead.state, dead.reason, dead.attempts, dead.content) == (
        "dead",
        "max_attempts",
        3,
        b"poison",
    )
    # the channel let go of it: no size, no slot
    assert queue.channel("a").info(conn).in_flight == 0
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (0, 0, 1)
    counters = status.counters
    assert (counters.enqueued, counters.delivered, counters.redelivered, counters.dead) == (
        1,
        3,
        2,
        1,
    )
    # the last holder wakes up: the message is gone
    assert holders[-1].delete(conn) is Outcome.NOT_FOUND
    assert holders[0].reject(conn) is Outcome.NOT_FOUND
    again = queue.dequeue(conn, limit=5, lock_ms=LOCK_MS)
    assert again.messages == [] and again.dead == [] and again.retry_ms is None
    assert_channels_exact(conn, broker.schema)


def test_poison_message_by_defer_and_requeue(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """Defers and requeues keep attempts: the delivery after the max_attempts-th is refused
    too, and the messages behind it in the channel still flow."""
    queue.configure(conn, max_attempts=2)
    ch = queue.channel("a")
    poison = created(ch.message.create(conn, b"poison", priority=9))
    behind = [created(ch.message.create(conn, f"m{i}".encode())) for i in range(3)]
    first = one(queue.dequeue(conn, lock_ms=10_000))
    assert (first.id, first.attempts, first.lock_expired) == (poison, 1, False)
    assert first.defer(conn, delay_ms=None) is Outcome.OK  # requeue in place
    second = one(queue.dequeue(conn, lock_ms=10_000))
    assert (second.id, second.attempts, second.lock_expired) == (poison, 2, False)
    assert second.defer(conn, delay_ms=0, state=b"s") is Outcome.OK

    delivered: list[int] = []
    dead: list[DeadLettered] = []
    for _ in range(3):
        result = queue.dequeue(conn, limit=10, lock_ms=10_000)
        delivered += [m.id for m in result.messages]
        dead += result.dead
        if len(delivered) == 3:
            break
    assert sorted(delivered) == behind
    assert [(d.id, d.attempts) for d in dead] == [(poison, 2)]
    letter = detail(broker, conn, poison)
    assert (letter.reason, letter.attempts, letter.saved_state, letter.priority) == (
        "max_attempts",
        2,
        b"s",
        9,
    )
    info = ch.info(conn)
    assert (info.size, info.in_flight) == (3, 3)
    counters = status_of(broker, conn, "default").counters
    assert (counters.delivered, counters.deferred, counters.dead, counters.redelivered) == (
        5,
        2,
        1,
        0,
    )
    assert_channels_exact(conn, broker.schema)


def test_default_max_attempts_is_twenty(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"x"))
    for attempt in range(1, 21):
        got = one(queue.dequeue(conn, lock_ms=10_000))
        assert got.attempts == attempt
        assert got.defer(conn) is Outcome.OK
    result = queue.dequeue(conn, lock_ms=10_000)
    assert result.messages == [] and [d.id for d in result.dead] == [ident]
    assert detail(broker, conn, ident).attempts == 20


def test_max_attempts_none_is_unlimited(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.configure(conn, max_attempts=None)
    created(queue.channel("a").message.create(conn, b"x"))
    for attempt in range(1, 26):
        got = one(queue.dequeue(conn, lock_ms=10_000))
        assert got.attempts == attempt
        assert got.defer(conn) is Outcome.OK
    # and by expired locks
    got = one(queue.dequeue(conn, lock_ms=LOCK_MS))
    expire_locks()
    again = one(queue.dequeue(conn, lock_ms=10_000))
    assert (again.id, again.attempts, again.lock_expired) == (got.id, 27, True)
    assert broker.messages(conn, state="dead") == []


def test_max_attempts_applies_per_queue_in_a_multi_queue_dequeue(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    strict, lenient = broker.queue("strict"), broker.queue("lenient")
    strict.configure(conn, max_attempts=1)
    s = created(strict.channel("a").message.create(conn, b"s"))
    n = created(lenient.channel("a").message.create(conn, b"l"))
    got = broker.dequeue(conn, ["strict", "lenient"], limit=10, lock_ms=LOCK_MS)
    assert sorted(m.id for m in got.messages) == sorted([s, n])
    expire_locks()
    again = broker.dequeue(conn, ["strict", "lenient"], limit=10, lock_ms=10_000)
    assert [(m.id, m.attempts, m.lock_expired) for m in again.messages] == [(n, 2, True)]
    assert [(d.id, d.queue) for d in again.dead] == [(s, "strict")]


def test_lowering_max_attempts_catches_messages_already_past_it(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"x"))
    for _ in range(3):
        assert one(queue.dequeue(conn, lock_ms=10_000)).defer(conn) is Outcome.OK
    queue.configure(conn, max_attempts=2)
    result = queue.dequeue(conn, lock_ms=10_000)
    assert result.messages == [] and [(d.id, d.attempts) for d in result.dead] == [(ident, 3)]


def test_poison_dropped_where_the_queue_keeps_no_dead_letters(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    queue.configure(conn, dead_letter=False, max_attempts=1)
    ident = created(queue.channel("a").message.create(conn, b"x"))
    one(queue.dequeue(conn, lock_ms=LOCK_MS))
    expire_locks()
    result = queue.dequeue(conn, lock_ms=LOCK_MS)
    assert result.messages == [] and [d.id for d in result.dead] == [ident]  # still reported
    assert broker.message(conn, ident) is None
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (0, 0, 0)
    assert_channels_exact(conn, broker.schema)


def test_dead_report_of_several_channels(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """DequeueResult.dead lists every message dead-lettered by the call, expired locks and
    deferred ones, with their queue, channel, name, attempts and creation time; the
    messages delivered by the same call are unaffected."""
    queue.configure(conn, max_attempts=1)
    a = created(queue.channel("a").message.create(conn, b"a", name="na"))
    b = created(queue.channel("b").message.create(conn, b"b"))
    c = created(queue.channel("c").message.create(conn, b"c", name="nc"))
    got = queue.dequeue(conn, limit=3, lock_ms=LOCK_MS).messages
    created_at = {m.id: m.created_at for m in got}
    by_id = {m.id: m for m in got}
    assert by_id[c].defer(conn) is Outcome.OK  # deferred at its last attempt
    fresh = created(queue.channel("d").message.create(conn, b"d"))
    expire_locks()
    result = queue.dequeue(conn, limit=10, lock_ms=10_000)
    assert [m.id for m in result.messages] == [fresh]
    assert sorted(result.dead, key=lambda d: d.id) == [
        DeadLettered(a, "default", "a", "na", 1, created_at[a]),
        DeadLettered(b, "default", "b", None, 1, created_at[b]),
        DeadLettered(c, "default", "c", "nc", 1, created_at[c]),
    ]
    reasons = {m.id: m.reason for m in broker.messages(conn, state="dead")}
    assert reasons == {a: "max_attempts", b: "max_attempts", c: "max_attempts"}
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (1, 1, 3)
    assert_channels_exact(conn, broker.schema)


def test_lock_expired_flag(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn) -> None:
    created(queue.channel("a").message.create(conn, b"x"))
    first = one(queue.dequeue(conn, lock_ms=LOCK_MS))
    assert first.lock_expired is False
    expire_locks()
    second = one(queue.dequeue(conn, lock_ms=10_000))
    assert (second.id, second.attempts, second.lock_expired) == (first.id, 2, True)
    # the first holder lost it
    assert first.delete(conn) is Outcome.STATE_INVALID
    assert first.reject(conn) is Outcome.STATE_INVALID
    assert not first.heartbeat(conn, lock_ms=10_000)
    assert second.defer(conn, delay_ms=None) is Outcome.OK
    third = one(queue.dequeue(conn, lock_ms=10_000))
    assert (third.attempts, third.lock_expired) == (3, False)  # after a requeue: not expired
    counters = status_of(broker, conn, "default").counters
    assert (counters.delivered, counters.redelivered) == (3, 1)


def test_dead_lettered_poison_frees_its_concurrency_slot(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """A channel with max_concurrency 1 whose only slot is held by a poison message keeps
    flowing once the message is dead-lettered."""
    queue.configure(conn, max_attempts=1)
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=1)
    poison = created(ch.message.create(conn, b"poison"))
    nxt = created(ch.message.create(conn, b"next"))
    assert one(queue.dequeue(conn, limit=5, lock_ms=300)).id == poison
    blocked = queue.dequeue(conn, limit=5, lock_ms=10_000)
    assert blocked.messages == [] and blocked.dead == []
    assert blocked.retry_ms is not None and 0 < blocked.retry_ms <= 300  # its lock is the wait
    time.sleep(0.35)
    result = queue.dequeue(conn, limit=5, lock_ms=10_000)
    assert [d.id for d in result.dead] == [poison]
    assert [m.id for m in result.messages] == [nxt]  # the freed slot, in the same call
    info = ch.info(conn)
    assert (info.size, info.in_flight) == (1, 1)
    assert result.messages[0].delete(conn) is Outcome.OK
    later = created(ch.message.create(conn, b"later"))
    assert one(queue.dequeue(conn, lock_ms=10_000)).id == later
    assert_channels_exact(conn, broker.schema)


def test_reject_frees_the_concurrency_slot(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=1)
    created(ch.message.create(conn, b"1"))
    second = created(ch.message.create(conn, b"2"))
    held = one(queue.dequeue(conn, limit=5, lock_ms=10_000))
    assert queue.dequeue(conn, limit=5, lock_ms=10_000).messages == []
    assert held.reject(conn) is Outcome.OK
    assert one(queue.dequeue(conn, limit=5, lock_ms=10_000)).id == second
    assert_channels_exact(conn, broker.schema)


def test_concurrent_dequeues_dead_letter_each_poison_message_once(
    broker: lonnymq.Broker, queue: lonnymq.Queue, connect: Callable[..., Conn]
) -> None:
    conn = connect()
    queue.configure(conn, max_attempts=1)
    ids = [created(queue.channel(f"c{i % 7}").message.create(conn, b"x")) for i in range(60)]
    assert len(queue.dequeue(conn, limit=100, lock_ms=LOCK_MS)) == 60
    expire_locks()
    conns = [connect() for _ in range(4)]
    dead: list[list[int]] = [[] for _ in conns]
    delivered: list[list[int]] = [[] for _ in conns]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(30):
                result = queue.dequeue(conns[i], limit=7, lock_ms=10_000)
                dead[i] += [d.id for d in result.dead]
                delivered[i] += [m.id for m in result.messages]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [i for d in delivered for i in d] == []
    assert sorted(i for d in dead for i in d) == ids  # each exactly once
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead, status.counters.dead) == (0, 0, 60, 60)
    assert_channels_exact(conn, broker.schema)


# --- retry -------------------------------------------------------------------------------------


def test_retry_a_dead_letter(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn) -> None:
    queue.configure(conn, max_attempts=2)
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"work", name="job", priority=5))
    first = one(queue.dequeue(conn, lock_ms=10_000))
    assert first.defer(conn, state=b"halfway") is Outcome.OK
    second = one(queue.dequeue(conn, lock_ms=10_000))
    assert second.reject(conn, reason="flaky") is Outcome.OK

    results = broker.retry(conn, [ident])
    assert len(results) == 1
    new_id = results[0].new_id
    assert results[0].result == "retried" and new_id is not None and new_id != ident
    assert broker.message(conn, ident) is None  # the dead letter is gone
    again = detail(broker, conn, new_id)
    assert (again.state, again.attempts, again.reason, again.dead_at) == ("ready", 0, None, None)
    assert (again.queue, again.channel, again.name, again.priority) == ("default", "a", "job", 5)
    assert (again.content, again.saved_state) == (b"work", b"halfway")
    # attempts start again at zero: max_attempts full deliveries before it is dead again
    got = one(queue.dequeue(conn, lock_ms=10_000))
    assert (got.id, got.attempts, got.state, got.lock_expired) == (new_id, 1, b"halfway", False)
    assert got.defer(conn) is Outcome.OK
    assert one(queue.dequeue(conn, lock_ms=10_000)).attempts == 2
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead) == (1, 1, 0)
    assert_channels_exact(conn, broker.schema)


def test_retried_dead_letter_takes_part_in_name_dedup(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    # a retried named dead letter is a never-dequeued message of that name again
    dead = created(ch.message.create(conn, b"old", name="job"))
    assert one(queue.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
    [retried] = broker.retry(conn, [dead])
    assert retried.result == "retried" and retried.new_id is not None
    assert ch.message.create(conn, b"dup", name="job") == Deduplicated(retried.new_id)

    # while a never-dequeued message of the name waits, retrying a dead letter of the same
    # name de-duplicates against it: nothing new is created, and the dead letter stays (its
    # content is not lost) until the waiting one has been delivered
    got = one(queue.dequeue(conn, lock_ms=10_000))
    assert got.reject(conn) is Outcome.OK
    waiting = created(ch.message.create(conn, b"new", name="job"))
    [result] = broker.retry(conn, [got.id])
    assert result == RetryResult(got.id, "deduplicated", waiting)
    kept = broker.message(conn, got.id)
    assert kept is not None and kept.state == "dead" and kept.content == b"old"
    assert [m.id for m in broker.messages(conn, queue="default")] == [got.id, waiting]
    assert ch.info(conn).size == 1
    # once the waiting one was delivered, the retry goes through
    assert one(queue.dequeue(conn, lock_ms=10_000)).delete(conn) is Outcome.OK
    [result] = broker.retry(conn, [got.id])
    assert result.result == "retried" and broker.message(conn, got.id) is None
    assert_channels_exact(conn, broker.schema)


def test_retry_into_a_full_channel_keeps_the_dead_letter(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_size=1)
    dead = created(ch.message.create(conn, b"dead"))
    assert one(queue.dequeue(conn, lock_ms=10_000)).reject(conn, reason="r") is Outcome.OK
    before = detail(broker, conn, dead)
    blocker = created(ch.message.create(conn, b"blocker"))
    assert broker.retry(conn, [dead]) == [RetryResult(dead, "channel_full", None)]
    assert detail(broker, conn, dead) == before  # untouched, same dead_at and reason
    info = ch.info(conn)
    assert (info.size, info.in_flight) == (1, 0)
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert held.id == blocker and held.delete(conn) is Outcome.OK
    [retried] = broker.retry(conn, [dead])
    assert retried.result == "retried" and retried.new_id is not None
    assert detail(broker, conn, retried.new_id).content == b"dead"
    assert_channels_exact(conn, broker.schema)


def test_retry_every_other_state(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    delayed = created(ch.message.create(conn, b"later", delay_ms=3_600_000))
    locked = created(ch.message.create(conn, b"held"))
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert held.id == locked
    ready = created(ch.message.create(conn, b"ready"))
    missing = ready + 1000
    assert detail(broker, conn, delayed).state == "delayed"
    results = broker.retry(conn, [missing, ready, delayed, locked, delayed])
    assert results == [  # by id, each once
        RetryResult(delayed, "due_now", None),
        RetryResult(locked, "locked", None),
        RetryResult(ready, "ready", None),
        RetryResult(missing, "not_found", None),
    ]
    assert detail(broker, conn, delayed).state == "ready"
    got = queue.dequeue(conn, limit=5, lock_ms=10_000)
    assert sorted(m.id for m in got.messages) == sorted([delayed, ready])
    assert broker.retry(conn, []) == []
    with pytest.raises(InvalidArgument):
        broker.retry(conn, [0])
    assert_channels_exact(conn, broker.schema)


def test_retry_of_a_delayed_message_wakes_a_channel_with_nothing_else(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"x", delay_ms=3_600_000))
    result = queue.dequeue(conn, lock_ms=10_000)
    assert result.messages == [] and result.retry_ms is not None and result.retry_ms > 3_000_000
    assert broker.retry(conn, [ident]) == [RetryResult(ident, "due_now", None)]
    assert one(queue.dequeue(conn, lock_ms=10_000)).id == ident


# --- remove ------------------------------------------------------------------------------------


def test_remove_a_held_message_unblocks_its_channel(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ch.policy.set(conn, max_concurrency=1)
    first = created(ch.message.create(conn, b"1"))
    second = created(ch.message.create(conn, b"2"))
    held = one(queue.dequeue(conn, limit=5, lock_ms=10_000))
    assert held.id == first
    assert queue.dequeue(conn, limit=5, lock_ms=10_000).messages == []  # saturated
    assert broker.remove(conn, [first]) == {first: "deleted"}
    nxt = one(queue.dequeue(conn, limit=5, lock_ms=10_000))
    assert nxt.id == second
    # the holder of the removed message finds it gone
    assert held.delete(conn) is Outcome.NOT_FOUND
    assert held.defer(conn) is Outcome.NOT_FOUND
    assert held.reject(conn) is Outcome.NOT_FOUND
    assert broker.delete_many(conn, [held]) == {first: Outcome.NOT_FOUND}
    info = ch.info(conn)
    assert (info.size, info.in_flight) == (1, 1)
    assert broker.message(conn, first) is None
    assert_channels_exact(conn, broker.schema)


def test_remove_in_every_state(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn) -> None:
    ch = queue.channel("a")
    dead = created(queue.channel("c").message.create(conn, b"dead"))
    assert one(queue.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
    locked = created(ch.message.create(conn, b"locked"))
    held = one(queue.dequeue(conn, lock_ms=10_000))
    assert held.id == locked
    expired = created(queue.channel("b").message.create(conn, b"expired lock"))
    assert one(queue.dequeue(conn, lock_ms=1)).id == expired
    time.sleep(0.01)
    ready = created(ch.message.create(conn, b"ready"))
    delayed = created(ch.message.create(conn, b"delayed", delay_ms=3_600_000))
    kept = created(ch.message.create(conn, b"kept"))
    states = {m.id: m.state for m in broker.messages(conn)}
    assert states == {
        locked: "locked",
        expired: "locked",
        ready: "ready",
        delayed: "delayed",
        dead: "dead",
        kept: "ready",
    }
    missing = kept + 1000
    ids = [locked, expired, ready, delayed, dead, missing, locked]
    assert broker.remove(conn, ids) == {
        locked: "deleted",
        expired: "deleted",
        ready: "deleted",
        delayed: "deleted",
        dead: "deleted",
        missing: "not_found",
    }
    assert [m.id for m in broker.messages(conn)] == [kept]
    assert held.delete(conn) is Outcome.NOT_FOUND
    status = status_of(broker, conn, "default")
    assert (status.total, status.in_flight, status.dead, status.ready, status.delayed) == (
        1,
        0,
        0,
        1,
        0,
    )
    assert broker.remove(conn, [locked, dead]) == {locked: "not_found", dead: "not_found"}
    assert broker.remove(conn, []) == {}
    with pytest.raises(InvalidArgument):
        broker.remove(conn, "12")  # type: ignore[arg-type]
    assert_channels_exact(conn, broker.schema)
    assert one(queue.dequeue(conn, lock_ms=10_000)).id == kept


# --- listing, showing, purging -----------------------------------------------------------------


def test_messages_filters_and_keyset_paging(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    a, b = queue.channel("a"), queue.channel("b")
    other = broker.queue("other")
    dead_b = created(b.message.create(conn, b"dead-b", name="d"))
    assert one(queue.dequeue(conn, lock_ms=10_000)).reject(conn, reason="why") is Outcome.OK
    ready_a = [created(a.message.create(conn, f"r{i}".encode())) for i in range(3)]
    delayed_a = created(a.message.create(conn, b"delayed", delay_ms=3_600_000, priority=3))
    locked_b = created(b.message.create(conn, b"locked-b"))
    held = queue.dequeue(conn, limit=1, lock_ms=10_000).messages[0]
    assert held.id == ready_a[0]  # channel a's turn first: it waited longest
    held_b = broker.dequeue(conn, ["default"], limit=1, lock_ms=10_000).messages[0]
    assert held_b.id == locked_b
    ready_a.pop(0)
    locked_a = held.id
    dead_other = created(other.channel("a").message.create(conn, b"other"))
    assert one(other.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
    ready_other = created(other.channel("a").message.create(conn, b"other ready"))

    def ids(**filters: Any) -> list[int]:
        return [m.id for m in broker.messages(conn, **filters)]

    everything = sorted([dead_b, *ready_a, delayed_a, locked_b, locked_a, dead_other, ready_other])
    assert ids() == everything
    assert ids(queue="default") == sorted([dead_b, *ready_a, delayed_a, locked_b, locked_a])
    assert ids(queue="default", state="ready") == ready_a
    assert ids(state="ready") == [*ready_a, ready_other]
    assert ids(queue="default", state="delayed") == [delayed_a]
    assert ids(queue="default", state="locked") == sorted([locked_a, locked_b])
    assert ids(state="dead") == [dead_b, dead_other]
    assert ids(queue="default", state="dead") == [dead_b]
    assert ids(queue="default", channel="b") == sorted([dead_b, locked_b])
    assert ids(channel="a", state="dead") == [dead_other]
    assert ids(channel="a", queue="other") == [dead_other, ready_other]
    assert ids(queue="nope") == [] and ids(channel="nope") == []

    listed = {m.id: m for m in broker.messages(conn)}
    letter = listed[dead_b]
    assert (letter.state, letter.reason, letter.name, letter.size) == ("dead", "why", "d", 6)
    assert letter.dead_at is not None and letter.dequeue_at is None
    assert listed[delayed_a].priority == 3 and listed[delayed_a].dequeue_at is not None
    assert listed[locked_a].locked_until is not None and listed[locked_a].attempts == 1
    assert listed[ready_a[0]].reason is None and listed[ready_a[0]].dead_at is None

    # keyset paging: pages of 2, then of 1, give the same ids in the same order
    for size in (1, 2, 3):
        seen: list[int] = []
        after = 0
        while page := broker.messages(conn, after=after, limit=size):
            assert len(page) <= size
            seen += [m.id for m in page]
            after = page[-1].id
        assert seen == everything
    # paging within a filter that mixes live messages and dead letters
    page1 = broker.messages(conn, channel="a", limit=2)
    page2 = broker.messages(conn, channel="a", after=page1[-1].id, limit=50)
    assert [m.id for m in page1 + page2] == ids(channel="a")

    with pytest.raises(InvalidArgument, match="state"):
        broker.messages(conn, state="held")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        broker.messages(conn, limit=0)


def test_message_detail_and_payload(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ident = created(queue.channel("a").message.create(conn, b'{"body": "x"}', ttl_ms=60_000))
    shown = detail(broker, conn, ident)
    assert shown.state == "ready"
    assert shown.expires_at is not None and shown.dequeue_at is not None
    assert shown.expires_at - shown.dequeue_at == timedelta(seconds=60)
    assert shown.payload() == {"body": "x"}
    raw = created(queue.channel("a").message.create(conn, b"\xff\xfe"))
    assert detail(broker, conn, raw).payload() is None
    assert broker.message(conn, raw + 1000) is None


def test_purge_dead_only_touches_that_queues_dead_letters(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    for name in ("q1", "q2"):
        q = broker.queue(name)
        for _ in range(2):
            q.channel("a").message.create(conn, b"x")
            assert one(q.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
        q.channel("a").message.create(conn, b"live")
    assert broker.queue("q1").purge_dead(conn) == 2
    assert broker.queue("q1").purge_dead(conn) == 0
    assert [m.queue for m in broker.messages(conn, state="dead")] == ["q2", "q2"]
    assert status_of(broker, conn, "q1").total == 1  # live messages stay
    assert broker.queue("nope").purge_dead(conn) == 0


# --- retention ---------------------------------------------------------------------------------


def test_housekeep_prunes_dead_letters_past_their_queue_retention(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    short, long_ = broker.queue("short"), broker.queue("long")
    for q in (short, long_, short, short):
        q.channel("a").message.create(conn, b"x")
        assert one(q.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
    assert broker.housekeep(conn) == 0  # kept 14 days by default
    # retention is a setting of the queue, applied when housekeep runs
    short.configure(conn, dead_retention_ms=50)
    time.sleep(0.1)
    assert broker.housekeep(conn, limit=2) == 2
    assert broker.housekeep(conn) == 1
    assert broker.housekeep(conn) == 0
    assert [m.queue for m in broker.messages(conn, state="dead")] == ["long"]
    assert status_of(broker, conn, "short").dead == 0
    assert status_of(broker, conn, "long").dead == 1
    with pytest.raises(InvalidArgument):
        broker.housekeep(conn, limit=0)


def test_dead_letters_outlive_their_deleted_queue(broker: lonnymq.Broker, conn: Conn) -> None:
    q = broker.queue("gone")
    q.configure(conn, dead_retention_ms=50)  # the deleted queue's setting goes with it
    q.channel("a").message.create(conn, b"x")
    assert one(q.dequeue(conn, lock_ms=10_000)).reject(conn) is Outcome.OK
    assert q.delete(conn) == 0
    assert "gone" not in [s.queue for s in broker.status(conn)]
    time.sleep(0.1)
    assert broker.housekeep(conn) == 0  # kept with the default retention
    [letter] = broker.messages(conn, state="dead")
    assert letter.queue == "gone"
    # retried: the queue comes back, with the default settings
    [retried] = broker.retry(conn, [letter.id])
    assert retried.result == "retried"
    assert q.settings(conn) == DEFAULTS
    assert status_of(broker, conn, "gone").total == 1


# --- roles -------------------------------------------------------------------------------------


def test_worker_dequeues_rejects_and_housekeeps_producer_reads_status(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str
) -> None:
    producer, worker, admin = (connect_as(roles[k]) for k in ("producer", "worker", "admin"))
    broker = lonnymq.Broker(schema)
    queue = broker.queue("jobs")
    queue.configure(admin, max_attempts=1)
    ids = [created(queue.channel("t").message.create(producer, f"m{i}")) for i in range(3)]

    # worker: dequeue (version 2), reject, the dead report, housekeep, status
    got = queue.dequeue(worker, limit=2, lock_ms=LOCK_MS).messages
    assert [m.id for m in got] == ids[:2]
    assert got[0].reject(worker, reason="by worker") is Outcome.OK
    assert broker.reject(worker, got[1].id, got[1].lock_token) is Outcome.OK
    held = one(queue.dequeue(worker, lock_ms=LOCK_MS))
    expire_locks()
    result = queue.dequeue(worker, lock_ms=LOCK_MS)
    assert [d.id for d in result.dead] == [held.id]
    assert broker.housekeep(worker) == 0
    assert status_of(broker, worker, "jobs").dead == 3
    assert queue.settings(worker).max_attempts == 1
    forbidden_calls: list[Callable[[Conn], object]] = [
        lambda c: broker.messages(c),
        lambda c: broker.message(c, ids[0]),
        lambda c: broker.retry(c, [ids[0]]),
        lambda c: broker.remove(c, [ids[0]]),
        lambda c: queue.purge_dead(c),
        lambda c: queue.configure(c, max_attempts=5),
        lambda c: queue.channels(c),
    ]
    for forbidden in forbidden_calls:
        with pytest.raises(PermissionDenied):
            forbidden(worker)
        # a producer may read the status, and nothing of the above either
        with pytest.raises(PermissionDenied):
            forbidden(producer)

    # producer: status yes; dequeue, reject, housekeep no
    status = status_of(broker, producer, "jobs")
    assert (status.total, status.dead, status.counters.dead) == (0, 3, 3)
    with pytest.raises(PermissionDenied):
        queue.dequeue(producer)
    with pytest.raises(PermissionDenied):
        broker.reject(producer, ids[0], uuid.uuid4())
    with pytest.raises(PermissionDenied):
        broker.housekeep(producer)

    # admin: everything
    assert [m.reason for m in broker.messages(admin, state="dead")] == [
        "by worker",
        "rejected",
        "max_attempts",
    ]
    assert detail(broker, admin, ids[0]).content == b"m0"
    [retried] = broker.retry(admin, [ids[0]])
    assert retried.result == "retried" and retried.new_id is not None
    assert broker.remove(admin, [ids[1]]) == {ids[1]: "deleted"}
    assert one(queue.dequeue(admin, lock_ms=10_000)).id == retried.new_id
    assert [(c.channel, c.size, c.in_flight) for c in queue.channels(admin)] == [("t", 1, 1)]
    assert queue.purge_dead(admin) == 1
    assert broker.housekeep(admin) == 0


def test_kombu_worker_role_rejects_to_the_dead_letters_and_housekeeps(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str, pg_dsn: str
) -> None:
    """Through the transport, as the worker role: reject without requeue dead-letters, a
    message that is not a kombu payload is put aside as a dead letter (the transport reads
    the queue's settings with the worker's rights), and the housekeeping the heartbeat
    thread does prunes old dead letters."""
    admin, producer = connect_as(roles["admin"]), connect_as(roles["producer"])
    broker = lonnymq.Broker(schema)
    # an old dead letter, in a queue that keeps them 50 ms
    old = broker.queue("old")
    old.configure(admin, dead_retention_ms=50)
    old_id = created(old.channel("a").message.create(producer, b"old"))
    assert one(old.dequeue(admin, lock_ms=10_000)).reject(admin) is Outcome.OK

    with kombu_as(pg_dsn, roles["producer"], schema) as c:
        jobs = c.SimpleQueue("kjobs")
        jobs.put({"n": 1})
        jobs.close()
    raw = created(broker.queue("kjobs").channel("raw").message.create(producer, b"\xffnot json"))
    with kombu_as(pg_dsn, roles["producer"], schema) as c:
        jobs = c.SimpleQueue("kjobs")
        jobs.put({"n": 2})
        jobs.close()

    url = lonnymq_url(dsn_as(pg_dsn, roles["worker"]))
    options = {
        "schema": schema,
        "visibility_timeout": 30,
        "heartbeat_interval": 0.05,
        "expire_interval": 0.05,
    }
    with Connection(url, transport_options=options) as worker:
        jobs = worker.SimpleQueue("kjobs")
        got = []
        for _ in range(2):
            message = jobs.get(timeout=5)
            got.append(message.payload["n"])
            message.reject()
        deadline = time.monotonic() + 5
        while broker.message(admin, old_id) is not None:  # the heartbeat thread's housekeep
            assert time.monotonic() < deadline, "old dead letter never pruned"
            with pytest.raises(jobs.Empty):
                jobs.get(timeout=0.05)
        jobs.close()
    assert sorted(got) == [1, 2]
    letters = broker.messages(admin, queue="kjobs", state="dead")
    assert sorted((m.channel == "raw", m.reason) for m in letters) == [
        (False, "rejected"),
        (False, "rejected"),
        (True, "undecodable"),
    ]
    assert raw in [m.id for m in letters]
    payloads = [detail(broker, admin, m.id).payload() for m in letters if m.id != raw]
    assert all(p is not None and "body" in p for p in payloads)
    status = status_of(broker, admin, "kjobs")
    assert (status.total, status.in_flight, status.dead, status.counters.dead) == (0, 0, 3, 3)


# --- upgrade from version 2 --------------------------------------------------------------------


def test_upgrade_from_version_2_keeps_roles_messages_and_channels(
    schema: str, conn: Conn, connect_as: Callable[[str], Conn]
) -> None:
    """Install migrations 1-2, grant roles as lonnymq did then (only the functions of their
    kind that existed), hold and queue messages; migration 3 forwards the new functions to
    those roles (and the later migrations, which replace functions, keep their grants), and
    the messages and channels keep working, with counters from zero."""
    steps = lonnymq.migrations(schema)
    assert [name[:4] for name, _ in steps[:3]] == ["0001", "0002", "0003"]
    for _name, text in steps[:2]:
        with conn.transaction():
            conn.execute(text.encode())
    existing = {
        r[0]
        for r in conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s",
            (schema,),
        ).fetchall()
    }
    assert "message_dequeue_v2" not in existing and "message_dequeue_v1" in existing
    suffix = uuid.uuid4().hex[:8]
    # names that need quoting: the migration's grants must quote them
    names: dict[Kind, str] = {kind: f"LMQ-Up-{kind}-{suffix}" for kind in KINDS}
    ns = sql.Identifier(schema)
    try:
        for kind, role in names.items():
            who = sql.Identifier(role)
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(who))
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ns, who))
            functions = [f for f in (*FUNCTIONS[kind], *DROPPED[kind]) if f in existing]
            conn.execute(
                sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                    sql.SQL(", ").join(sql.Identifier(schema, f) for f in functions), who
                )
            )
        _upgrade(schema, [text for _, text in steps[2:]], conn, names, connect_as)
    finally:
        for role in names.values():
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _upgrade(
    schema: str,
    migrations: list[str],
    conn: Conn,
    names: dict[Kind, str],
    connect_as: Callable[[str], Conn],
) -> None:
    worker, producer, admin = (connect_as(names[k]) for k in ("worker", "producer", "admin"))
    broker = lonnymq.Broker(schema)
    queue = broker.queue("jobs")
    ch = queue.channel("t")
    # (as a client of version 2 set it; today's client calls the version-8 function)
    admin.execute(
        sql.SQL("SELECT {}.channel_policy_set_v1('jobs', 't', 2, NULL)").format(
            sql.Identifier(schema)
        )
    )
    ids = [created(ch.message.create(producer, f"m{i}".encode())) for i in range(4)]
    created(queue.channel("u").message.create(producer, b"u", delay_ms=3_600_000))
    v1 = sql.SQL("SELECT message_id, message_lock_token FROM {}.message_dequeue_v1(%s, %s, %s)")
    held = worker.execute(
        v1.format(sql.Identifier(schema)), (["jobs"], 10, 60_000)
    ).fetchall()  # a consumer of version 2 holds two (the channel's limit)
    assert [h[0] for h in held] == ids[:2]
    with pytest.raises(psycopg.errors.UndefinedFunction):
        worker.execute(
            sql.SQL("SELECT * FROM {}.message_dequeue_v2('{{jobs}}', 1, 1000)").format(
                sql.Identifier(schema)
            )
        )

    for migration in migrations:
        with conn.transaction():
            conn.execute(migration.encode())
    assert broker.check(conn) == lonnymq.CURRENT_VERSION
    assert_channels_exact(conn, schema)

    # counters start at zero; gauges carry on
    status = status_of(broker, producer, "jobs")
    assert status.counters == lonnymq.queue.Counters(0, 0, 0, 0, 0, 0, 0, 0)
    assert (status.total, status.in_flight, status.dead) == (5, 2, 0)
    assert status.settings == DEFAULTS

    # the worker: the messages it held before the upgrade, then dequeue v2 and reject
    assert broker.delete(worker, held[0][0], held[0][1]) is Outcome.OK
    assert broker.reject(worker, held[1][0], held[1][1], reason="after upgrade") is Outcome.OK
    got = queue.dequeue(worker, limit=10, lock_ms=10_000).messages
    assert [m.id for m in got] == ids[2:]
    assert [m.lock_expired for m in got] == [False, False]
    # an ack sent with the next dequeue (message_ack_dequeue_v1, new in version 4)
    assert queue.dequeue(worker, ack=[got[0]]).acked == {got[0].id: Outcome.OK}
    assert got[1].reject(worker) is Outcome.OK
    assert broker.housekeep(worker) == 0
    status = status_of(broker, producer, "jobs")
    counters = status.counters
    assert (counters.enqueued, counters.delivered, counters.acked, counters.dead) == (0, 2, 2, 2)
    assert (status.total, status.in_flight, status.dead) == (1, 0, 2)
    with pytest.raises(PermissionDenied):
        broker.messages(producer)
    with pytest.raises(PermissionDenied):
        broker.messages(worker)
    with pytest.raises(PermissionDenied):
        queue.dequeue(producer)

    # the admin: listing, retry, configure, and reading the new tables
    assert [m.reason for m in broker.messages(admin, state="dead")] == [
        "after upgrade",
        "rejected",
    ]
    [retried] = broker.retry(admin, [ids[1]])
    assert retried.result == "retried"
    queue.configure(admin, max_attempts=1)
    for table in ("dead_message", "lane", "tally", "channel_count", "queue_count"):
        admin.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table)))
    again = one(queue.dequeue(worker, lock_ms=LOCK_MS))
    assert again.id == retried.new_id
    expire_locks()
    assert [d.id for d in queue.dequeue(worker, lock_ms=LOCK_MS).dead] == [again.id]
    # new messages count from here
    created(ch.message.create(producer, b"new"))
    assert status_of(broker, producer, "jobs").counters.enqueued == 2  # the retry and this
    assert_channels_exact(conn, schema)
    # and revoke takes the new rights too
    lonnymq.revoke(conn, names["worker"], schema=schema)
    with pytest.raises(PermissionDenied):
        queue.dequeue(worker)
    with pytest.raises(PermissionDenied):
        broker.housekeep(worker)
