# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Celery's ``expires=``: a task that expires while it waits ends REVOKED, as on RabbitMQ and
Redis, rather than being dropped by the broker (Celery sends ``expires`` as the message's
``expiration`` too). A plain Kombu message's ``expiration`` still drops it. Real worker
processes (the app of ``tests/test_celery_worker.py``, results through ``rpc://``)."""

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
from tests.test_celery_worker import Env, Worker

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
