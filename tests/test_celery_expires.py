# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Celery's ``expires=``: a task that expires while it waits ends REVOKED, as on RabbitMQ and
Redis, rather than being dropped by the broker (Celery sends ``expires`` as the message's
``expiration`` too), and monitoring hears of it (a ``task-revoked`` event). A plain Kombu
message's ``expiration`` still drops it. Real worker processes (the app of
``tests/test_celery_worker.py``, results through ``rpc://``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from celery.exceptions import TaskRevokedError
from kombu.connection import Connection
from psycopg import sql

from tests import test_celery_worker
from tests.test_celery_worker import Env, Worker, captured_events, wait_for

Conn = psycopg.Connection[Any]
pytestmark = pytest.mark.slow

# the fixtures of tests/test_celery_worker.py: its app module, and its worker processes
env = test_celery_worker.env
workers = test_celery_worker.workers


def _expires_at(conn: Conn, schema: str, queue: str) -> list[Any]:
    rows = conn.execute(
        sql.SQL("SELECT expires_at FROM {} WHERE queue = %s ORDER BY id").format(
            sql.Identifier(schema, "message")
        ),
        (queue,),
    ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("prefetch", ["1", "4"])
def test_a_task_that_expires_while_it_waits_ends_revoked(
    env: Env, workers: Callable[..., Worker], prefetch: str
) -> None:
    """The issue's case: a solo worker busy with 3 tasks of 2 s; a task sent with
    ``expires=1`` behind them. ``result.get()`` raises ``TaskRevokedError`` (it timed out when
    the broker dropped the message; with a prefetch of 1 it always did)."""
    worker = workers("--pool", "solo", extra_env={"LMQ_PREFETCH": prefetch})
    sleeper = env.task("sleeper")
    busy = [sleeper.delay(2, "busy") for _ in range(3)]
    started = time.monotonic()
    late = env.task("add").apply_async((1, 1), expires=1)
    with pytest.raises(TaskRevokedError):
        late.get(timeout=30)
    assert late.state == "REVOKED"
    assert 1 <= time.monotonic() - started < 25, worker.log_tail()
    assert [r.get(timeout=20) for r in busy] == [2, 2, 2]
    assert f"Discarding revoked task: t.add[{late.id}]" in worker.log.read_text(errors="replace")


def test_a_celery_task_keeps_its_message_until_a_worker_revokes_it(
    env: Env, url: str, conn: Conn, schema: str
) -> None:
    """What is stored: a task with ``expires`` has no time to live in Postgres (the worker
    revokes it); a task with only kombu's ``expiration`` option, and a plain Kombu message
    with an ``expiration``, keep theirs."""
    app = env.app
    app.send_task("t.add", (1, 2), queue="exp", expires=60)
    app.send_task("t.add", (1, 2), queue="exp", expiration=60)
    with Connection(url, transport_options={"schema": schema}) as c:
        c.SimpleQueue("exp").put({"plain": True}, expiration=60)
    kept, explicit, plain = _expires_at(conn, schema, "exp")
    assert kept is None
    assert explicit is not None and plain is not None


@pytest.mark.parametrize(
    ("pool_args", "prefetch"),
    [(("--pool", "solo"), "4"), (("--pool", "prefork", "-c", "1"), "1")],
    ids=["solo", "prefork"],
)
def test_monitoring_sees_a_task_that_expired_while_it_waited(
    env: Env, workers: Callable[..., Worker], pool_args: tuple[str, ...], prefetch: str
) -> None:
    """A worker with task events on (``-E``, Celery's defaults otherwise) busy with 3 tasks of
    2 s; a task sent with ``expires=1`` behind them waits in the queue past its ``expires``
    (the solo pool fetches no task while one runs; a prefork child with a prefetch of 1 holds
    one task besides the one it runs). Monitoring hears of it as Celery's worker tells it on
    RabbitMQ: a ``task-revoked`` event from that worker with ``expired=True``, which Celery's
    event state (Flower's, ``celery events``') turns into ``REVOKED``; it is never received,
    started or run."""
    worker = workers(*pool_args, "-E", extra_env={"LMQ_PREFETCH": prefetch})
    with captured_events(env, worker, heard_within=20) as seen:
        sleeper = env.task("sleeper")
        busy = [sleeper.delay(2, "busy") for _ in range(3)]
        late = env.task("add").apply_async((1, 1), expires=1)
        with pytest.raises(TaskRevokedError):
            late.get(timeout=30)
        assert [r.get(timeout=20) for r in busy] == [2, 2, 2]
        wait_for(
            lambda: any(e["type"] == "task-revoked" for e in seen() if e.get("uuid") == late.id),
            10,
            "the expired task's task-revoked event",
            worker,
        )
        # the busy tasks' last events (task-succeeded) came after the expired one's
        wait_for(
            lambda: sum(e["type"] == "task-succeeded" for e in seen()) >= 3,
            10,
            "the busy tasks' task-succeeded events",
            worker,
        )
    events = seen()
    mine = [e for e in events if e.get("uuid") == late.id]
    assert [e["type"] for e in mine] == ["task-revoked"], mine
    (revoked,) = mine
    assert revoked["expired"] is True, revoked
    assert revoked["terminated"] is False, revoked
    assert revoked["hostname"].startswith(worker.name + "@"), revoked
    state = env.app.events.State()
    for event in events:
        state.event(event)
    assert state.tasks[late.id].state == "REVOKED"
    assert all(state.tasks[r.id].state == "SUCCESS" for r in busy)
