# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""``eta`` under a Celery app whose timezone is not UTC (``timezone = "America/New_York"``,
``enable_utc`` left at its default, True), with a real worker.

A task published with an ``eta`` 3 s ahead must be stored in Postgres as delayed (due in
about 3 s) and run about 3 s later: not at once, and not hours early or late because the
eta's timezone was misread. Uses the app module, fixtures and launcher of
``tests/test_celery_worker.py``; the app module gets the timezone setting and a task that
records when it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests import test_celery_worker as tcw
from tests.test_celery_worker import WHEN_TASK, Conn, Env, Worker, app_env, ran_at, stats, wait_for

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

workers = tcw.workers

NEW_YORK = ZoneInfo("America/New_York")
AHEAD = 3.0  # seconds

EXTRA = (
    """

app.conf.timezone = "America/New_York"
"""
    + WHEN_TASK
)


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    with app_env(tmp_path, pg_dsn, schema, EXTRA) as environment:
        yield environment


def check_app(env: Env) -> None:
    assert env.app.conf.enable_utc is True
    assert str(env.app.timezone) == "America/New_York"
    # the test means something only while New York is hours away from UTC (always)
    offset = datetime.now(NEW_YORK).utcoffset()
    assert offset is not None and offset <= timedelta(hours=-4)


def run_delayed(
    env: Env, worker: Worker, conn: Conn, publish: dict[str, Callable[[], object]]
) -> dict[str, float]:
    """Publish each task (tag -> publishing call, each ``AHEAD`` s ahead), check they wait in
    Postgres as delayed, and return how long after publishing each one ran."""
    published: dict[str, float] = {}
    for tag, call in publish.items():
        published[tag] = time.time()
        call()
    s = stats(conn, env.schema)
    assert (s.delayed, s.in_flight) == (len(publish), 0), (s, ran_at(env), worker.log_tail())
    wait_for(lambda: len(ran_at(env)) >= len(publish), 30, "the delayed tasks to run", worker)
    ran = ran_at(env)
    return {tag: ran[tag] - published[tag] for tag in publish}


def test_aware_eta_and_countdown_with_new_york_timezone(
    env: Env, workers: Callable[..., Worker], conn: Conn
) -> None:
    check_app(env)
    worker = workers("--pool", "threads", "-c", "4")
    when = env.task("when")
    after = run_delayed(
        env,
        worker,
        conn,
        {
            "utc": lambda: when.apply_async(
                ("utc",), eta=datetime.now(timezone.utc) + timedelta(seconds=AHEAD)
            ),
            "new-york-aware": lambda: when.apply_async(
                ("new-york-aware",), eta=datetime.now(NEW_YORK) + timedelta(seconds=AHEAD)
            ),
            "countdown": lambda: when.apply_async(("countdown",), countdown=AHEAD),
        },
    )
    print(f"\naware eta / countdown ({AHEAD} s ahead) ran after: {after}")
    for tag, seconds in after.items():
        assert AHEAD - 0.5 <= seconds < AHEAD + 12, (tag, after, worker.log_tail())


def test_naive_eta_is_in_the_app_timezone(
    env: Env, workers: Callable[..., Worker], conn: Conn
) -> None:
    """A naive eta is in the app's timezone, as the app's ``now()`` and countdowns are.
    (lonnymq up to 7cb68cf read it as UTC: 4-5 hours in the past, so the task ran at once.)"""
    check_app(env)
    worker = workers("--pool", "threads", "-c", "4")
    when = env.task("when")
    # 3 s from now on New York wall clocks, without a tzinfo
    naive = datetime.now(NEW_YORK).replace(tzinfo=None) + timedelta(seconds=AHEAD)
    after = run_delayed(
        env, worker, conn, {"naive": lambda: when.apply_async(("naive",), eta=naive)}
    )
    print(f"\nnaive New York eta ({AHEAD} s ahead) ran after: {after}")
    assert AHEAD - 0.5 <= after["naive"] < AHEAD + 12, (after, worker.log_tail())
