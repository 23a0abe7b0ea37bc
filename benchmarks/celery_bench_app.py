# mypy: allow-untyped-calls
"""Celery app of ``bench_brokers.py``'s Celery scenario.

The worker is started as ``celery -A celery_bench_app worker`` (with ``benchmarks/`` on
``PYTHONPATH``) and configured from the environment: ``BENCH_CELERY_BROKER`` (broker URL),
``BENCH_CELERY_OPTIONS`` (JSON ``broker_transport_options``) and ``BENCH_CELERY_QUEUE``.
The parent process builds its own app with :func:`make_app` to publish the tasks.

The only task, ``bench.noop``, does nothing but append one fixed-width line with the wall
clock time to the file named by its argument (one ``write`` on an ``O_APPEND`` file: atomic,
also across prefork children), so the parent sees completions by the file's size.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

import lonnymq  # noqa: F401  (registers the lonnymq:// transport)

LINE_BYTES = 21  # "%020.6f\n"
TASK_NAME = "bench.noop"


def noop(out_path: str, payload: str = "") -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"%020.6f\n" % time.time())
    finally:
        os.close(fd)


def worker_command(
    broker: str, options: dict[str, Any], queue: str, pool: str, concurrency: int, *extra: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a worker of this app, as the celery scenario of
    ``bench_brokers.py`` starts it (gossip, mingle and heartbeat off), ``extra`` added."""
    env = {
        **os.environ,
        "BENCH_CELERY_BROKER": broker,
        "BENCH_CELERY_OPTIONS": json.dumps(options),
        "BENCH_CELERY_QUEUE": queue,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    argv = [
        sys.executable, "-m", "celery", "-A", "celery_bench_app", "worker", "--pool", pool,
        "-c", str(concurrency), "-Q", queue, "-n", f"{queue}@%h", "-l", "WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat", *extra,
    ]  # fmt: skip
    return argv, env


def make_app(broker: str, options: dict[str, Any], queue: str) -> Celery:
    app = Celery("celery_bench_app", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_ignore_result=True,
        result_backend=None,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        task_serializer="json",
        accept_content=["json"],
    )
    app.task(name=TASK_NAME, ignore_result=True)(noop)
    return app


app = make_app(
    os.environ.get("BENCH_CELERY_BROKER", "memory://"),
    json.loads(os.environ.get("BENCH_CELERY_OPTIONS", "{}")),
    os.environ.get("BENCH_CELERY_QUEUE", "bench_celery"),
)
