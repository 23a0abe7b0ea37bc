# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""A real Celery worker, started with Celery's defaults (mingle, gossip, heartbeat, remote
control on; no ``--without-*`` flag), wakes within milliseconds of a publish (issue 25).

Its consumer has several kombu channels on one connection (task queues, pidbox, gossip, with
``-E`` events too): idle, it must sleep on all of them. Each test leaves a worker idle, then
publishes tasks 0.5 s apart and checks that each one started within :data:`PICKUP_S` of its
publish, in every worker form: prefork (Celery's event loop and asynchronous pool), threads,
solo, the blocking loop (``event_loop=False``), ``-E``, a task sent to the second queue of
``-Q a,b``, after its connections were cut and after a Postgres restart. Also the Celery
behaviours that a late wake-up broke: a revoke followed by its task, a retry, an rpc round
trip.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery.exceptions import TaskRevokedError

from lonnymq.testing import TempPostgres
from tests import test_celery_worker as tcw
from tests.test_faults import backends, renewed
from tests.test_wakeup import asleep_on

Conn = psycopg.Connection[Any]

#: How soon after its publish a task must start on an idle worker.
PICKUP_S = 0.1

STAMP_TASK = """

@app.task(name="t.stamp", shared=False)
def stamp(tag, sent):
    append("stamps", json.dumps([tag, sent, time.time()]))


@app.task(name="t.get_from", shared=False)
def get_from(queue, timeout):
    # a consumer in a pool process (prefork: a child, after the fork)
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        message = simple.get(timeout=timeout)
        got = time.time()
        message.ack()
        simple.close()
    return got


@app.task(name="t.retry_once", bind=True, shared=False)
def retry_once(self, key):
    append(key, str(time.time()))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return self.request.retries
"""


def stamps(env: tcw.Env) -> dict[Any, tuple[float, float]]:
    """tag -> (sent, started) of each ``t.stamp`` that ran."""
    return {tag: (sent, ran) for tag, sent, ran in map(json.loads, env.lines("stamps"))}


def idle_pickups(
    env: tcw.Env,
    worker: tcw.Worker,
    *,
    idle: float = 10.0,
    n: int = 10,
    gap: float = 0.5,
    **options: Any,
) -> list[float]:
    """Leave ``worker`` idle for ``idle`` seconds, then publish ``n`` ``t.stamp`` tasks
    ``gap`` seconds apart (``apply_async`` ``options``); the seconds from each publish to its
    task's start. A first task warms this process's producer up (its connection, the queue
    declared) and shows the worker consumes."""
    stamp = env.task("stamp")
    stamp.apply_async(("warm", time.time()), **options)
    tcw.wait_for(lambda: "warm" in stamps(env), 30, "the warm-up task", worker)
    time.sleep(idle)
    for i in range(n):
        stamp.apply_async((i, time.time()), **options)
        time.sleep(gap)
    tcw.wait_for(lambda: len(stamps(env)) > n, 30, f"{n} tasks", worker)
    got = stamps(env)
    return [got[i][1] - got[i][0] for i in range(n)]


def check(late: list[float], worker: tcw.Worker) -> None:
    shown = [round(x * 1000, 1) for x in late]
    assert max(late) < PICKUP_S, f"ms from publish to start: {shown}\n{worker.log_tail()}"
    print(f"\npublish -> start, ms: {shown}")


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[tcw.Env]:
    with tcw.app_env(tmp_path, pg_dsn, schema, STAMP_TASK) as environment:
        yield environment


@pytest.fixture
def start(env: tcw.Env) -> Iterator[Callable[..., tcw.Worker]]:
    """Start ``celery worker`` with Celery's defaults and ``args``."""
    started: list[tcw.Worker] = []

    def launch(*args: str, extra_env: dict[str, str] | None = None) -> tcw.Worker:
        name = f"w{len(started)}"
        argv = ["worker", "-n", f"{name}@%h", "--loglevel", "INFO", *args]
        return tcw.launch(env.dir, env.module, name, argv, started, extra_env=extra_env)

    try:
        yield launch
    finally:
        for worker in started:
            tcw._stop(worker)


FORMS = [
    pytest.param((), {}, id="prefork"),
    pytest.param(("--pool", "threads", "-c", "4"), {}, id="threads"),
    pytest.param(("--pool", "solo"), {}, id="solo"),
    pytest.param((), {"LMQ_EVENT_LOOP": "0"}, id="prefork-blocking-loop"),
    pytest.param(("--pool", "threads", "-c", "4"), {"LMQ_EVENT_LOOP": "0"}, id="threads-blocking"),
    pytest.param(("-E",), {}, id="prefork-events"),
    pytest.param(
        ("--pool", "gevent", "-c", "10"),
        {},
        id="gevent",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("gevent") is None, reason="gevent is not installed"
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "extra_env"), FORMS)
def test_idle_default_worker_starts_each_task_within_100_ms(
    env: tcw.Env,
    start: Callable[..., tcw.Worker],
    args: tuple[str, ...],
    extra_env: dict[str, str],
) -> None:
    worker = start(*args, extra_env=extra_env)
    check(idle_pickups(env, worker), worker)


@pytest.mark.slow
def test_task_sent_to_the_second_of_two_queues(
    env: tcw.Env, start: Callable[..., tcw.Worker]
) -> None:
    worker = start("-Q", "a,b")
    check(idle_pickups(env, worker, queue="b"), worker)


@pytest.mark.slow
def test_wakes_after_its_connections_were_cut(
    env: tcw.Env, start: Callable[..., tcw.Worker], conn: Conn
) -> None:
    """The LISTEN connection (where it sleeps) and the command connections of the worker's
    main process are terminated while it is idle: it reconnects, and wakes as before."""
    worker = start()
    check(idle_pickups(env, worker, idle=1.0, n=3), worker)
    pid = worker.proc.pid
    for role in ("listen", "command"):
        old = backends(conn, pid, role)
        assert old, f"no lonnymq-{role} connection of the worker"
        for backend in old:
            conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
        tcw.wait_for(renewed(conn, pid, role, old), 30, f"new {role} connections", worker)
    env.dir.joinpath("stamps").unlink()
    check(idle_pickups(env, worker, idle=3.0), worker)


@pytest.mark.slow
def test_wakes_after_a_postgres_restart(tmp_path: Path, schema: str) -> None:
    """A throwaway server restarted under an idle worker: the worker reconnects and wakes
    as before; and this process's first publish after the restart (its producer's channel
    closed with the lost connection; the rpc backend declares its reply queue on it) goes
    through on kombu's retry instead of failing with 'channel disconnected'."""
    server = TempPostgres().init().start()
    started: list[tcw.Worker] = []
    try:
        with tcw.app_env(tmp_path, server.dsn(), schema, STAMP_TASK) as env:
            argv = ["worker", "-n", "restart@%h", "--loglevel", "INFO"]
            worker = tcw.launch(env.dir, env.module, "restart", argv, started)
            check(idle_pickups(env, worker, idle=1.0, n=3), worker)
            server.restart()
            env.dir.joinpath("stamps").unlink()
            with psycopg.connect(server.dsn(), autocommit=True) as pg:
                tcw.wait_for(
                    lambda: bool(backends(pg, worker.proc.pid, "listen")),
                    60,
                    "the worker's LISTEN connection back",
                    worker,
                )
            check(idle_pickups(env, worker, idle=3.0), worker)
    finally:
        for w in started:
            tcw._stop(w)
        server.cleanup()


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_revoke_then_its_task_is_revoked(env: tcw.Env, start: Callable[..., tcw.Worker]) -> None:
    """``revoke(id)`` (a broadcast to the pidbox) followed at once by the task with that id
    (to the task queue), to an idle worker: the task never runs and ends REVOKED."""
    worker = start()
    stamp = env.task("stamp")
    stamp.apply_async(("warm", time.time()))
    tcw.wait_for(lambda: "warm" in stamps(env), 30, "the warm-up task", worker)
    for i in range(5):
        time.sleep(0.5)  # idle
        task_id = f"revoked-{i}-{time.time()}"
        env.app.control.revoke(task_id)
        result = stamp.apply_async((task_id, time.time()), task_id=task_id)
        with pytest.raises(TaskRevokedError):
            result.get(timeout=10)
    assert not [tag for tag in stamps(env) if str(tag).startswith("revoked")], worker.log_tail()


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_consumer_in_a_prefork_child_wakes(
    env: tcw.Env, start: Callable[..., tcw.Worker], conn: Conn
) -> None:
    """A task in a prefork child consumes a queue (``SimpleQueue.get``, on a connection of
    its own made after the fork) and is woken by a publish to it."""
    worker = start()
    result = env.task("get_from").delay("child_q", 20)
    # the child found nothing and sleeps (a worker slow to start the task, under load, is
    # not what this measures)
    tcw.wait_for(lambda: asleep_on(conn, env.schema, "child_q"), 30, "the child asleep", worker)
    time.sleep(0.3)  # (and made its look after taking the key)
    with env.app.connection_for_write() as producer:
        producer.SimpleQueue("child_q").put("hello")
        sent = time.time()
    got = result.get(timeout=30)
    assert got - sent < PICKUP_S, f"{(got - sent) * 1000:.1f} ms\n{worker.log_tail()}"


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_retry_and_rpc_round_trips_are_prompt(
    env: tcw.Env, start: Callable[..., tcw.Worker]
) -> None:
    """An idle worker: ``add.delay(1, 1).get()`` (the result comes back through an rpc reply
    queue, which the caller's consumer sleeps on) and a task retried with ``countdown=0``
    (the retry is a new publish to the worker) each take well under a second."""
    worker = start()
    add, retry_once = env.task("add"), env.task("retry_once")
    assert add.delay(0, 0).get(timeout=30) == 0  # warm up
    trips = []
    for i in range(5):
        time.sleep(0.5)
        begin = time.monotonic()
        assert add.delay(i, 1).get(timeout=10) == i + 1
        trips.append(time.monotonic() - begin)
    assert max(trips) < 0.2, [round(t * 1000, 1) for t in trips]
    time.sleep(0.5)
    begin = time.monotonic()
    assert retry_once.delay("once").get(timeout=10) == 1
    took = time.monotonic() - begin
    assert took < 0.5, f"{took:.3f} s\n{worker.log_tail()}"
