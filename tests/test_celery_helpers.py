"""Celery helpers: the tenant channel derived from task arguments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

import lonnymq
import lonnymq.celery
from tests.apps import close_app
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


@pytest.fixture
def app(pg_dsn: str, schema: str) -> Iterator[Celery]:
    app = Celery("helpers", broker=lonnymq_url(pg_dsn))
    app.conf.broker_transport_options = {"schema": schema}
    lonnymq.celery.setup(app)
    yield app
    close_app(app)


def channels(conn: Conn, schema: str) -> list[str]:
    got = lonnymq.Broker(schema).dequeue(conn, ["celery"], limit=100).messages
    return [m.channel for m in got]


def test_channel_from_task_arguments(app: Celery, conn: Conn, schema: str) -> None:
    @app.task(name="helpers.report", lonnymq_channel="tenant_id")  # type: ignore[untyped-decorator]
    def report(tenant_id: int, report_id: int, fmt: str = "pdf") -> None: ...

    @app.task(name="helpers.by_kwarg", lonnymq_channel="account")  # type: ignore[untyped-decorator]
    def by_kwarg(x: int, account: str = "house") -> None: ...

    @app.task(  # type: ignore[untyped-decorator]
        name="helpers.computed", lonnymq_channel=lambda args, kwargs: f"t-{args[0] % 2}"
    )
    def computed(n: int) -> None: ...

    @app.task(name="helpers.plain")  # type: ignore[untyped-decorator]
    def plain() -> None: ...

    report.delay(42, 7)
    report.delay(tenant_id=43, report_id=8)
    report.apply_async((44, 9), headers={"x-channel": "override"})
    by_kwarg.delay(1)
    by_kwarg.delay(1, account="acme")
    computed.delay(5)
    plain.delay()
    assert sorted(channels(conn, schema)) == sorted(
        ["42", "43", "override", "house", "acme", "t-1", "celery"]
    )


def test_channel_option_naming_no_argument(
    app: Celery, conn: Conn, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(name="helpers.bad", lonnymq_channel="nope")  # type: ignore[untyped-decorator]
    def bad(x: int) -> None: ...

    bad.delay(1)  # Celery logs the signal handler's error; the message is not lost
    assert "lonnymq_channel names no argument 'nope'" in caplog.text
    assert channels(conn, schema) == ["celery"]


def test_full_channel_raises_in_the_caller(app: Celery, conn: Conn, schema: str) -> None:
    """apply_async to a channel at max_size raises lonnymq.ChannelFull in the caller (not
    retried by Celery's publish retry), and nothing is written."""

    @app.task(name="helpers.job", lonnymq_channel="tenant")  # type: ignore[untyped-decorator]
    def job(tenant: str, n: int) -> None: ...

    broker = lonnymq.Broker(schema)
    broker.install(conn)
    broker.queue("celery").channel("small").policy.set(conn, max_size=2)
    job.delay("small", 1)
    job.delay("small", 2)
    with pytest.raises(lonnymq.ChannelFull) as err:
        job.delay("small", 3)
    assert "small" in str(err.value)
    job.delay("other", 1)  # other tenants are not affected
    stats = broker.queue("celery").stats(conn)
    assert stats.total == 3


def test_dedup_header_makes_a_second_enqueue_a_no_op(app: Celery, conn: Conn, schema: str) -> None:
    @app.task(name="helpers.refresh")  # type: ignore[untyped-decorator]
    def refresh(key: str) -> None: ...

    for _ in range(3):
        refresh.apply_async(("k1",), headers={"x-dedup-name": "refresh:k1"})
    refresh.apply_async(("k2",), headers={"x-dedup-name": "refresh:k2"})
    got = lonnymq.Broker(schema).dequeue(conn, ["celery"], limit=10, lock_ms=60_000).messages
    assert sorted(m.name or "" for m in got) == ["refresh:k1", "refresh:k2"]
    for message in got:
        message.delete(conn)
    # once the first was delivered, the same name may be enqueued again
    refresh.apply_async(("k1",), headers={"x-dedup-name": "refresh:k1"})
    assert lonnymq.Broker(schema).queue("celery").stats(conn).total == 1
