# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Fault tests with real processes and real Postgres servers ("Reliability and security").

1. A Celery worker (acks_late) SIGKILLed (its whole process group) several times during a run
   and restarted: every task completes, only tasks in flight at a kill run twice.
2. The Postgres server of a run crashes and restarts while producers publish: a producer with
   kombu's retry policy never fails, one without gets connection errors; no publish that
   returned is lost; the consumer reconnects by itself.
3. pg_terminate_backend on one connection at a time: the producer's, the consumer's command
   connection, its LISTEN connection, and the command connection while only the consumer's
   heartbeat thread uses it (lonnymq's lock heartbeat runs on the command connection).
4. 8 consumer processes over a batch-filled queue, with short locks and consumers that stall
   past them: no message is delivered again while a lock on it is valid, the queue ends
   empty and the channel counters exact.
5. A Celery task running 3x visibility_timeout in a live prefork worker runs once.
6. Failover: a primary and a synchronous streaming standby; the standby is promoted and the
   primary stopped mid-run; a producer and a consumer whose URL names both hosts
   (target_session_attrs=read-write) carry on on the new primary; no acknowledged publish is
   lost.

Already covered elsewhere, so not repeated here: one consumer SIGKILLed with messages held
(tests/test_transport_processes.py::test_sigkilled_consumer_messages_redelivered_after_
visibility_timeout), a consumer across a clean restart with publishes after it
(::test_consumer_survives_postgres_restart), every backend cut at once
(::test_consumer_and_producer_survive_terminated_connections), a kombu consumer holding a
message for 3x visibility_timeout (::test_live_consumer_keeps_its_lock_past_visibility_timeout).

Sizes: CI runs a reduced scale; ``LONNYMQ_FAULT_SCALE=full`` runs the issue's numbers
(10,000 tasks and 5 kills; 100,000 messages over 8 consumers).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq.testing import TempPostgres
from tests import _fault_procs
from tests import test_celery_worker as tcw
from tests.apps import close_app
from tests.conftest import lonnymq_url
from tests.test_concurrency import Sampler, counter_mismatches, ident, message_ids
from tests.test_transport_processes import (
    WORKER,
    Event,
    assert_empty,
    ids,
    kill_running,
    single_queue,
    start_script,
)
from tests.test_transport_processes import Worker as Proc

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]

FULL = os.environ.get("LONNYMQ_FAULT_SCALE", "").lower() == "full"
SCALED_TIMEOUT = 1500 if FULL else 300  # seconds (pytest-timeout); the default is 300

# --------------------------------------------------------------------------------------------
# Processes: the kombu consumer of tests/test_transport_processes.py, and a producer that
# reports every publish


PRODUCER = r'''
"""A kombu producer for tests/test_faults.py (config: JSON in argv[1]). Publishes ids from
cfg["start"] until its stop file appears (or cfg["count"] of them), one at a time, and
reports each as a JSON line: "pub" when publish() returned (the message is committed), "err"
when it raised."""
import json
import os
import sys
import time

import kombu

import lonnymq  # noqa: F401  registers lonnymq://

cfg = json.loads(sys.argv[1])
out = open(cfg["out"], "a", buffering=1)


def emit(event, **fields):
    fields["ev"] = event
    fields.setdefault("t", time.time())
    out.write(json.dumps(fields) + "\n")


policy = {"max_retries": 400, "interval_start": 0.05, "interval_step": 0.1, "interval_max": 0.25}
with kombu.Connection(cfg["url"], transport_options=cfg["options"]) as conn:
    producer = conn.Producer(serializer="json")
    transport = conn.transport
    emit("ready")
    i = cfg["start"]
    end = cfg["start"] + cfg.get("count", 10**12)
    while i < end and not os.path.exists(cfg["stop_file"]):
        began = time.time()
        try:
            producer.publish(
                {"id": i, "sent": began},
                exchange=cfg["exchange"],
                routing_key=cfg["routing_key"],
                retry=cfg["retry"],
                retry_policy=policy,
            )
        except Exception as exc:
            emit(
                "err",
                id=i,
                began=began,
                type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                error=str(exc)[:300],
                connection_error=isinstance(exc, conn.connection_errors),
            )
            time.sleep(0.1)
        else:
            emit("pub", id=i, began=began)
        if conn.transport is not transport:  # kombu replaced it to recover from an error
            transport = conn.transport
            emit("reconnected", id=i)
        i += 1
        time.sleep(cfg.get("pause", 0.01))
    emit("done", count=i - cfg["start"])
out.close()
'''


@dataclass
class Launcher:
    """Starts the consumer (``WORKER`` of test_transport_processes) or producer scripts."""

    root: Path
    started: list[Proc] = field(default_factory=list)

    def __call__(self, name: str, script: str, **cfg: Any) -> Proc:
        source = {"consumer": WORKER, "producer": PRODUCER}[script]
        proc = start_script(self.root, f"fault_{script}.py", source, name, cfg)
        self.started.append(proc)
        return proc


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    kill_running(launcher.started)


def published(producer: Proc) -> list[int]:
    return ids(producer.events(), "pub")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *procs: Proc) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(p.log_tail() for p in procs)
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")
        time.sleep(0.02)


def finish(consumer: Proc, producers: list[Proc], timeout: float) -> tuple[set[int], list[Event]]:
    """Stop the producers, wait until the consumer acked every id they report published,
    stop it; returns (the ids published, the consumer's events)."""
    for producer in producers:
        producer.stop()
    for producer in producers:
        producer.join(timeout=60)
    sent = {i for producer in producers for i in published(producer)}
    wait_until(
        lambda: set(ids(consumer.events(), "ack")) >= sent,
        timeout,
        f"the consumer to ack all {len(sent)} published messages",
        consumer,
    )
    time.sleep(0.5)  # any duplicate on its way
    consumer.stop()
    consumer.join(timeout=30)
    return sent, consumer.events()


# --------------------------------------------------------------------------------------------
# Backends of a process: its TCP connections' local ports, matched with pg_stat_activity


def local_ports(pid: int) -> set[int]:
    """Local ports of the TCP sockets process ``pid`` has open (Linux /proc)."""
    inodes: set[int] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            link = os.readlink(fd_dir / fd)
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if int(parts[9]) in inodes:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def backends(conn: Conn, pid: int, role: str) -> list[int]:
    """Backend pids of the connections of process ``pid`` whose application_name is
    ``lonnymq-<role>`` (``command`` or ``listen``)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
        "AND client_port = ANY(%s) ORDER BY pid",
        (f"lonnymq-{role}", sorted(local_ports(pid))),
    ).fetchall()
    return [int(r[0]) for r in rows]


def cut(conn: Conn, pid: int, role: str) -> int:
    """Terminate the one ``lonnymq-<role>`` backend of process ``pid``; returns its pid."""
    found = backends(conn, pid, role)
    assert len(found) == 1, f"expected one lonnymq-{role} connection of {pid}: {found}"
    [backend] = found
    [(ok,)] = conn.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchall()
    assert ok
    return backend


def replaced(conn: Conn, pid: int, role: str, old: int) -> Callable[[], bool]:
    """True once process ``pid`` has a new ``lonnymq-<role>`` connection (not ``old``)."""

    def check() -> bool:
        now = backends(conn, pid, role)
        return bool(now) and old not in now

    return check


def connected(conn: Conn, pid: int, role: str) -> Callable[[], bool]:
    """True while process ``pid`` has exactly one ``lonnymq-<role>`` connection."""
    return lambda: len(backends(conn, pid, role)) == 1


# --------------------------------------------------------------------------------------------
# 1. A Celery worker SIGKILLed repeatedly during a run

RECORD_TASK = r"""

@app.task(name="t.record", acks_late=True, ignore_result=True, shared=False)
def record(i):
    # one write(2) of one line with O_APPEND: lines of concurrent pool processes never mix
    fd = os.open(str(OUT / "runs"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{i} {os.getpid()} {time.time()}\n".encode())
    finally:
        os.close(fd)
"""


def runs(env: tcw.Env) -> Counter[int]:
    """How many times each task id ran (completed its record)."""
    counts: Counter[int] = Counter()
    for line in env.lines("runs"):
        parts = line.split()
        if len(parts) == 3:
            counts[int(parts[0])] += 1
    return counts


@pytest.mark.slow
@pytest.mark.timeout(SCALED_TIMEOUT)
def test_celery_worker_sigkilled_repeatedly_loses_no_task(
    tmp_path: Path, pg_dsn: str, schema: str, conn: Conn
) -> None:
    """N tasks (acks_late) run by a prefork worker (concurrency 2, prefetch multiplier 4,
    visibility_timeout 2 s) that is SIGKILLed, pool children included, K times during the run
    and restarted each time: every task ran at least once, the queue ends empty, and the
    tasks run twice are at most K x concurrency x multiplier (the messages a worker holds)."""
    total, kills = (10_000, 5) if FULL else (2_000, 3)
    concurrency, multiplier, vt = 2, 4, 2.0
    env = tcw.make_env(tmp_path, pg_dsn, schema, RECORD_TASK)
    started: list[tcw.Worker] = []
    worker_env = {"LMQ_VT": str(vt), "LMQ_PREFETCH": str(multiplier)}
    try:
        record = env.task("record")
        t0 = time.monotonic()
        with env.app.producer_or_acquire() as producer:
            for i in range(total):
                record.apply_async((i,), producer=producer)
        publish_s = time.monotonic() - t0
        assert tcw.stats(conn, schema).total == total

        def start(n: int) -> tcw.Worker:
            name = f"kill{n}"
            args = tcw.worker_args(name, "celery", "--pool", "prefork", "-c", str(concurrency))
            return tcw.launch(env.dir, env.module, name, args, started, extra_env=worker_env)

        def done_at_least(n: int) -> Callable[[], bool]:
            return lambda: len(runs(env)) >= n

        t1 = time.monotonic()
        worker = start(0)
        at_kill: list[int] = []
        for k in range(kills):
            threshold = total * (k + 1) // (kills + 1)
            tcw.wait_for(done_at_least(threshold), 120, f"{threshold} tasks done", worker)
            os.killpg(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(timeout=10)
            at_kill.append(len(runs(env)))
            worker = start(k + 1)
        tcw.wait_for(lambda: len(runs(env)) >= total, 300, "every task to run", worker)
        tcw.wait_for(lambda: tcw.stats(conn, schema).total == 0, 60, "the queue to empty", worker)
        run_s = time.monotonic() - t1
        time.sleep(1.0)  # a duplicate still on its way would show now
        counts = runs(env)
    finally:
        for w in started:
            tcw._stop(w)
        close_app(env.app)

    missing = set(range(total)) - set(counts)
    twice = {i: n for i, n in counts.items() if n > 1}
    duplicates = sum(n - 1 for n in counts.values())
    bound = kills * concurrency * multiplier
    print(
        f"\n{total} tasks, {kills} SIGKILLs (distinct tasks done at each: {at_kill}): "
        f"published in {publish_s:.1f} s, run in {run_s:.1f} s; {len(missing)} lost, "
        f"{duplicates} extra runs over {len(twice)} tasks (bound {bound})"
    )
    assert not missing, f"{len(missing)} tasks never ran: {sorted(missing)[:20]}"
    assert set(counts) == set(range(total))
    assert duplicates <= bound, twice
    s = tcw.stats(conn, schema)
    assert (s.total, s.in_flight) == (0, 0), s


# --------------------------------------------------------------------------------------------
# 2. Postgres crashes and restarts while producers publish


@pytest.mark.slow
def test_publishes_acknowledged_across_a_postgres_crash_are_not_lost(
    launch: Launcher, schema: str
) -> None:
    """A throwaway server, a consumer (kombu's ConsumerMixin) and two producers publishing
    one message every 10 ms, one with kombu's retry policy and one without. The server is
    stopped in 'immediate' mode (a crash: no checkpoint, recovery from WAL at start), kept
    down for 3 s and started again. The retrying producer never raises; the other one raises
    connection errors (kombu's ``connection_errors``) while the server is down and publishes
    again after. Every publish that returned is consumed; the consumer reconnects by itself."""
    server = TempPostgres().init().start()
    try:
        url = lonnymq_url(server.dsn())
        options = {"schema": schema, "visibility_timeout": 2.0}
        topology = single_queue("crash.direct", "c", "crash")
        consumer = launch(
            "consumer", "consumer", mode="mixin", url=url, options=options, max_seconds=120,
            **topology,
        )  # fmt: skip
        consumer.wait_ready()
        common = {"url": url, "options": options, "exchange": "crash.direct", "routing_key": "c"}
        retrying = launch("retrying", "producer", start=0, retry=True, **common)
        failing = launch("failing", "producer", start=1_000_000, retry=False, **common)
        retrying.wait_ready()
        failing.wait_ready()
        wait_until(lambda: len(ids(consumer.events(), "ack")) >= 60, 30, "60 acks", consumer)

        down_at = time.time()
        server.stop("immediate")
        time.sleep(3.0)
        server.start()
        up_at = time.time()
        wait_until(
            lambda: all(
                sum(e["began"] > up_at for e in p.events("pub")) >= 50 for p in (retrying, failing)
            ),
            60,
            "50 publishes by each producer after the restart",
            retrying,
            failing,
        )
        sent, events = finish(consumer, [retrying, failing], timeout=60)
        with psycopg.connect(server.dsn(), autocommit=True) as pg:
            assert_empty(lonnymq.Broker(schema), pg, "crash")
    finally:
        server.cleanup()

    acked = set(ids(events, "ack"))
    assert sent <= acked, f"lost: {sorted(sent - acked)[:20]}"
    assert not retrying.events("err"), retrying.events("err")[:3]
    across = [e for e in retrying.events("pub") if e["began"] < up_at and e["t"] > down_at + 0.5]
    assert across, "no publish of the retrying producer waited out the outage"
    errors = failing.events("err")
    assert errors, "the producer without retries never saw the outage"
    assert all(e["connection_error"] for e in errors), errors[:3]
    assert all(down_at - 0.5 <= e["t"] <= up_at + 5 for e in errors), errors[:3]
    assert consumer.events("connection_error") or consumer.events("error")
    failed_ids = {int(e["id"]) for e in errors}
    ambiguous = failed_ids & set(ids(events))
    dups = sum(n - 1 for n in Counter(ids(events)).values())
    pubs = sorted(e["t"] for e in retrying.events("pub"))
    longest = max(b - a for a, b in itertools.pairwise(pubs))
    messages = Counter(f"{e['type']}: {e['error'].splitlines()[0][:100]}" for e in errors)
    print(
        f"\ncrash: down {up_at - down_at:.1f} s; {len(sent)} publishes returned, all consumed; "
        f"retrying producer: {len(across)} publish(es) waited out the outage (longest pause "
        f"{longest:.1f} s), 0 errors; producer without retry: {len(errors)} errors, all kombu "
        f"connection errors: {dict(messages)}; "
        f"{len(ambiguous)} of them committed anyway; consumer recovered from "
        f"{len(consumer.events('connection_error'))} error(s); {dups} delivered twice"
    )


# --------------------------------------------------------------------------------------------
# 3. One connection cut at a time


@pytest.mark.slow
def test_each_connection_cut_in_turn_recovers(
    launch: Launcher, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """A consumer process (ConsumerMixin) and a producer process (retry policy, one publish
    every 10 ms). In turn, each connection is terminated alone (pg_terminate_backend),
    found by its client port in the process's sockets: the producer's command connection,
    the consumer's command connection, the consumer's LISTEN connection. After each cut the
    process opens a new one and the run goes on; in the end every message published is
    consumed."""
    options = {"schema": schema, "visibility_timeout": 2.0}
    topology = single_queue("turn.direct", "t", "turn")
    consumer = launch(
        "consumer", "consumer", mode="mixin", url=url, options=options, max_seconds=120,
        **topology,
    )  # fmt: skip
    consumer.wait_ready()
    producer = launch(
        "producer", "producer", url=url, options=options, exchange="turn.direct",
        routing_key="t", start=0, retry=True,
    )  # fmt: skip
    producer.wait_ready()

    def acks() -> int:
        return len(ids(consumer.events(), "ack"))

    def progressed(pubs: int, acked: int) -> Callable[[], bool]:
        return lambda: len(published(producer)) >= pubs + 30 and acks() >= acked + 30

    wait_until(lambda: acks() >= 30, 30, "30 acks", consumer)
    # The consumer waits on LISTEN between messages: its LISTEN connection is open.
    wait_until(connected(conn, consumer.popen.pid, "listen"), 10, "LISTEN")
    steps: list[str] = []
    for who, role in (
        (producer, "command"),
        (consumer, "command"),
        (consumer, "listen"),
    ):
        # (a consumer that reconnected opens its LISTEN connection again when it next waits
        # between messages: not at once)
        wait_until(connected(conn, who.popen.pid, role), 20, role, who)
        old = cut(conn, who.popen.pid, role)
        pubs, acked = len(published(producer)), acks()
        wait_until(
            replaced(conn, who.popen.pid, role, old),
            20,
            f"a new {role} connection of the {who.name}",
            who,
        )
        wait_until(
            progressed(pubs, acked),
            30,
            f"30 more publishes and acks after cutting the {who.name}'s {role} connection",
            producer,
            consumer,
        )
        steps.append(f"{who.name} {role}")

    sent, events = finish(consumer, [producer], timeout=30)
    acked_ids = set(ids(events, "ack"))
    assert sent <= acked_ids, f"lost: {sorted(sent - acked_ids)[:20]}"
    assert not producer.events("err")
    assert "LISTEN connection lost" in consumer.log.read_text()
    assert_empty(broker, conn, "turn")
    dups = sum(n - 1 for n in Counter(ids(events)).values())
    print(
        f"\ncuts in turn ({', '.join(steps)}): {len(sent)} messages, all consumed; consumer "
        f"recovered from {len(consumer.events('error'))} error(s), producer "
        f"reconnected {len(producer.events('reconnected'))}x; {dups} delivered twice"
    )


@pytest.mark.slow
def test_heartbeat_connection_cut_while_a_message_is_held(
    launch: Launcher, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """The lock heartbeat runs on the consumer's command connection. A consumer busy with one
    message for 3x visibility_timeout (its main thread asleep in the callback, so only the
    heartbeat thread uses the connection) has that connection terminated 1 s in: the next
    beat fails, the one after opens a new connection and extends the lock in time. A second
    consumer never gets the message; the first acks it."""
    vt = 2.0
    hold = 3 * vt
    options = {"schema": schema, "visibility_timeout": vt}
    topology = single_queue("hb.direct", "h", "hb")
    holder = launch(
        "holder", "consumer", mode="plain", url=url, options=options, prefetch=1, hold=hold,
        expect=1, **topology,
    )  # fmt: skip
    holder.wait_ready()
    producer = launch(
        "producer", "producer", url=url, options=options, exchange="hb.direct",
        routing_key="h", start=1, count=1, retry=True,
    )  # fmt: skip
    holder.wait_msgs(1)
    producer.join()
    assert published(producer) == [1], "the producer published more than one message"
    other = launch("other", "consumer", mode="plain", url=url, options=options, **topology)
    other.wait_ready()
    time.sleep(1.0)
    old = cut(conn, holder.popen.pid, "command")
    cut_at = time.time()
    wait_until(replaced(conn, holder.popen.pid, "command", old), vt, "a new connection", holder)
    reconnected_s = time.time() - cut_at
    holder.join(timeout=hold + 15)
    time.sleep(0.5)
    other.stop()
    other.join()

    assert ids(holder.events(), "ack") == [1]
    assert ids(other.events()) == [], "the held message was delivered to the other consumer"
    assert "heartbeat failed" in holder.log.read_text(), holder.log_tail()
    assert_empty(broker, conn, "hb")
    print(f"\nheartbeat cut: new command connection {reconnected_s:.2f} s after the cut")


# --------------------------------------------------------------------------------------------
# 4. 8 consumer processes, short locks, stalls


@pytest.mark.slow
@pytest.mark.timeout(SCALED_TIMEOUT)
def test_eight_consumer_processes_never_overlap_a_valid_lock(
    pg_dsn: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """N messages in 16 channels (4 with max_concurrency 3) created with ``broker.batch()``;
    8 spawned consumer processes dequeue 10 at a time with a 1.5 s lock and delete them.
    Consumers 0-3 stall past the lock twice each. Checked: every message deleted exactly once;
    a message delivered again only after its previous lock expired (the new delivery
    returned at least lock_ms after the previous dequeue was called), with attempts + 1 and
    a new token, and the stalled delete refused; the queue ends empty; the channel counters
    agree with the message table in every snapshot an observer takes, and at the end."""
    total = 100_000 if FULL else 20_000
    n_procs, limit, lock_ms, stall_s = 8, 10, 1500, 2.2
    schema = broker.schema
    queue = broker.queue("q")
    channels = [f"c{i:02d}" for i in range(16)]
    limited = channels[:4]
    t0 = time.monotonic()
    for name in limited:
        queue.channel(name).policy.set(conn, max_concurrency=3)
    created: list[int] = []
    with psycopg.connect(pg_dsn, autocommit=True, options=_fault_procs.FAST) as fast:
        for start in range(0, total, 5000):
            batch = queue.batch()
            pending = [
                batch.channel(channels[i % len(channels)]).message(f"m{i}")
                for i in range(start, min(total, start + 5000))
            ]
            batch.execute(fast)
            for p in pending:
                result = p.get()
                assert isinstance(result, lonnymq.Created), result
                created.append(result.id)
    fill_s = time.monotonic() - t0
    assert queue.stats(conn).total == total

    mismatches: list[list[tuple[Any, ...]]] = []

    def probe(c: Conn) -> None:
        found = counter_mismatches(c, schema)
        if found:
            mismatches.append(found)
        time.sleep(1.0 if FULL else 0.2)  # a snapshot joins every message

    per_proc_calls = total // (n_procs * limit)
    stalls = [per_proc_calls // 8, per_proc_calls // 4]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n_procs + 1, timeout=120)
    out: Any = ctx.Queue()
    procs = [
        ctx.Process(
            target=_fault_procs.consume_process,
            args=(
                pg_dsn,
                schema,
                "q",
                i,
                lock_ms,
                limit,
                stalls if i < 4 else [],
                stall_s,
                SCALED_TIMEOUT - 60.0,
                barrier,
                out,
            ),
        )
        for i in range(n_procs)
    ]
    for proc in procs:
        proc.start()
    results: list[tuple[list[_fault_procs.Delivery], list[str]]] = []
    try:
        with (
            psycopg.connect(pg_dsn, autocommit=True) as observer,
            Sampler(observer, probe) as sampler,
        ):
            barrier.wait()
            t1 = time.monotonic()
            for _ in range(n_procs):
                status, value = out.get(timeout=SCALED_TIMEOUT - 30)
                assert status == "ok", f"consumer process failed: {value}"
                results.append(value)
            consume_s = time.monotonic() - t1
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [p.exitcode for p in procs] == [0] * n_procs

    deliveries = [d for ds, _ in results for d in ds]
    errors = [e for _, es in results for e in es]
    by_id: dict[int, list[_fault_procs.Delivery]] = defaultdict(list)
    for d in deliveries:
        by_id[d.id].append(d)
    assert sorted(by_id) == sorted(created), "delivered ids differ from created ids"
    redelivered = unstalled = 0
    early: list[tuple[Any, ...]] = []
    for mid, ds in by_id.items():
        ds.sort(key=lambda d: d.got)
        assert [d.outcome for d in ds].count("ok") == 1, ds
        assert ds[-1].outcome == "ok", ds  # nothing delivered after the delete succeeded
        assert [d.attempts for d in ds] == list(range(1, len(ds) + 1)), ds
        assert len({d.token for d in ds}) == len(ds), ds
        for first, second in itertools.pairwise(ds):
            redelivered += 1
            if second.got < first.called + lock_ms / 1000:
                early.append((mid, first, second))
            if first.acked - first.got < stall_s:
                unstalled += 1  # its holder was descheduled for longer than the lock
    assert early == [], f"delivered again while the lock was valid: {early[:5]}"
    stalled = 4 * len(stalls) * limit
    assert redelivered > 0, "no stall led to a redelivery"
    assert redelivered - unstalled <= stalled, (redelivered, unstalled, stalled)
    refused = Counter(d.outcome for d in deliveries if d.outcome != "ok")
    assert sum(refused.values()) == redelivered, refused
    assert sampler.samples > 0
    assert mismatches == [], mismatches[:3]
    assert message_ids(conn, schema) == []
    assert counter_mismatches(conn, schema) == []
    s = queue.stats(conn)
    assert (s.total, s.in_flight, s.ready, s.delayed) == (0, 0, 0, 0), s
    rows = conn.execute(
        sql.SQL("SELECT name, current_size, current_concurrency FROM {} ORDER BY name").format(
            ident(schema, "channel")
        )
    ).fetchall()
    assert rows == [(name, 0, 0) for name in limited]  # empty channels without policy gone
    per_proc = sorted(Counter(d.process for d in deliveries).values())
    print(
        f"\n{total} messages: filled in {fill_s:.1f} s (batches of 5,000), consumed by "
        f"{n_procs} processes in {consume_s:.1f} s ({total / consume_s:.0f}/s); "
        f"{redelivered} redelivered after their lock expired ({unstalled} of them without a "
        f"stall; {stalled} messages held by stalls), "
        f"stalled deletes refused {dict(refused)}; {len(errors)} database errors retried; "
        f"deliveries per process {per_proc}; {sampler.samples} counter snapshots, 0 off"
    )


# --------------------------------------------------------------------------------------------
# 5. A long task in a live Celery worker


@pytest.mark.slow
def test_celery_task_running_3x_visibility_timeout_runs_once(
    tmp_path: Path, pg_dsn: str, schema: str, conn: Conn
) -> None:
    """An acks_late task sleeping 3x visibility_timeout (2 s) in a prefork worker's child:
    the worker's main process keeps extending its lock, so a second worker, started once
    the task runs and idle meanwhile, never gets it; it runs once and is acked."""
    vt = 2.0
    env = tcw.make_env(tmp_path, pg_dsn, schema)
    started: list[tcw.Worker] = []
    extra = {"LMQ_VT": str(vt), "LMQ_PREFETCH": "1", "LMQ_SLOW": str(3 * vt)}
    try:

        def start(name: str) -> tcw.Worker:
            args = tcw.worker_args(name, "celery", "--pool", "prefork", "-c", "1")
            return tcw.launch(env.dir, env.module, name, args, started, extra_env=extra)

        a = start("longa")
        env.task("slow_late").delay()
        tcw.wait_for(lambda: len(env.lines("slow_starts")) == 1, 20, "the task to start", a)
        b = start("longb")
        tcw.wait_for(lambda: len(env.lines("slow_done")) == 1, 3 * vt + 20, "the task's end", a)
        tcw.wait_for(lambda: tcw.stats(conn, schema).total == 0, 10, "its ack", a)
        time.sleep(1.0)
        starts = [json.loads(line) for line in env.lines("slow_starts")]
        done = [json.loads(line) for line in env.lines("slow_done")]
        assert a.alive() and b.alive()
    finally:
        for w in started:
            tcw._stop(w)
        close_app(env.app)
    assert len(starts) == 1, starts
    assert len(done) == 1, done
    assert done[0][1] - starts[0][1] >= 3 * vt
    print(f"\nlong task: ran once, {done[0][1] - starts[0][1]:.1f} s (visibility_timeout {vt} s)")


# --------------------------------------------------------------------------------------------
# 5b. Connections of a Celery worker's event loop cut under load

SLOW_RECORD_TASK = RECORD_TASK.replace('name="t.record"', 'name="t.slow_record"').replace(
    "def record(i):", "def slow_record(i):\n    time.sleep(0.005)"
)


def renewed(conn: Conn, pid: int, role: str, old: list[int]) -> Callable[[], bool]:
    """True once process ``pid`` has ``lonnymq-<role>`` connections, none of them ``old``."""

    def check() -> bool:
        now = backends(conn, pid, role)
        return bool(now) and not set(old) & set(now)

    return check


def runs_at_least(env: tcw.Env, n: int) -> Callable[[], bool]:
    return lambda: len(runs(env)) >= n


@pytest.mark.slow
def test_celery_event_loop_recovers_from_cut_connections(
    tmp_path: Path, pg_dsn: str, schema: str, conn: Conn
) -> None:
    """A prefork worker (Celery's event loop and asynchronous pool) runs acks_late tasks
    published at ~150/s. In turn, every command connection of the worker's main process is
    terminated, then its LISTEN connection: after each cut it opens new ones and goes on; in
    the end every task ran and the queue is empty."""
    env = tcw.make_env(tmp_path, pg_dsn, schema, SLOW_RECORD_TASK)
    started: list[tcw.Worker] = []
    stop = threading.Event()
    sent: list[int] = []

    def publish() -> None:
        task = env.task("slow_record")
        with env.app.producer_or_acquire() as producer:
            for i in itertools.count():
                if stop.is_set():
                    return
                task.apply_async((i,), producer=producer)
                sent.append(i)
                time.sleep(1 / 150)

    publisher = threading.Thread(target=publish)
    try:
        args = tcw.worker_args("cuts", "celery", "--pool", "prefork", "-c", "2")
        worker = tcw.launch(env.dir, env.module, "cuts", args, started, extra_env={"LMQ_VT": "5"})
        publisher.start()
        tcw.wait_for(lambda: len(runs(env)) >= 100, 30, "100 tasks", worker)
        pid = worker.proc.pid
        cuts = []
        for role in ("command", "listen"):
            old = backends(conn, pid, role)
            assert old, f"no lonnymq-{role} connection of the worker"
            for backend in old:
                conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
            done = len(runs(env))
            tcw.wait_for(renewed(conn, pid, role, old), 30, f"new {role} connections", worker)
            tcw.wait_for(
                runs_at_least(env, done + 100),
                60,
                f"100 more tasks after cutting the {role} connections",
                worker,
            )
            cuts.append(f"{len(old)} {role}")
        stop.set()
        publisher.join(timeout=30)
        total = len(sent)
        tcw.wait_for(lambda: set(runs(env)) >= set(sent), 120, "every task to run", worker)
        tcw.wait_for(lambda: tcw.stats(conn, schema).total == 0, 60, "the queue to empty", worker)
        log = worker.log.read_text(errors="replace")
        assert worker.alive()
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join(timeout=30)
        for w in started:
            tcw._stop(w)
        close_app(env.app)
    counts = runs(env)
    assert set(counts) == set(range(total))
    print(
        f"\nevent loop cuts ({', '.join(cuts)}): {total} tasks, all ran; "
        f"{sum(n - 1 for n in counts.values())} ran twice; "
        f"{log.count('Connection to broker lost')} consumer reconnection(s)"
    )


# --------------------------------------------------------------------------------------------
# 6. Failover to a promoted synchronous standby


def run_as(server: TempPostgres, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a server binary as the user TempPostgres runs the server as (postgres as root)."""
    cmd = [str(server.bindir / args[0]), *args[1:]]
    if server.user:
        cmd = ["runuser", "-u", server.user, "--", *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=server.root, timeout=120)
    assert result.returncode == 0, f"{args[0]} failed: {result.stdout}{result.stderr}"
    return result


@contextlib.contextmanager
def primary_and_standby() -> Iterator[tuple[TempPostgres, TempPostgres]]:
    """A primary and a streaming standby (pg_basebackup -R) in synchronous replication
    (synchronous_standby_names = '*', on once the standby streams)."""
    primary = TempPostgres(settings={"wal_level": "replica", "max_wal_senders": "5"})
    standby: TempPostgres | None = None
    try:
        primary.init().start()
        standby = TempPostgres()
        run_as(
            primary, "pg_basebackup", "-D", str(standby.data), "-h", "127.0.0.1",
            "-p", str(primary.port), "-U", "postgres", "-R", "-X", "stream", "--no-sync",
        )  # fmt: skip
        with open(standby.data / "postgresql.conf", "a") as conf:
            conf.write(f"unix_socket_directories = '{standby.root}'\n")
            conf.write("cluster_name = 'standby'\n")
        standby.start()
        with psycopg.connect(primary.dsn(), autocommit=True) as pg:
            deadline = time.monotonic() + 30
            while not pg.execute(
                "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'"
            ).fetchall():
                assert time.monotonic() < deadline, "the standby never streamed"
                time.sleep(0.1)
            pg.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            pg.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while pg.execute("SELECT sync_state FROM pg_stat_replication").fetchall() != [
                ("sync",)
            ]:
                assert time.monotonic() < deadline, "the standby never became synchronous"
                time.sleep(0.1)
        yield primary, standby
    finally:
        if standby is not None:
            standby.cleanup()
        primary.cleanup()


@pytest.mark.slow
def test_failover_to_promoted_standby(launch: Launcher, schema: str) -> None:
    """Primary and synchronous standby on localhost. A consumer (ConsumerMixin) and a producer
    (retry policy) use ``lonnymq://postgres@127.0.0.1:P1,127.0.0.1:P2/postgres?
    target_session_attrs=read-write`` (libpq tries the hosts in turn and keeps the first
    that accepts writes). Mid-run the standby is promoted and the primary stopped (fast):
    both processes carry on on the new primary, and every publish that returned is consumed
    there."""
    with primary_and_standby() as (primary, standby):
        url = (
            f"lonnymq://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
            "?target_session_attrs=read-write&connect_timeout=2"
        )
        options = {"schema": schema, "visibility_timeout": 2.0}
        topology = single_queue("fo.direct", "f", "failover")
        consumer = launch(
            "consumer", "consumer", mode="mixin", url=url, options=options, max_seconds=120,
            **topology,
        )  # fmt: skip
        consumer.wait_ready()
        producer = launch(
            "producer", "producer", url=url, options=options, exchange="fo.direct",
            routing_key="f", start=0, retry=True,
        )  # fmt: skip
        producer.wait_ready()
        wait_until(lambda: len(ids(consumer.events(), "ack")) >= 100, 30, "100 acks", consumer)

        promote_at = time.time()
        run_as(standby, "pg_ctl", "-D", str(standby.data), "-w", "-t", "60", "promote")
        primary.stop("fast")
        stopped_at = time.time()

        def first_after(proc: Proc, kind: str) -> float | None:
            times = [e["t"] for e in proc.events(kind) if e["t"] > stopped_at]
            return min(times) if times else None

        wait_until(
            lambda: (
                sum(e["t"] > stopped_at for e in producer.events("pub")) >= 50
                and sum(e["t"] > stopped_at for e in consumer.events("ack")) >= 50
            ),
            60,
            "50 publishes and acks on the new primary",
            producer,
            consumer,
        )
        pub_after, ack_after = first_after(producer, "pub"), first_after(consumer, "ack")
        assert pub_after is not None and ack_after is not None
        sent, events = finish(consumer, [producer], timeout=60)
        with psycopg.connect(standby.dsn(), autocommit=True) as pg:
            assert pg.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
            assert_empty(lonnymq.Broker(schema), pg, "failover")

    acked = set(ids(events, "ack"))
    assert sent <= acked, f"lost: {sorted(sent - acked)[:20]}"
    assert not producer.events("err")
    assert consumer.events("connection_error") or consumer.events("error")
    dups = sum(n - 1 for n in Counter(ids(events)).values())

    def longest_gap(times: list[float]) -> float:
        return max(b - a for a, b in itertools.pairwise(sorted(times)))

    pub_gap = longest_gap([e["t"] for e in producer.events("pub")])
    ack_gap = longest_gap([e["t"] for e in events if e["ev"] == "ack"])
    print(
        f"\nfailover: promoted + primary stopped in {stopped_at - promote_at:.2f} s; first "
        f"publish on the new primary {pub_after - stopped_at:.2f} s after the stop, first ack "
        f"{ack_after - stopped_at:.2f} s after; longest pause between publishes "
        f"{pub_gap:.2f} s, between acks {ack_gap:.2f} s; {len(sent)} publishes returned, all "
        f"consumed; producer reconnected {len(producer.events('reconnected'))}x, consumer "
        f"recovered from {len(consumer.events('error'))} error(s); {dups} delivered twice"
    )
