"""The lonnymq demo: a real Celery worker runs tasks for several tenants, fairly.

Four tenants enqueue tasks, the biggest first: ``acme`` 400, ``globex`` 100, ``initech`` 20 and
``hooli`` 5. On a plain FIFO broker hooli's 5 tasks would wait behind the 520 before them;
here every tenant has its own channel of the ``celery`` queue and channels are served
round-robin, so the small tenants finish first while acme's backlog drains. acme is also
limited to 2 running tasks at a time by a channel policy declared in the Celery configuration.

Run it with ``python examples/demo.py``. It uses $DATABASE_URL when set, else starts a
throwaway Postgres of its own (see lonnymq.testing). It prints progress while the worker runs
and, at the end, when each tenant's last task completed. This file is both the script and the
Celery app module of the worker it starts (``python -m celery -A demo worker ...``).
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
from lonnymq.testing import NoServerBinaries, database, where

HERE = Path(__file__).resolve().parent
TENANTS = {"acme": 400, "globex": 100, "initech": 20, "hooli": 5}

# The worker imports this module: it gets its settings from the environment the script sets.
DSN = os.environ.get("DATABASE_URL", "postgresql://postgres@localhost:5432/postgres")
SCHEMA = os.environ.get("LONNYMQ_EXAMPLE_SCHEMA", "lonnymq_demo")
BROKER_URL = "lonnymq://" + DSN.split("://", 1)[1]  # lonnymq://user:password@host:5432/db

# --8<-- [start:celery]
app = Celery("demo", broker=BROKER_URL)
app.conf.update(
    broker_transport_options={
        "schema": SCHEMA,  # the Postgres schema holding the queues (default "lonnymq")
        # tenant acme may run at most 2 tasks at a time; the others are not limited
        "policies": {"celery": {"channels": {"acme": {"max_concurrency": 2}}}},
    },
    task_acks_late=True,  # a task counts against its tenant's limit until it ends...
    worker_prefetch_multiplier=1,  # ...and a worker takes a task only when it can run it
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
)
lonnymq.celery.setup(app)  # enables the lonnymq_channel task option


@app.task(name="demo.work", lonnymq_channel="tenant")  # type: ignore[untyped-decorator]
def work(tenant: str, n: int) -> None:
    """Each tenant's calls go to a channel of their own, served round-robin."""
    time.sleep(0.02)  # the "work"
    record_completion(tenant, n)


# --8<-- [end:celery]


def configure(dsn: str, schema: str) -> None:
    """Point the app at ``dsn`` and ``schema`` (the script's throwaway database)."""
    global DSN, SCHEMA
    DSN, SCHEMA = dsn, schema
    app.conf.broker_url = "lonnymq://" + dsn.split("://", 1)[1]
    options = dict(app.conf.broker_transport_options)
    app.conf.broker_transport_options = options | {"schema": schema}


def record_completion(tenant: str, n: int) -> None:
    """A row in ``<schema>.done``, whose id is the completion order."""
    with psycopg.connect(DSN, autocommit=True) as conn:
        query = sql.SQL("INSERT INTO {} (tenant, n) VALUES (%s, %s)")
        conn.execute(query.format(sql.Identifier(SCHEMA, "done")), (tenant, n))


def start_worker(log: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    }
    cmd = [sys.executable, "-m", "celery", "-A", "demo", "worker", "--pool", "threads"]
    cmd += ["-c", "4", "--loglevel", "INFO"]
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


def progress(done: list[str], elapsed: float) -> str:
    parts = []
    for tenant, total in TENANTS.items():
        count = done.count(tenant)
        parts.append(f"{tenant} {count:>3}/{total}{' done' if count == total else '     '}")
    return f"[{elapsed:5.1f}s] {len(done):>3}/{sum(TENANTS.values())} completed | " + "  ".join(
        parts
    )


def run(conn: psycopg.Connection[tuple[str]]) -> list[str]:
    with app.producer_or_acquire() as producer:
        for tenant, count in TENANTS.items():
            for n in range(count):
                work.apply_async((tenant, n), producer=producer)
            print(f"enqueued {count} tasks for tenant {tenant}")
    stats = lonnymq.Queue("celery", schema=SCHEMA).stats(conn)
    print(f"queue 'celery': {stats.total} messages in {stats.channels} channels; starting a worker")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "worker.log"
        worker = start_worker(log)
        started = time.monotonic()
        try:
            deadline = started + 180
            while len(done := completed(conn)) < sum(TENANTS.values()):
                if time.monotonic() > deadline or worker.poll() is not None:
                    print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                    raise SystemExit(f"only {len(done)} tasks completed")
                print(progress(done, time.monotonic() - started), flush=True)
                time.sleep(0.5)
            print(progress(done, time.monotonic() - started))
        finally:
            stop_worker(worker)
    return done


def main() -> None:
    with database() as dsn:
        print(where(dsn), flush=True)
        schema = f"lonnymq_demo_{uuid.uuid4().hex[:8]}"
        os.environ["DATABASE_URL"] = dsn  # for the worker
        os.environ["LONNYMQ_EXAMPLE_SCHEMA"] = schema
        configure(dsn, schema)
        with psycopg.connect(dsn, autocommit=True) as conn:
            lonnymq.install(conn, schema=schema)  # the worker would install it on first use
            table = sql.Identifier(schema, "done")
            conn.execute(sql.SQL("CREATE TABLE {} (id serial, tenant text, n int)").format(table))
            try:
                done = run(conn)
            finally:
                app.close()
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    print("each tenant's last task completed at position (of 525):")
    for tenant, total in TENANTS.items():
        last = max(i + 1 for i, t in enumerate(done) if t == tenant)
        print(f"  {tenant:<8} {total:>3} tasks: {last}")


if __name__ == "__main__":
    try:
        main()
    except NoServerBinaries as exc:
        raise SystemExit(f"demo: {exc}") from None
