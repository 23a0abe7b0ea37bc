#!/usr/bin/env python3
# mypy: allow-untyped-calls
"""What idle Celery workers cost the database: statements per second, by statement.

Starts a throwaway Postgres with ``pg_stat_statements`` (from the machine's server binaries,
see ``lonnymq.testing``), ``--workers`` Celery workers on it with Celery's defaults (mingle,
gossip, heartbeat, remote control on; ``celery_wakeup_app``), lets them settle, resets the
statistics, waits ``--seconds``, and prints the calls per second of each statement the
workers ran (``pg_stat_statements``, top-level and nested) and the transactions committed per
second (``pg_stat_database``). Nothing is published meanwhile: what shows is the workers' own
traffic (Celery's heartbeat events every 2 s, received by every worker's gossip queue) and
lonnymq's fallback poll and housekeeping.

    python benchmarks/bench_idle.py --workers 1 --seconds 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from lonnymq.testing import TempPostgres

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--pool", default="prefork")
    p.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    server = TempPostgres(
        settings={
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "all",
            "track_functions": "pl",
        }
    )
    server.init().start()
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix="bench_idle_"))
    try:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("CREATE EXTENSION pg_stat_statements")
        env = {
            **os.environ,
            "BENCH_CELERY_BROKER": "lonnymq://" + dsn.split("://", 1)[1],
            "BENCH_CELERY_OPTIONS": json.dumps({"schema": "idle"}),
            "BENCH_CELERY_QUEUE": "celery",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        for i in range(args.workers):
            log = logs / f"w{i}.log"
            cmd = [sys.executable, "-m", "celery", "-A", "celery_wakeup_app", "worker"]
            cmd += ["--pool", args.pool, "-n", f"w{i}@%h", "-l", "INFO"]
            with log.open("wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while b" ready." not in log.read_bytes():
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {i} did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.1)
        time.sleep(15)  # settle: mingle done, every worker asleep
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_stat_statements_reset()")
            admin.execute("SELECT pg_stat_reset()")
            time.sleep(args.seconds)
            rows = admin.execute(
                "SELECT calls, toplevel, left(regexp_replace(query, '\\s+', ' ', 'g'), 110) "
                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                "WHERE datname = current_database()) AND query NOT ILIKE '%pg_stat%' "
                "ORDER BY calls DESC"
            ).fetchall()
            time.sleep(1.0)  # the backends' stats reach pg_stat_database within a second
            commits = admin.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
        top = [(int(calls), query) for calls, toplevel, query in rows if toplevel]
        nested = sum(int(calls) for calls, toplevel, _ in rows if not toplevel)
        per_s = {q: c / args.seconds for c, q in top}
        total = sum(per_s.values())
        print(
            f"{args.workers} idle worker(s) ({args.pool}), {args.seconds:.0f} s: "
            f"{total:.2f} client statements/s, {nested / args.seconds:.1f} nested/s, "
            f"{(commits[0] if commits else 0) / args.seconds:.2f} transactions/s"
        )
        for query, rate in per_s.items():
            if rate > 0:
                print(f"  {rate:7.3f}/s  {query}")
        if args.output:
            args.output.write_text(
                json.dumps(
                    {
                        "workers": args.workers,
                        "pool": args.pool,
                        "seconds": args.seconds,
                        "client_statements_per_s": total,
                        "nested_statements_per_s": nested / args.seconds,
                        "by_statement_per_s": per_s,
                    },
                    indent=2,
                )
                + "\n"
            )
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
