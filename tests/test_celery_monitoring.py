# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Monitoring Celery on lonnymq: Flower and ``celery events --dump`` against a real worker
started with ``-E`` (task events), all in subprocesses of their own.

Uses the app module, fixtures and launcher of ``tests/test_celery_worker.py``. Flower's HTTP
API needs ``FLOWER_UNAUTHENTICATED_API=true`` when Flower runs without authentication.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import test_celery_worker as tcw
from tests.conftest import free_port
from tests.test_celery_worker import Env, Worker, _stop, launch, wait_for

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

env = tcw.env
workers = tcw.workers


@pytest.fixture
def monitors(env: Env) -> Iterator[Callable[..., Worker]]:
    """Start ``celery -A <app> <args>`` (flower, events) processes, waiting until their log
    shows ``ready``; all are stopped after the test."""
    started: list[Worker] = []

    def start(*args: str, ready: str, extra_env: dict[str, str] | None = None) -> Worker:
        name = f"m{uuid.uuid4().hex[:8]}"
        return launch(
            env.dir, env.module, name, list(args), started, extra_env=extra_env, ready=ready
        )

    try:
        yield start
    finally:
        for proc in started:
            _stop(proc)


def get_json(url: str, timeout: float = 15) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_flower_lists_worker_and_tasks(
    env: Env, workers: Callable[..., Worker], monitors: Callable[..., Worker]
) -> None:
    worker = workers("--pool", "threads", "-c", "2", "-E")
    port = free_port()
    flower = monitors(
        "flower",
        f"--port={port}",
        "--address=127.0.0.1",
        "--inspect_timeout=5000",
        ready="Visit me at",
        extra_env={"FLOWER_UNAUTHENTICATED_API": "true"},
    )
    base = f"http://127.0.0.1:{port}"

    # /api/workers?refresh=1 asks the workers (inspect, through the lonnymq broker's pidbox)
    found: dict[str, Any] = {}

    def worker_listed() -> bool:
        try:
            listed = get_json(f"{base}/api/workers?refresh=1")
        except (urllib.error.URLError, OSError):
            return False
        found.update({k: v for k, v in listed.items() if k.startswith(worker.name + "@")})
        return bool(found)

    wait_for(worker_listed, 40, "Flower to list the worker", flower)
    (node, info), *_ = found.items()
    assert info["stats"]["broker"]["transport"] == "lonnymq", info["stats"]["broker"]
    assert "t.add" in info["registered"]
    assert [q["name"] for q in info["active_queues"]] == ["celery"]

    add = env.task("add")
    results = [add.delay(i, 100) for i in range(5)]
    for i, result in enumerate(results):
        try:
            assert result.get(timeout=30) == i + 100
        except Exception as exc:
            pytest.fail(f"{exc!r}\nworker log:\n{worker.log_tail()}")

    # /api/tasks comes from the task events Flower receives over the broker
    ids = {r.id for r in results}
    tasks: dict[str, Any] = {}

    def tasks_succeeded() -> bool:
        tasks.clear()
        tasks.update(get_json(f"{base}/api/tasks"))
        return all(tasks.get(i, {}).get("state") == "SUCCESS" for i in ids)

    wait_for(tasks_succeeded, 30, "Flower to show 5 tasks as SUCCESS", flower)
    for i, result in enumerate(results):
        task = tasks[result.id]
        assert task["name"] == "t.add"
        assert task["worker"] == node
        assert task["result"] == str(i + 100)

    # the worker is alive by its heartbeats (?status=1 reads the event state, not inspect)
    wait_for(
        lambda: get_json(f"{base}/api/workers?status=1").get(node) is True,
        20,
        "Flower to see the worker online",
        flower,
    )
    assert flower.alive(), flower.log_tail()
    assert worker.alive(), worker.log_tail()


def test_celery_events_dump(
    env: Env, workers: Callable[..., Worker], monitors: Callable[..., Worker]
) -> None:
    worker = workers("--pool", "threads", "-c", "2", "-E")
    dump = monitors("events", "--dump", ready="starting capture")

    def dumped() -> str:
        return dump.log.read_text(errors="replace")

    # the dump's event queue is bound once it shows the worker's heartbeats (every 2 s)
    wait_for(
        lambda: f"{worker.name}@" in dumped() and "heartbeat" in dumped(),
        20,
        "a worker heartbeat in the dump",
        dump,
    )
    result = env.task("add").delay(20, 22)
    try:
        assert result.get(timeout=30) == 42
    except Exception as exc:
        pytest.fail(f"{exc!r}\nworker log:\n{worker.log_tail()}")

    def task_lines() -> list[str]:
        # "received" names the task and its id; later events of the task repeat that text
        return [line for line in dumped().splitlines() if f"t.add({result.id})" in line]

    wait_for(
        lambda: len(task_lines()) >= 3 and "task succeeded" in " ".join(task_lines()),
        20,
        "the task's events in the dump",
        dump,
    )
    lines = task_lines()
    kinds = [line.split("] ", 1)[1].split(":", 1)[0] for line in lines]
    assert kinds[:3] == ["task received", "task started", "task succeeded"], lines
    assert all(line.startswith(f"{worker.name}@") for line in lines), lines
    assert "args=(20, 22)" in lines[0], lines
    assert "result=42" in lines[2], lines
    assert dump.alive(), dump.log_tail()
