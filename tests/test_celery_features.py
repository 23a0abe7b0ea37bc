# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""More Celery features through lonnymq under real worker (and beat) processes.

As in ``tests/test_celery_worker.py``: each test writes a Celery app module (``APP`` below) to
``tmp_path``, runs ``celery -A <module> worker`` (or ``beat``) in a subprocess of its own
session, and imports the same module to publish. Results go through Celery's SQLAlchemy
database backend on the test Postgres, in tables (and a schema) of their own, dropped afterwards, so
that canvas primitives (chain, group, chord) work. Tasks report what they do by appending lines
to files in ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import chain, chord, group
from psycopg import sql

import lonnymq
from tests.apps import close_app
from tests.test_celery_worker import (
    Env,
    Worker,
    _stop,
    captured_events,
    launch,
    wait_for,
    worker_args,
)

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]

APP = r'''
"""Celery app for tests/test_celery_features.py."""
import json
import os
import time
from pathlib import Path

from celery import Celery

import lonnymq  # noqa: F401  registers lonnymq://

OUT = Path(__OUT__)
app = Celery("lmqfeat", broker=__URL__, backend=__BACKEND__)
app.conf.update(
    broker_transport_options={"schema": __SCHEMA__},
    database_table_names=__TABLES__,
    database_table_schemas={"task": __RESULT_SCHEMA__, "group": __RESULT_SCHEMA__},
    worker_prefetch_multiplier=int(os.environ.get("LMQ_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_routes={"t.x": {"queue": "q1"}, "t.y": {"queue": "q2"}},
    beat_schedule={"tick": {"task": "t.tick", "schedule": 1.0}},
    worker_lost_wait=1.0,  # a killed pool child's job is failed/rejected after 1 s, not 10
)


def append(name, line):
    with open(OUT / name, "a") as f:
        f.write(line + "\n")


def lines(name):
    path = OUT / name
    return path.read_text().splitlines() if path.exists() else []


@app.task(name="t.add", shared=False)
def add(x, y):
    return x + y


@app.task(name="t.tsum", shared=False)
def tsum(values):
    return sum(values)


@app.task(name="t.prio", shared=False)
def prio(n):
    append("prio", str(n))


@app.task(name="t.x", shared=False)
def x(tag):
    append("x", tag)


@app.task(name="t.y", shared=False)
def y(tag):
    append("y", tag)


@app.task(name="t.hang", time_limit=1, shared=False)
def hang():
    append("hang", "start")
    time.sleep(5)
    append("hang", "end")
    return "finished"


@app.task(name="t.victim", acks_late=True, reject_on_worker_lost=True, shared=False)
def victim():
    append("victim", json.dumps([os.getpid(), time.time()]))
    if len(lines("victim")) == 1:
        time.sleep(30)
    return "survived"


@app.task(name="t.tick", shared=False)
def tick():
    append("tick", str(time.time()))
'''


def _result_schema(pg_dsn: str, name: str, *, create: bool) -> None:
    """Create (or drop) the Postgres schema of a test's result tables. Celery names the
    tables' indexes ``ix_celery_taskmeta_date_done`` whatever the table names, so tables in
    one shared schema would collide on them; a schema per test keeps them apart."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")
        ident = sql.Identifier(name)
        if create:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
            return
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
        # Celery's id sequences are not in the tables' schema (their names are fixed): drop
        # them unless another result table still uses them
        for seq in ("task_id_sequence", "taskset_id_sequence"):
            with contextlib.suppress(psycopg.errors.DependentObjectsStillExist):
                conn.execute(sql.SQL("DROP SEQUENCE IF EXISTS {}").format(sql.Identifier(seq)))


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    hexid = uuid.uuid4().hex[:10]
    module = f"lmqfeat_{hexid}"
    tables = {"task": f"lmq_t_{hexid}", "group": f"lmq_g_{hexid}"}
    result_schema = f"{schema}_results"
    _result_schema(pg_dsn, result_schema, create=True)
    rest = pg_dsn.split("://", 1)[1]
    source = (
        APP.replace("__OUT__", repr(str(tmp_path)))
        .replace("__URL__", repr("lonnymq://" + rest))
        .replace("__BACKEND__", repr("db+postgresql+psycopg://" + rest))
        .replace("__SCHEMA__", repr(schema))
        .replace("__TABLES__", repr(tables))
        .replace("__RESULT_SCHEMA__", repr(result_schema))
    )
    path = tmp_path / f"{module}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    environment = Env(tmp_path, module, mod, schema)
    try:
        yield environment
    finally:
        close_app(environment.app)
        with contextlib.suppress(Exception):
            environment.app.backend.ResultSession().get_bind().dispose()
        _result_schema(pg_dsn, result_schema, create=False)


@pytest.fixture
def procs(env: Env) -> Iterator[Callable[..., Worker]]:
    """Start ``celery worker`` (or ``beat``) processes, waiting until their log shows
    ``ready``; all are stopped (SIGTERM, then SIGKILL of their session) after the test."""
    started: list[Worker] = []

    def start(
        *args: str,
        extra_env: dict[str, str] | None = None,
        queues: str = "celery",
        beat: bool = False,
        ready: str = " ready.",
    ) -> Worker:
        name = f"{'b' if beat else 'w'}{uuid.uuid4().hex[:8]}"
        if beat:
            argv = ["beat", "-s", str(env.dir / "schedule"), "--loglevel", "INFO", *args]
        else:
            argv = worker_args(name, queues, *args)
        return launch(env.dir, env.module, name, argv, started, extra_env=extra_env, ready=ready)

    try:
        yield start
    finally:
        for worker in started:
            _stop(worker)


def get(result: Any, worker: Worker, timeout: float = 30) -> Any:
    try:
        return result.get(timeout=timeout)
    except Exception as exc:
        pytest.fail(f"{exc!r}\nworker log:\n{worker.log_tail()}")


def queue_total(conn: Conn, schema: str, queue: str) -> int:
    return lonnymq.Broker(schema).queue(queue).stats(conn).total


# --------------------------------------------------------------------------------------------
# 1. Canvas with the SQLAlchemy result backend


@pytest.mark.slow  # with the worker's warm shutdown, about 10 s
def test_canvas_chain_group_chord(env: Env, procs: Callable[..., Worker]) -> None:
    worker = procs("--pool", "threads", "-c", "4")
    add, tsum = env.task("add"), env.task("tsum")
    assert get(chain(add.s(1, 1), add.s(2), add.s(3)).apply_async(), worker) == 7
    assert get(group(add.s(i, i) for i in range(10)).apply_async(), worker) == [
        2 * i for i in range(10)
    ]
    assert get(chord([add.s(i, i) for i in range(10)], tsum.s()).apply_async(), worker) == 90


# --------------------------------------------------------------------------------------------
# 2. Priority


def test_priority_highest_first(env: Env, procs: Callable[..., Worker], conn: Conn) -> None:
    prio = env.task("prio")
    order = [3, 0, 7, 9, 1, 5, 2, 8, 4, 6]
    for n in order:
        prio.apply_async((n,), priority=n)
    assert queue_total(conn, env.schema, "celery") == 10
    worker = procs("--pool", "solo", extra_env={"LMQ_PREFETCH": "1"})
    wait_for(lambda: len(env.lines("prio")) >= 10, 30, "10 tasks", worker)
    assert [int(n) for n in env.lines("prio")] == list(range(9, -1, -1))


# --------------------------------------------------------------------------------------------
# 3. Routing to several queues


@pytest.mark.slow
def test_routing_to_several_queues(env: Env, procs: Callable[..., Worker], conn: Conn) -> None:
    x, y = env.task("x"), env.task("y")
    only_q1 = procs("--pool", "threads", "-c", "2", queues="q1")
    x.delay("x1")
    y.delay("y1")
    wait_for(lambda: env.lines("x") == ["x1"], 15, "X on the q1 worker", only_q1)
    time.sleep(2)  # Y gets its chance to be (wrongly) consumed
    assert env.lines("y") == []
    assert queue_total(conn, env.schema, "q2") == 1
    assert queue_total(conn, env.schema, "q1") == 0
    _stop(only_q1)

    both = procs("--pool", "threads", "-c", "2", queues="q1,q2")
    x.delay("x2")
    y.delay("y2")
    wait_for(lambda: len(env.lines("x")) == 2 and len(env.lines("y")) == 2, 15, "X and Y", both)
    assert env.lines("x") == ["x1", "x2"]
    assert sorted(env.lines("y")) == ["y1", "y2"]
    wait_for(
        lambda: queue_total(conn, env.schema, "q1") + queue_total(conn, env.schema, "q2") == 0,
        10,
        "the acks",
        both,
    )


# --------------------------------------------------------------------------------------------
# 4. Time limits


@pytest.mark.slow  # with the worker's warm shutdown, about 10 s
def test_time_limit_kills_task_and_worker_survives(
    env: Env, procs: Callable[..., Worker], conn: Conn
) -> None:
    worker = procs("--pool", "prefork", "-c", "1")
    result = env.task("hang").delay()
    with pytest.raises(Exception) as info:
        result.get(timeout=20)
    assert type(info.value).__name__ == "TimeLimitExceeded", (info.value, worker.log_tail())
    assert result.state == "FAILURE"
    assert env.lines("hang") == ["start"]
    assert get(env.task("add").delay(2, 3), worker) == 5
    assert worker.alive()
    wait_for(lambda: queue_total(conn, env.schema, "celery") == 0, 10, "the acks", worker)


# --------------------------------------------------------------------------------------------
# 5. reject_on_worker_lost


@pytest.mark.slow  # with the worker's warm shutdown, about 10 s
def test_reject_on_worker_lost_redelivers(
    env: Env, procs: Callable[..., Worker], conn: Conn
) -> None:
    worker = procs("--pool", "prefork", "-c", "1", extra_env={"LMQ_PREFETCH": "1"})
    result = env.task("victim").delay()
    wait_for(lambda: len(env.lines("victim")) >= 1, 15, "the task to start", worker)
    child = json.loads(env.lines("victim")[0])[0]
    assert child != worker.proc.pid
    os.kill(child, signal.SIGKILL)
    assert get(result, worker, timeout=30) == "survived"
    runs = [json.loads(line) for line in env.lines("victim")]
    assert len(runs) == 2
    assert runs[1][0] != child  # ran again in the replacement pool child
    assert worker.alive()
    wait_for(lambda: queue_total(conn, env.schema, "celery") == 0, 10, "the ack", worker)


# --------------------------------------------------------------------------------------------
# 6. Events


def test_events(env: Env, procs: Callable[..., Worker]) -> None:
    worker = procs("--pool", "threads", "-c", "2", "-E")
    with captured_events(env, worker, heard_within=15) as seen:
        result = env.task("add").delay(20, 22)
        assert get(result, worker) == 42
        wanted = {"task-received", "task-started", "task-succeeded"}
        wait_for(
            lambda: wanted <= {e["type"] for e in seen() if e.get("uuid") == result.id},
            10,
            "the task events",
            worker,
        )
    mine = [e for e in seen() if e.get("uuid") == result.id]
    succeeded = next(e for e in mine if e["type"] == "task-succeeded")
    assert succeeded["result"] == "42"
    received = next(e for e in mine if e["type"] == "task-received")
    assert received["name"] == "t.add"
    beats = [e for e in seen() if e["type"] == "worker-heartbeat"]
    assert all(b["hostname"].startswith(worker.name + "@") for b in beats)


# --------------------------------------------------------------------------------------------
# 7. celery beat


def test_beat_runs_periodic_task(env: Env, procs: Callable[..., Worker]) -> None:
    worker = procs("--pool", "threads", "-c", "2")
    beat = procs(beat=True, ready="beat: Starting")
    started = time.monotonic()
    wait_for(lambda: len(env.lines("tick")) >= 3, 8, "3 ticks", worker)
    assert time.monotonic() - started < 8, beat.log_tail()
    assert beat.alive(), beat.log_tail()
