"""The Kombu, Celery, multi-tenant and framework examples run and print what they should."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(pg_dsn: str, name: str, timeout: float = 120) -> list[str]:
    pythonpath = [str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = os.environ | {"DATABASE_URL": pg_dsn, "PYTHONPATH": os.pathsep.join(pythonpath)}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_kombu_producer_consumer(pg_dsn: str) -> None:
    lines = run(pg_dsn, "kombu_producer_consumer.py")
    assert lines[0] == "published 4 events to the topic exchange 'events'"
    assert "orders: tenant-b order.created {'order': 2} -> rejected with requeue" in lines
    assert "orders: tenant-b order.created {'order': 2} (redelivered)" in lines
    assert "audit: tenant-b user.signed_up {'user': 7}" in lines
    assert not any(line.startswith("orders: tenant-b user.") for line in lines)  # not order.*
    assert lines[-1] == "consumed and acked 7 messages"


def test_celery_demo(pg_dsn: str) -> None:
    lines = run(pg_dsn, "celery_demo.py")
    assert re.fullmatch(r"[0-9a-f]{8} -> 5", lines[0])
    assert re.fullmatch(r"[0-9a-f]{8} -> 'hello, lonnymq'", lines[1])
    assert lines[2:] == ["countdown=1 task -> 42", "worker stopped (exit code 0)"]


def test_demo(pg_dsn: str) -> None:
    """The README's demo: a real worker, four tenants, the small ones finish first."""
    lines = run(pg_dsn, "demo.py", timeout=240)
    assert lines[0] == f"Postgres: {pg_dsn} (from $DATABASE_URL)"  # says where it works
    lines = lines[1:]
    assert lines[:5] == [
        "enqueued 400 tasks for tenant acme",
        "enqueued 100 tasks for tenant globex",
        "enqueued 20 tasks for tenant initech",
        "enqueued 5 tasks for tenant hooli",
        "queue 'celery': 525 messages in 4 channels; starting a worker",
    ]
    assert any(re.match(r"\[ *[0-9.]+s\] +[0-9]+/525 completed \| acme", line) for line in lines)
    assert re.match(r"\[ *[0-9.]+s\] 525/525 completed", lines[-6]), lines[-6]
    assert lines[-5] == "each tenant's last task completed at position (of 525):"
    last = {}
    for line in lines[-4:]:
        match = re.fullmatch(r"  (\w+) +(\d+) tasks: (\d+)", line)
        assert match, line
        last[match.group(1)] = int(match.group(3))
    # round-robin over 4 channels: hooli's 5 tasks are done within the first ~4 rounds, not
    # after the 520 tasks enqueued before them
    assert last["hooli"] <= 30, last
    assert last["initech"] <= 90, last
    assert last["globex"] <= 260, last
    assert last["acme"] == 525


def test_multi_tenant(pg_dsn: str) -> None:
    lines = run(pg_dsn, "multi_tenant.py")
    assert lines[0] == "enqueued 200 tasks for tenant big, then 5 for tenant small"
    assert lines[1] == "205 tasks completed"
    match = re.fullmatch(r"small tenant's tasks completed at positions \[(.*)\] of 205", lines[2])
    assert match, lines
    positions = [int(p) for p in match.group(1).split(", ")]
    # Round-robin with the big tenant at max_concurrency=1: the small tenant's 5 tasks finish
    # among the first few, not behind the 200-task backlog.
    assert len(positions) == 5 and max(positions) <= 20, positions


def test_django_enqueue(pg_dsn: str) -> None:
    assert run(pg_dsn, "django_enqueue.py") == [
        "after rollback: orders=[] messages=0",
        "after commit: orders=[2] messages=1",
    ]


def test_sqlalchemy_enqueue(pg_dsn: str) -> None:
    assert run(pg_dsn, "sqlalchemy_enqueue.py") == [
        "before rollback: orders=[] messages=0",
        "after rollback: orders=[] messages=0",
        "after commit: orders=[2] messages=1",
    ]
