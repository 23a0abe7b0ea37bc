"""lonnymq tenants through Celery: a big tenant's backlog does not delay a small tenant.

A task's tenant comes from its ``tenant`` argument (``@app.task(lonnymq_channel="tenant")``
after ``lonnymq.celery.setup(app)``), so every tenant has its own channel of the ``celery``
queue, and channels are served round-robin. The big tenant is limited to one task in flight
by a policy declared in ``broker_transport_options={"policies": ...}``; with
``task_acks_late=True`` and ``worker_prefetch_multiplier=1`` that means one task running.

The big tenant enqueues 200 tasks, then the small tenant 5; one worker (2 threads) runs them
all. The script prints at which positions the small tenant's tasks completed: among the first
few, not after the 200.

Run it with ``python examples/multi_tenant.py``. It uses $DATABASE_URL when set, else starts a
throwaway Postgres of its own (see lonnymq.testing). This file is both the script and the
Celery app module of the worker it starts (``python -m celery -A multi_tenant worker ...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from celery import Celery
from psycopg import sql

import lonnymq  # registers the lonnymq:// transport alias
import lonnymq.celery
from lonnymq.testing import database

HERE = Path(__file__).resolve().parent
BIG, SMALL = 200, 5

app = Celery("multi_tenant")
app.conf.update(
    task_acks_late=True,  # a message counts against max_concurrency until its task ends
    worker_prefetch_multiplier=1,  # and the worker does not hoard messages it cannot run yet
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
)
lonnymq.celery.setup(app)
DSN = SCHEMA = ""


def configure(dsn: str, schema: str) -> None:
    """Point the app at ``dsn`` and ``schema``, with the big tenant limited to 1 in flight."""
    global DSN, SCHEMA
    DSN, SCHEMA = dsn, schema
    app.conf.broker_url = "lonnymq://" + dsn.split("://", 1)[1]
    app.conf.broker_transport_options = {
        "schema": schema,
        "policies": {"celery": {"channels": {"big": {"max_concurrency": 1}}}},
    }


# The worker imports this module: it gets its settings from the environment the script sets.
configure(
    os.environ.get("DATABASE_URL", "postgresql://postgres@localhost:5432/postgres"),
    os.environ.get("LONNYMQ_EXAMPLE_SCHEMA", "lonnymq_tenants_example"),
)


@app.task(name="multi_tenant.work", lonnymq_channel="tenant")  # type: ignore[untyped-decorator]
def work(tenant: str, n: int) -> None:
    """Record the completion (a row in ``<schema>.done``; its id is the completion order)."""
    time.sleep(0.01)  # the "work"
    with psycopg.connect(DSN, autocommit=True) as conn:
        query = sql.SQL("INSERT INTO {} (tenant, n) VALUES (%s, %s)")
        conn.execute(query.format(sql.Identifier(SCHEMA, "done")), (tenant, n))


def start_worker(log: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    }
    cmd = [sys.executable, "-m", "celery", "-A", "multi_tenant", "worker", "--pool", "threads"]
    cmd += ["-c", "2", "--loglevel", "INFO"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # warm shutdown
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def completed(conn: psycopg.Connection[tuple[str]]) -> list[str]:
    query = sql.SQL("SELECT tenant FROM {} ORDER BY id").format(sql.Identifier(SCHEMA, "done"))
    return [row[0] for row in conn.execute(query).fetchall()]


def demo(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        lonnymq.install(conn, schema=SCHEMA)  # the transport would install it on first use
        table = sql.Identifier(SCHEMA, "done")
        conn.execute(sql.SQL("CREATE TABLE {} (id serial, tenant text, n int)").format(table))
        try:
            for n in range(BIG):
                work.delay("big", n)
            for n in range(SMALL):
                work.delay("small", n)
            print(f"enqueued {BIG} tasks for tenant big, then {SMALL} for tenant small")
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "worker.log"
                worker = start_worker(log)
                try:
                    deadline = time.monotonic() + 120
                    while len(done := completed(conn)) < BIG + SMALL:
                        if time.monotonic() > deadline or worker.poll() is not None:
                            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                            raise SystemExit(f"only {len(done)} tasks completed")
                        time.sleep(0.2)
                finally:
                    stop_worker(worker)
            return done
        finally:
            app.close()
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(SCHEMA)))


def main() -> None:
    with database() as dsn:
        schema = f"lonnymq_tenants_{uuid.uuid4().hex[:8]}"
        os.environ["DATABASE_URL"] = dsn  # for the worker
        os.environ["LONNYMQ_EXAMPLE_SCHEMA"] = schema
        configure(dsn, schema)
        done = demo(dsn)
    positions = [i + 1 for i, tenant in enumerate(done) if tenant == "small"]
    print(f"{len(done)} tasks completed")
    print(f"small tenant's tasks completed at positions {positions} of {len(done)}")


if __name__ == "__main__":
    main()
