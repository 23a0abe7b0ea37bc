# mypy: allow-untyped-calls
"""Where a Celery worker's CPU goes, a task at a time, broker by broker: the worker's main
process, its pool (prefork processes, or the threads within the main process), and the broker's
server (Postgres backends, or RabbitMQ's Erlang VM). An explanation of ``bench_brokers.py``'s
celery rows (issue 26), not a benchmark row.

Each run publishes ``--tasks`` tasks of ``celery_bench_app`` to a fresh queue, starts a worker
as the celery scenario of ``bench_brokers.py`` starts it, and reads the CPU time (user +
system) of each process between the 2,000th and the ``--until``-th task done: microseconds a
task, and tasks a second over that span. The machine's other processes are not counted.

    python benchmarks/probe_worker_cpu.py [--broker lonnymq|rabbitmq] [--pool prefork|threads]
        [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kombu.connection import Connection

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from celery_bench_app import LINE_BYTES, TASK_NAME, make_app, worker_command  # noqa: E402
from probe_worker_stop import URLS  # noqa: E402

FROM = 2_000  # tasks done before the span measured
PARTS = ("main", "pool", "server")


def cpu_by_part(worker: int) -> dict[str, float]:
    """CPU seconds so far of the worker's main process, its pool processes (its children) and
    the servers' processes, from ``/proc`` (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(PARTS, 0.0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # (gone meanwhile)
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # from the state, field 3
        pid, parent = int(entry.name), int(fields[1])
        if pid == worker:
            part = "main"
        elif parent == worker:
            part = "pool"
        elif name.startswith("postgres") or "beam" in name:
            part = "server"
        else:
            continue
        out[part] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def one_run(
    url: str, pool: str, tasks: int, until: int, tmp: Path
) -> tuple[float, dict[str, float]]:
    """Tasks a second over the span, and CPU microseconds a task by part."""
    queue = f"cpu_{uuid.uuid4().hex[:8]}"
    done_file = tmp / f"{queue}.done"
    app = make_app(url, {}, queue)
    with app.producer_pool.acquire(block=True) as producer:
        for _ in range(tasks):
            app.send_task(TASK_NAME, args=[str(done_file), "x" * 200], producer=producer)
    app.close()
    concurrency = 4 if pool == "threads" else 2
    cmd, env = worker_command(url, {}, queue, pool, concurrency, "--prefetch-multiplier", "4")
    with (tmp / f"{queue}.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def done() -> int:
        return done_file.stat().st_size // LINE_BYTES if done_file.exists() else 0

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 300
        while done() < count:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the worker did not do {count} tasks; see {log.name}")
            time.sleep(0.01)

    try:
        wait_for(FROM)
        cpu0, t0, n0 = cpu_by_part(proc.pid), time.monotonic(), done()
        wait_for(until)
        cpu1, t1, n1 = cpu_by_part(proc.pid), time.monotonic(), done()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with Connection(url) as conn:
            conn.default_channel.queue_delete(queue)
    n = n1 - n0
    return n / (t1 - t0), {part: (cpu1[part] - cpu0[part]) / n * 1e6 for part in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=sorted(URLS), default="lonnymq")
    parser.add_argument("--url", help="broker URL (default: the machine's, by --broker)")
    parser.add_argument("--pool", choices=("prefork", "threads"), default="prefork")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--until", type=int, default=14_000, help="tasks done at the span's end")
    parser.add_argument("--tmp", default="/tmp/lonnymq_probe_worker_cpu")
    args = parser.parse_args()
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    url = args.url or URLS[args.broker]
    for i in range(args.runs):
        rate, cpu = one_run(url, args.pool, args.tasks, args.until, tmp)
        parts = ", ".join(f"{part} {us:.0f}" for part, us in cpu.items())
        print(
            f"{args.broker} {args.pool} run {i + 1}/{args.runs}: {rate:,.0f} tasks/s; "
            f"CPU us a task: {parts}, total {sum(cpu.values()):.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
