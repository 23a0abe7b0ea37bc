"""Automatic install on first use is safe when many processes start at once (a Celery worker,
Flower and a producer starting together)."""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from tests.conftest import lonnymq_url

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow


def _first_use(url: str, schema: str, barrier: Any) -> str:
    from kombu.connection import Connection

    connection = Connection(url, transport_options={"schema": schema})
    barrier.wait()
    try:
        connection.connect()
        return "ok"
    except Exception as exc:  # reported to the test
        return repr(exc)
    finally:
        connection.release()


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_first_use_through_the_transport(pg_dsn: str, round_: int) -> None:
    schema = f"lmq_race_{uuid.uuid4().hex[:10]}"
    url = lonnymq_url(pg_dsn)
    ctx = multiprocessing.get_context("spawn")
    try:
        with ctx.Manager() as manager, ctx.Pool(4) as pool:
            barrier = manager.Barrier(4)
            results = pool.starmap(_first_use, [(url, schema, barrier)] * 4)
        assert results == ["ok"] * 4
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert lonnymq.Broker(schema).check(conn) == lonnymq.CURRENT_VERSION
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
