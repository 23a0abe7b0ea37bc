"""Rescheduling and editing a waiting message (``Broker.update``, ``message_update_v1``,
``lonnymq messages update``): due time, priority and content of a ready or delayed message,
refused for one in flight, a dead letter or a missing id.

What must hold (docs/design.md): the dequeue starts from each lane's positions, so a message
moved earlier or to a higher priority must be found again (the update gives it a new txid and
the ingest lowers the lane's position and turn to it); counters stay exact; a dequeue running
at the same time either misses the update (the message is taken as it was, and then the
update is refused) or passes the row by. A Celery task's ``eta`` header agrees with the new
due time (tests/test_celery_update.py runs it with a real worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import lonnymq
from lonnymq import InvalidArgument, MessageLocked, MessageNotFound, Outcome
from tests import invariants
from tests.conftest import created

Conn = psycopg.Connection[Any]


def contents(result: lonnymq.DequeueResult) -> list[bytes]:
    return [m.content for m in result.messages]


def celery_payload(eta: str | None) -> bytes:
    """A kombu message as the transport stores a Celery task (protocol 2)."""
    return json.dumps(
        {
            "body": "W1sxLCAyXSwge30sIHt9XQ==",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py",
                "task": "t.add",
                "id": "0b3c4e6a",
                "eta": eta,
                "expires": None,
                "retries": 0,
                "timelimit": [None, 1.5],
                "argsrepr": "(1, 2)",
            },
            "properties": {"body_encoding": "base64", "priority": 0, "delivery_tag": "x"},
        }
    ).encode()


def headers_of(broker: lonnymq.Broker, conn: Conn, ident: int) -> dict[str, Any]:
    detail = broker.message(conn, ident)
    assert detail is not None
    payload = detail.payload()
    assert payload is not None
    headers: dict[str, Any] = payload["headers"]
    return headers


# --- due time and priority, and the lanes' positions -------------------------------------------


def test_a_delayed_message_made_due_now_is_found_behind_its_lanes_position(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """The lane served the ready message and moved its position (and turn) to the delayed
    one, an hour ahead: the message made due now lies before both, and is delivered now."""
    ch = queue.channel("a")
    created(ch.message.create(conn, b"ready"))
    later = created(ch.message.create(conn, b"later", delay_ms=3_600_000))
    assert contents(queue.dequeue(conn, lock_ms=60_000)) == [b"ready"]
    assert not queue.dequeue(conn, lock_ms=60_000)  # the lane's turn is an hour ahead

    result = broker.update(conn, later, delay_ms=0)
    assert result.id == later and result.priority == 0
    assert result.dequeue_at <= datetime.now(timezone.utc)
    got = queue.dequeue(conn, lock_ms=60_000)
    assert [m.id for m in got.messages] == [later]
    invariants.assert_consistent(conn, broker.schema)


def test_a_raised_priority_is_respected_by_the_next_dequeue(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ids = [created(ch.message.create(conn, f"m{i}".encode())) for i in range(4)]
    assert contents(queue.dequeue(conn, lock_ms=60_000)) == [b"m0"]  # the lane has positions
    assert broker.update(conn, ids[3], priority=9).priority == 9
    assert contents(queue.dequeue(conn, lock_ms=60_000)) == [b"m3"]
    # and a lowered one: m1 goes behind m2
    assert broker.update(conn, ids[1], priority=0).priority == 0  # unchanged: keeps its place
    broker.update(conn, ids[2], priority=1)
    assert contents(queue.dequeue(conn, limit=2, lock_ms=60_000)) == [b"m2", b"m1"]
    invariants.assert_consistent(conn, broker.schema)


def test_reschedule_later_then_earlier(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"x"))
    moved = broker.update(conn, ident, delay_ms=3_600_000)
    assert moved.dequeue_at > datetime.now(timezone.utc) + timedelta(minutes=59)
    assert not queue.dequeue(conn, lock_ms=60_000)
    stats = queue.stats(conn)
    assert (stats.ready, stats.delayed) == (0, 1)
    invariants.assert_consistent(conn, broker.schema)

    at = datetime.now(timezone.utc) + timedelta(seconds=0.5)
    assert broker.update(conn, ident, at=at).dequeue_at == at
    first = queue.dequeue(conn, lock_ms=60_000)
    assert not first and first.retry_ms is not None and first.retry_ms <= 600
    deadline = time.monotonic() + 5
    while not (got := queue.dequeue(conn, lock_ms=60_000)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m.id for m in got.messages] == [ident]
    assert datetime.now(timezone.utc) >= at
    invariants.assert_consistent(conn, broker.schema)


def test_due_now_keeps_the_place_of_a_message_already_due(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    """A ready message made "due now" (or at a time past) keeps its due time: it does not go
    behind the messages that came after it, nor jump ahead of the ones before it."""
    ch = queue.channel("a")
    first = created(ch.message.create(conn, b"first"))
    created(ch.message.create(conn, b"second"))
    before = broker.message(conn, first)
    assert before is not None and before.dequeue_at is not None
    assert broker.update(conn, first, delay_ms=0).dequeue_at == before.dequeue_at
    past = datetime(2000, 1, 1, tzinfo=timezone.utc)
    assert broker.update(conn, first, at=past).dequeue_at == before.dequeue_at
    assert contents(queue.dequeue(conn, limit=2, lock_ms=60_000)) == [b"first", b"second"]


def test_content_of_a_plain_message_and_time_to_live(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"old", delay_ms=3_600_000, ttl_ms=60_000))
    before = broker.message(conn, ident)
    assert before is not None and before.expires_at is not None and before.dequeue_at
    broker.update(conn, ident, content="new ✓")
    after = broker.message(conn, ident)
    assert after is not None
    assert after.content == "new ✓".encode()
    assert (after.dequeue_at, after.expires_at) == (before.dequeue_at, before.expires_at)
    # moved later, it keeps as long to live after its due time
    moved = broker.update(conn, ident, delay_ms=7_200_000)
    later = broker.message(conn, ident)
    assert later is not None and later.expires_at is not None
    assert later.expires_at - moved.dequeue_at == before.expires_at - before.dequeue_at
    # moved earlier, its deadline stays
    broker.update(conn, ident, delay_ms=0)
    now = broker.message(conn, ident)
    assert now is not None and now.expires_at == later.expires_at
    assert contents(queue.dequeue(conn, lock_ms=60_000)) == ["new ✓".encode()]


# --- refusals and arguments --------------------------------------------------------------------


def test_refused_for_a_message_in_flight_a_dead_letter_or_a_missing_id(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("a")
    held_id = created(ch.message.create(conn, b"held"))
    [held] = queue.dequeue(conn, lock_ms=60_000).messages
    with pytest.raises(MessageLocked, match=f"message {held_id} is in flight") as raised:
        broker.update(conn, held_id, delay_ms=0)
    assert raised.value.message_id == held_id
    # a lock that expired: still in flight until a consumer takes it over
    lost_id = created(ch.message.create(conn, b"lost"))
    assert [m.id for m in queue.dequeue(conn, lock_ms=1).messages] == [lost_id]
    time.sleep(0.01)
    with pytest.raises(MessageLocked):
        broker.update(conn, lost_id, priority=3)
    assert held.reject(conn) is Outcome.OK
    with pytest.raises(MessageNotFound, match=r"dead letter.*messages retry") as dead:
        broker.update(conn, held_id, delay_ms=0)
    assert dead.value.dead
    with pytest.raises(MessageNotFound, match="no message 999999"):
        broker.update(conn, 999_999, delay_ms=0)
    assert isinstance(MessageLocked(1), lonnymq.LonnyMQError)
    invariants.assert_consistent(conn, broker.schema)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "nothing to change"),
        ({"delay_ms": 0, "at": datetime.now(timezone.utc)}, "not both"),
        ({"at": datetime(2030, 1, 1)}, "aware datetime"),
        ({"at": "2030-01-01"}, "must be a datetime"),
        ({"delay_ms": -1}, "delay_ms"),
        ({"priority": 256}, "priority"),
        ({"priority": True}, "priority"),
        ({"content": 5}, "content"),
    ],
)
def test_bad_arguments_are_refused_before_the_database(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, kwargs: dict[str, Any], match: str
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"x"))
    with pytest.raises(InvalidArgument, match=match):
        broker.update(conn, ident, **kwargs)
    with pytest.raises(InvalidArgument):
        broker.update(conn, 0, priority=1)


# --- counters ----------------------------------------------------------------------------------


def test_counters_stay_exact(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn) -> None:
    """An update of a message the ingest has not seen yet and of one it has: each counts once
    as enqueued, and the gauges follow the state it moves to."""
    ch = queue.channel("a")
    fresh = created(ch.message.create(conn, b"fresh", delay_ms=3_600_000))
    broker.update(conn, fresh, priority=2)  # before any ingest
    created(ch.message.create(conn, b"seen"))
    seen = queue.dequeue(conn, lock_ms=60_000)  # ingests both
    assert contents(seen) == [b"seen"]
    [status] = broker.status(conn)
    assert (status.total, status.in_flight, status.counters.enqueued) == (2, 1, 2)
    invariants.assert_consistent(conn, broker.schema)
    assert broker.delete_many(conn, seen.messages) == {m.id: Outcome.OK for m in seen.messages}
    another = created(ch.message.create(conn, b"another", delay_ms=3_600_000))
    assert not queue.dequeue(conn, lock_ms=60_000)  # ingested, nothing due
    broker.update(conn, another, delay_ms=0)
    broker.update(conn, fresh, delay_ms=0)
    stats = queue.stats(conn)
    assert (stats.total, stats.ready, stats.delayed) == (2, 2, 0)
    invariants.assert_consistent(conn, broker.schema)
    got = queue.dequeue(conn, limit=5, lock_ms=60_000)
    assert contents(got) == [b"fresh", b"another"]  # priority 2 first
    assert broker.delete_many(conn, got.messages) == {m.id: Outcome.OK for m in got.messages}
    broker.housekeep(conn)  # fold the tallies
    [status] = broker.status(conn)
    assert status.total == 0 and status.in_flight == 0
    c = status.counters
    assert (c.enqueued, c.delivered, c.acked, c.deferred) == (3, 3, 3, 0)
    invariants.assert_consistent(conn, broker.schema)


# --- concurrent dequeues -----------------------------------------------------------------------


def test_a_dequeue_taking_the_message_meanwhile_makes_the_update_wait_then_refuse(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, connect: Callable[..., Conn]
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"x", delay_ms=0))
    consumer = connect(autocommit=False)
    assert [m.id for m in queue.dequeue(consumer, lock_ms=60_000).messages] == [ident]
    outcome: list[BaseException | lonnymq.queue.UpdateResult] = []

    def update() -> None:
        other = connect()
        try:
            outcome.append(broker.update(other, ident, priority=7))
        except BaseException as exc:  # the assertion is below
            outcome.append(exc)

    thread = threading.Thread(target=update)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and outcome == []  # waits for the dequeue's transaction
    consumer.commit()
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], MessageLocked), outcome
    consumer.close()


def test_a_dequeue_during_an_open_update_passes_the_row_by(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, connect: Callable[..., Conn]
) -> None:
    ch = queue.channel("a")
    created(ch.message.create(conn, b"first"))
    target = created(ch.message.create(conn, b"target"))
    created(ch.message.create(conn, b"other"))
    # ingested: the update holds the ingest key until it commits, and consumers meanwhile
    # serve what was ingested before (docs/design.md, "What waits for what")
    assert contents(queue.dequeue(conn, lock_ms=60_000)) == [b"first"]
    editor = connect(autocommit=False)
    broker.update(editor, target, priority=5)  # row locked until commit
    consumer = connect()
    started = time.monotonic()
    got = queue.dequeue(consumer, lock_ms=60_000)
    assert time.monotonic() - started < 2
    assert contents(got) == [b"other"]  # the locked row was skipped, not waited for
    editor.commit()
    again = queue.dequeue(consumer, lock_ms=60_000)
    assert [(m.id, m.priority) for m in again.messages] == [(target, 5)]
    editor.close()
    invariants.assert_consistent(conn, broker.schema)


# --- wake-ups ----------------------------------------------------------------------------------


def test_an_update_wakes_sleeping_consumers(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, connect: Callable[..., Conn]
) -> None:
    ident = created(queue.channel("a").message.create(conn, b"later", delay_ms=3_600_000))
    listener = connect()
    listener.execute(f'LISTEN "{broker.wake_channel}"')
    consumer = connect()
    assert not queue.dequeue(consumer)  # found nothing: sleeps on the queue
    broker.update(conn, ident, delay_ms=0)
    payloads = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert payloads == [queue.name]
    assert [m.id for m in queue.dequeue(consumer, lock_ms=60_000).messages] == [ident]


# --- Celery's eta header -----------------------------------------------------------------------


def test_the_eta_header_agrees_with_the_due_time(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn
) -> None:
    ch = queue.channel("celery")
    ahead = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    task = created(ch.message.create(conn, celery_payload(ahead), delay_ms=3_600_000))
    moved = broker.update(conn, task, delay_ms=30_000)
    eta = headers_of(broker, conn, task)["eta"]
    assert datetime.fromisoformat(eta) == moved.dequeue_at
    assert eta.endswith("+00:00")
    # a priority change alone leaves the content as it is
    detail = broker.message(conn, task)
    assert detail is not None
    broker.update(conn, task, priority=3)
    again = broker.message(conn, task)
    assert again is not None and again.content == detail.content
    # due now: no eta, as Celery writes a task without one; the rest of the payload stays
    broker.update(conn, task, delay_ms=0)
    headers = headers_of(broker, conn, task)
    assert headers["eta"] is None
    assert headers["timelimit"] == [None, 1.5] and headers["argsrepr"] == "(1, 2)"
    [m] = queue.dequeue(conn, lock_ms=60_000).messages
    assert json.loads(m.content)["body"] == "W1sxLCAyXSwge30sIHt9XQ=="
    # `retry` of a delayed task clears its eta too
    retried = created(ch.message.create(conn, celery_payload(ahead), delay_ms=3_600_000))
    assert [r.result for r in broker.retry(conn, [retried])] == ["due_now"]
    assert headers_of(broker, conn, retried)["eta"] is None
    # a task without an eta that is moved later gets one
    plain = created(ch.message.create(conn, celery_payload(None)))
    later = broker.update(conn, plain, delay_ms=60_000)
    assert datetime.fromisoformat(headers_of(broker, conn, plain)["eta"]) == later.dequeue_at


@pytest.mark.parametrize(
    "content",
    [b'not json but "eta" in it', b'{"eta": "2030-01-01"}', b'["eta"]', b'\xff"eta"\xfe'],
)
def test_other_contents_are_left_alone(
    broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, content: bytes
) -> None:
    ident = created(queue.channel("a").message.create(conn, content, delay_ms=3_600_000))
    broker.update(conn, ident, delay_ms=60_000)
    broker.update(conn, ident, delay_ms=0)
    detail = broker.message(conn, ident)
    assert detail is not None and detail.content == content


# --- the command -------------------------------------------------------------------------------


def cli(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lonnymq", "messages", "update", *args, "--dsn", pg_dsn,
         "--schema", schema],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


@pytest.mark.slow
def test_command(broker: lonnymq.Broker, queue: lonnymq.Queue, conn: Conn, pg_dsn: str) -> None:
    ch = queue.channel("a")
    ident = created(ch.message.create(conn, b"x", delay_ms=3_600_000))
    out = cli(pg_dsn, broker.schema, str(ident), "--in", "90s", "--priority", "4")
    assert out.returncode == 0, out.stderr
    assert f"message {ident}: due in 1m" in out.stdout and "priority 4" in out.stdout
    out = cli(pg_dsn, broker.schema, str(ident), "--now", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["id"] == ident and data["priority"] == 4
    assert datetime.fromisoformat(data["dequeue_at"]) <= datetime.now(timezone.utc)
    out = cli(pg_dsn, broker.schema, str(ident), "--at", "2030-01-01T00:00:00Z", "--content", "y")
    assert out.returncode == 0, out.stderr
    detail = broker.message(conn, ident)
    assert detail is not None and detail.content == b"y" and detail.state == "delayed"
    assert detail.dequeue_at == datetime(2030, 1, 1, tzinfo=timezone.utc)

    # usage errors: nothing to change, a naive time, two times
    assert cli(pg_dsn, broker.schema, str(ident)).returncode == 2
    naive = cli(pg_dsn, broker.schema, str(ident), "--at", "2030-01-01T00:00:00")
    assert naive.returncode == 2 and "UTC offset" in naive.stderr
    assert cli(pg_dsn, broker.schema, str(ident), "--now", "--in", "5s").returncode == 2
    # a Celery task's content is not replaced
    task = created(ch.message.create(conn, celery_payload(None)))
    refused = cli(pg_dsn, broker.schema, str(task), "--content", "z")
    assert refused.returncode == 2 and "Celery task (t.add)" in refused.stderr
    # refusals: in flight, missing
    broker.update(conn, ident, delay_ms=0)
    assert len(queue.dequeue(conn, limit=5, lock_ms=60_000).messages) == 2
    locked = cli(pg_dsn, broker.schema, str(ident), "--now")
    assert locked.returncode == 1 and "in flight" in locked.stderr
    missing = cli(pg_dsn, broker.schema, "999999", "--now")
    assert missing.returncode == 1 and "no message 999999" in missing.stderr
