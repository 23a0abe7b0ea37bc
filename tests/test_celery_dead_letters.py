# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Dead letters, poison messages and client metrics under a real Celery worker process.

Uses the app module, fixtures and launcher of ``tests/test_celery_worker.py``, with the tasks
and settings of ``EXTRA`` appended to the app module. The worker reads more settings from its
environment: ``LMQ_METRICS_PORT`` (the ``metrics_port`` transport option) and
``LMQ_POLICIES`` (JSON, the ``policies`` transport option); this process imports the module
without them.

- A poison message (its task kills the worker, ``acks_late``) is delivered ``max_attempts``
  times, then moved to the dead letters (reason ``max_attempts``) instead of killing a third
  worker; ``lonnymq messages retry`` puts it back.
- ``Reject(requeue=False)`` moves the message to the dead letters (reason ``rejected``), or
  deletes it where the queue keeps none (``dead_letter=False``).
- ``metrics_port`` serves the worker's client metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

import lonnymq
from lonnymq.queue import MessageInfo, QueueStatus
from tests import test_celery_worker as tcw
from tests.conftest import free_port
from tests.test_celery_worker import Env, Worker, app_env, stats, wait_for

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]

workers = tcw.workers

EXTRA = r'''

import signal

from celery.exceptions import Reject

_options = dict(app.conf.broker_transport_options)
if os.environ.get("LMQ_METRICS_PORT"):
    _options["metrics_port"] = int(os.environ["LMQ_METRICS_PORT"])
if os.environ.get("LMQ_POLICIES"):
    _options["policies"] = json.loads(os.environ["LMQ_POLICIES"])
app.conf.broker_transport_options = _options


@app.task(name="t.poison", acks_late=True, shared=False)
def poison(key):
    """Kills its whole worker (solo pool: the task runs in the worker's main process) unless
    the file "harmless" exists."""
    append(key, json.dumps([os.getpid(), time.time()]))
    if not (OUT / "harmless").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived:" + key


@app.task(name="t.reject", acks_late=True, shared=False)
def reject(key):
    append(key, str(os.getpid()))
    raise Reject("not wanted", requeue=False)
'''

VT = "2"  # visibility_timeout of the workers of the poison test, seconds


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    """The app module of test_celery_worker plus ``EXTRA`` (overrides its ``env``, which the
    ``workers`` fixture uses)."""
    with app_env(tmp_path, pg_dsn, schema, EXTRA) as environment:
        yield environment


def dead_letters(broker: lonnymq.Broker, conn: Conn) -> list[MessageInfo]:
    return broker.messages(conn, queue="celery", state="dead")


def celery_status(broker: lonnymq.Broker, conn: Conn) -> QueueStatus:
    (status,) = [s for s in broker.status(conn) if s.queue == "celery"]
    return status


def wait_dead(worker: Worker, timeout: float = 30) -> None:
    wait_for(lambda: not worker.alive(), timeout, f"worker {worker.name} to die", worker)


def log_lines(worker: Worker, text: str) -> list[str]:
    return [line for line in worker.log.read_text(errors="replace").splitlines() if text in line]


def lonnymq_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lonnymq", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------------------------
# 1. Poison messages


@pytest.mark.parametrize("configured_by", ["configure", "policies"])
def test_poison_message_is_dead_lettered_after_max_attempts(
    env: Env,
    workers: Callable[..., Worker],
    broker: lonnymq.Broker,
    conn: Conn,
    pg_dsn: str,
    configured_by: str,
) -> None:
    """max_attempts=2, set with Queue.configure or by the workers' policies option."""
    started = time.monotonic()
    worker_env = {"LMQ_VT": VT}
    if configured_by == "configure":
        broker.queue("celery").configure(conn, max_attempts=2)
    else:
        policies = {"celery": {"settings": {"max_attempts": 2}}}
        worker_env["LMQ_POLICIES"] = json.dumps(policies)
    assert broker.queue("celery").settings(conn).max_attempts == (
        2 if configured_by == "configure" else 20
    )
    result = env.task("poison").delay("poison")
    (queued,) = broker.messages(conn, queue="celery")
    assert queued.attempts == 0

    # two deliveries, each killing its worker; the message stays held by the dead worker
    # until its lock expires (visibility_timeout)
    killed: list[Worker] = []
    for attempt in (1, 2):
        worker = workers("--pool", "solo", extra_env=worker_env)
        wait_dead(worker)
        killed.append(worker)
        assert len(env.lines("poison")) == attempt
        (held,) = broker.messages(conn, queue="celery")
        assert (held.id, held.attempts) == (queued.id, attempt)
        assert broker.queue("celery").settings(conn).max_attempts == 2
    # the second worker got it after the first one's lock expired, and said so
    redelivered = log_lines(killed[1], f"redelivered message {queued.id} after its lock expired")
    assert len(redelivered) == 1, killed[1].log_tail()
    assert "WARNING" in redelivered[0]
    assert "attempt 2" in redelivered[0]

    # a third worker does not run it: once the lock expires, it goes to the dead letters
    survivor = workers("--pool", "solo", extra_env=worker_env)
    wait_for(lambda: bool(dead_letters(broker, conn)), 30, "the dead letter", survivor)
    (dead,) = dead_letters(broker, conn)
    assert (dead.id, dead.reason, dead.attempts, dead.queue) == (
        queued.id,
        "max_attempts",
        2,
        "celery",
    )
    assert broker.messages(conn, queue="celery", state="locked") == []
    assert stats(conn, env.schema).total == 0
    status = celery_status(broker, conn)
    assert status.dead == 1
    assert (status.counters.delivered, status.counters.redelivered) == (2, 1)
    assert status.counters.dead == 1
    assert status.counters.acked == 0

    # the worker logged it (WARNING, from lonnymq.events) and stays up and running tasks
    wait_for(
        lambda: bool(log_lines(survivor, f"dead-lettered message {queued.id}: max_attempts")),
        10,
        "the dead-letter line in the worker log",
        survivor,
    )
    (line,) = log_lines(survivor, f"dead-lettered message {queued.id}: max_attempts")
    assert "WARNING" in line
    assert "after 2 attempt(s)" in line
    assert f"lonnymq messages retry {queued.id}" in line
    assert env.task("add").delay(2, 3).get(timeout=30) == 5, survivor.log_tail()
    assert survivor.alive(), survivor.log_tail()
    assert len(env.lines("poison")) == 2  # never delivered a third time

    # made harmless, `lonnymq messages retry ID` puts it back and the worker runs it
    (env.dir / "harmless").touch()
    out = lonnymq_cli(
        "messages", "retry", str(dead.id), "--dsn", pg_dsn, "--schema", env.schema, "--json"
    )
    assert out.returncode == 0, out.stderr
    (retried,) = json.loads(out.stdout)
    assert retried["id"] == dead.id
    assert retried["result"] == "retried"
    assert retried["new_id"] not in (None, dead.id)
    try:
        # the same task (same id and reply queue): its result reaches the original caller
        assert result.get(timeout=30) == "survived:poison"
    except Exception as exc:
        pytest.fail(f"{exc!r}\nworker log:\n{survivor.log_tail()}")
    assert len(env.lines("poison")) == 3
    assert dead_letters(broker, conn) == []
    wait_for(lambda: stats(conn, env.schema).total == 0, 10, "the ack", survivor)
    assert survivor.alive(), survivor.log_tail()
    print(f"\npoison test ({configured_by}): {time.monotonic() - started:.1f} s")


# --------------------------------------------------------------------------------------------
# 2. Reject without requeue


def test_reject_without_requeue_goes_to_the_dead_letters(
    env: Env, workers: Callable[..., Worker], broker: lonnymq.Broker, conn: Conn
) -> None:
    worker = workers("--pool", "threads", "-c", "2")
    result = env.task("reject").delay("rejected")
    wait_for(lambda: bool(dead_letters(broker, conn)), 30, "the dead letter", worker)
    (dead,) = dead_letters(broker, conn)
    assert (dead.reason, dead.attempts, dead.queue, dead.channel) == (
        "rejected",
        1,
        "celery",
        "celery",
    )
    detail = broker.message(conn, dead.id)
    assert detail is not None
    payload = detail.payload()
    assert payload is not None
    assert payload["headers"]["id"] == result.id  # the Celery task, kept whole
    assert payload["headers"]["task"] == "t.reject"
    assert stats(conn, env.schema).total == 0
    assert celery_status(broker, conn).counters.dead == 1
    wait_for(
        lambda: bool(log_lines(worker, f"dead-lettered message {dead.id}: rejected")),
        10,
        "the dead-letter line in the worker log",
        worker,
    )
    assert env.task("add").delay(1, 1).get(timeout=30) == 2, worker.log_tail()
    assert env.lines("rejected") == [str(worker.proc.pid)]  # ran once, not redelivered
    assert worker.alive(), worker.log_tail()


def test_reject_without_requeue_deletes_where_the_queue_keeps_no_dead_letters(
    env: Env, workers: Callable[..., Worker], broker: lonnymq.Broker, conn: Conn
) -> None:
    # the setting comes from the worker's configuration (the policies transport option)
    assert broker.queue("celery").settings(conn).dead_letter is True
    policies = {"celery": {"settings": {"dead_letter": False}}}
    worker = workers(
        "--pool", "threads", "-c", "2", extra_env={"LMQ_POLICIES": json.dumps(policies)}
    )
    assert broker.queue("celery").settings(conn).dead_letter is False, worker.log_tail()
    env.task("reject").delay("rejected")
    wait_for(lambda: bool(env.lines("rejected")), 30, "the task to run", worker)
    wait_for(lambda: stats(conn, env.schema).total == 0, 10, "the message to go", worker)
    assert env.task("add").delay(1, 1).get(timeout=30) == 2, worker.log_tail()
    assert dead_letters(broker, conn) == []
    assert celery_status(broker, conn).dead == 0
    assert env.lines("rejected") == [str(worker.proc.pid)]  # ran once, not redelivered
    assert worker.alive(), worker.log_tail()


# --------------------------------------------------------------------------------------------
# 3. Client metrics of the worker


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples at http://127.0.0.1:PORT/metrics: {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_worker_serves_client_metrics(
    env: Env, workers: Callable[..., Worker], broker: lonnymq.Broker, conn: Conn
) -> None:
    port = free_port()
    worker = workers("--pool", "threads", "-c", "2", extra_env={"LMQ_METRICS_PORT": str(port)})
    celery = (("queue", "celery"),)
    delivered = ("lonnymq_client_messages_delivered_total", celery)
    acked = ("lonnymq_client_messages_acked_total", celery)
    rejected = (
        "lonnymq_client_messages_dead_lettered_total",
        (("queue", "celery"), ("reason", "rejected")),
    )

    before = scrape(port)  # served from the first connection on, before any task
    assert delivered not in before
    assert ("lonnymq_client_dequeue_duration_seconds_count", ()) in before

    add = env.task("add")
    results = [add.delay(i, i) for i in range(5)]
    try:
        assert [r.get(timeout=30) for r in results] == [2 * i for i in range(5)]
    except Exception as exc:
        pytest.fail(f"{exc!r}\nworker log:\n{worker.log_tail()}")
    env.task("reject").delay("rejected")
    wait_for(lambda: bool(dead_letters(broker, conn)), 30, "the rejected task", worker)

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def counted() -> bool:
        samples.clear()
        try:
            samples.update(scrape(port))
        except (urllib.error.URLError, OSError):
            return False
        return samples.get(acked) == 5 and samples.get(rejected) == 1

    wait_for(counted, 20, "the worker's metrics to count 5 acks and 1 reject", worker)
    assert samples[delivered] == 6
    assert samples[acked] == 5
    assert samples[rejected] == 1
    assert samples.get(("lonnymq_client_messages_redelivered_total", celery), 0) == 0
    assert samples.get(("lonnymq_client_messages_requeued_total", celery), 0) == 0

    count = samples[("lonnymq_client_dequeue_duration_seconds_count", ())]
    total = samples[("lonnymq_client_dequeue_duration_seconds_sum", ())]
    assert count >= 1
    assert 0 < total < 60 * count
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in samples.items()
        if name == "lonnymq_client_dequeue_duration_seconds_bucket"
    )
    assert buckets[-1] == (float("inf"), count)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert worker.alive(), worker.log_tail()
