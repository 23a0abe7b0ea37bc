# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""What a person running Celery workers sees of them, with a real worker (Celery's default
flags: mingle, gossip, events, remote control): who consumes each queue (the worker's node
name, host and pid, since when, its last delivery) in ``lonnymq web`` and in ``lonnymq
status``; a worker's own plumbing queues (pidbox, its gossip queue ``celeryev.*``, which
receives every worker's heartbeats) hidden while they are idle, as the docs say, however
the readings fall; its auto_delete queues gone when it stops; its Celery tasks named in the
message lists."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange
from psycopg import sql

from tests import test_celery_worker
from tests.test_celery_worker import Env, Worker, _stop

from ._web import web_server

Conn = psycopg.Connection[Any]
pytestmark = pytest.mark.slow

# the fixtures of tests/test_celery_worker.py: its app module, and its worker processes
env = test_celery_worker.env
workers = test_celery_worker.workers


def _status(pg_dsn: str, schema: str, *args: str) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "lonnymq", "status", "--json", *args]
    out = subprocess.run(
        [*argv, "--dsn", pg_dsn, "--schema", schema],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found: list[dict[str, Any]] = json.loads(out.stdout)
    return found


def _queues(conn: Conn, schema: str) -> list[str]:
    rows = conn.execute(
        sql.SQL("SELECT name FROM {} ORDER BY name").format(sql.Identifier(schema, "queue"))
    ).fetchall()
    return [r[0] for r in rows]


def test_a_workers_consumers_in_the_web_view_and_status(
    env: Env, workers: Callable[..., Worker], pg_dsn: str, url: str, conn: Conn, schema: str
) -> None:
    worker = workers()
    node = f"{worker.name}@{socket.gethostname()}"
    env.task("add").delay(1, 2).get(timeout=20)  # a delivery
    gossip = [q for q in _queues(conn, schema) if q.startswith("celeryev.")]
    assert gossip, _queues(conn, schema)

    # the status: consumers per queue; the worker's plumbing hidden, even right after a
    # burst of events into its gossip queue (ready messages it has not taken yet)
    with Connection(url, transport_options={"schema": schema}) as c:
        producer = c.Producer()
        for _ in range(3):
            for i in range(20):
                producer.publish(
                    {"type": "worker-heartbeat", "hostname": f"other{i}@box"},
                    exchange=Exchange("celeryev", type="topic"),
                    routing_key="worker.heartbeat",
                )
            shown = {s["queue"]: s for s in _status(pg_dsn, schema)}
            assert not [q for q in shown if q.startswith("celeryev.") or "pidbox" in q], shown
            assert shown["celery"]["consumers"] == 1
    every = {s["queue"]: s for s in _status(pg_dsn, schema, "--all")}
    assert every[gossip[0]]["consumers"] == 1

    with web_server(pg_dsn, schema) as srv, srv.client() as http:
        status = http.get("/api/status").json()
        by_queue = {q["queue"]: q for q in status["queues"]}
        assert by_queue["celery"]["consumers"] == 1
        assert not any(q.startswith("celeryev.") for q in by_queue)
        page = http.get("/api/queue", params={"q": "celery"}).json()
        [consumer] = page["consumers"]
        assert (consumer["node"], consumer["pid"], consumer["host"]) == (
            node,
            worker.proc.pid,
            socket.gethostname(),
        )
        assert consumer["alive"] and consumer["no_ack"] is False
        assert consumer["consuming_seconds"] >= 0
        # the delivery is reported by the worker's next beat (every few seconds)
        deadline = time.monotonic() + 15
        while consumer["delivered_at"] is None and time.monotonic() < deadline:
            time.sleep(0.5)
            [consumer] = http.get("/api/queue", params={"q": "celery"}).json()["consumers"]
        assert consumer["delivered_at"] is not None
        listed = http.get("/api/consumers").json()
        [process] = [p for p in listed["processes"] if p["node"] == node]
        assert "celery" in process["queues"] and gossip[0] in process["queues"]
        assert any(q.endswith(".celery.pidbox") for q in process["queues"])
        html = http.get("/queue", params={"q": "celery"}).text
        assert node in html and str(worker.proc.pid) in html
        # a Celery task in a message list, with its arguments
        env.task("add").apply_async((40, 2), countdown=60)
        rows = http.get("/api/messages", params={"queue": "celery", "state": "delayed"}).json()
        assert [(m["task"], m["args"]) for m in rows["messages"]] == [("t.add", "(40, 2)")]

    # the worker stops: its auto_delete queues (pidbox, gossip) go with it
    _stop(worker)
    assert not worker.alive()
    left = _queues(conn, schema)
    assert not [q for q in left if q.startswith("celeryev.") or q.endswith(".celery.pidbox")], left
    assert "celery" in left
    assert [s["consumers"] for s in _status(pg_dsn, schema, "celery")] == [0]
