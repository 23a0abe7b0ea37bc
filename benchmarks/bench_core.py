#!/usr/bin/env python3
"""Core throughput benchmark of lonnymq: create, and dequeue + delete (ack).

Run ``python benchmarks/bench_core.py --help``; see ``benchmarks/README.md``.

Everything runs in a fresh schema (``bench_core_<random>``) that is created at the start and
dropped at the end. Every call is its own transaction on an autocommit connection, so every
create and every ack is a durable commit (``--async-commit`` adds drain runs with
``synchronous_commit = off`` on the consumer connections).

Workers are separate processes (``spawn``), each with its own connection. They connect and warm
up their session (plpgsql compiles functions per session) on a queue that is not measured, then
start together on a barrier. Throughput is messages / (last worker's end - first worker's
start); the clock is ``time.perf_counter``, system-wide (CLOCK_MONOTONIC) on Linux and macOS.

A run stops after ``--max-run-seconds``: its throughput is then measured on the messages
handled so far and it is reported as partial (``*``), so a pathological scenario cannot blow
the time budget.

An *empty dequeue* is a dequeue call that returned no message although, once it had returned,
some messages had not been handed out to any consumer yet (a counter shared by the consumers of
the run is below the number of messages). It is a consumer being told "nothing to do" while work
waits. A consumer stops as soon as every message has been handed out, so empty polls while the
last messages are being acked are not counted (they are reported apart, as tail polls). The
counter is bumped just after a dequeue returns, so a call racing with another consumer's last
dequeue can be counted: at most a few per run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from multiprocessing.context import SpawnContext
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import lonnymq

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
QUEUE = "bench"
WARMUP_QUEUE = "bench_warmup"
PAYLOAD_BYTES = 300
LOCK_MS = 120_000
RESULTS_PATH = Path(__file__).resolve().parent / "results" / "core.json"


# --------------------------------------------------------------------------------------------
# Scenarios and results


@dataclass(frozen=True)
class Scenario:
    kind: str  # "create" or "drain" (dequeue + delete)
    workers: int  # producer or consumer processes
    channels: int  # messages are spread round-robin over this many channels
    messages: int  # messages created, or pre-filled and drained, per run
    limit: int = 0  # dequeue limit (drain only)
    async_commit: bool = False  # synchronous_commit = off on the worker connections
    ack_many: bool = False  # ack each dequeued batch with one Broker.delete_many call

    @property
    def label(self) -> str:
        role = "producer" if self.kind == "create" else "consumer"
        text = f"{self.kind:<6} {self.workers} {role}{'s' if self.workers > 1 else ' '}"
        text += f" {self.channels:>5} ch"
        if self.kind == "drain":
            text += f" limit={self.limit:<3}"
        if self.ack_many:
            text += " ack_many"
        if self.async_commit:
            text += " async"
        return text


@dataclass(frozen=True)
class WorkerTask:
    dsn: str
    schema: str
    scenario: Scenario
    index: int
    max_seconds: float
    profile: bool


@dataclass
class WorkerResult:
    index: int
    start: float = 0.0
    end: float = 0.0
    #: messages created, or dequeued and acked
    messages: int = 0
    #: create calls, or dequeue calls (empty ones included)
    calls: int = 0
    #: empty dequeues while messages were still waiting, by the retry_ms they returned
    empty_retry_none: int = 0
    empty_retry_zero: int = 0
    empty_retry_positive: int = 0
    #: empty dequeues once every message had been handed out (not a defect)
    tail_polls: int = 0
    call_latencies: list[float] = field(default_factory=list)
    ack_latencies: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def empty_dequeues(self) -> int:
        return self.empty_retry_none + self.empty_retry_zero + self.empty_retry_positive


@dataclass
class RunResult:
    elapsed_s: float
    messages: int
    #: the run hit --max-run-seconds before handling every message
    partial: bool
    msgs_per_s: float
    calls: int
    empty_dequeues: int
    #: how the empty dequeues were answered: retry_ms None ("nothing pending"), 0, > 0
    empty_retry_ms: dict[str, int]
    tail_polls: int
    call_ms_p50: float
    call_ms_p99: float
    ack_ms_p50: float | None
    ack_ms_p99: float | None
    #: 1-minute load average of the machine before and after the run (other work on it
    #: skews the figures)
    load_before: float
    load_after: float
    #: server time per message in each lonnymq function, ms (only with --profile)
    functions: dict[str, dict[str, float]] | None = None


# --------------------------------------------------------------------------------------------
# Workers (run in child processes)


def _connect(task: WorkerTask) -> psycopg.Connection[Any]:
    conn = psycopg.connect(task.dsn, autocommit=True)
    conn.execute("SET application_name = 'lonnymq-bench'")
    if task.scenario.async_commit:
        conn.execute("SET synchronous_commit = off")
    if task.profile:
        conn.execute("SET track_functions = 'pl'")
    return conn


def _channel_name(i: int, channels: int) -> str:
    return f"ch{i % channels:05d}"


def _warm_up(conn: psycopg.Connection[Any], broker: lonnymq.Broker, task: WorkerTask) -> None:
    """Compile the functions this session will call, on a queue that is not measured."""
    warm = broker.queue(WARMUP_QUEUE)
    if task.scenario.kind == "create":
        warm.channel(f"w{task.index}").message.create(conn, b"warm-up")
        return
    for _ in range(50):
        res = warm.dequeue(conn, limit=task.scenario.limit, lock_ms=LOCK_MS)
        for message in res.messages:
            message.delete(conn)
        if res.messages:
            return


def _produce(
    conn: psycopg.Connection[Any], queue: lonnymq.Queue, task: WorkerTask, out: WorkerResult
) -> None:
    sc = task.scenario
    payload = os.urandom(PAYLOAD_BYTES)
    channels = [queue.channel(_channel_name(i, sc.channels)) for i in range(sc.channels)]
    latencies = out.call_latencies
    clock = time.perf_counter
    out.start = clock()
    deadline = out.start + task.max_seconds
    for i in range(task.index, sc.messages, sc.workers):
        if clock() > deadline:
            break
        t0 = clock()
        channels[i % sc.channels].message.create(conn, payload)
        latencies.append(clock() - t0)
        out.messages += 1
    out.end = clock()
    out.calls = out.messages


def _consume(
    conn: psycopg.Connection[Any],
    queue: lonnymq.Queue,
    task: WorkerTask,
    out: WorkerResult,
    claimed: Synchronized[int],
) -> None:
    sc = task.scenario
    total = sc.messages
    clock = time.perf_counter
    calls = out.call_latencies
    acks = out.ack_latencies
    out.start = clock()
    deadline = out.start + task.max_seconds
    while claimed.value < total and clock() <= deadline:
        t0 = clock()
        res = queue.dequeue(conn, limit=sc.limit, lock_ms=LOCK_MS)
        calls.append(clock() - t0)
        out.calls += 1
        if not res.messages:
            # Retry at once whatever retry_ms says: 0 asks for that anyway, and None (nothing
            # pending: sleep until a NOTIFY) would stall the run if it were wrong.
            if claimed.value >= total:
                out.tail_polls += 1
            elif res.retry_ms is None:
                out.empty_retry_none += 1
            elif res.retry_ms == 0:
                out.empty_retry_zero += 1
            else:
                out.empty_retry_positive += 1
            continue
        with claimed.get_lock():
            claimed.value += len(res.messages)
        if sc.ack_many:
            t1 = clock()
            outcomes = queue.broker.delete_many(conn, res.messages)
            acks.append((clock() - t1) / len(res.messages))
            if len(outcomes) != len(res.messages) or not all(outcomes.values()):
                raise RuntimeError(f"ack of a batch failed: {outcomes}")
        else:
            for message in res.messages:
                t1 = clock()
                if not message.delete(conn):
                    raise RuntimeError(f"ack of message {message.id} failed")
                acks.append(clock() - t1)
        out.messages += len(res.messages)
    out.end = clock()


def worker_main(
    task: WorkerTask,
    barrier: Barrier,
    claimed: Synchronized[int],
    results: multiprocessing.Queue[WorkerResult],
) -> None:
    out = WorkerResult(task.index)
    try:
        broker = lonnymq.Broker(schema=task.schema)
        queue = broker.queue(QUEUE)
        with _connect(task) as conn:
            _warm_up(conn, broker, task)
            barrier.wait(timeout=120)
            if task.scenario.kind == "create":
                _produce(conn, queue, task, out)
            else:
                _consume(conn, queue, task, out, claimed)
    except Exception:
        out.error = traceback.format_exc()
        barrier.abort()
    results.put(out)


# --------------------------------------------------------------------------------------------
# Orchestration (parent process)


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dsn: str = args.dsn
        self.repeat: int = args.repeat
        self.profile: bool = args.profile
        self.max_seconds: float = args.max_run_seconds
        self.schema = f"bench_core_{secrets.token_hex(4)}"
        self.broker = lonnymq.Broker(schema=self.schema)
        self.queue = self.broker.queue(QUEUE)
        self.admin = psycopg.connect(self.dsn, autocommit=True)
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")

    # -- schema and data ---------------------------------------------------------------------

    def install(self) -> None:
        self.broker.install(self.admin)

    def drop(self) -> None:
        self.admin.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
        )
        self.admin.close()

    def _vacuum(self) -> None:
        for table in ("message", "channel", "queue"):
            self.admin.execute(
                sql.SQL("VACUUM (ANALYZE) {}.{}").format(
                    sql.Identifier(self.schema), sql.Identifier(table)
                )
            )

    def _reset(self) -> None:
        """Empty the measured queue and clean the tables, so that each run starts alike."""
        self.queue.delete(self.admin)
        self.broker.queue(WARMUP_QUEUE).delete(self.admin)
        self._vacuum()

    def _prefill(self, sc: Scenario) -> None:
        payload = os.urandom(PAYLOAD_BYTES)
        step = 1000
        for start in range(0, sc.messages, step):
            batch = self.queue.batch()
            for i in range(start, min(sc.messages, start + step)):
                batch.channel(_channel_name(i, sc.channels)).message(payload)
            batch.execute(self.admin)
        warm = self.broker.queue(WARMUP_QUEUE).batch()
        for i in range(sc.workers * 3):
            warm.channel(f"w{i}").message(b"warm-up")
        warm.execute(self.admin)
        self._vacuum()

    def _function_times(self) -> dict[str, tuple[int, float, float]]:
        self.admin.execute("SELECT pg_stat_clear_snapshot()")
        rows = self.admin.execute(
            "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
            "WHERE schemaname = %s",
            (self.schema,),
        ).fetchall()
        return {str(r[0]): (int(r[1]), float(r[2]), float(r[3])) for r in rows}

    def _function_delta(
        self, before: dict[str, tuple[int, float, float]], messages: int
    ) -> dict[str, dict[str, float]]:
        # Backends flush their function statistics as they exit, just after the workers.
        time.sleep(1.0)
        delta: dict[str, dict[str, float]] = {}
        for name, (calls, total, self_time) in self._function_times().items():
            c0, t0, s0 = before.get(name, (0, 0.0, 0.0))
            if calls > c0 and messages:
                delta[name] = {
                    "calls_per_msg": (calls - c0) / messages,
                    "total_ms_per_msg": (total - t0) / messages,
                    "self_ms_per_msg": (self_time - s0) / messages,
                }
        return delta

    # -- one run -----------------------------------------------------------------------------

    def run_once(self, sc: Scenario) -> RunResult:
        self._reset()
        if sc.kind == "drain":
            self._prefill(sc)
        before = self._function_times() if self.profile else {}
        load_before = os.getloadavg()[0]
        barrier = self.ctx.Barrier(sc.workers)
        claimed = self.ctx.Value("q", 0)
        results: multiprocessing.Queue[WorkerResult] = self.ctx.Queue()
        procs = [
            self.ctx.Process(
                target=worker_main,
                args=(
                    WorkerTask(self.dsn, self.schema, sc, i, self.max_seconds, self.profile),
                    barrier,
                    claimed,
                    results,
                ),
            )
            for i in range(sc.workers)
        ]
        for p in procs:
            p.start()
        outs = [results.get(timeout=self.max_seconds + 300) for _ in procs]
        for p in procs:
            p.join()
        load_after = os.getloadavg()[0]
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{sc.label}: a worker failed:\n{errors[0]}")
        elapsed = max(o.end for o in outs) - min(o.start for o in outs)
        messages = sum(o.messages for o in outs)
        self._verify(sc, messages)
        call_lat = [x for o in outs for x in o.call_latencies]
        ack_lat = [x for o in outs for x in o.ack_latencies]
        result = RunResult(
            elapsed_s=elapsed,
            messages=messages,
            partial=messages < sc.messages,
            msgs_per_s=messages / elapsed if elapsed > 0 else 0.0,
            calls=sum(o.calls for o in outs),
            empty_dequeues=sum(o.empty_dequeues for o in outs),
            empty_retry_ms={
                "none": sum(o.empty_retry_none for o in outs),
                "zero": sum(o.empty_retry_zero for o in outs),
                "positive": sum(o.empty_retry_positive for o in outs),
            },
            tail_polls=sum(o.tail_polls for o in outs),
            call_ms_p50=_percentile(call_lat, 0.5) * 1000,
            call_ms_p99=_percentile(call_lat, 0.99) * 1000,
            ack_ms_p50=_percentile(ack_lat, 0.5) * 1000 if ack_lat else None,
            ack_ms_p99=_percentile(ack_lat, 0.99) * 1000 if ack_lat else None,
            load_before=load_before,
            load_after=load_after,
        )
        if self.profile:
            result.functions = self._function_delta(before, messages)
        return result

    def _verify(self, sc: Scenario, handled: int) -> None:
        """Every message handled exactly once: the counters agree with the table."""
        stats = self.queue.stats(self.admin, count_ready=True)
        left = handled if sc.kind == "create" else sc.messages - handled
        counted = (stats.ready or 0) + (stats.delayed or 0)
        if stats.total != left or stats.in_flight != 0 or counted != left:
            raise RuntimeError(
                f"{sc.label}: {handled} messages handled, expected {left} left; found {stats}"
            )

    def run(self, sc: Scenario) -> dict[str, Any]:
        runs: list[RunResult] = []
        for r in range(self.repeat):
            res = self.run_once(sc)
            runs.append(res)
            note = f"  empty dequeues {res.empty_dequeues}" if sc.kind == "drain" else ""
            if res.partial:
                note += f"  (stopped after {res.messages}/{sc.messages} messages)"
            note += f"  [load {res.load_before:.1f}]"
            print(
                f"  {sc.label:<52} run {r + 1}/{self.repeat}: "
                f"{res.msgs_per_s:7.0f} msg/s in {res.elapsed_s:5.2f}s{note}",
                flush=True,
            )
        rates = [r.msgs_per_s for r in runs]
        empties = [r.empty_dequeues for r in runs]
        return {
            "scenario": asdict(sc),
            "label": sc.label,
            "summary": {
                "msgs_per_s_median": statistics.median(rates),
                "msgs_per_s_min": min(rates),
                "msgs_per_s_max": max(rates),
                "partial_runs": sum(r.partial for r in runs),
                "messages_median": statistics.median(r.messages for r in runs),
                "empty_dequeues_median": statistics.median(empties),
                "empty_dequeues_max": max(empties),
                "empty_dequeues_per_message": sum(empties) / max(1, sum(r.messages for r in runs)),
                "calls_median": statistics.median(r.calls for r in runs),
                "call_ms_p50_median": statistics.median(r.call_ms_p50 for r in runs),
                "call_ms_p99_median": statistics.median(r.call_ms_p99 for r in runs),
                "ack_ms_p50_median": _median_or_none([r.ack_ms_p50 for r in runs]),
                "load_median": statistics.median(r.load_before for r in runs),
            },
            "runs": [asdict(r) for r in runs],
        }

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        row = self.admin.execute("SELECT version()").fetchone()
        info["version"] = row[0] if row else None
        for name in (
            "synchronous_commit",
            "fsync",
            "wal_sync_method",
            "shared_buffers",
            "commit_delay",
            "plan_cache_mode",
            "autovacuum",
        ):
            row = self.admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            info[name] = row[0] if row else None
        return info


def build_scenarios(args: argparse.Namespace) -> list[Scenario]:
    workers = sorted({1, args.workers})
    channel_counts = sorted({1, args.channels})
    out: list[Scenario] = []
    if args.only in (None, "create"):
        for ch in channel_counts:
            for w in workers:
                out.append(Scenario("create", w, ch, args.create_messages))
    if args.only in (None, "drain"):
        for async_commit in [False, True] if args.async_commit else [False]:
            for limit in sorted({1, args.batch_limit}):
                for ch in channel_counts:
                    for w in workers:
                        out.append(
                            Scenario("drain", w, ch, args.drain_messages, limit, async_commit)
                        )
                        if args.ack_many and limit > 1:
                            out.append(
                                Scenario(
                                    "drain", w, ch, args.drain_messages, limit, async_commit, True
                                )
                            )
    if args.match:
        pattern = re.compile(args.match)
        out = [sc for sc in out if pattern.search(sc.label)]
    return out


def provenance() -> dict[str, Any]:
    """Which code was measured: the lonnymq schema SQL's digest and the git state, if any."""
    schema_sql = lonnymq.migrator.fresh_install_sql("lonnymq").encode()
    info: dict[str, Any] = {"schema_sql_sha256": hashlib.sha256(schema_sql).hexdigest()}
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return info
    info["git_commit"] = commit
    info["git_src_changes"] = [line for line in dirty if line]
    return info


# --------------------------------------------------------------------------------------------
# Report


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-".rjust(int(spec.split(".")[0]))
    return format(value, spec)


def print_table(entries: list[dict[str, Any]]) -> None:
    header = (
        f"{'scenario':<52} {'msgs':>6} {'median/s':>8} {'min/s':>6} {'max/s':>6} "
        f"{'empty deq':>9} {'calls':>6} {'call p50':>8} {'call p99':>8} {'ack p50':>7} {'load':>4}"
    )
    print()
    print(header)
    print("-" * len(header))
    for e in entries:
        s = e["summary"]
        sc = e["scenario"]
        msgs = f"{s['messages_median']:.0f}{'*' if s['partial_runs'] else ''}"
        empty = (
            f"{s['empty_dequeues_median']:g}/{s['empty_dequeues_max']}"
            if sc["kind"] == "drain"
            else "-"
        )
        print(
            f"{e['label']:<52} {msgs:>6} {s['msgs_per_s_median']:>8.0f} "
            f"{s['msgs_per_s_min']:>6.0f} {s['msgs_per_s_max']:>6.0f} {empty:>9} "
            f"{s['calls_median']:>6.0f} {_fmt(s['call_ms_p50_median'], '8.2f')} "
            f"{_fmt(s['call_ms_p99_median'], '8.2f')} {_fmt(s['ack_ms_p50_median'], '7.2f')} "
            f"{s['load_median']:>4.1f}"
        )
    print(
        "\nmsgs/s: median, min and max over the runs. msgs: messages handled per run (median;\n"
        "* = some runs hit --max-run-seconds and were measured on what they handled).\n"
        "empty deq: dequeue calls that returned nothing while messages were still waiting\n"
        "(median/max per run). calls: create or dequeue calls per run. call p50/p99: latency of\n"
        "one create or dequeue call, ack p50: of one delete (ack_many: of a delete_many call\n"
        "divided by its batch size), in ms (medians over the runs). load: the machine's 1-minute\n"
        "load average before the runs (median); above the CPU count, other work skews them."
    )
    for e in entries:
        funcs: dict[str, dict[str, float]] | None = e["runs"][-1].get("functions")
        if not funcs:
            continue
        print(f"\nserver time per message, last run of {e['label'].strip()}:")
        for name, f in sorted(funcs.items(), key=lambda kv: -kv[1]["total_ms_per_msg"]):
            print(
                f"  {name:<22} calls {f['calls_per_msg']:6.2f}  total "
                f"{f['total_ms_per_msg']:7.3f} ms  self {f['self_ms_per_msg']:7.3f} ms"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_BENCH_DSN", DEFAULT_DSN),
        help="Postgres DSN (default: $LONNYMQ_BENCH_DSN, else %(default)s)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per scenario (default 3)")
    p.add_argument("--workers", type=int, default=4, help="processes of the multi-worker runs")
    p.add_argument("--channels", type=int, default=1000, help="channels of the many-channel runs")
    p.add_argument("--create-messages", type=int, default=2000, help="messages per create run")
    p.add_argument(
        "--drain-messages", type=int, default=5000, help="messages pre-filled per drain run"
    )
    p.add_argument("--batch-limit", type=int, default=100, help="dequeue limit of batch runs")
    p.add_argument(
        "--async-commit",
        action="store_true",
        help="also run the drains with synchronous_commit = off on the consumer connections",
    )
    p.add_argument(
        "--ack-many",
        action="store_true",
        help="also run the batch drains acking each batch with one Broker.delete_many call",
    )
    p.add_argument("--only", choices=["create", "drain"], help="run only these scenarios")
    p.add_argument("--match", help="run only the scenarios whose label matches this regex")
    p.add_argument(
        "--max-run-seconds",
        type=float,
        default=10.0,
        help="stop a run after this long and measure what it handled (default 10)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time each lonnymq SQL function (track_functions; needs a superuser)",
    )
    p.add_argument("--output", type=Path, default=RESULTS_PATH, help="JSON results file")
    args = p.parse_args(argv)
    for name in ("repeat", "workers", "channels", "create_messages", "drain_messages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.batch_limit <= 1000:
        p.error("--batch-limit must be between 1 and 1000")
    if args.max_run_seconds <= 0:
        p.error("--max-run-seconds must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scenarios = build_scenarios(args)
    if not scenarios:
        print("no scenario selected", file=sys.stderr)
        return 2
    code = provenance()
    bench = Bench(args)
    started = time.perf_counter()
    entries: list[dict[str, Any]] = []
    try:
        bench.install()
        server = bench.server_info()
        print(f"schema {bench.schema}; {server['version']}")
        print(
            f"synchronous_commit={server['synchronous_commit']} fsync={server['fsync']}; "
            f"{os.cpu_count()} CPUs; {len(scenarios)} scenarios x {args.repeat} runs",
            flush=True,
        )
        for sc in scenarios:
            entries.append(bench.run(sc))
    finally:
        bench.drop()
    total_s = time.perf_counter() - started
    print_table(entries)
    print(f"\ntotal benchmark time {total_s:.0f}s")
    report = {
        "benchmark": "bench_core",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "lonnymq_version": lonnymq.__version__,
        "code": code,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "server": server,
        "settings": {
            "repeat": args.repeat,
            "workers": args.workers,
            "channels": args.channels,
            "create_messages": args.create_messages,
            "drain_messages": args.drain_messages,
            "batch_limit": args.batch_limit,
            "async_commit": args.async_commit,
            "ack_many": args.ack_many,
            "max_run_seconds": args.max_run_seconds,
            "match": args.match,
            "payload_bytes": PAYLOAD_BYTES,
            "lock_ms": LOCK_MS,
        },
        "total_seconds": total_s,
        "results": entries,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
