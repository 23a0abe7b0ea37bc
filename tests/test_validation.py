"""Bad input gets a clear, typed error before anything is written; odd but valid names work."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import InvalidArgument, InvalidName, MessageTooLarge

Conn = psycopg.Connection[Any]

BAD_NAMES: list[object] = ["", "x" * 256, "nul\x00byte", None, 42, b"bytes"]


def _count(conn: Conn, schema: str, table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def _nothing_written(conn: Conn, schema: str) -> None:
    assert [_count(conn, schema, t) for t in ("queue", "channel", "message")] == [0, 0, 0]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_queue_channel_and_message_names(broker: lonnymq.Broker, conn: Conn, bad: Any) -> None:
    with pytest.raises(InvalidName):
        broker.queue(bad)
    with pytest.raises(InvalidName):
        broker.queue("q").channel(bad)
    if bad is not None:
        with pytest.raises(InvalidName):
            broker.queue("q").channel("c").message.create(conn, b"x", name=bad)
    with pytest.raises((InvalidName, InvalidArgument)):
        broker.dequeue(conn, [bad])
    _nothing_written(conn, broker.schema)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_ms": -1},
        {"delay_ms": float("nan")},
        {"delay_ms": float("inf")},
        {"delay_ms": 11 * 365 * 24 * 3600 * 1000},
        {"delay_ms": "10"},
        {"priority": -1},
        {"priority": 256},
        {"priority": 1.5},
        {"priority": True},
    ],
)
def test_bad_create_arguments(broker: lonnymq.Broker, conn: Conn, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        broker.queue("q").channel("c").message.create(conn, b"x", **kwargs)
    _nothing_written(conn, broker.schema)


@pytest.mark.parametrize("content", [None, 12, ["list"], {"a": 1}])
def test_bad_content(broker: lonnymq.Broker, conn: Conn, content: Any) -> None:
    with pytest.raises(InvalidArgument):
        broker.queue("q").channel("c").message.create(conn, content)
    _nothing_written(conn, broker.schema)


def test_message_too_large(schema: str, conn: Conn) -> None:
    broker = lonnymq.Broker(schema, max_message_bytes=1024)
    broker.install(conn)
    ch = broker.queue("q").channel("c")
    ch.message.create(conn, b"x" * 1024)
    with pytest.raises(MessageTooLarge) as err:
        ch.message.create(conn, b"x" * 1025)
    assert (err.value.size, err.value.limit) == (1025, 1024)
    batch = broker.batch()
    with pytest.raises(MessageTooLarge):
        batch.queue("q").channel("c").message("é" * 513)  # 1026 bytes in UTF-8
    assert _count(conn, schema, "message") == 1


def test_default_size_limit_is_8_mib(broker: lonnymq.Broker, conn: Conn) -> None:
    with pytest.raises(MessageTooLarge):
        broker.queue("q").channel("c").message.create(conn, bytes(8 * 1024 * 1024 + 1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit": 0},
        {"limit": 10_001},
        {"limit": "5"},
        {"lock_ms": 0},
        {"lock_ms": -5},
        {"lock_ms": 400 * 24 * 3600 * 1000},
    ],
)
def test_bad_dequeue_arguments(broker: lonnymq.Broker, conn: Conn, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        broker.dequeue(conn, ["q"], **kwargs)


def test_bad_queue_lists(broker: lonnymq.Broker, conn: Conn) -> None:
    with pytest.raises(InvalidArgument):
        broker.dequeue(conn, [])
    with pytest.raises(InvalidArgument):
        broker.dequeue(conn, "q")


@pytest.mark.parametrize(
    "kwargs", [{"max_concurrency": -1}, {"max_size": -3}, {"max_size": 2**31}, {"max_size": "9"}]
)
def test_bad_policies(broker: lonnymq.Broker, conn: Conn, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        broker.queue("q").channel("c").policy.set(conn, **kwargs)
    with pytest.raises(InvalidArgument):
        broker.queue("q").policy.set(conn, **kwargs)
    _nothing_written(conn, broker.schema)


def test_bad_defer_arguments(broker: lonnymq.Broker, conn: Conn) -> None:
    q = broker.queue("q")
    q.channel("c").message.create(conn, b"x")
    message = q.dequeue(conn, lock_ms=60_000).messages[0]
    with pytest.raises(InvalidArgument):
        message.defer(conn, delay_ms=-1)
    with pytest.raises(InvalidArgument):
        message.defer(conn, state="not bytes")
    with pytest.raises(InvalidArgument):
        message.heartbeat(conn, lock_ms=0)
    assert message.delete(conn)


@pytest.mark.parametrize(
    "schema",
    ["", "Upper", "1abc", "a-b", 'x"; DROP TABLE t; --', "a" * 49, "pg_catalog", None, 7],
)
def test_bad_schema_names(schema: Any) -> None:
    with pytest.raises(InvalidName):
        lonnymq.Broker(schema)
    with pytest.raises(InvalidName):
        lonnymq.Queue("q", schema=schema)
    with pytest.raises(InvalidName):
        lonnymq.migrations(schema)


def test_not_a_connection() -> None:
    with pytest.raises(InvalidArgument):
        lonnymq.Queue("q").channel("c").message.create("postgresql://nope", b"x")  # type: ignore[call-overload]


NASTY = [
    "robert'); DROP TABLE students;--",
    'double "quotes" and \\backslashes\\',
    "semi;colons;$$dollar$$ quoting",
    "ünïcødé ☃ 🐘 名前",
    "%s %(name)s {schema} {}",
    "x" * 255,
    " leading and trailing spaces ",
]


@pytest.mark.parametrize("name", NASTY)
def test_nasty_names_are_just_data(
    broker: lonnymq.Broker, conn: Conn, connect: Callable[..., Conn], name: str
) -> None:
    q = broker.queue(name)
    ch = q.channel(name)
    ch.policy.set(conn, max_size=5)
    created = ch.message.create(conn, name.encode(), name=name)
    assert isinstance(created, lonnymq.Created)
    assert ch.message.create(conn, b"dup", name=name) == lonnymq.Deduplicated(created.id)
    got = broker.dequeue(conn, [name], limit=5).messages
    assert [(m.queue, m.channel, m.name, m.content) for m in got] == [
        (name, name, name, name.encode())
    ]
    assert broker.queues(conn) == [name]
    assert got[0].delete(conn)
    assert q.stats(conn).total == 0
    # the schema has exactly its own tables still
    tables = (
        connect()
        .execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (broker.schema,)
        )
        .fetchall()
    )
    assert [t[0] for t in tables] == [
        "binding",
        "channel",
        "channel_count",
        "consumer",
        "dead_message",
        "discovery",
        "exchange",
        "lane",
        "lane_idle",
        "message",
        "migration",
        "queue",
        "queue_count",
        "queue_gone",
        "sleeper",
        "tally",
    ]


def test_delay_arithmetic_across_minutes(queue: lonnymq.Queue, conn: Conn) -> None:
    """Delays are timestamptz arithmetic, exact past minute and hour boundaries (LonnyMQ
    1.0.2's epoch() read the seconds field and jumped back at each minute)."""
    for delay in (59_999, 61_500, 3_600_250, 86_400_000 + 7):
        created = queue.channel("t").message.create(conn, b"x", delay_ms=delay)
        assert isinstance(created, lonnymq.Created)
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM dequeue_at - created_at) * 1000 FROM {}.message "
                "WHERE id = %s"
            ).format(sql.Identifier(queue.schema)),
            (created.id,),
        ).fetchone()
        assert row is not None
        assert abs(float(row[0]) - delay) < 50
    result = queue.dequeue(conn)
    assert result.retry_ms is not None and 59_000 < result.retry_ms <= 59_999


@pytest.mark.parametrize(
    ("priority", "name", "said"),
    [(256, None, "priority"), (-1, None, "priority"), (0, "", "name"), (0, "n" * 256, "name")],
)
def test_the_functions_refuse_what_the_client_would(
    broker: lonnymq.Broker, conn: Conn, priority: int, name: str | None, said: str
) -> None:
    """A direct SQL call with a priority outside 0-255 or a name of 0 or over 255 characters
    (what the client refuses before calling) is refused by the function with SQLSTATE 23514,
    the error the message table's CHECK constraints raised until schema version 27, naming
    the field; nothing is written. Through the create, a batch, a publish and an update."""
    s = sql.Identifier(broker.schema)
    calls = [
        (
            "SELECT * FROM {}.message_create_v1('q', 'c', %s, 'x', %s, 0, NULL)",
            (name, priority),
        ),
        (
            "SELECT * FROM {}.message_create_many_v1(ARRAY['q', 'q'], ARRAY['c', 'c'], "
            "ARRAY[NULL, %s], ARRAY['x', 'y']::bytea[], ARRAY[0, %s], ARRAY[0, 0]::bigint[], "
            "ARRAY[NULL, NULL]::bigint[])",
            (name, priority),
        ),
        (
            "SELECT * FROM {}.message_publish_v2('', 'q', 'c', %s, 'x', %s, 0, NULL, false)",
            (name, priority),
        ),
    ]
    for query, params in calls:
        with pytest.raises(psycopg.errors.CheckViolation, match=said):
            conn.execute(sql.SQL(query).format(s), params)
    assert [_count(conn, broker.schema, t) for t in ("channel", "message")] == [0, 0]
    if name is None:
        created = broker.queue("q").channel("c").message.create(conn, b"x", priority=3)
        assert isinstance(created, lonnymq.Created)
        with pytest.raises(psycopg.errors.CheckViolation, match=said):
            conn.execute(
                sql.SQL("SELECT * FROM {}.message_update_v1(%s, NULL, NULL, %s, NULL)").format(s),
                (created.id, priority),
            )
        row = conn.execute(sql.SQL("SELECT priority FROM {}.message").format(s)).fetchall()
        assert row == [(3,)]


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda b, c: b.delete(c, 1, "not-a-uuid"), "lock token must be a UUID"),
        (lambda b, c: b.defer(c, 1, 42), "lock token must be a UUID"),
        (lambda b, c: b.reject(c, True, uuid.uuid4()), "message id must be an int"),
        (lambda b, c: b.heartbeat(c, [(1,)], lock_ms=1000), "an (id, lock_token) pair, not (1,)"),
        (lambda b, c: b.delete_many(c, [5]), "an (id, lock_token) pair, not 5"),
        (lambda b, c: b.dequeue(c, ["q"], ack=[5]), "a message to ack is a Message or"),
        (lambda b, c: b.dequeue(c, ["q"], ack=[("1", uuid.uuid4())]), "message id must be"),
        (
            lambda b, c: b.queue("q").channel("c").message.create(c, b"x", raise_if_dropped="no"),
            "raise_if_dropped must be True or False",
        ),
        (lambda b, c: b.batch().execute(c, raise_if_dropped=1), "raise_if_dropped must be"),
        (
            lambda b, c: b.reject(c, 1, uuid.uuid4(), reason="r" * 300),
            "reason is 300 characters long, over the limit of 255",
        ),
    ],
    ids=[
        "delete-token",
        "defer-token",
        "reject-id",
        "heartbeat-pair",
        "delete_many-pair",
        "dequeue-ack",
        "dequeue-ack-id",
        "create-flag",
        "batch-flag",
        "reject-reason",
    ],
)
def test_held_messages_and_flags_are_checked_before_anything_is_sent(
    broker: lonnymq.Broker, conn: Conn, call: Callable[[lonnymq.Broker, Conn], Any], said: str
) -> None:
    """A held message given by hand (an (id, lock_token) pair) and a flag are checked as the
    other arguments are: ``InvalidArgument`` naming the problem (a lock token that is not a
    UUID reached Postgres as ``DatabaseError``, a malformed pair raised ``IndexError`` or
    ``TypeError``, a flag that is not a bool was taken for true, a reason too long was
    "reason name is ... characters long")."""
    with pytest.raises((InvalidArgument, InvalidName), match=re.escape(said)):
        call(broker, conn)
    _nothing_written(conn, broker.schema)
