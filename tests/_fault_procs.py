"""Entry point of the consumer processes of tests/test_faults.py (multiprocessing 'spawn').

Kept apart from the test module so that a spawned child imports only psycopg and lonnymq
(not celery, kombu and the other test modules): eight children start in a second, not ten.
"""

from __future__ import annotations

import multiprocessing.queues
import multiprocessing.synchronize
import time
from typing import Any, NamedTuple

import psycopg

import lonnymq

FAST = "-c synchronous_commit=off"


class Delivery(NamedTuple):
    """One delivery of a message to a consumer. Times are ``time.time()`` (the clock Postgres's
    ``now()`` uses, so comparable with lock expiry): ``called`` just before the dequeue call,
    ``got`` just after it returned, ``acked`` just before the delete call. ``outcome`` is the
    delete's result value (``ok``, ``state_invalid``, ``not_found``)."""

    id: int
    attempts: int
    token: str
    process: int
    called: float
    got: float
    acked: float
    outcome: str


def consume_process(
    dsn: str,
    schema: str,
    queue_name: str,
    index: int,
    lock_ms: int,
    limit: int,
    stalls: list[int],
    stall_s: float,
    deadline_s: float,
    start: multiprocessing.synchronize.Barrier,
    out: multiprocessing.queues.Queue[Any],
) -> None:
    """Dequeue ``limit`` messages at a time (locked ``lock_ms``) and delete them in one call,
    until the queue is empty. At the dequeue calls numbered in ``stalls`` the consumer sleeps
    ``stall_s`` (longer than the lock) before deleting: those messages' locks expire, another
    consumer may take them, and this one's delete must then be refused."""
    try:
        deliveries: list[Delivery] = []
        errors: list[str] = []
        with psycopg.connect(dsn, autocommit=True, options=FAST) as conn:
            broker = lonnymq.Broker(schema)
            queue = broker.queue(queue_name)
            start.wait()
            deadline = time.monotonic() + deadline_s
            calls = 0
            while True:
                if time.monotonic() > deadline:
                    raise AssertionError(f"consumer {index} still running after {deadline_s} s")
                called = time.time()
                try:
                    result = queue.dequeue(conn, limit=limit, lock_ms=lock_ms)
                except lonnymq.DatabaseError as exc:  # rolled back as a whole: retry
                    errors.append(str(exc).splitlines()[0])
                    continue
                got = time.time()
                if not result.messages:
                    if queue.stats(conn, count_ready=False).total == 0:
                        break
                    wait_ms = 5 if result.retry_ms is None else min(result.retry_ms, 50)
                    time.sleep(max(wait_ms, 1) / 1000)
                    continue
                calls += 1
                if calls in stalls:
                    time.sleep(stall_s)
                acked = time.time()
                outcomes = broker.delete_many(conn, result.messages)
                for m in result.messages:
                    deliveries.append(
                        Delivery(
                            m.id,
                            m.attempts,
                            m.lock_token.hex,
                            index,
                            called,
                            got,
                            acked,
                            outcomes[m.id].value,
                        )
                    )
        out.put(("ok", (deliveries, errors)))
    except BaseException as exc:
        out.put(("error", repr(exc)))
