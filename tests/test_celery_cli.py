"""``celery -A proj lonnymq ...`` works on the app's broker: its broker_url and the schema of
its broker_transport_options, explicit --dsn / --schema still winning (a real ``celery``
command in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from tests.conftest import lonnymq_url

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]


def _celery(
    cwd: Path, *args: str, database_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    if database_url:
        env["DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "celery", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


@pytest.fixture
def proj(tmp_path: Path, pg_dsn: str, schema: str) -> Path:
    url = lonnymq_url(pg_dsn)
    (tmp_path / "proj.py").write_text(
        "from celery import Celery\n\n"
        f"app = Celery('proj', broker={url!r})\n"
        f"app.conf.broker_transport_options = {{'schema': {schema!r}, 'visibility_timeout': 60}}\n"
    )
    return tmp_path


@pytest.fixture
def other_schema(conn: Conn, schema: str) -> Iterator[str]:
    name = schema + "_flag"
    yield name
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_uses_the_apps_broker_url_and_schema(proj: Path, conn: Conn, schema: str) -> None:
    # DATABASE_URL names another database: the app's broker is what `-A proj` means
    out = _celery(
        proj, "-A", "proj", "lonnymq", "migrate", database_url="postgresql://nobody@127.0.0.1:1/x"
    )
    assert out.returncode == 0, out.stderr
    assert f"schema {schema!r}: applied" in out.stdout
    assert lonnymq.migrator.installed_version(conn, schema) == lonnymq.CURRENT_VERSION
    status = _celery(proj, "-A", "proj", "lonnymq", "status", "--json")
    assert status.returncode == 0, status.stderr


def test_explicit_flags_win(proj: Path, conn: Conn, schema: str, other_schema: str) -> None:
    out = _celery(proj, "-A", "proj", "lonnymq", "migrate", "--schema", other_schema)
    assert out.returncode == 0, out.stderr
    assert lonnymq.migrator.installed_version(conn, other_schema) == lonnymq.CURRENT_VERSION
    assert lonnymq.migrator.installed_version(conn, schema) is None
    bad = _celery(
        proj, "-A", "proj", "lonnymq", "migrate", "--dsn", "postgresql://nobody@127.0.0.1:1/x"
    )
    assert bad.returncode != 0 and "cannot connect" in bad.stderr
    assert lonnymq.migrator.installed_version(conn, schema) is None
