"""lonnymq as a Celery broker: start a worker, send it tasks (one delayed with ``countdown``,
which waits in Postgres, not in the worker), print the results, stop the worker.

Run it with ``python examples/celery_demo.py``. It uses $DATABASE_URL when set, else starts a
throwaway Postgres of its own (see lonnymq.testing). The app is ``examples/celery_app.py``;
the worker is started as ``python -m celery -A celery_app worker --pool threads -c 2``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from lonnymq.testing import database

HERE = Path(__file__).resolve().parent


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "celery_app",
        "worker",
        "--pool",
        "threads",
        "-c",
        "2",
        "--loglevel",
        "INFO",
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (warm shutdown: finish running tasks), then SIGKILL if it takes too long."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def demo(dsn: str) -> None:
    schema = f"lonnymq_celery_{uuid.uuid4().hex[:8]}"
    # The app module reads these when imported, here and in the worker.
    os.environ["DATABASE_URL"] = dsn
    os.environ["LONNYMQ_EXAMPLE_SCHEMA"] = schema
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    }
    sys.path.insert(0, str(HERE))
    import celery_app

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "worker.log"
        worker = start_worker(env, log)
        try:
            delayed = celery_app.add.apply_async((20, 22), countdown=1)
            results = [celery_app.add.delay(2, 3), celery_app.greet.delay("lonnymq")]
            for result in results:
                print(f"{result.task_id[:8]} -> {result.get(timeout=30)!r}")
            value = delayed.get(timeout=30)
            print(f"countdown=1 task -> {value!r}")
        except BaseException:
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            stop_worker(worker)
            celery_app.app.close()
            with psycopg.connect(dsn, autocommit=True) as conn:
                query = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                conn.execute(query.format(sql.Identifier(schema)))
    print(f"worker stopped (exit code {worker.returncode})")


def main() -> None:
    with database() as dsn:
        demo(dsn)


if __name__ == "__main__":
    main()
