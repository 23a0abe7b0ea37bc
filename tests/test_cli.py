"""The lonnymq command, run as a subprocess against a real Postgres."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg
import pytest

import lonnymq
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


def cli(*args: str, database_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if database_url:
        env["DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "lonnymq", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_migrate_print_sql_runs_nothing(pg_dsn: str, schema: str, conn: Conn) -> None:
    out = cli("migrate", "--dsn", pg_dsn, "--schema", schema, "--print-sql")
    assert out.returncode == 0, out.stderr
    assert f'CREATE TABLE "{schema}".message' in out.stdout
    assert lonnymq.migrator.installed_version(conn, schema) is None


def test_migrate_then_up_to_date(pg_dsn: str, schema: str, conn: Conn) -> None:
    first = cli("migrate", "--schema", schema, database_url=pg_dsn)
    assert first.returncode == 0, first.stderr
    assert "applied 0001_initial" in first.stdout
    assert lonnymq.migrator.installed_version(conn, schema) == lonnymq.CURRENT_VERSION
    again = cli("migrate", "--dsn", lonnymq_url(pg_dsn), "--schema", schema)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert "up to date" in cli("migrate", "--dsn", pg_dsn, "--schema", schema, "--print-sql").stdout


@pytest.mark.slow
def test_policy_and_stats(pg_dsn: str, schema: str, conn: Conn) -> None:
    lonnymq.install(conn, schema)
    queue = lonnymq.Broker(schema).queue("jobs")
    queue.channel("a").message.create(conn, b"x")
    base = ("--dsn", pg_dsn, "--schema", schema)
    out = cli("policy", "set", "jobs", "a", "--max-concurrency", "2", "--max-size", "10", *base)
    assert out.returncode == 0, out.stderr
    assert queue.channel("a").info(conn).own == lonnymq.Policy(2, 10)
    shown = json.loads(cli("policy", "show", "jobs", "a", "--json", *base).stdout)
    assert shown["own_policy"] == {"max_concurrency": 2, "max_size": 10}
    assert shown["size"] == 1
    assert cli("policy", "set", "jobs", "--max-concurrency", "5", *base).returncode == 0
    assert queue.policy.get(conn) == lonnymq.Policy(5, None)
    assert cli("policy", "clear", "jobs", "a", *base).returncode == 0
    assert queue.channel("a").info(conn).own is None
    stats = json.loads(cli("stats", "--json", *base).stdout)
    assert stats == [
        {"queue": "jobs", "total": 1, "ready": 1, "delayed": 0, "in_flight": 0, "channels": 1}
    ]
    table = cli("stats", *base).stdout
    assert table.splitlines()[0].split() == [
        "queue",
        "total",
        "ready",
        "delayed",
        "in_flight",
        "channels",
    ]


@pytest.mark.slow
def test_errors_are_clear(pg_dsn: str, schema: str) -> None:
    no_dsn = cli("migrate", "--schema", schema)
    assert no_dsn.returncode != 0 and "DATABASE_URL" in no_dsn.stderr
    missing = cli("stats", "--dsn", pg_dsn, "--schema", schema)
    assert missing.returncode == 1 and "lonnymq migrate" in missing.stderr
    bad_schema = cli("migrate", "--dsn", pg_dsn, "--schema", "Bad-Name")
    assert bad_schema.returncode == 1 and "invalid schema name" in bad_schema.stderr
    bad_limit = cli("policy", "set", "q", "--max-size", "-3", "--dsn", pg_dsn)
    assert bad_limit.returncode == 2 and "must be 0 or more" in bad_limit.stderr
    unreachable = cli("migrate", "--dsn", "postgresql://u:secret@127.0.0.1:1/db")
    assert unreachable.returncode != 0 and "cannot connect" in unreachable.stderr
    assert "secret" not in unreachable.stderr


def test_messages_list_names_the_celery_task(pg_dsn: str, schema: str, conn: Conn) -> None:
    from tests._web import celery_payload

    lonnymq.install(conn, schema)
    queue = lonnymq.Broker(schema).queue("jobs")
    queue.channel("c").message.create(conn, celery_payload("billing.charge", [42], {}, "t1"))
    queue.channel("c").message.create(conn, b"not celery")
    base = ("--dsn", pg_dsn, "--schema", schema)
    rows = json.loads(cli("messages", "list", "--json", *base).stdout)
    assert [(r["task"], r["args"]) for r in rows] == [("billing.charge", "(42,)"), (None, None)]
    table = cli("messages", "list", "--color", "never", *base).stdout
    assert "TASK" in table.splitlines()[0] and "billing.charge" in table
