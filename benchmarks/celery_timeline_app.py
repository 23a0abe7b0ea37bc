# mypy: allow-untyped-calls
"""``celery_wakeup_app`` with marks in the worker's processes, for ``bench_timeline.py``.

Each mark is a line ``tag wall-clock pid`` appended (one ``write`` on an ``O_APPEND`` file) to
``$BENCH_TIMELINE_MARKS``: ``received`` when Celery's consumer is handed a task message (its
``on_task_received``); ``started`` when a task starts in its pool process, ``reply`` and
``replied`` around its result's publish to an ``rpc://`` reply queue; for lonnymq also
``notified`` (the LISTEN connection's notification read for a consumed queue), ``dequeue`` /
``dequeued`` (a dequeue that brought messages: start and end) and ``delivered`` (the
transport hands a message to kombu), ``sql`` / ``sql done`` around each statement (with
``$BENCH_TIMELINE_SQL`` set, also a mark ``Q<the statement's start>``). Benchmarks only:
it wraps Celery's and the transport's functions in the worker's processes (and
:func:`mark_transport` in a client's).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals
from celery.backends import rpc as celery_rpc
from celery.worker.consumer import consumer as celery_consumer
from celery_wakeup_app import app  # (the app the worker runs)


def mark(tag: str, at: float | None = None) -> None:
    marks = os.environ.get("BENCH_TIMELINE_MARKS", "")
    if not marks:
        return
    fd = os.open(marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        when = time.time() if at is None else at
        os.write(fd, b"%s %.6f %d\n" % (tag.encode(), when, os.getpid()))
    finally:
        os.close(fd)


_task_handler = celery_consumer.Consumer.create_task_handler


def create_task_handler(self: Any, *args: Any, **kwargs: Any) -> Any:
    handler = _task_handler(self, *args, **kwargs)

    def on_task_received(message: Any) -> Any:
        mark("received")
        return handler(message)

    return on_task_received


celery_consumer.Consumer.create_task_handler = create_task_handler


def task_prerun(**kwargs: Any) -> None:
    mark("started")


signals.task_prerun.connect(task_prerun, weak=False)


_store_result = celery_rpc.RPCBackend.store_result


def store_result(self: Any, *args: Any, **kwargs: Any) -> Any:
    mark("reply")
    try:
        return _store_result(self, *args, **kwargs)
    finally:
        mark("replied")


celery_rpc.RPCBackend.store_result = store_result


def mark_transport() -> None:
    """Marks in lonnymq's transport of this process (see the module's docstring)."""
    from lonnymq.transport import connection as lq_connection
    from lonnymq.transport import transport as lq_transport

    _notified = lq_connection.Waiter.notified
    _dequeue = lq_transport.Transport.ack_and_dequeue
    _deliver = lq_transport.Transport._deliver

    def notified(self: Any, queues: Any) -> Any:
        got = _notified(self, queues)
        if got:
            mark("notified")
        return got

    def ack_and_dequeue(self: Any, queues: Any, limit: int, **kwargs: Any) -> Any:
        started = time.time()
        result = _dequeue(self, queues, limit, **kwargs)
        if result.messages:
            mark("dequeue", at=started)
            mark("dequeued")
        return result

    def deliver(self: Any, message: Any, queue: str) -> None:
        mark("delivered")
        _deliver(self, message, queue)

    import psycopg

    _execute = psycopg.Cursor.execute

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark("sql")
        if os.environ.get("BENCH_TIMELINE_SQL"):
            mark("Q" + str(args[0])[:60].replace(" ", "_").replace("\n", "_"))
        try:
            return _execute(self, *args, **kwargs)
        finally:
            mark("sql done")

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    lq_connection.Waiter.notified = notified  # type: ignore[method-assign]
    lq_transport.Transport.ack_and_dequeue = ack_and_dequeue  # type: ignore[method-assign]
    lq_transport.Transport._deliver = deliver  # type: ignore[method-assign]


if app.conf.broker_url.startswith("lonnymq"):
    mark_transport()
