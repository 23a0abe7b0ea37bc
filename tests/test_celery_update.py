# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Rescheduling Celery tasks that wait in Postgres, with a real worker.

A Celery worker holds a task until the ``eta`` it reads in the message, whatever the
database says: a task scheduled an hour ahead and then made due now ran an hour later
(``lonnymq messages retry`` made its row due, the header kept the old eta). "Run it now"
must run it now, through ``Broker.update``, ``lonnymq messages update --now`` and
``lonnymq messages retry``; a reschedule runs it at its new time. Uses the app module,
fixtures and launcher of ``tests/test_celery_worker.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import lonnymq
from tests import test_celery_worker as tcw
from tests.test_celery_worker import WHEN_TASK, Conn, Env, Worker, app_env, ran_at, stats, wait_for

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

workers = tcw.workers

EXTRA = WHEN_TASK

HOUR = 3600


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    with app_env(tmp_path, pg_dsn, schema, EXTRA) as environment:
        yield environment


def schedule(env: Env, conn: Conn, tags: list[str]) -> dict[str, int]:
    """Publish one ``when`` task per tag an hour ahead; their message ids, by tag."""
    task_ids = {env.task("when").apply_async((tag,), countdown=HOUR).id: tag for tag in tags}
    broker = lonnymq.Broker(env.schema)
    found: dict[str, int] = {}
    for info in broker.messages(conn, queue="celery", state="delayed"):
        detail = broker.message(conn, info.id)
        assert detail is not None
        payload = detail.payload()
        assert payload is not None
        task_id = payload["headers"]["id"]
        if task_id in task_ids:
            found[task_ids[task_id]] = info.id
    assert sorted(found) == sorted(tags), found
    s = stats(conn, env.schema)
    assert (s.delayed, s.in_flight) == (len(tags), 0), s
    return found


def lonnymq_cli(env: Env, pg_dsn: str, *args: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lonnymq", *args, "--dsn", pg_dsn, "--schema", env.schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)


def runs_within(env: Env, worker: Worker, tag: str, since: float, seconds: float) -> float:
    """Wait (at most ``seconds`` + 10) for the task tagged ``tag`` to run; how long after
    ``since`` it ran, which must be within ``seconds``."""
    wait_for(lambda: tag in ran_at(env), seconds + 10, f"task {tag} to run", worker)
    after = ran_at(env)[tag] - since
    assert after <= seconds, (tag, after, worker.log_tail())
    return after


def test_run_a_scheduled_task_now(
    env: Env, workers: Callable[..., Worker], conn: Conn, pg_dsn: str
) -> None:
    """Three tasks an hour ahead, each made due now another way: each runs within seconds."""
    worker = workers("--pool", "threads", "-c", "4")
    ids = schedule(env, conn, ["python", "update-cli", "retry-cli"])
    time.sleep(1)  # the worker went idle: nothing is due
    assert ran_at(env) == {}
    broker = lonnymq.Broker(env.schema)

    started = time.time()
    broker.update(conn, ids["python"], delay_ms=0)
    python = runs_within(env, worker, "python", started, 5)

    started = time.time()
    lonnymq_cli(env, pg_dsn, "messages", "update", str(ids["update-cli"]), "--now")
    update_cli = runs_within(env, worker, "update-cli", started, 5)

    started = time.time()
    lonnymq_cli(env, pg_dsn, "messages", "retry", str(ids["retry-cli"]))
    retry_cli = runs_within(env, worker, "retry-cli", started, 5)
    print(
        f"\nran after: update {python:.2f} s, update --now {update_cli:.2f} s, "
        f"retry {retry_cli:.2f} s"
    )
    s = stats(conn, env.schema)
    assert (s.total, s.in_flight) == (0, 0), s


def test_reschedule_a_task_to_run_in_two_seconds(
    env: Env, workers: Callable[..., Worker], conn: Conn, pg_dsn: str
) -> None:
    worker = workers("--pool", "threads", "-c", "4")
    ids = schedule(env, conn, ["python", "cli"])
    broker = lonnymq.Broker(env.schema)
    started = time.time()
    broker.update(conn, ids["python"], delay_ms=2_000)
    lonnymq_cli(env, pg_dsn, "messages", "update", str(ids["cli"]), "--in", "2s")
    wait_for(lambda: len(ran_at(env)) == 2, 20, "the rescheduled tasks to run", worker)
    after = {tag: at - started for tag, at in ran_at(env).items()}
    print(f"\nrescheduled to +2 s, ran after: {after}")
    for tag, seconds in after.items():
        assert 1.8 <= seconds < 2 + 4, (tag, after, worker.log_tail())
