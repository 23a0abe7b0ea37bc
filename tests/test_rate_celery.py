# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""A channel rate under three real Celery worker processes (issue "Per-tenant rate limits"):
tenant A limited to 20/s with a burst of 5 by the ``policies`` transport option, tenant B
unlimited. Over every 1-second window A runs at most 20 + 5 tasks, on average 20 +- 1 a second
over 30 s, while B runs as fast as it does alone; a rate change on the live channel takes
effect at once."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import lonnymq
from tests.test_celery_worker import Env, Worker, _stop, app_env, launch, worker_args

pytestmark = pytest.mark.slow

TASKS = """

app.conf.broker_transport_options["policies"] = {
    "celery": {"channels": {"A": {"rate": "20/s", "burst": 5}}},
}


@app.task(name="t.rated", lonnymq_channel="tenant", shared=False)
def rated(tenant, i):
    append("rated", json.dumps([tenant, time.time()]))
"""


@pytest.fixture
def renv(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    with app_env(tmp_path, pg_dsn, schema, TASKS) as environment:
        yield environment


def runs(env: Env, tenant: str) -> list[float]:
    return sorted(at for who, at in map(json.loads, env.lines("rated")) if who == tenant)


def most_in_a_second(times: list[float]) -> int:
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best


def start_workers(env: Env, n: int) -> list[Worker]:
    """``n`` workers (threads, 4 each, prefetch 1) that consume nothing until
    :func:`consume` tells them all at once."""
    started: list[Worker] = []
    for _ in range(n):
        name = f"w{uuid.uuid4().hex[:8]}"
        args = worker_args(name, "gate", "--pool", "threads", "-c", "4")
        launch(env.dir, env.module, name, args, started, extra_env={"LMQ_PREFETCH": "1"})
    return started


def consume(env: Env, on: bool, workers: list[Worker]) -> None:
    control = env.app.control
    call = control.add_consumer if on else control.cancel_consumer
    replies = call("celery", reply=True, timeout=5)
    assert len(replies) == len(workers), replies


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, workers: list[Worker]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    logs = "\n".join(w.log_tail(20) for w in workers)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


# B's speed next to A against alone is a ratio of two throughputs of 12 threads on 2 cores:
# CI once saw 0.76 (713 against 940/s) where runs alone give 0.9 and more. Run once more
# before failing; the rate's own assertions are exact either way.
@pytest.mark.flaky(reruns=1)
def test_three_workers_hold_one_tenant_to_its_rate_and_not_the_other(
    renv: Env, pg_dsn: str, schema: str
) -> None:
    rated = renv.task("rated")
    workers = start_workers(renv, 3)
    try:
        # B alone: its speed with the three workers
        for i in range(2000):
            rated.delay("B", i)
        consume(renv, True, workers)
        wait_until(lambda: len(runs(renv, "B")) >= 2000, 60, "B alone", workers)
        consume(renv, False, workers)
        alone = runs(renv, "B")
        (renv.dir / "rated").unlink()

        # A (20/s, burst 5, 1,000 waiting) and B (2,000) together
        for i in range(2000):
            if i < 1000:
                rated.delay("A", i)
            rated.delay("B", i)
        consume(renv, True, workers)
        wait_until(lambda: len(runs(renv, "B")) >= 2000, 60, "B next to A", workers)
        together = runs(renv, "B")
        a_start = runs(renv, "A")[0]
        wait_until(lambda: runs(renv, "A")[-1] >= a_start + 30.5, 40, "30 s of A", workers)
        window = [t for t in runs(renv, "A") if t < a_start + 30]
        # a rate change on the live channel: 50/s from now on
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            changed = time.time()
            broker = lonnymq.Broker(schema)
            broker.queue("celery").channel("A").policy.set(conn, rate="50/s", burst=5)
        wait_until(lambda: runs(renv, "A")[-1] >= changed + 2.5, 10, "A at 50/s", workers)
        first_after = min(t for t in runs(renv, "A") if t >= changed)
        after = [t for t in runs(renv, "A") if changed + 0.5 <= t < changed + 2.5]
    finally:
        for w in workers:
            _stop(w)

    alone_rate = 2000 / (alone[-1] - alone[0])
    together_rate = 2000 / (together[-1] - together[0])
    steady = [t for t in window if t >= a_start + 1.0]
    print(  # (shown with pytest -s: the figures of the run)
        f"A: at most {most_in_a_second(window)} in a second, {len(steady) / 29.0:.2f}/s over "
        f"29 s after the first; B {together_rate:.0f}/s next to A, {alone_rate:.0f}/s alone "
        f"({together_rate / alone_rate:.2f}); after the change to 50/s: first in "
        f"{(first_after - changed) * 1000:.0f} ms, {len(after) / 2.0:.1f}/s"
    )
    assert most_in_a_second(window) <= 20 + 5, most_in_a_second(window)
    # (the burst comes first: the average is over the 29 s after the first second)
    average = len(steady) / 29.0
    assert 19.0 <= average <= 21.0, average
    # B is not held to A's 20/s: 0.85 of B alone on a quiet machine; the two are measured at
    # different times, and with the suite in 4 processes the load between them differs
    # (0.64 seen in CI), so 0.5 (still 20 times A's rate)
    assert together_rate >= 0.5 * alone_rate, (together_rate, alone_rate)
    assert first_after - changed < 0.1, first_after - changed
    assert 45 <= len(after) / 2.0 <= 55, len(after) / 2.0
