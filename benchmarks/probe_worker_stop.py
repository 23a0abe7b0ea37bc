"""How long a Celery prefork worker takes to stop (SIGTERM: a warm shutdown) while it drains a
backlog, broker by broker: an open question of issue 25's work, not a benchmark row.

Each run publishes ``--tasks`` tasks of ``celery_bench_app`` to a fresh queue, starts a worker
as the celery scenario of ``bench_brokers.py`` starts it (prefork ``-c 2``, its flags), sends
SIGTERM to its process group ``--after`` seconds after 500 tasks are done, and times the
worker's exit. A stop that takes 30 s more than the others is billiard's pool process waiting
(``_ensure_messages_consumed``, 300 x 0.1 s) for the parent to read a result that it will
never read: see docs/benchmarks.md, "A prefork worker's slow stop".

    python benchmarks/probe_worker_stop.py [--broker lonnymq|rabbitmq] [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from celery_bench_app import LINE_BYTES, TASK_NAME, make_app, worker_command  # noqa: E402

URLS = {
    "lonnymq": "lonnymq://postgres@127.0.0.1:5432/test",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
}


def backlog_worker(
    url: str,
    tasks: int,
    tmp: Path,
    queue: str,
    pool: str,
    concurrency: int,
    *extra: str,
    pad: int = 100,
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``tasks`` tasks (each with ``pad`` bytes of padding) published to ``queue``, then a
    worker started on it as the celery scenario starts one (``extra`` added): the worker, the
    file of its tasks done (one line each) and its log."""
    done_file = tmp / f"{queue}.done"
    app = make_app(url, {}, queue)
    with app.producer_pool.acquire(block=True) as producer:
        for _ in range(tasks):
            app.send_task(TASK_NAME, args=[str(done_file), "x" * pad], producer=producer)
    app.close()
    cmd, env = worker_command(url, {}, queue, pool, concurrency, *extra)
    log = tmp / f"{queue}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, done_file, log


def one_stop(url: str, tasks: int, after: float, tmp: Path) -> tuple[float, int]:
    """Seconds from the SIGTERM to the worker's exit, and the tasks done by then."""
    queue = f"stop_{uuid.uuid4().hex[:8]}"
    proc, done_file, log = backlog_worker(url, tasks, tmp, queue, "prefork", 2)
    try:
        deadline = time.monotonic() + 120
        while not done_file.exists() or done_file.stat().st_size < 500 * LINE_BYTES:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the worker did not do 500 tasks; see {log.name}")
            time.sleep(0.01)
        time.sleep(after)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        return time.monotonic() - sent, done_file.stat().st_size // LINE_BYTES
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def worker_probe(doc: str, runs: int, name: str) -> argparse.ArgumentParser:
    """The options of a probe that starts workers (this one's and ``probe_worker_cpu.py``'s):
    the broker, the runs, the tasks published for each, the directory of their files."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--broker", choices=sorted(URLS), default="lonnymq")
    parser.add_argument("--url", help="broker URL (default: the machine's, by --broker)")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--tmp", type=Path, default=Path(f"/tmp/lonnymq_{name}"))
    return parser


def broker_url(args: argparse.Namespace) -> str:
    """The URL of the broker a worker probe measures (its files' directory made)."""
    args.tmp.mkdir(parents=True, exist_ok=True)
    return str(args.url or URLS[args.broker])


def main() -> None:
    parser = worker_probe(__doc__, 10, "probe_worker_stop")
    parser.add_argument("--after", type=float, default=6.0, help="seconds after 500 done")
    args = parser.parse_args()
    tmp, url = args.tmp, broker_url(args)
    took: list[float] = []
    for i in range(args.runs):
        seconds, done = one_stop(url, args.tasks, args.after, tmp)
        took.append(seconds)
        print(f"run {i + 1}/{args.runs}: exit {seconds:.1f} s after SIGTERM ({done} tasks done)")
    slow = [t for t in took if t > 10]
    print(
        f"{args.broker}: median {statistics.median(took):.1f} s, "
        f"{len(slow)} of {len(took)} over 10 s"
    )


if __name__ == "__main__":
    main()
