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

import os
import signal
import sys
import time
import uuid
from pathlib import Path

from kombu.connection import Connection

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from celery_bench_app import LINE_BYTES  # noqa: E402
from probe_worker_stop import backlog_worker, broker_url, worker_probe  # noqa: E402

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
    concurrency = 4 if pool == "threads" else 2
    extra = ("--prefetch-multiplier", "4")
    proc, done_file, log = backlog_worker(
        url, tasks, tmp, queue, pool, concurrency, *extra, pad=200
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
    parser = worker_probe(__doc__, 3, "probe_worker_cpu")
    parser.add_argument("--pool", choices=("prefork", "threads"), default="prefork")
    parser.add_argument("--until", type=int, default=14_000, help="tasks done at the span's end")
    args = parser.parse_args()
    tmp, url = args.tmp, broker_url(args)
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
