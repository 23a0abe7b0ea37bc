"""A Celery app on lonnymq, used by ``examples/celery_demo.py`` (which starts a worker with
``python -m celery -A celery_app worker ...`` and sends it tasks).

The broker is $DATABASE_URL with its scheme turned into ``lonnymq://``; the Postgres schema
is $LONNYMQ_EXAMPLE_SCHEMA (the demo sets a unique one, so that the worker and the demo share
it). Results travel back over the broker with Celery's ``rpc://`` backend. Run the demo, not
this module: ``python examples/celery_demo.py``.
"""

from __future__ import annotations

import os

from celery import Celery

import lonnymq  # noqa: F401  registers the lonnymq:// transport alias

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@localhost:5432/postgres")
SCHEMA = os.environ.get("LONNYMQ_EXAMPLE_SCHEMA", "lonnymq_celery_example")

app = Celery(
    "celery_app",
    broker="lonnymq://" + DATABASE_URL.split("://", 1)[1],
    backend="rpc://",
)
app.conf.update(
    broker_transport_options={"schema": SCHEMA},
    result_backend="rpc://",
    broker_connection_retry_on_startup=True,
)


@app.task(name="celery_app.add")  # type: ignore[untyped-decorator]
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="celery_app.greet")  # type: ignore[untyped-decorator]
def greet(name: str) -> str:
    return f"hello, {name}"
