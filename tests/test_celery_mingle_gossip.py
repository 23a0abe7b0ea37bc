# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Mingle and gossip between real Celery workers on lonnymq (``lonnymq.celery_steps``).

Uses the app module and launcher of ``tests/test_celery_worker.py``; the app here also has a
consumer step that writes what the worker's gossip reports (``c.gossip.on.node_join`` and
``node_leave``) to a file per worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from celery import Celery, signals
from celery.worker.consumer.gossip import Gossip as CeleryGossip
from celery.worker.consumer.mingle import Mingle as CeleryMingle

import lonnymq
import lonnymq.celery
from lonnymq import celery_steps
from tests.apps import close_app
from tests.conftest import lonnymq_url
from tests.test_celery_worker import Env, Worker, _stop, app_env, launch, node_of, wait_for

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]

GOSSIP_WATCH = r'''

from celery import bootsteps


class GossipWatch(bootsteps.StartStopStep):
    """Write this worker's gossip (other workers joining and leaving) to gossip_<name>."""

    requires = ("celery.worker.consumer.gossip:Gossip",)

    def start(self, c):
        out = "gossip_" + c.hostname.split("@", 1)[0]
        c.gossip.on.node_join.add(lambda worker: append(out, "join " + worker.hostname))
        c.gossip.on.node_leave.add(lambda worker: append(out, "leave " + worker.hostname))


app.steps["consumer"].add(GossipWatch)
'''


@pytest.fixture
def env(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[Env]:
    with app_env(tmp_path, pg_dsn, schema, GOSSIP_WATCH) as environment:
        yield environment


@pytest.fixture
def start(env: Env) -> Iterator[Callable[..., Worker]]:
    """Start a ``celery worker`` named ``name`` consuming ``queues`` (mingle and gossip on,
    unless ``args`` turn them off); all are stopped after the test."""
    started: list[Worker] = []

    def _start(name: str, queues: str, *args: str) -> Worker:
        argv = ["worker", "-Q", queues, "-n", f"{name}@%h", "--loglevel", "INFO"]
        argv += ["--pool", "threads", "-c", "1", *args]
        return launch(env.dir, env.module, name, argv, started)

    try:
        yield _start
    finally:
        for worker in started:
            _stop(worker)


def full_name(env: Env, worker: Worker) -> str:
    """``name@host`` of a running worker, from its ping reply."""
    for _ in range(5):
        for node in env.app.control.inspect(timeout=3).ping() or {}:
            if node.startswith(worker.name + "@"):
                return str(node)
    pytest.fail(f"{worker.name} does not answer ping:\n{worker.log_tail()}")


def event_queues(env: Env, conn: Conn) -> list[str]:
    """The event (gossip) queues in the schema: ``celeryev.<uuid>``."""
    return [q for q in lonnymq.Broker(env.schema).queues(conn) if q.startswith("celeryev.")]


def test_late_worker_learns_revokes_and_gossips(
    env: Env, start: Callable[..., Worker], conn: Conn
) -> None:
    suffix = uuid.uuid4().hex[:6]
    a = start(f"a{suffix}", "celery")
    a_node = full_name(env, a)
    assert "mingle: all alone" in a.log.read_text(), a.log_tail()

    # while only A runs, revoke a task id that nobody has seen yet
    revoked_id = str(uuid.uuid4())
    env.app.control.revoke(revoked_id)

    def a_knows() -> bool:
        reply = node_of(env.app.control.inspect(timeout=3, destination=[a_node]).revoked(), a)
        return revoked_id in (reply or [])

    wait_for(a_knows, 20, "worker A to list the revoked id", a)

    # B starts after the revoke: only mingle (hello to A) can tell it
    b = start(f"b{suffix}", "only_b")
    b_log = b.log.read_text()
    assert "mingle: sync with 1 nodes" in b_log, b.log_tail()
    mark = env.task("mark")
    mark.apply_async(("b-revoked",), task_id=revoked_id, queue="only_b")
    mark.apply_async(("b-after",), queue="only_b")
    wait_for(lambda: bool(env.lines("b-after")), 20, "B to run the task after it", b)
    assert env.lines("b-revoked") == [], b.log_tail()
    assert revoked_id in b.log.read_text()  # "Discarding revoked task: t.mark[<id>]"

    # the control: a worker without mingle does not know, and runs it
    c = start(f"c{suffix}", "only_c", "--without-mingle", "--without-gossip")
    assert "mingle:" not in c.log.read_text(), c.log_tail()
    mark.apply_async(("c-revoked",), task_id=revoked_id, queue="only_c")
    wait_for(lambda: bool(env.lines("c-revoked")), 20, "C to run the task", c)

    # gossip: B sees A (A's heartbeats, every 2 s), and A leaving when it stops
    b_gossip = f"gossip_{b.name}"
    wait_for(lambda: f"join {a_node}" in env.lines(b_gossip), 20, "B's gossip to see A", b)
    wait_for(
        lambda: f"join {full_name(env, b)}" in env.lines(f"gossip_{a.name}"),
        20,
        "A's gossip to see B",
        a,
    )
    assert len(event_queues(env, conn)) == 2  # A's and B's gossip (C has none)
    _stop(a)
    wait_for(lambda: f"leave {a_node}" in env.lines(b_gossip), 20, "B's gossip to see A go", b)
    # C runs without gossip: its consumer has Celery's disabled step and hears nothing
    assert env.lines(f"gossip_{c.name}") == []
    # a worker that stops deletes its event queue (auto_delete), not left to collect events
    assert len(event_queues(env, conn)) == 1
    _stop(b)
    assert event_queues(env, conn) == []
    _stop(c)
    for worker in (a, b, c):
        assert worker.proc.returncode == 0, worker.log_tail()
        assert "Traceback" not in worker.log.read_text(), worker.log_tail(120)


# --------------------------------------------------------------------------------------------
# Other brokers: unchanged


def worker_init(app: Celery) -> None:
    """What ``celery worker`` / ``app.Worker`` send before the worker builds its consumer."""
    signals.celeryd_init.send(
        sender="w@test", instance=SimpleNamespace(app=app), conf=app.conf, options={}
    )


def test_steps_are_added_for_lonnymq_workers_only(pg_dsn: str) -> None:
    assert lonnymq.celery.setup is not None  # importing lonnymq.celery connects the signal
    url = lonnymq_url(pg_dsn)
    apps = {
        "lonnymq": Celery("lmq", broker=url, set_as_current=False),
        "class path": Celery("lmq2", broker=pg_dsn, set_as_current=False),
        "memory": Celery("mem", broker="memory://", set_as_current=False),
        "amqp": Celery("amq", broker="amqp://guest@localhost//", set_as_current=False),
    }
    apps["class path"].conf.broker_transport = "lonnymq.transport:Transport"
    try:
        for app in apps.values():
            worker_init(app)
        for kind, app in apps.items():
            ours = set(celery_steps.STEPS)
            if kind in ("lonnymq", "class path"):
                assert ours <= app.steps["consumer"], kind
                assert celery_steps.is_lonnymq(app)
            else:
                assert not ours & app.steps["consumer"], kind
                assert not celery_steps.is_lonnymq(app)
        # Celery's own steps are not patched: their broker lists are Celery's
        assert "lonnymq" not in CeleryMingle.compatible_transports
        assert "lonnymq" not in CeleryGossip.compatible_transports
        assert {"amqp", "redis"} <= CeleryMingle.compatible_transports
    finally:
        for app in apps.values():
            close_app(app)
