#!/usr/bin/env python3
# mypy: allow-untyped-calls
"""Where a default Celery worker's idle pickup goes, step by step, beside RabbitMQ.

``bench_brokers.py --only pickup`` gives the time from ``send_task`` to the task's start.
This splits it: a worker of ``celery_timeline_app`` (Celery's defaults, marks in its main
process) is idle, tasks are sent ``--gap`` seconds apart, and for each the medians of, from
just before ``send_task``:

- ``sent``: ``send_task`` returned (the publish: for lonnymq its durable commit);
- lonnymq only: ``notified`` (the worker read the NOTIFY), ``dequeue`` / ``dequeued`` (the
  dequeue that brought the task: start, end), ``delivered`` (handed to kombu);
- ``received``: Celery's consumer has the task message;
- ``started``: the task runs (in the pool process or thread).

With ``--roundtrip``, the same for ``add.delay(1, 1).get()`` with the ``rpc://`` result
backend (as ``bench_brokers.py --only roundtrip``), on to the reply: ``reply`` / ``replied``
(the pool process publishes the result: start, end), for lonnymq the client's
``reply notified`` and ``reply delivered`` (its transport), ``reply in`` (Celery's result
consumer has it) and ``got`` (``get()`` returned).

    python benchmarks/bench_timeline.py --brokers lonnymq,rabbitmq --pool prefork --tasks 20
    python benchmarks/bench_timeline.py --brokers lonnymq,rabbitmq --roundtrip --tasks 30

The brokers are ``bench_brokers.py``'s (same URLs and options: RabbitMQ with publisher
confirms). Clocks: ``time.time`` across the processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_brokers import BrokerSpec, delete_queue, make_brokers  # noqa: E402
from bench_wakeup import default_worker, stamps, warm_up  # noqa: E402

STEPS = ("sent", "notified", "dequeue", "dequeued", "delivered", "received", "started")
#: a round trip's: the client's first statement, the pickup's steps, the reply's (in the pool
#: process, then the client)
ROUNDTRIP_STEPS = (
    "sql",
    "sql done",
    *STEPS,
    "reply",
    "reply sql",
    "reply sql done",
    "replied",
    "reply notified",
    "reply delivered",
    "reply in",
    "got",
)


def marks_pids(path: Path) -> list[tuple[str, float, int]]:
    """The marks of ``path``: (tag, wall clock, pid), in the order written."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().split("\n"):
        if line:
            tag, at, pid = line.rsplit(" ", 2)
            out.append((tag, float(at), int(pid)))
    return out


def marks_of(path: Path) -> list[tuple[str, float]]:
    return [(tag, at) for tag, at, _pid in marks_pids(path)]


def run(
    spec: BrokerSpec, pool: str, tasks: int, gap: float, idle: float, tmp: Path
) -> dict[str, float]:
    """Per step, the median ms from just before ``send_task``."""
    qname = f"bench_tl_{uuid.uuid4().hex[:8]}"
    marks_file, stamp_file = tmp / f"{qname}.marks", tmp / f"{qname}.stamps"
    pool_args = ["--pool", pool, "-c", "2" if pool == "prefork" else "4"]
    env = {"BENCH_TIMELINE_MARKS": str(marks_file)}
    sends: list[tuple[float, float]] = []
    try:
        with default_worker(
            spec, qname, pool_args, None, tmp / f"{qname}.log", "celery_timeline_app", env
        ) as app:
            warm_up(app, stamp_file)
            time.sleep(idle)
            with app.producer_pool.acquire(block=True) as producer:
                for _ in range(tasks):
                    sent = time.time()
                    app.send_task("bench.stamp", args=[str(stamp_file), sent], producer=producer)
                    sends.append((sent, time.time()))
                    time.sleep(gap)
            deadline = time.monotonic() + 30
            while len(stamps(stamp_file)) < tasks + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        delete_queue(spec, qname)
    started = {round(sent, 6): ran for sent, ran in stamps(stamp_file)[1:]}
    marks = marks_of(marks_file)
    steps: dict[str, list[float]] = {step: [] for step in STEPS}
    for sent, returned in sends:
        ran = started.get(round(sent, 6))
        if ran is None:
            continue
        steps["sent"].append(returned - sent)
        steps["started"].append(ran - sent)
        for tag in STEPS[1:-1]:
            # the first mark of its kind after the send and before the task ran
            at = [t for kind, t in marks if kind == tag and sent <= t <= ran]
            if at:
                steps[tag].append(min(at) - sent)
    return {step: statistics.median(v) * 1000 for step, v in steps.items() if v}


def run_roundtrip(
    spec: BrokerSpec, tasks: int, gap: float, idle: float, tmp: Path, show: int = 0
) -> dict[str, float]:
    """Per step of ``add.delay(i, 1).get()`` with the ``rpc://`` backend, the median ms from
    just before ``delay()``; the steps of the first ``show`` round trips are printed one by
    one (the first ones after the warm-up are the slowest)."""
    qname = f"bench_tl_{uuid.uuid4().hex[:8]}"
    marks_file = tmp / f"{qname}.marks"
    os.environ["BENCH_TIMELINE_MARKS"] = str(marks_file)  # (this process's marks: the client)
    import celery_timeline_app as timeline
    from celery.backends import asynchronous

    on_state_change = asynchronous.BaseResultConsumer.on_state_change

    def state_changed(self: Any, meta: Any, message: Any) -> Any:
        timeline.mark("reply in")
        return on_state_change(self, meta, message)

    asynchronous.BaseResultConsumer.on_state_change = state_changed
    if spec.name == "lonnymq":
        timeline.mark_transport()
    env = {"BENCH_TIMELINE_MARKS": str(marks_file)}
    pool_args = ["--pool", "prefork", "-c", "2"]
    trips: list[tuple[float, float, float]] = []  # (begin, delay() returned, get() returned)
    try:
        with default_worker(
            spec, qname, pool_args, "rpc://", tmp / f"{qname}.log", "celery_timeline_app", env
        ) as app:
            add = app.signature("bench.add")
            add.delay(0, 0).get(timeout=60)  # (warm-up: the client's consumer too)
            time.sleep(idle)
            for i in range(tasks):
                begin = time.time()
                result = add.delay(i, 1)
                sent = time.time()
                if result.get(timeout=30) != i + 1:
                    raise RuntimeError(f"add({i}, 1) failed")
                trips.append((begin, sent, time.time()))
                time.sleep(gap)
            with contextlib.suppress(Exception):
                app.backend.result_consumer.stop()
    finally:
        asynchronous.BaseResultConsumer.on_state_change = on_state_change
        del os.environ["BENCH_TIMELINE_MARKS"]
        delete_queue(spec, qname)
    client = os.getpid()
    marks = marks_pids(marks_file)
    pool = {pid for tag, _, pid in marks if tag == "started"}  # (the pool processes)
    steps: dict[str, list[float]] = {step: [] for step in ROUNDTRIP_STEPS}
    for number, (begin, sent, got) in enumerate(trips):
        steps["sent"].append(sent - begin)
        steps["got"].append(got - begin)
        shown = {"sent": sent - begin, "got": got - begin}
        for tag, at, pid in marks:
            if not begin <= at <= got:
                continue
            name = tag
            reply = pid == client and tag in ("notified", "delivered")
            if reply or (pid in pool and tag.startswith("sql")):
                name = f"reply {tag}"
            elif (pid == client) != (tag in ("reply in", "sql", "sql done")):
                continue
            if name in steps and len(steps[name]) < len(steps["got"]):
                steps[name].append(at - begin)  # (the first of its kind in this trip)
                shown[name] = at - begin
        if number < show:
            ordered = sorted(shown.items(), key=lambda item: item[1])
            print(
                f"{spec.name} trip {number}: "
                + ", ".join(f"{n} {v * 1000:.1f}" for n, v in ordered)
            )
    return {step: statistics.median(v) * 1000 for step, v in steps.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--brokers", default="lonnymq,rabbitmq")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads"])
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between tasks")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds idle before the first")
    parser.add_argument(
        "--roundtrip",
        action="store_true",
        help="add.delay(1, 1).get() with rpc://, on to the reply",
    )
    parser.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="with --roundtrip: print the steps of the first N round trips one by one",
    )
    args = parser.parse_args()
    specs, missing = make_brokers(args.brokers.split(","), uuid.uuid4().hex[:8])
    for name, why in missing.items():
        print(f"{name}: skipped ({why})")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_timeline_") as tmp:
        for spec in specs:
            if args.roundtrip:
                results[spec.name] = run_roundtrip(
                    spec, args.tasks, args.gap, args.idle, Path(tmp), args.show
                )
            else:
                results[spec.name] = run(
                    spec, args.pool, args.tasks, args.gap, args.idle, Path(tmp)
                )
    names = list(results)
    if args.roundtrip:
        print(
            f"add.delay(i, 1).get() with rpc://, prefork -c 2, {args.tasks} calls "
            f"{args.gap} s apart"
        )
        print("median ms from just before delay()")
    else:
        print(f"pool {args.pool}, {args.tasks} tasks {args.gap} s apart; median ms from send_task")
    print(f"{'step':<16}" + "".join(f"{n:>12}" for n in names))
    for step in ROUNDTRIP_STEPS if args.roundtrip else STEPS:
        row = [results[n].get(step) for n in names]
        print(f"{step:<16}" + "".join(f"{'':>12}" if v is None else f"{v:>12.2f}" for v in row))


if __name__ == "__main__":
    main()
