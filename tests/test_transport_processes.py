# mypy: allow-untyped-calls
# (kombu is untyped, as pyproject.toml notes for lonnymq.transport)
"""The kombu transport across real processes, against a real Postgres.

Every worker (consumer or producer) is a separate Python process running the script
``WORKER`` below (written to ``tmp_path``), configured by one JSON argument. A worker reports
what it observes as JSON lines in a file of its own: ``ready`` once its queues, bindings and
consumers are declared, ``msg`` for each delivery (receive time, queue, id, redelivered flag,
publish time), ``ack`` after each successful ack, ``error`` / ``connection_error`` for each
connection failure a consumer recovered from, ``reconnected`` when kombu gave a producer a new
transport after an error, ``done`` when a producer is through. The tests read these files and
assert on them, and on the queue counters in Postgres (``broker.queue(name).stats(conn)``).
On a timeout, a still running worker is asked (SIGUSR1, faulthandler) for its threads' stacks,
shown in the failure message.

Times in the reports are ``time.time()``: the processes run on one machine, so they compare.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue

import lonnymq
from lonnymq.testing import TempPostgres
from lonnymq.transport.sweep import join_running
from tests.conftest import lonnymq_url

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]
Event = dict[str, Any]
Topology = dict[str, Any]

# --------------------------------------------------------------------------------------------
# The worker process

WORKER = r'''
"""A lonnymq kombu worker for tests/test_transport_processes.py (config: JSON in argv[1])."""
import faulthandler
import json
import os
import signal
import socket
import sys
import time

import kombu
from kombu.mixins import ConsumerMixin

import lonnymq  # noqa: F401  registers the lonnymq:// scheme

faulthandler.register(signal.SIGUSR1)  # the tests ask for a stack dump before a kill
cfg = json.loads(sys.argv[1])
out = open(cfg["out"], "a", buffering=1)
started = time.monotonic()
done = set()  # (queue, id) handled: acked, or received when not acking
reached_at = None


def emit(event, **fields):
    fields["ev"] = event
    fields.setdefault("t", time.time())
    out.write(json.dumps(fields) + "\n")


def connection():
    return kombu.Connection(cfg["url"], transport_options=cfg["options"])


def declared_queues():
    exchanges = {name: kombu.Exchange(name, type=kind) for name, kind in cfg["exchanges"].items()}
    return [
        kombu.Queue(
            name,
            bindings=[kombu.binding(exchanges[ex], routing_key=key) for ex, key in bindings],
        )
        for name, bindings in cfg["queues"].items()
    ]


def finished():
    global reached_at
    if cfg.get("stop_file") and os.path.exists(cfg["stop_file"]):
        return True
    if time.monotonic() - started > cfg.get("max_seconds", 60):
        emit("gave_up")
        return True
    expect = cfg.get("expect")
    if expect is not None and len(done) >= expect:
        if reached_at is None:
            reached_at = time.monotonic()
        return time.monotonic() - reached_at >= cfg.get("grace", 0.0)
    return False


def handler(queue):
    def on_message(body, message):
        now = time.time()
        emit(
            "msg",
            t=now,
            queue=queue,
            id=body["id"],
            sent=body.get("sent"),
            redelivered=bool(message.delivery_info.get("redelivered")),
        )
        if cfg.get("hold"):
            time.sleep(cfg["hold"])
        if cfg.get("work"):
            time.sleep(cfg["work"])
        if cfg.get("ack", True):
            message.ack()
            emit("ack", queue=queue, id=body["id"])
        done.add((queue, body["id"]))

    return on_message


def consume_plain():
    """One connection, drain_events(timeout=drain_timeout) until finished."""
    with connection() as conn:
        channel = conn.channel()
        consumers = [
            kombu.Consumer(
                channel,
                [queue],
                callbacks=[handler(queue.name)],
                accept=["json"],
                prefetch_count=cfg.get("prefetch"),
            )
            for queue in declared_queues()
        ]
        for consumer in consumers:
            consumer.consume()
        emit("ready")
        while not finished():
            timeout = cfg.get("drain_timeout", 0.5)
            if reached_at is not None:
                timeout = min(timeout, 0.1)
            try:
                conn.drain_events(timeout=timeout)
            except socket.timeout:
                pass


class Worker(ConsumerMixin):
    """kombu's reconnecting consumer loop (drain_events(timeout=1), reconnect on errors)."""

    def __init__(self):
        self.connection = connection()

    def get_consumers(self, Consumer, channel):
        return [
            Consumer(
                queues=[queue],
                callbacks=[handler(queue.name)],
                accept=["json"],
                prefetch_count=cfg.get("prefetch"),
            )
            for queue in declared_queues()
        ]

    def on_connection_error(self, exc, interval):
        emit("connection_error", error=repr(exc), interval=interval)

    def on_consume_ready(self, connection, channel, consumers, **kwargs):
        emit("ready")

    def on_iteration(self):
        if finished():
            self.should_stop = True

    def consume(self, *args, **kwargs):
        try:
            yield from super().consume(*args, **kwargs)
        except Exception as exc:
            emit("error", error=repr(exc))
            raise


def produce():
    plan = [tuple(m) for m in cfg.get("messages", [])]
    bulk = cfg.get("bulk")
    if bulk:
        first = bulk["start"]
        plan += [
            (bulk["exchange"], bulk["routing_key"], i) for i in range(first, first + bulk["count"])
        ]
    policy = {"max_retries": 100, "interval_start": 0.05, "interval_step": 0.1, "interval_max": 0.5}
    with connection() as conn:
        producer = conn.Producer(serializer="json")
        transport = conn.transport
        emit("ready")
        published = 0
        for exchange, key, ident in plan:
            if cfg.get("stop_file") and os.path.exists(cfg["stop_file"]):
                break
            producer.publish(
                {"id": ident, "sent": time.time()},
                exchange=exchange,
                routing_key=key,
                retry=cfg.get("retry", False),
                retry_policy=policy,
            )
            if conn.transport is not transport:  # kombu replaced it to recover from an error
                transport = conn.transport
                emit("reconnected", id=ident)
            published += 1
            if cfg.get("pause"):
                time.sleep(cfg["pause"])
        emit("done", count=published)


{"plain": consume_plain, "mixin": lambda: Worker().run(), "produce": produce}[cfg["mode"]]()
out.close()
'''

# --------------------------------------------------------------------------------------------
# Helpers


def with_libpq_options(url: str, options: str) -> str:
    """``url`` with a libpq ``options`` parameter (e.g. ``-c synchronous_commit=off``)."""
    return f"{url}{'&' if '?' in url else '?'}options={quote(options, safe='')}"


def read_events(path: Path) -> list[Event]:
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1]]  # the last one may be incomplete


def ids(events: list[Event], kind: str = "msg") -> list[int]:
    return [int(e["id"]) for e in events if e["ev"] == kind]


@dataclass
class Worker:
    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    log: Path
    stop_file: Path

    def events(self, kind: str | None = None) -> list[Event]:
        return [e for e in read_events(self.out) if kind is None or e["ev"] == kind]

    def log_tail(self) -> str:
        if self.popen.poll() is None:  # still running: have it dump its threads' stacks
            self.popen.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        text = self.log.read_text() if self.log.exists() else ""
        return f"--- {self.name} (exit code {self.popen.poll()}) log tail:\n{text[-5000:]}"

    def wait_for(
        self, predicate: Callable[[list[Event]], bool], what: str, timeout: float = 10.0
    ) -> list[Event]:
        deadline = time.monotonic() + timeout
        while True:
            exited = self.popen.poll() is not None
            events = self.events()
            if predicate(events):
                return events
            if exited or time.monotonic() > deadline:
                pytest.fail(
                    f"{self.name}: {'exited' if exited else 'timed out'} waiting for {what}\n"
                    + self.log_tail()
                )
            time.sleep(0.01)

    def wait_ready(self, timeout: float = 30.0) -> float:
        events = self.wait_for(lambda es: any(e["ev"] == "ready" for e in es), "ready", timeout)
        return float(next(e["t"] for e in events if e["ev"] == "ready"))

    def wait_msgs(self, n: int, timeout: float = 8.0, kind: str = "msg") -> list[Event]:
        return self.wait_for(lambda es: len(ids(es, kind)) >= n, f"{n} {kind} events", timeout)

    def stop(self) -> None:
        self.stop_file.touch()

    def join(self, timeout: float = 20.0) -> None:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            tail = self.log_tail()
            self.popen.kill()
            self.popen.wait()
            pytest.fail(f"{self.name} did not finish within {timeout} s\n{tail}")
        assert code == 0, self.log_tail()
        assert not self.events("gave_up"), f"{self.name} hit max_seconds\n{self.log_tail()}"


def start_script(root: Path, script: str, source: str, name: str, cfg: dict[str, Any]) -> Worker:
    """Run ``source`` (written to ``root/script`` the first time) as process ``name`` with
    ``cfg``: its events go to ``name.jsonl``, its output to ``name.log``; ``name.stop`` asks
    it to stop."""
    path = root / script
    if not path.exists():
        path.write_text(source)
    out = root / f"{name}.jsonl"
    log = root / f"{name}.log"
    stop_file = root / f"{name}.stop"
    cfg = {"out": str(out), "stop_file": str(stop_file), **cfg}
    with log.open("wb") as log_file:
        popen = subprocess.Popen(
            [sys.executable, str(path), json.dumps(cfg)],
            cwd=root,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return Worker(name, popen, out, log, stop_file)


def kill_running(processes: list[Worker]) -> None:
    """Kill those of ``processes`` (the ones a test started) still running."""
    for process in processes:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()


@dataclass
class Spawner:
    root: Path
    workers: list[Worker] = field(default_factory=list)

    def __call__(self, name: str, **cfg: Any) -> Worker:
        worker = start_script(self.root, "lonnymq_worker.py", WORKER, name, cfg)
        self.workers.append(worker)
        return worker


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path)
    yield spawner
    kill_running(spawner.workers)


RETRY = {"max_retries": 100, "interval_start": 0.05, "interval_step": 0.1, "interval_max": 1.0}


@contextmanager
def publisher(
    url: str, options: dict[str, Any], *, retry: bool = False
) -> Iterator[Callable[[str, str, int], None]]:
    """A kombu producer in this process: publish(exchange, routing_key, id); the body carries
    the id and the publish time."""
    with Connection(url, transport_options=dict(options)) as conn:
        producer = conn.Producer(serializer="json")

        def publish(exchange: str, routing_key: str, ident: int) -> None:
            producer.publish(
                {"id": ident, "sent": time.time()},
                exchange=exchange,
                routing_key=routing_key,
                retry=retry,
                retry_policy=dict(RETRY),
            )

        yield publish


def assert_empty(broker: lonnymq.Broker, conn: Conn, *queues: str) -> None:
    for name in queues:
        stats = broker.queue(name).stats(conn)
        assert (stats.total, stats.in_flight) == (0, 0), stats


def single_queue(exchange: str, key: str, queue: str) -> Topology:
    return {"exchanges": {exchange: "direct"}, "queues": {queue: [[exchange, key]]}}


# Terminates this test's lonnymq backends only: their last query names the test's unique
# schema (other tests may be using the same server). Returns (application_name, query, ok).
TERMINATE = """
SELECT application_name, query, pg_terminate_backend(pid)
FROM pg_stat_activity
WHERE application_name LIKE 'lonnymq-%%' AND pid <> pg_backend_pid()
  AND position(%s in query) > 0
"""


def cut_connections(conn: Conn, schema: str) -> Counter[str]:
    """Terminate the transport's backends of ``schema``; counts them by role: ``listen``,
    ``producer`` (a command connection whose last query was a publish, or the flush after
    one: publish_commit="flush_after"), ``consumer``."""
    cut: Counter[str] = Counter()
    for app, query, ok in conn.execute(TERMINATE, (schema,)).fetchall():
        if not ok:
            continue
        if app == "lonnymq-listen":
            cut["listen"] += 1
        elif "message_publish_v" in query or "pg_logical_emit_message" in query:
            cut["producer"] += 1
        else:
            cut["consumer"] += 1
    return cut


# --------------------------------------------------------------------------------------------
# 1. Routing across processes, and 10,000 messages exactly once

ROUTING: Topology = {
    "exchanges": {"px.direct": "direct", "px.topic": "topic", "px.fanout": "fanout"},
    "queues": {
        "d.red": [["px.direct", "red"]],
        "d.green": [["px.direct", "green"], ["px.direct", "lime"]],
        "t.nyse": [["px.topic", "stock.*.nyse"]],
        "t.stock": [["px.topic", "stock.#"]],
        "t.usd": [["px.topic", "*.usd.*"]],
        "t.all": [["px.topic", "#"]],
        "f.one": [["px.fanout", ""]],
        "f.two": [["px.fanout", ""]],
        "f.three": [["px.fanout", "ignored"]],
    },
}
FANOUT = {"f.one", "f.two", "f.three"}
# (exchange, routing key) -> the queues it must reach. kombu's topic semantics: '*' is exactly
# one word, '#' one or more ('.*?' between dots).
ROUTES: list[tuple[str, str, set[str]]] = [
    ("px.direct", "red", {"d.red"}),
    ("px.direct", "green", {"d.green"}),
    ("px.direct", "lime", {"d.green"}),
    ("px.direct", "blue", set()),
    ("px.direct", "stock.usd.nyse", set()),  # a direct exchange does not match patterns
    ("px.topic", "stock.usd.nyse", {"t.nyse", "t.stock", "t.usd", "t.all"}),
    ("px.topic", "stock.eur.nyse", {"t.nyse", "t.stock", "t.all"}),
    ("px.topic", "stock.usd.lse", {"t.stock", "t.usd", "t.all"}),
    ("px.topic", "stock.a.b.nyse", {"t.stock", "t.all"}),
    ("px.topic", "bond.usd.nyse", {"t.usd", "t.all"}),
    ("px.topic", "bond.usd", {"t.all"}),
    ("px.topic", "red", {"t.all"}),
    ("px.fanout", "anything", FANOUT),
    ("px.fanout", "", FANOUT),
]
PER_ROUTE = 5


def test_routing_across_processes(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """The consumer declares exchanges, queues and bindings; a producer in another process
    publishes by exchange + routing key only; each message reaches exactly the queues its
    exchange type and bindings select, once (and unroutable ones none)."""
    expected: Counter[tuple[str, int]] = Counter()
    messages: list[list[Any]] = []
    for n, (exchange, key, targets) in enumerate(ROUTES):
        for k in range(PER_ROUTE):
            ident = n * 100 + k
            messages.append([exchange, key, ident])
            expected.update((queue, ident) for queue in targets)
    options = {"schema": schema}
    consumer = spawn(
        "consumer", mode="plain", url=url, options=options, expect=len(expected), grace=1.0,
        **ROUTING,
    )  # fmt: skip
    consumer.wait_ready()
    producer = spawn("producer", mode="produce", url=url, options=options, messages=messages)
    producer.join()
    consumer.join(timeout=10)

    events = consumer.events()
    got = Counter((e["queue"], int(e["id"])) for e in events if e["ev"] == "msg")
    assert got == expected, (
        f"missing: {sorted(expected - got)}; unexpected or duplicated: {sorted(got - expected)}"
    )
    assert not any(e["redelivered"] for e in events if e["ev"] == "msg")
    assert_empty(broker, conn, *ROUTING["queues"])


@pytest.mark.slow
def test_10k_messages_cross_process_exactly_once(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """10,000 messages published by one process on a direct exchange, consumed (and acked
    one by one) concurrently by another: every id arrives exactly once, none redelivered;
    the queue ends empty. (synchronous_commit=off, passed as a libpq parameter in the URL,
    only spares the WAL flushes: locking and visibility are unchanged.)"""
    total = 10_000
    fast = with_libpq_options(url, "-c synchronous_commit=off")
    options = {"schema": schema}
    topology = single_queue("bulk.direct", "bulk", "bulk")
    consumer = spawn(
        "consumer", mode="plain", url=fast, options=options, expect=total, grace=1.0,
        max_seconds=80, **topology,
    )  # fmt: skip
    consumer.wait_ready()
    started = time.monotonic()
    producer = spawn(
        "producer", mode="produce", url=fast, options=options,
        bulk={"exchange": "bulk.direct", "routing_key": "bulk", "start": 0, "count": total},
    )  # fmt: skip
    consumer.wait_msgs(1)
    producer.join(timeout=60)
    consumer.join(timeout=60)
    elapsed = time.monotonic() - started

    events = consumer.events()
    received = Counter(ids(events))
    duplicates = {i: n for i, n in received.items() if n > 1}
    missing = set(range(total)) - set(received)
    assert not duplicates, f"{len(duplicates)} ids delivered more than once: {duplicates}"
    assert not missing, f"{len(missing)} ids never delivered: {sorted(missing)[:20]}"
    assert set(received) == set(range(total))
    assert Counter(ids(events, "ack")) == received
    assert not any(e["redelivered"] for e in events if e["ev"] == "msg")
    assert_empty(broker, conn, "bulk")
    print(f"\n10k cross-process: published and consumed in {elapsed:.1f} s")


# --------------------------------------------------------------------------------------------
# 2. A consumer killed with SIGKILL: its messages come back after visibility_timeout


def test_sigkilled_consumer_messages_redelivered_after_visibility_timeout(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """A consumer holds 5 prefetched, unacked messages for longer than visibility_timeout
    (its heartbeat keeps them), then is SIGKILLed; a second consumer, waiting meanwhile,
    gets none of them before their locks can have expired, and all of them, flagged
    redelivered, soon after."""
    vt = 2.0
    heartbeat = vt / 4  # the default heartbeat_interval
    options = {"schema": schema, "visibility_timeout": vt}
    topology = single_queue("kill.direct", "k", "kill")
    n = 5
    first = spawn(
        "holder", mode="plain", url=url, options=options, prefetch=n, ack=False, **topology
    )
    first.wait_ready()
    with publisher(url, options) as publish:
        for i in range(n):
            publish("kill.direct", "k", i)
    held = first.wait_msgs(n)
    held_at = max(e["t"] for e in held if e["ev"] == "msg")
    assert sorted(ids(held)) == list(range(n))
    stats = broker.queue("kill").stats(conn)
    assert (stats.total, stats.in_flight) == (n, n), stats

    second = spawn("second", mode="plain", url=url, options=options, **topology)
    second.wait_ready()
    # Hold them alive for longer than visibility_timeout: the heartbeat keeps them locked.
    time.sleep(max(0.0, held_at + vt + 0.5 - time.time()))
    assert not second.events("msg"), "delivered twice while the first consumer was alive"

    first.popen.send_signal(signal.SIGKILL)
    killed_at = time.time()
    assert first.popen.wait(5) == -signal.SIGKILL
    second.wait_msgs(n, timeout=vt + 8)
    second.stop()
    second.join()

    events = second.events()
    msgs = [e for e in events if e["ev"] == "msg"]
    assert sorted(ids(events)) == list(range(n)), "each message once to the second consumer"
    delays = sorted(e["t"] - killed_at for e in msgs)
    print(f"\nSIGKILL: redelivered {[round(d, 2) for d in delays]} s after the kill")
    # The last heartbeat came at most one heartbeat interval before the kill, so the locks
    # expire between vt - heartbeat and vt after it.
    assert delays[0] >= vt - heartbeat - 0.1, f"redelivered too early: {delays}"
    assert delays[-1] <= vt + 1.5, f"redelivered too late: {delays}"
    assert all(e["redelivered"] is True for e in msgs), msgs
    assert sorted(ids(events, "ack")) == list(range(n))
    assert_empty(broker, conn, "kill")


# --------------------------------------------------------------------------------------------
# 3. A live consumer holding a message for 3x visibility_timeout keeps it


def test_live_consumer_keeps_its_lock_past_visibility_timeout(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """visibility_timeout=1.5 (heartbeat every 0.375 s): a consumer busy for 3x that with one
    message (its main thread asleep in the callback, as a worker running a long task) keeps
    it: a second consumer of the queue, which does consume another message meanwhile, never
    gets it. After the first acks, the queue is empty."""
    vt = 1.5
    hold = 3 * vt
    options = {"schema": schema, "visibility_timeout": vt}
    topology = single_queue("hold.direct", "h", "hold")
    holder = spawn(
        "holder", mode="plain", url=url, options=options, prefetch=1, hold=hold, expect=1,
        **topology,
    )  # fmt: skip
    holder.wait_ready()
    with publisher(url, options) as publish:
        publish("hold.direct", "h", 1)
        taken = holder.wait_msgs(1)
        assert ids(taken) == [1]
        taken_at = float(next(e["t"] for e in taken if e["ev"] == "msg"))
        other = spawn("other", mode="plain", url=url, options=options, **topology)
        other_ready = other.wait_ready()
        publish("hold.direct", "h", 2)  # proves the other consumer consumes meanwhile
        other.wait_for(lambda es: 2 in ids(es), "message 2")
    holder.join(timeout=hold + 10)
    acked = holder.events("ack")
    assert [int(e["id"]) for e in acked] == [1]
    acked_at = float(acked[0]["t"])
    assert acked_at - taken_at >= hold
    assert other_ready <= acked_at - vt, "the other consumer watched less than one lock period"
    time.sleep(0.3)
    other.stop()
    other.join()

    assert ids(other.events()) == [2], "the held message was delivered to the other consumer"
    assert ids(other.events(), "ack") == [2]
    assert_empty(broker, conn, "hold")
    print(
        f"\nhold: message 1 held {acked_at - taken_at:.2f} s; the other consumer watched "
        f"for {acked_at - other_ready:.2f} s of it"
    )


# --------------------------------------------------------------------------------------------
# 4. Postgres restarted under a running consumer


@pytest.mark.slow
def test_consumer_survives_postgres_restart(spawn: Spawner, schema: str) -> None:
    """A consumer process (kombu's ConsumerMixin: drain_events(timeout=1), reconnect on
    connection errors) on a throwaway server; 200 messages published, the server restarted
    while they are being consumed, 200 more published (kombu retry): all 400 consumed."""
    server = TempPostgres().init().start()
    try:
        url = lonnymq_url(server.dsn())
        options = {"schema": schema, "visibility_timeout": 2.0}
        topology = single_queue("rs.direct", "r", "restart")
        consumer = spawn(
            "consumer", mode="mixin", url=url, options=options, expect=400, grace=1.0,
            work=0.005, max_seconds=60, **topology,
        )  # fmt: skip
        consumer.wait_ready()
        with publisher(url, options, retry=True) as publish:
            for i in range(200):
                publish("rs.direct", "r", i)
            consumer.wait_msgs(50, kind="ack")
            server.restart()
            before_restart = set(ids(consumer.events(), "ack"))
            for i in range(200, 400):
                publish("rs.direct", "r", i)
        consumer.join(timeout=40)

        events = consumer.events()
        acked = set(ids(events, "ack"))
        assert len(before_restart) < 200, "the restart did not happen mid-run"
        assert acked == set(range(400)), f"never consumed: {sorted(set(range(400)) - acked)}"
        # the restart reached the consumer: its drain loop got the error (and reconnected), or
        # its heartbeat thread or LISTEN connection met it first and the next call reconnected
        log = consumer.log.read_text()
        assert consumer.events("error") or "LISTEN connection lost" in log, log[-3000:]
        with psycopg.connect(server.dsn(), autocommit=True) as pg:
            assert_empty(lonnymq.Broker(schema), pg, "restart")
        dups = sum(n - 1 for n in Counter(ids(events)).values())
        print(
            f"\nrestart: {len(before_restart)}/200 acked before it; consumer recovered from "
            f"{len(consumer.events('error'))} error(s) in its drain loop; {dups} delivered twice"
        )
    finally:
        server.cleanup()


# --------------------------------------------------------------------------------------------
# 5. Connections cut (pg_terminate_backend) while consuming and publishing


@pytest.mark.slow
def test_consumer_and_producer_survive_terminated_connections(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """The transport's backends (application_name lonnymq-*) are terminated three times, a
    second apart, while a producer process publishes (kombu retry) and a consumer process
    (ConsumerMixin) consumes: both recover, and every message published arrives."""
    options = {"schema": schema, "visibility_timeout": 2.0}
    topology = single_queue("cut.direct", "c", "cut")
    consumer = spawn("consumer", mode="mixin", url=url, options=options, max_seconds=60, **topology)
    consumer.wait_ready()
    producer = spawn(
        "producer", mode="produce", url=url, options=options, retry=True, pause=0.005,
        bulk={"exchange": "cut.direct", "routing_key": "c", "start": 0, "count": 100_000},
    )  # fmt: skip
    consumer.wait_msgs(1, kind="ack")
    cut: Counter[str] = Counter()
    for _ in range(3):
        time.sleep(1.0)
        cut += cut_connections(conn, schema)
    time.sleep(0.5)
    producer.stop()
    producer.join()
    [done] = producer.events("done")
    total = int(done["count"])
    consumer.wait_for(
        lambda es: set(ids(es, "ack")) >= set(range(total)), f"all {total} messages acked", 20
    )
    time.sleep(0.5)  # any duplicate on its way
    consumer.stop()
    consumer.join()

    events = consumer.events()
    dups = sum(n - 1 for n in Counter(ids(events)).values())
    print(
        f"\ncuts: terminated {dict(cut)}; {total} messages; consumer recovered from "
        f"{len(consumer.events('error'))} error(s), producer reconnected "
        f"{len(producer.events('reconnected'))}x; {dups} delivered twice"
    )
    assert cut["consumer"] >= 2 and cut["producer"] >= 2 and cut["listen"] >= 1, cut
    assert set(ids(events, "ack")) == set(range(total))
    assert consumer.events("error"), "the consumer never saw a cut"
    assert producer.events("reconnected"), "the producer never saw a cut"
    assert_empty(broker, conn, "cut")


def test_producer_with_errback_in_retry_policy_recovers_from_a_cut(
    url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """kombu documents retry_policy as the keywords of Connection.ensure(), errback among
    them (Celery adds retry_errors). A producer (here, in this process) whose connection is
    terminated publishes again on the next call, its errback told once."""
    options = {"schema": schema}
    errors: list[BaseException] = []
    policy = {**RETRY, "errback": lambda exc, interval: errors.append(exc)}
    with Connection(url, transport_options=dict(options)) as kconn:
        Queue("eb", Exchange("eb.direct"), routing_key="e")(kconn.channel()).declare()
        producer = kconn.Producer(serializer="json")
        # (twice: a producer's first publish starts a sweep on the same connection, and
        # the cut finds the producer's connection by its last query, a publish)
        for i in (0, 1):
            producer.publish(
                {"id": i}, exchange="eb.direct", routing_key="e", retry=True, retry_policy=policy
            )
            join_running(timeout=5.0)
        assert cut_connections(conn, schema)["producer"] == 1
        producer.publish(
            {"id": 2}, exchange="eb.direct", routing_key="e", retry=True, retry_policy=policy
        )
    assert len(errors) == 1, errors
    assert broker.queue("eb").stats(conn).total == 3


# --------------------------------------------------------------------------------------------
# 6. An idle consumer wakes on NOTIFY


def test_idle_consumer_wakeup_latency(
    spawn: Spawner, url: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """An idle consumer blocked in drain_events(timeout=60), with polling_interval=30 so only
    LISTEN/NOTIFY can wake it in time, receives each of 100 messages published one at a time
    by this process: publish -> receive latency median < 50 ms, p99 < 250 ms."""
    n = 100
    options = {"schema": schema, "polling_interval": 30.0}
    topology = single_queue("lat.direct", "l", "latency")
    consumer = spawn(
        "consumer", mode="plain", url=url, options=options, expect=n, drain_timeout=60,
        **topology,
    )  # fmt: skip
    consumer.wait_ready()
    time.sleep(0.5)  # let it go idle (blocked on its LISTEN connection)
    with publisher(url, options) as publish:
        for i in range(n):
            publish("lat.direct", "l", i)
            if i == 0:
                consumer.wait_msgs(1, timeout=5)
            time.sleep(0.03)
    consumer.join(timeout=10)

    msgs = [e for e in consumer.events() if e["ev"] == "msg"]
    assert sorted(int(e["id"]) for e in msgs) == list(range(n))
    latencies = sorted(e["t"] - e["sent"] for e in msgs)
    median = statistics.median(latencies)
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(
        f"\nwake-up latency over {n} messages: median {median * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    assert median < 0.050
    assert p99 < 0.250


def test_message_published_while_listen_connection_opens_is_not_missed(
    spawn: Spawner, pg_dsn: str, schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    """The consumer's URL lists, before the real server, a port that accepts TCP connections
    but never answers, with connect_timeout=1: each connection it opens first waits ~2 s
    there. Its LISTEN connection, opened when it starts consuming, is cut while it is idle,
    so the one it opens again takes ~2 s to set up. A message published meanwhile must be
    consumed as soon as the LISTEN is in place, not at the next poll (polling_interval=6)."""
    polling = 6.0
    blackhole = socket.socket()
    listening_query = (
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'lonnymq-listen' "
        "AND position(%s in query) > 0"
    )
    try:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(16)
        rest = pg_dsn.split("://", 1)[1]
        userinfo, at, hosts = rest.rpartition("@")
        assert not hosts.startswith("/"), "needs a DSN with a host"
        slow_url = f"lonnymq://{userinfo}{at}127.0.0.1:{blackhole.getsockname()[1]},{hosts}"
        options = {"schema": schema, "polling_interval": polling}
        topology = single_queue("lw.direct", "w", "wakeup")
        consumer = spawn(
            "consumer", mode="plain", url=slow_url, options={**options, "connect_timeout": 1},
            expect=1, drain_timeout=60, **topology,
        )  # fmt: skip
        consumer.wait_ready()
        deadline = time.monotonic() + 10
        pids: list[tuple[Any, ...]] = []
        while not pids and time.monotonic() < deadline:  # asleep on its LISTEN session
            pids = conn.execute(listening_query, (schema,)).fetchall()
            time.sleep(0.05)
        assert len(pids) == 1, pids
        conn.execute("SELECT pg_terminate_backend(%s)", (pids[0][0],))
        cut_at = time.time()
        time.sleep(0.5)  # it is opening the LISTEN connection again, ~2 s
        assert conn.execute(listening_query, (schema,)).fetchall() == [], (
            "the LISTEN connection was already open again: no race to test"
        )
        with publisher(lonnymq_url(pg_dsn), options) as publish:
            publish("lw.direct", "w", 1)
        consumer.join(timeout=polling + 5)
    finally:
        blackhole.close()
    [msg] = consumer.events("msg")
    took = msg["t"] - cut_at
    print(f"\nlost wake-up: published 0.5 s after the cut, received after {took:.2f} s")
    assert took < polling - 2, f"received only at the next poll, {took:.2f} s after the cut"
