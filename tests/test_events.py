# mypy: allow-untyped-calls
# (kombu is untyped)
"""Structured log events of the transport (the ``lonnymq.events`` logger, see
``lonnymq.transport.events``) and their JSON rendering (``lonnymq.logs.JsonFormatter``), in one
process through kombu: no worker needed.

Each event is a log record whose fields are attributes: ``event``, ``message_id``, ``queue``,
``channel`` and, where they apply, ``attempts`` and ``reason``. DEBUG for the steady flow
(enqueued, dequeued, acked, deferred), WARNING for what someone should look at (redelivered,
dead_lettered, channel_full). A holder that died is simulated with the queue API: a dequeue
with a short lock that is never acked.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from queue import Empty
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection

import lonnymq
from lonnymq.logs import FIELDS, JsonFormatter

Conn = psycopg.Connection[Any]

EVENTS = "lonnymq.events"


@pytest.fixture
def make_connection(
    broker: lonnymq.Broker, make_connection: Callable[..., Connection]
) -> Callable[..., Connection]:
    """kombu connections (the shared fixture) on the test's schema, installed first."""
    return make_connection


@pytest.fixture
def events(caplog: pytest.LogCaptureFixture) -> Callable[..., list[logging.LogRecord]]:
    """Capture ``lonnymq.events`` at DEBUG; ``events()`` returns its records so far,
    ``events("acked")`` those of one event."""
    caplog.set_level(logging.DEBUG, logger=EVENTS)

    def get(event: str | None = None) -> list[logging.LogRecord]:
        records = [r for r in caplog.records if r.name == EVENTS]
        if event is not None:
            records = [r for r in records if getattr(r, "event", None) == event]
        return records

    return get


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event fields present on a record (those JsonFormatter writes)."""
    return {
        name: getattr(record, name) for name in FIELDS if getattr(record, name, None) is not None
    }


def lonnymq_id(message: Any) -> int:
    """The lonnymq message id of a kombu message (from its delivery info)."""
    ident: int = message.delivery_info["lonnymq"]["id"]
    return ident


def test_publish_consume_ack_requeue_reject(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    connection = make_connection()
    q = connection.SimpleQueue("evq")
    q.put({"n": 1})
    q.put({"n": 2}, headers={"x-channel": "tenant-a"})
    q.put({"n": 3})

    enqueued = events("enqueued")
    assert [fields(r) for r in enqueued] == [
        {
            "event": "enqueued",
            "message_id": fields(enqueued[0])["message_id"],
            "queue": "evq",
            "channel": "evq",
        },
        {
            "event": "enqueued",
            "message_id": fields(enqueued[1])["message_id"],
            "queue": "evq",
            "channel": "tenant-a",
        },
        {
            "event": "enqueued",
            "message_id": fields(enqueued[2])["message_id"],
            "queue": "evq",
            "channel": "evq",
        },
    ]
    ids = [fields(r)["message_id"] for r in enqueued]
    assert len(set(ids)) == 3
    assert all(r.levelno == logging.DEBUG for r in enqueued)

    first = q.get(timeout=5)
    first.ack()
    second = q.get(timeout=5)
    second.reject(requeue=True)
    third = q.get(timeout=5)
    third.reject()  # without requeue: to the dead letters
    again = q.get(timeout=5)
    again.ack()
    assert [first.payload, second.payload, third.payload, again.payload] == [
        {"n": 1},
        {"n": 2},
        {"n": 3},
        {"n": 2},
    ]
    # the ids in the events are the ids the consumer sees
    assert [lonnymq_id(m) for m in (first, second, third, again)] == [
        ids[0],
        ids[1],
        ids[2],
        ids[1],
    ]

    dequeued = events("dequeued")
    assert [[fields(r)[k] for k in ("message_id", "channel", "attempts")] for r in dequeued] == [
        [ids[0], "evq", 1],
        [ids[1], "tenant-a", 1],
        [ids[2], "evq", 1],
        [ids[1], "tenant-a", 2],  # requeued: delivered again, attempt 2
    ]
    assert all(r.levelno == logging.DEBUG for r in dequeued)

    acked = events("acked")
    assert [fields(r) for r in acked] == [
        {"event": "acked", "message_id": ids[0], "queue": "evq", "channel": "evq"},
        {"event": "acked", "message_id": ids[1], "queue": "evq", "channel": "tenant-a"},
    ]
    assert all(r.levelno == logging.DEBUG for r in acked)

    (deferred,) = events("deferred")
    assert deferred.levelno == logging.DEBUG
    assert fields(deferred) == {
        "event": "deferred",
        "message_id": ids[1],
        "queue": "evq",
        "channel": "tenant-a",
        "reason": "reject",
    }

    (dead,) = events("dead_lettered")
    assert dead.levelno == logging.WARNING
    assert fields(dead) == {
        "event": "dead_lettered",
        "message_id": ids[2],
        "queue": "evq",
        "channel": "evq",
        "reason": "rejected",
        "attempts": 1,
    }
    assert f"lonnymq messages retry {ids[2]}" in dead.getMessage()
    # ... and it is there
    (letter,) = broker.messages(conn, queue="evq", state="dead")
    assert (letter.id, letter.reason, letter.attempts) == (ids[2], "rejected", 1)

    # the steady flow is DEBUG, the dead letter the only WARNING
    assert {fields(r)["event"] for r in events()} == {
        "enqueued",
        "dequeued",
        "acked",
        "deferred",
        "dead_lettered",
    }
    assert [fields(r)["event"] for r in events() if r.levelno >= logging.WARNING] == [
        "dead_lettered"
    ]
    q.close()


def test_steady_flow_is_silent_above_debug(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=EVENTS)
    connection = make_connection()
    q = connection.SimpleQueue("quiet")
    q.put({"n": 1})
    q.get(timeout=5).ack()
    q.put({"n": 2})
    q.get(timeout=5).reject(requeue=True)
    q.get(timeout=5).ack()
    q.close()
    assert [r for r in caplog.records if r.name == EVENTS] == []


def test_redelivered_after_lock_expired(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    connection = make_connection()
    q = connection.SimpleQueue("rq")
    q.put({"n": 1})
    # a holder that dies: dequeued with a short lock, never acked
    (held,) = broker.dequeue(conn, ["rq"], limit=1, lock_ms=200).messages
    time.sleep(0.3)
    message = q.get(timeout=5)
    assert lonnymq_id(message) == held.id
    assert message.delivery_info["redelivered"] is True
    message.ack()

    (redelivered,) = events("redelivered")
    assert redelivered.levelno == logging.WARNING
    assert fields(redelivered) == {
        "event": "redelivered",
        "message_id": held.id,
        "queue": "rq",
        "channel": "rq",
        "attempts": 2,
    }
    assert "its lock expired" in redelivered.getMessage()
    assert events("dequeued") == []  # a redelivery is logged as such, not also as dequeued
    assert [fields(r)["message_id"] for r in events("acked")] == [held.id]
    q.close()


@pytest.mark.slow
def test_dead_lettered_at_max_attempts(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    connection = make_connection()
    q = connection.SimpleQueue("pq")
    broker.queue("pq").configure(conn, max_attempts=2)
    q.put({"poison": True})
    # delivered twice, and its holder died both times
    (held,) = broker.dequeue(conn, ["pq"], limit=1, lock_ms=200).messages
    time.sleep(0.3)
    (again,) = broker.dequeue(conn, ["pq"], limit=1, lock_ms=200).messages
    assert (again.id, again.attempts) == (held.id, 2)
    time.sleep(0.3)

    with pytest.raises(Empty):  # not delivered a third time
        q.get(timeout=1)
    (dead,) = events("dead_lettered")
    assert dead.levelno == logging.WARNING
    assert fields(dead) == {
        "event": "dead_lettered",
        "message_id": held.id,
        "queue": "pq",
        "channel": "pq",
        "reason": "max_attempts",
        "attempts": 2,
    }
    assert events("dequeued") == events("redelivered") == []
    (letter,) = broker.messages(conn, queue="pq", state="dead")
    assert (letter.id, letter.reason, letter.attempts) == (held.id, "max_attempts", 2)
    q.close()


def test_channel_full(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    broker.queue("fq").channel("small").policy.set(conn, max_size=1)
    connection = make_connection()
    q = connection.SimpleQueue("fq")
    q.put({"n": 1}, headers={"x-channel": "small"})
    with pytest.raises(lonnymq.ChannelFull):
        q.put({"n": 2}, headers={"x-channel": "small"})
    (full,) = events("channel_full")
    assert full.levelno == logging.WARNING
    assert fields(full) == {"event": "channel_full", "queue": "fq", "channel": "small"}
    assert len(events("enqueued")) == 1
    q.close()


def test_undecodable_message_is_dead_lettered(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    caplog: pytest.LogCaptureFixture,
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    connection = make_connection()
    q = connection.SimpleQueue("uq")
    created = broker.queue("uq").channel("raw").message.create(conn, b"\xff not a kombu message")
    assert isinstance(created, lonnymq.Created)
    with pytest.raises(Empty):
        q.get(timeout=1)
    (dead,) = events("dead_lettered")
    assert dead.levelno == logging.WARNING
    assert fields(dead) == {
        "event": "dead_lettered",
        "message_id": created.id,
        "queue": "uq",
        "channel": "raw",
        "reason": "undecodable",
        "attempts": 1,
    }
    errors = [r for r in caplog.records if r.name == "lonnymq.transport"]
    assert [r.levelno for r in errors] == [logging.ERROR]
    assert "is not a kombu message" in errors[0].getMessage()
    (letter,) = broker.messages(conn, queue="uq", state="dead")
    assert (letter.id, letter.reason) == (created.id, "undecodable")
    q.close()


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The setup of lonnymq.logs' docstring: a JsonFormatter handler on the ``lonnymq``
    logger, events at DEBUG; undone after the test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("lonnymq")
    events_logger = logging.getLogger(EVENTS)
    old_level = events_logger.level
    root.addHandler(handler)
    events_logger.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        events_logger.setLevel(old_level)


def test_json_formatter_lines(
    make_connection: Callable[..., Connection], json_log: io.StringIO
) -> None:
    connection = make_connection()
    q = connection.SimpleQueue("jq")
    before = datetime.now().astimezone()
    q.put({"n": 1}, headers={"x-channel": "tenant-j"})
    q.put({"n": 2})
    q.get(timeout=5).ack()
    q.get(timeout=5).reject()
    q.close()
    after = datetime.now().astimezone()

    lines = json_log.getvalue().splitlines()
    docs = [json.loads(line) for line in lines]  # one JSON object per line
    by_event: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_event.setdefault(doc.get("event", ""), []).append(doc)
    assert set(by_event) == {"enqueued", "dequeued", "acked", "dead_lettered"}, lines

    for doc in docs:
        assert doc["logger"] == EVENTS
        assert set(doc) <= {"time", "level", "logger", "message", *FIELDS}, doc
        stamp = datetime.fromisoformat(doc["time"])
        assert stamp.utcoffset() == timedelta(0)  # UTC
        assert before - timedelta(seconds=1) <= stamp <= after + timedelta(seconds=1)
        assert isinstance(doc["message_id"], int)
        assert doc["queue"] == "jq"
        assert str(doc["message_id"]) in doc["message"]

    one, two = (d["message_id"] for d in by_event["enqueued"])
    assert by_event["enqueued"] == [
        {
            "time": by_event["enqueued"][0]["time"],
            "level": "debug",
            "logger": EVENTS,
            "message": f"enqueued message {one} (queue=jq channel=tenant-j)",
            "event": "enqueued",
            "message_id": one,
            "queue": "jq",
            "channel": "tenant-j",
        },
        {
            "time": by_event["enqueued"][1]["time"],
            "level": "debug",
            "logger": EVENTS,
            "message": f"enqueued message {two} (queue=jq channel=jq)",
            "event": "enqueued",
            "message_id": two,
            "queue": "jq",
            "channel": "jq",
        },
    ]
    assert [(d["level"], d["message_id"], d["attempts"]) for d in by_event["dequeued"]] == [
        ("debug", one, 1),
        ("debug", two, 1),
    ]
    assert [(d["level"], d["message_id"]) for d in by_event["acked"]] == [("debug", one)]
    assert "attempts" not in by_event["acked"][0]  # absent fields are left out, not null
    (dead,) = by_event["dead_lettered"]
    assert (dead["level"], dead["message_id"], dead["reason"]) == ("warning", two, "rejected")
    assert dead["attempts"] == 1


def test_json_formatter_plain_records_and_exceptions() -> None:
    formatter = JsonFormatter()
    plain = logging.LogRecord("lonnymq.transport", logging.INFO, __file__, 1, "x=%d", (5,), None)
    plain.created = 1_700_000_000.25
    assert json.loads(formatter.format(plain)) == {  # no event fields on a plain record
        "time": "2023-11-14T22:13:20.250+00:00",
        "level": "info",
        "logger": "lonnymq.transport",
        "message": "x=5",
    }
    try:
        raise ValueError("boom")
    except ValueError:
        info = sys.exc_info()
    failed = logging.LogRecord(EVENTS, logging.ERROR, __file__, 1, "failed", (), info)
    failed.__dict__.update(event="dead_lettered", message_id=7, reason=object())  # not JSON
    doc = json.loads(formatter.format(failed))
    assert doc["level"] == "error"
    assert doc["event"] == "dead_lettered"
    assert doc["message_id"] == 7
    assert doc["reason"].startswith("<object object")
    assert "ValueError: boom" in doc["exception"]
    assert doc["exception"].startswith("Traceback")


def test_reject_where_the_queue_keeps_no_dead_letters(
    make_connection: Callable[..., Connection],
    events: Callable[..., list[logging.LogRecord]],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    broker.queue("nq").configure(conn, dead_letter=False)
    connection = make_connection()
    q = connection.SimpleQueue("nq")
    q.put({"n": 1})
    message = q.get(timeout=5)
    ident = lonnymq_id(message)
    message.reject()
    q.close()
    # deleted: nothing to show, nothing to retry
    assert broker.message(conn, ident) is None
    assert broker.messages(conn, queue="nq", state="dead") == []
    assert [r.result for r in broker.retry(conn, [ident])] == ["not_found"]
    # the log should not send the operator to a dead letter that does not exist
    claims = [
        r.getMessage()
        for r in events()
        if fields(r).get("message_id") == ident and "messages retry" in r.getMessage()
    ]
    assert claims == []
    (discarded,) = [r for r in events() if fields(r).get("event") == "discarded"]
    assert discarded.levelno == logging.WARNING
    assert fields(discarded) == {
        "event": "discarded",
        "message_id": ident,
        "queue": "nq",
        "channel": "nq",
        "reason": "rejected",
        "attempts": 1,
    }
