# mypy: allow-untyped-calls
# (kombu is untyped)
"""Least privilege: a producer, a worker and an admin role (lonnymq.grant), each able to do
its job and nothing more; a role without a grant can do nothing. The schema is installed by
the test's superuser, who owns it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from kombu.entity import Queue
from psycopg import errors as pgerrors
from psycopg import sql

import lonnymq
from lonnymq import PermissionDenied
from tests.apps import close_app
from tests.commit_modes import record_commit_modes
from tests.conftest import dsn_as, kombu_as
from tests.test_wakeup import asleep_on

Conn = psycopg.Connection[Any]


def denied(conn: Conn, query: str, schema: str) -> bool:
    try:
        conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)))
    except pgerrors.InsufficientPrivilege:
        return True
    return False


def test_producer_creates_and_nothing_more(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str, conn: Conn
) -> None:
    producer = connect_as(roles["producer"])
    queue = lonnymq.Queue("jobs", schema=schema)
    assert isinstance(queue.channel("t").message.create(producer, b"work"), lonnymq.Created)
    assert queue.stats(producer).total == 1
    with pytest.raises(PermissionDenied, match="lonnymq grant"):
        queue.dequeue(producer)
    with pytest.raises(PermissionDenied):
        queue.channel("t").policy.set(producer, max_concurrency=1)
    with pytest.raises(PermissionDenied):
        queue.purge(producer)
    for query in (
        "SELECT * FROM {s}.message",
        "DELETE FROM {s}.message",
        "UPDATE {s}.channel SET own_max_size = 1",
        "INSERT INTO {s}.queue (name) VALUES ('x')",
        "SELECT {s}.ingest_v1('{{}}', false, false)",  # an internal function
        "CREATE TABLE {s}.evil (id int)",
    ):
        assert denied(producer, query, schema), query
    assert lonnymq.Queue("jobs", schema=schema).stats(conn).total == 1  # nothing else changed


def test_worker_consumes_and_cannot_administer(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str
) -> None:
    producer, worker = connect_as(roles["producer"]), connect_as(roles["worker"])
    queue = lonnymq.Queue("jobs", schema=schema)
    for i in range(3):
        queue.channel("t").message.create(producer, f"m{i}")
    got = queue.dequeue(worker, limit=3, lock_ms=30_000).messages
    assert [m.content for m in got] == [b"m0", b"m1", b"m2"]
    assert got[0].heartbeat(worker, lock_ms=60_000)
    assert got[0].delete(worker) is lonnymq.Outcome.OK
    assert got[1].defer(worker, delay_ms=None) is lonnymq.Outcome.OK
    assert lonnymq.Broker(schema).delete_many(worker, got[2:]) == {got[2].id: lonnymq.Outcome.OK}
    with pytest.raises(PermissionDenied):
        queue.channel("t").policy.set(worker, max_size=1)
    with pytest.raises(PermissionDenied):
        queue.purge(worker)
    with pytest.raises(PermissionDenied):
        queue.delete(worker)
    for query in ("SELECT * FROM {s}.message", "DELETE FROM {s}.message WHERE true"):
        assert denied(worker, query, schema), query
    assert queue.stats(worker).total == 1


def test_admin_manages_but_does_not_own(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str
) -> None:
    producer, admin = connect_as(roles["producer"]), connect_as(roles["admin"])
    queue = lonnymq.Queue("jobs", schema=schema)
    queue.channel("t").message.create(producer, b"x")
    queue.channel("t").policy.set(admin, max_concurrency=2, max_size=10)
    assert queue.channel("t").info(admin).own == lonnymq.Policy(2, 10)
    rows = admin.execute(sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema)))
    assert rows.fetchone() == (1,)
    assert queue.purge(admin) == 1
    assert denied(admin, "DROP TABLE {s}.message", schema)  # the owner's, not the admin's


def test_role_without_grant_can_do_nothing(
    roles: dict[str, str], connect_as: Callable[[str], Conn], schema: str, pg_dsn: str
) -> None:
    nobody = connect_as(roles["nobody"])
    queue = lonnymq.Queue("jobs", schema=schema)
    with pytest.raises(PermissionDenied):
        queue.channel("t").message.create(nobody, b"x")
    with pytest.raises(PermissionDenied):
        queue.dequeue(nobody)
    with kombu_as(pg_dsn, roles["nobody"], schema) as c, pytest.raises(PermissionDenied):
        c.SimpleQueue("jobs").put("x")


def test_kombu_producer_and_consumer_roles(
    roles: dict[str, str], schema: str, pg_dsn: str, conn: Conn
) -> None:
    """Through the transport: a producer role publishes (declaring its queue), a worker role
    consumes and acks; the producer cannot consume."""
    with kombu_as(pg_dsn, roles["producer"], schema) as producer:
        jobs = producer.SimpleQueue("kjobs")
        for i in range(5):
            jobs.put({"n": i}, headers={"x-channel": f"t{i % 2}"})
        with pytest.raises(PermissionDenied):
            jobs.get(timeout=1)
    with kombu_as(pg_dsn, roles["worker"], schema) as worker:
        jobs = worker.SimpleQueue("kjobs")
        got = []
        for _ in range(5):
            message = jobs.get(timeout=5)
            got.append(message.payload["n"])
            message.ack()
        jobs.close()
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert lonnymq.Queue("kjobs", schema=schema).stats(conn).total == 0


def test_a_producer_role_hands_off_to_a_sleeping_worker_role(
    roles: dict[str, str], schema: str, pg_dsn: str, conn: Conn
) -> None:
    """A producer role's publish to a worker role's consumer asleep on the queue: handed off,
    committed without waiting for the WAL flush, and flushed (a transactional logical
    message, which the role may write) before the publish returned (publish_commit=
    "flush_after_wake", the default)."""
    modes = record_commit_modes(conn, schema)
    got: list[Any] = []

    def take(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with (
        kombu_as(pg_dsn, roles["worker"], schema) as worker,
        kombu_as(pg_dsn, roles["producer"], schema) as producer,
    ):
        queue = Queue("hjobs")
        queue(worker.default_channel).declare()
        worker.Consumer([queue], callbacks=[take], accept=["json"]).consume()
        publisher = producer.Producer(serializer="json")
        publisher.publish("warm", routing_key="hjobs")
        worker.drain_events(timeout=5)
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.3)
        assert asleep_on(conn, schema, "hjobs")
        publisher.publish("woke", routing_key="hjobs")
        assert modes()[0] == ("off", True)
        worker.drain_events(timeout=5)
    assert got == ["warm", "woke"]


@pytest.mark.slow
def test_grant_cli(roles: dict[str, str], schema: str, pg_dsn: str, conn: Conn) -> None:
    role = roles["nobody"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lonnymq",
            "grant",
            "producer",
            role,
            "--dsn",
            pg_dsn,
            "--schema",
            schema,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"role {role!r} may now act as a lonnymq producer" in out.stdout
    with psycopg.connect(dsn_as(pg_dsn, role), autocommit=True) as c:
        lonnymq.Queue("jobs", schema=schema).channel("t").message.create(c, b"x")
    out = subprocess.run(
        [sys.executable, "-m", "lonnymq", "revoke", role, "--dsn", pg_dsn, "--schema", schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with (
        psycopg.connect(dsn_as(pg_dsn, role), autocommit=True) as c,
        pytest.raises(PermissionDenied),
    ):
        lonnymq.Queue("jobs", schema=schema).channel("t").message.create(c, b"x")
    bad = subprocess.run(
        [sys.executable, "-m", "lonnymq", "grant", "superuser", role, "--dsn", pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "invalid choice" in bad.stderr


@pytest.mark.slow
def test_celery_worker_runs_as_the_worker_role(
    roles: dict[str, str], schema: str, pg_dsn: str, conn: Conn, tmp_path: Any
) -> None:
    """A real Celery worker connected as the worker role runs tasks that a producer role
    published (no result backend: a producer may not consume replies)."""
    from tests.test_celery_worker import launch, make_env, wait_for, worker_args

    (tmp_path / "w").mkdir()
    (tmp_path / "p").mkdir()
    worker_env = make_env(tmp_path / "w", dsn_as(pg_dsn, roles["worker"]), schema)
    producer_env = make_env(tmp_path / "p", dsn_as(pg_dsn, roles["producer"]), schema)
    started: list[Any] = []
    try:
        worker = launch(
            worker_env.dir,
            worker_env.module,
            "roleworker",
            worker_args("roleworker", "celery", "--pool", "threads", "-c", "2"),
            started,
        )
        mark = producer_env.task("mark")
        for i in range(10):
            mark.apply_async((f"done-{i}",), ignore_result=True)
        wait_for(
            lambda: all(worker_env.lines(f"done-{i}") for i in range(10)), 30, "10 tasks", worker
        )
        wait_for(
            lambda: lonnymq.Queue("celery", schema=schema).stats(conn).total == 0,
            10,
            "the acks",
            worker,
        )
        assert "PermissionDenied" not in worker.log.read_text()
        assert "permission denied" not in worker.log.read_text()
    finally:
        from tests.test_celery_worker import _stop

        for w in started:
            _stop(w)
        close_app(worker_env.app)
        close_app(producer_env.app)
