"""A process that never imports lonnymq (a fresh interpreter): kombu has no entry point for
transports, so the ``lonnymq://`` alias exists only after ``import lonnymq``; the class path
(``transport=`` / Celery's ``broker_transport``) works without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import psycopg

import lonnymq
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_alias_needs_the_import_the_class_path_does_not(
    pg_dsn: str, schema: str, conn: Conn
) -> None:
    url = lonnymq_url(pg_dsn)
    out = _fresh(
        f"""
        import sys
        import kombu
        from celery import Celery

        try:
            kombu.Connection({url!r}).connect()
        except KeyError as exc:
            print("alias:", exc)
        assert "lonnymq" not in sys.modules

        with kombu.Connection(
            {url!r}, transport="lonnymq.transport:Transport",
            transport_options={{"schema": {schema!r}}},
        ) as c:
            c.SimpleQueue("plain").put({{"n": 1}})
        app = Celery("p", broker={url!r}, set_as_current=False)
        app.conf.broker_transport = "lonnymq.transport:Transport"
        app.conf.broker_transport_options = {{"schema": {schema!r}}}
        app.send_task("p.add", (1, 2))
        app.close()
        print("class path: ok")
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "alias: 'No such transport: lonnymq'",
        "class path: ok",
    ]
    broker = lonnymq.Broker(schema)
    assert {m.queue for m in broker.messages(conn)} == {"plain", "celery"}
