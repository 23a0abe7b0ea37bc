# mypy: allow-untyped-calls
"""Celery app of ``bench_brokers.py``'s wake-up scenarios (``pickup``, ``roundtrip``).

Unlike ``celery_bench_app`` (throughput, with remote control and events off), this app keeps
Celery's defaults: its worker runs mingle, gossip, heartbeats and remote control, as users
run it. Configured from the environment: ``BENCH_CELERY_BROKER``, ``BENCH_CELERY_OPTIONS``
(JSON transport options), ``BENCH_CELERY_QUEUE`` and ``BENCH_CELERY_BACKEND`` (a result
backend URL, or empty for none).

``bench.stamp(path, sent)`` appends ``sent started`` (wall clock, one ``write`` on an
``O_APPEND`` file) to ``path``; ``bench.add(x, y)`` returns ``x + y``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import lonnymq  # noqa: F401  (registers the lonnymq:// transport)


def stamp(path: str, sent: float) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"%.6f %.6f\n" % (sent, time.time()))
    finally:
        os.close(fd)


def add(x: int, y: int) -> int:
    return x + y


def make_app(broker: str, options: dict[str, Any], queue: str, backend: str | None) -> Celery:
    app = Celery("celery_wakeup_app", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        worker_hijack_root_logger=False,
        task_serializer="json",
        accept_content=["json"],
    )
    app.task(name="bench.stamp", ignore_result=True)(stamp)
    app.task(name="bench.add")(add)
    return app


app = make_app(
    os.environ.get("BENCH_CELERY_BROKER", "memory://"),
    json.loads(os.environ.get("BENCH_CELERY_OPTIONS", "{}")),
    os.environ.get("BENCH_CELERY_QUEUE", "bench_wakeup"),
    os.environ.get("BENCH_CELERY_BACKEND") or None,
)
