"""Shared helpers for the Celery apps tests create."""

from __future__ import annotations

import contextlib
from typing import Any


def close_app(app: Any) -> None:
    """Close a Celery app and the broker connections it holds. ``Celery.close()`` (5.7) only
    deregisters the app: its producer and connection pools, the connection of an ``rpc://``
    result consumer, and the Postgres sessions behind them would stay open until the garbage
    collector found them."""
    backend = app._local.__dict__.get("backend")
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and getattr(consumer, "_connection", None) is not None:
        with contextlib.suppress(Exception):
            consumer.stop()
        consumer._connection = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None and amqp._producer_pool is not None:
        amqp._producer_pool.force_close_all()
        amqp._producer_pool = None
    if app._pool is not None:
        app._pool.force_close_all()
        app._pool = None
    app.close()
