# mypy: allow-untyped-calls
"""``bench_brokers.py``'s wake-up scenarios: how soon an idle consumer has a message.

* ``pickup``: a Celery worker started with Celery's defaults (mingle, gossip, heartbeat and
  remote control on), idle; tasks published one at a time, ``--pickup-gap`` seconds apart;
  figure: wall clock from just before ``apply_async`` to the task's start (prefork, and
  threads ``-c 4``).
* ``roundtrip``: ``add.delay(1, 1).get()`` against such a worker, idle between calls, with
  the ``rpc://`` result backend (the client sleeps on a reply queue of the broker) and with
  Redis as a stored backend.
* ``wakeup``: a Kombu consumer (``drain_events``, and for lonnymq also an event loop, as a
  Celery worker runs it) idle between messages, where its milliseconds go: the publish call,
  the NOTIFY's delivery after it returned, the consumer's dequeue (with its ingest), Kombu's
  delivery to the callback. Beside it, as ``floor``, the same in bare Postgres in the same
  run: a psycopg ``INSERT`` and ``NOTIFY`` committed by one producer (durable, as a publish)
  and a ``LISTEN`` loop, which then runs the consume floor's one round trip that locks the
  row (``FOR UPDATE SKIP LOCKED``, committed asynchronously like lonnymq's consumer).

Clocks: ``time.time`` across the Celery processes, ``time.perf_counter`` (CLOCK_MONOTONIC,
shared by the processes of the machine) in ``wakeup``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from kombu.messaging import Consumer, Producer
from psycopg import sql

HERE = Path(__file__).resolve().parent
DEFAULT_BACKEND = os.environ.get("BENCH_REDIS_BACKEND", "redis://127.0.0.1:6379/1")

if TYPE_CHECKING:  # the mixin's host, bench_brokers.Bench
    from bench_brokers import BrokerSpec


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 0.99)}


# --------------------------------------------------------------------------------------------
# Celery worker with Celery's defaults


@contextlib.contextmanager
def default_worker(
    spec: BrokerSpec,
    qname: str,
    pool_args: list[str],
    backend: str | None,
    log: Path,
    app_module: str = "celery_wakeup_app",
    env_extra: dict[str, str] | None = None,
) -> Iterator[Any]:
    """A ``celery worker`` of ``app_module`` (``celery_wakeup_app`` or a module that wraps
    it) on ``qname`` (no ``--without-*`` flag), up (its log says ready) on entry, stopped on
    exit; yields the app to publish with."""
    sys.path.insert(0, str(HERE))
    from celery_wakeup_app import make_app

    app = make_app(spec.url, spec.options, qname, backend)
    env = {
        **os.environ,
        "BENCH_CELERY_BROKER": spec.url,
        "BENCH_CELERY_OPTIONS": json.dumps(spec.options),
        "BENCH_CELERY_QUEUE": qname,
        "BENCH_CELERY_BACKEND": backend or "",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **(env_extra or {}),
    }
    cmd = [sys.executable, "-m", "celery", "-A", app_module, "worker", *pool_args]
    cmd += ["-Q", qname, "-n", f"{qname}@%h", "-l", "INFO"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while b" ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.05)
        yield app
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        with contextlib.suppress(Exception):
            app.close()


def warm_up(app: Any, stamp_file: Path) -> None:
    """Send one ``bench.stamp`` task to a worker just started and wait (60 s at most) until
    it has run."""
    app.send_task("bench.stamp", args=[str(stamp_file), time.time()])
    deadline = time.monotonic() + 60
    while not stamps(stamp_file):
        if time.monotonic() > deadline:
            raise RuntimeError("the warm-up task did not run")
        time.sleep(0.05)


def stamps(path: Path) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    return [
        (float(a), float(b))
        for a, b in (line.split() for line in path.read_text().split("\n") if line)
    ]


# --------------------------------------------------------------------------------------------
# Kombu wake-up, instrumented, and its floor


@dataclass
class WakeOut:
    #: per message: seq -> (notified, dequeue start, dequeue end, callback)
    marks: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    received: dict[int, float] = field(default_factory=dict)
    error: str | None = None


def wakeup_consumer(
    url: str,
    options: dict[str, Any],
    qname: str,
    n: int,
    hub: bool,
    ready: Event,
    out: multiprocessing.Queue[WakeOut],
) -> None:
    """Consume ``n`` messages of ``qname``; for lonnymq, note when each was notified (the
    last notification read before its dequeue began) and its dequeue's start and end."""
    from kombu.connection import Connection
    from kombu.entity import Queue

    res = WakeOut()
    clock = time.perf_counter
    notified: list[float] = []
    dequeued: dict[int, tuple[float, float]] = {}
    if url.startswith("lonnymq"):
        import lonnymq  # noqa: F401
        from lonnymq.transport import connection as tc
        from lonnymq.transport import transport as tt

        orig_notified, orig_dequeue = tc.Waiter.notified, tt.Transport.ack_and_dequeue

        def on_notified(self: Any, queues: Any) -> Any:
            got = orig_notified(self, queues)
            if got:
                notified.append(clock())
            return got

        def on_dequeue(self: Any, queues: Any, limit: int, **kwargs: Any) -> Any:
            started = clock()
            result = orig_dequeue(self, queues, limit, **kwargs)
            for m in result.messages:
                dequeued[m.id] = (started, clock())
            return result

        tc.Waiter.notified = on_notified  # type: ignore[method-assign]
        tt.Transport.ack_and_dequeue = on_dequeue  # type: ignore[method-assign]

    def on_message(body: Any, message: Any) -> None:
        now = clock()
        message.ack()
        seq = int(body["seq"])
        res.received[seq] = now
        mid = (message.delivery_info.get("lonnymq") or {}).get("id")
        if mid in dequeued:
            start, end = dequeued[mid]
            before = [t for t in notified if t <= start]
            res.marks[seq] = (before[-1] if before else start, start, end, now)

    try:
        with Connection(url, transport_options=options) as conn:
            queue = Queue(qname, durable=True)
            queue(conn.default_channel).declare()
            Consumer(conn, [queue], callbacks=[on_message], accept=["json"]).consume()
            if hub:
                from kombu.asynchronous import Hub

                loop = Hub()
                conn.transport.register_with_event_loop(conn.connection, loop)
                run = loop.create_loop()
                settle = clock() + 1.0
                while clock() < settle:
                    next(run)
                ready.set()
                while len(res.received) < n:
                    next(run)
                conn.transport.unregister_from_event_loop(conn.connection, loop)
                loop.close()
            else:
                with contextlib.suppress(socket.timeout):
                    conn.drain_events(timeout=1.0)
                ready.set()
                while len(res.received) < n:
                    with contextlib.suppress(socket.timeout):
                        conn.drain_events(timeout=1.0)
    except Exception:
        res.error = traceback.format_exc()
        ready.set()
    out.put(res)


def floor_listener(
    dsn: str, table: str, n: int, ready: Event, out: multiprocessing.Queue[WakeOut]
) -> None:
    """The floor's consumer: LISTEN; on each notification, one round trip that deletes the
    row it holds and locks the next (``FOR UPDATE SKIP LOCKED``), committed asynchronously.
    ``received``: when each row was locked; ``marks``: (notified, fetch start, fetch end,
    fetch end)."""
    res = WakeOut()
    clock = time.perf_counter
    t = sql.Identifier(*table.split("."))
    step = sql.SQL(
        "WITH d AS (DELETE FROM {t} WHERE id = ANY(%s::bigint[])), "
        "n AS (SELECT id FROM {t} WHERE locked_until IS NULL ORDER BY id LIMIT 1 "
        "FOR UPDATE SKIP LOCKED) "
        "UPDATE {t} SET locked_until = now() + interval '1 minute' "
        "WHERE id = ANY (ARRAY(SELECT id FROM n)) RETURNING id, seq"
    ).format(t=t)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.execute("LISTEN bench_floor")
            ready.set()
            held: list[int] = []
            while len(res.received) < n:
                for _ in conn.notifies(stop_after=1):  # (the generator holds the connection)
                    pass
                got = clock()
                rows = conn.execute(step, (held,)).fetchall()
                done = clock()
                held = [r[0] for r in rows]
                for _, seq in rows:
                    res.received[seq] = done
                    res.marks[seq] = (got, got, done, done)
            conn.execute(sql.SQL("DELETE FROM {t} WHERE id = ANY(%s)").format(t=t), (held,))
    except Exception:
        res.error = traceback.format_exc()
        ready.set()
    out.put(res)


# --------------------------------------------------------------------------------------------
# The scenarios (a mixin of bench_brokers.Bench)


class WakeupScenarios:
    """``pickup``, ``roundtrip`` and ``wakeup``; the host class gives ``args``, ``repeat``,
    ``ctx``, ``tmp``, ``q``, ``rotated``, ``measure``, ``begin`` and ``brokers``."""

    args: Any
    repeat: int
    ctx: Any
    tmp: Path
    brokers: list[BrokerSpec]
    q: Callable[[int, int], int]
    rotated: Callable[..., list[BrokerSpec]]
    measure: Callable[..., None]
    begin: Callable[[str], None]

    def _celery_brokers(self) -> list[BrokerSpec]:
        return [b for b in self.brokers if b.name in ("lonnymq", "rabbitmq", "redis")]

    # -- pickup ---------------------------------------------------------------------------

    def pickup_run(self, spec: BrokerSpec, pool_args: list[str], n: int, gap: float) -> Any:
        from bench_brokers import delete_queue, fresh_name

        qname = fresh_name("bench_pick")
        out_file = self.tmp / f"{qname}.stamps"
        try:
            with default_worker(spec, qname, pool_args, None, self.tmp / f"{qname}.log") as app:
                warm_up(app, out_file)
                time.sleep(self.args.pickup_idle)
                with app.producer_pool.acquire(block=True) as producer:
                    for _ in range(n):
                        app.send_task(
                            "bench.stamp", args=[str(out_file), time.time()], producer=producer
                        )
                        time.sleep(gap)
                deadline = time.monotonic() + 30
                while len(stamps(out_file)) < n + 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
            got = stamps(out_file)[1:]
        finally:
            delete_queue(spec, qname)
        if len(got) < n:
            raise RuntimeError(f"{len(got)}/{n} tasks ran")
        late = [ran - sent for sent, ran in got]
        return (
            figures_ms(late),
            {
                "tasks": n,
                "gap_s": gap,
                "max_ms": max(late) * 1000,
                "all_ms": [x * 1000 for x in late],
            },
        )

    def scenario_pickup(self) -> None:
        self.begin("pickup")
        n = self.q(20, 8)
        for rep in range(self.repeat):
            for pool_args in (["--pool", "prefork", "-c", "2"], ["--pool", "threads", "-c", "4"]):
                variant = f"{pool_args[1]} -c {pool_args[3]}, Celery's defaults"
                for spec in self.rotated(rep, self._celery_brokers()):
                    self.measure(
                        "pickup",
                        variant,
                        spec,
                        "p50_ms",
                        functools.partial(
                            self.pickup_run, spec, pool_args, n, self.args.pickup_gap
                        ),
                    )

    # -- round trip -----------------------------------------------------------------------

    def roundtrip_run(self, spec: BrokerSpec, backend: str, n: int, gap: float) -> Any:
        from bench_brokers import delete_queue, fresh_name

        qname = fresh_name("bench_rt")
        pool = ["--pool", "prefork", "-c", "2"]
        trips: list[float] = []
        try:
            with default_worker(spec, qname, pool, backend, self.tmp / f"{qname}.log") as app:
                add = app.signature("bench.add")
                if add.delay(0, 0).get(timeout=60) != 0:  # warm-up: the client's consumer too
                    raise RuntimeError("warm-up round trip failed")
                for i in range(n):
                    time.sleep(gap)
                    begin = time.perf_counter()
                    got = add.delay(i, 1).get(timeout=30)
                    trips.append(time.perf_counter() - begin)
                    if got != i + 1:
                        raise RuntimeError(f"add({i}, 1) returned {got!r}")
                with contextlib.suppress(Exception):
                    app.backend.result_consumer.stop()
        finally:
            delete_queue(spec, qname)
        return figures_ms(trips), {"calls": n, "gap_s": gap, "max_ms": max(trips) * 1000}

    def scenario_roundtrip(self) -> None:
        self.begin("roundtrip")
        n = self.q(30, 8)
        for rep in range(self.repeat):
            for label, backend in (("rpc://", "rpc://"), ("redis backend", DEFAULT_BACKEND)):
                variant = f"add.delay(1, 1).get(), {label}"
                for spec in self.rotated(rep, self._celery_brokers()):
                    self.measure(
                        "roundtrip",
                        variant,
                        spec,
                        "p50_ms",
                        functools.partial(self.roundtrip_run, spec, backend, n, 0.3),
                    )

    # -- Kombu wake-up and its floor --------------------------------------------------------

    def wakeup_run(self, spec: BrokerSpec, hub: bool, n: int, gap: float) -> Any:
        from bench_brokers import delete_queue, fresh_name, make_body

        qname = fresh_name("bench_wake")
        ready = self.ctx.Event()
        out: multiprocessing.Queue[WakeOut] = self.ctx.Queue()
        proc = self.ctx.Process(
            target=wakeup_consumer, args=(spec.url, spec.options, qname, n, hub, ready, out)
        )
        proc.start()
        published: dict[int, tuple[float, float]] = {}
        try:
            if not ready.wait(120):
                raise RuntimeError("consumer not ready")
            with spec.connection() as conn:
                producer = Producer(conn.channel(), serializer="json")
                from kombu.entity import Queue

                queue = Queue(qname, durable=True)
                queue(producer.channel).declare()
                for i in range(n):
                    time.sleep(gap)
                    start = time.perf_counter()
                    producer.publish(make_body(i), routing_key=qname, delivery_mode=2)
                    published[i] = (start, time.perf_counter())
            res = out.get(timeout=60)
            proc.join(timeout=30)
        finally:
            if proc.is_alive():
                proc.kill()
            delete_queue(spec, qname)
        if res.error:
            raise RuntimeError(res.error)
        return self._breakdown(published, res)

    @staticmethod
    def _breakdown(published: dict[int, tuple[float, float]], res: WakeOut) -> Any:
        seqs = sorted(published)
        total = [res.received[s] - published[s][0] for s in seqs if s in res.received]
        if len(total) < len(seqs):
            raise RuntimeError(f"received {len(total)}/{len(seqs)}")
        figures = figures_ms(total)
        parts: dict[str, list[float]] = {"publish": [], "notify": [], "dequeue": [], "deliver": []}
        for s in seqs:
            start, end = published[s]
            parts["publish"].append(end - start)
            if s in res.marks:
                notified, dq_start, dq_end, callback = res.marks[s]
                parts["notify"].append(notified - end)
                parts["dequeue"].append(dq_end - dq_start)
                parts["deliver"].append(callback - dq_end)
        for name, values in parts.items():
            if values:
                figures[f"{name}_p50_ms"] = statistics.median(values) * 1000
        return figures, {"messages": len(total), "max_ms": max(total) * 1000}

    def floor_run(self, n: int, gap: float, flush_after: bool = False) -> Any:
        """The floor; ``flush_after``: its commit does not wait for the WAL flush, and a
        second transaction flushes it before the publish is done, as lonnymq's
        ``publish_commit="flush_after"`` does (a transactional logical message: a transaction
        waits for the flush only when it has an ID and wrote WAL)."""
        from bench_brokers import PG_DSN, fresh_name

        table = f"public.{fresh_name('bench_floor')}"
        t = sql.Identifier(*table.split("."))
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigint generated always as identity primary key, "
                    "seq integer not null, locked_until timestamptz, payload bytea not null)"
                ).format(t)
            )
            admin.execute(sql.SQL("CREATE INDEX ON {} (id) WHERE locked_until IS NULL").format(t))
        ready = self.ctx.Event()
        out: multiprocessing.Queue[WakeOut] = self.ctx.Queue()
        proc = self.ctx.Process(target=floor_listener, args=(PG_DSN, table, n, ready, out))
        proc.start()
        published: dict[int, tuple[float, float]] = {}
        insert = sql.SQL("INSERT INTO {} (seq, payload) VALUES (%s, %s)").format(t)
        try:
            if not ready.wait(60):
                raise RuntimeError("listener not ready")
            with psycopg.connect(PG_DSN) as conn:
                payload = b"x" * 300
                for i in range(n):
                    time.sleep(gap)
                    start = time.perf_counter()
                    if flush_after:
                        conn.execute("SET LOCAL synchronous_commit = off")
                    conn.execute(insert, (i, payload))
                    conn.execute("NOTIFY bench_floor")
                    conn.commit()
                    if flush_after:
                        conn.execute("SELECT pg_logical_emit_message(true, 'bench', ''::bytea)")
                        conn.commit()
                    published[i] = (start, time.perf_counter())
            res = out.get(timeout=60)
            proc.join(timeout=30)
        finally:
            if proc.is_alive():
                proc.kill()
            with psycopg.connect(PG_DSN, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t))
        if res.error:
            raise RuntimeError(res.error)
        figures, run = self._breakdown(published, res)
        # the floor: INSERT + NOTIFY committed -> LISTEN got it (no fetch)
        to_listen = [res.marks[s][0] - published[s][0] for s in published if s in res.marks]
        figures["listen_p50_ms"] = statistics.median(to_listen) * 1000
        return figures, run

    def scenario_wakeup(self) -> None:
        from bench_brokers import BrokerSpec

        self.begin("wakeup")
        n = self.q(200, 40)
        gap = 0.03
        # (the floor commits durably before its NOTIFY goes; "floor_flush_after"
        # commits as lonnymq's publish_commit="flush_after" does)
        floors = [BrokerSpec("floor", "", {}), BrokerSpec("floor_flush_after", "", {})]
        for rep in range(self.repeat):
            for hub in (False, True):
                variant = "Kombu, " + ("event loop" if hub else "drain_events")
                pool = [b for b in self.brokers if b.name in ("lonnymq", "rabbitmq", "redis")]
                if hub:
                    pool = [b for b in pool if b.name == "lonnymq"]
                for spec in [*self.rotated(rep, pool), *floors]:
                    run = (
                        functools.partial(
                            self.floor_run, n, gap, flush_after=spec.name == "floor_flush_after"
                        )
                        if spec.name.startswith("floor")
                        else functools.partial(self.wakeup_run, spec, hub, n, gap)
                    )
                    self.measure("wakeup", variant, spec, "p50_ms", run)
