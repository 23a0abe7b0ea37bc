# mypy: allow-untyped-calls
# (celery and kombu are untyped)
"""Kombu's queue keyword arguments (``expires``, ``message_ttl``, ``max_length``,
``max_priority``) and what expires when the processes that used a queue are gone: reply
queues of Celery's ``rpc://`` backend, pidbox queues of exited workers, kombu queues whose
consumer exited. Real Postgres, real kombu, real Celery worker and client processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from psycopg import sql

import lonnymq
from lonnymq import ChannelFull, InvalidArgument
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]


@pytest.fixture
def kombu_defaults() -> dict[str, Any]:
    """make_connection's defaults here: none but the schema (the transport's own timings)."""
    return {}


def queue_row(conn: Conn, schema: str, queue: str) -> tuple[Any, ...] | None:
    """The queue's (expires_ms, message_ttl_ms, max_size, max_concurrency), or None."""
    if conn.execute("SELECT to_regclass(%s)", (f"{schema}.queue",)).fetchone() == (None,):
        return None  # not installed yet
    return conn.execute(
        sql.SQL(
            "SELECT expires_ms, message_ttl_ms, max_size, max_concurrency FROM {} WHERE name = %s"
        ).format(sql.Identifier(schema, "queue")),
        (queue,),
    ).fetchone()


def messages_of(conn: Conn, schema: str, queue: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE queue = %s").format(
            sql.Identifier(schema, "message")
        ),
        (queue,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    tail = f"\nlog:\n{log.read_text(errors='replace')[-4000:]}" if log and log.exists() else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what}{tail}")


# --------------------------------------------------------------------------------------------
# 1. kombu's queue keyword arguments


def test_queue_keyword_arguments_are_mapped_like_amqp(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """``Queue(expires=, message_ttl=, max_length=, max_priority=)`` (seconds, as kombu
    takes them) become ``x-expires`` / ``x-message-ttl`` in milliseconds, ``x-max-length``
    the queue's default ``max_size``, as kombu's amqp and redis transports map them."""
    with make_connection() as connection:
        q = Queue("kw", expires=5, message_ttl=2.5, max_length=3, max_priority=10)
        q(connection.default_channel).declare()
        assert queue_row(conn, schema, "kw") == (5000, 2500, 3, None)
        producer = connection.Producer()
        for i in range(3):
            producer.publish({"i": i}, routing_key="kw", priority=i)
        with pytest.raises(ChannelFull):  # a fourth: refused, like x-overflow=reject-publish
            producer.publish({"i": 3}, routing_key="kw")
        # priorities are honoured (higher first), within max_priority
        got = []
        for _ in range(3):
            message = q(connection.default_channel).get(no_ack=True)
            assert message is not None
            got.append(message.payload["i"])
        assert got == [2, 1, 0]
        # a declare with the queue_arguments spelling gives the same row
        Queue("kw2", queue_arguments={"x-expires": 5000, "x-message-ttl": 2500, "x-max-length": 3})(
            connection.default_channel
        ).declare()
        assert queue_row(conn, schema, "kw2") == (5000, 2500, 3, None)
        # a redeclare without max_length leaves the limit (a policy) alone; other arguments
        # are what the last declare with arguments says, as before
        Queue("kw", expires=7)(connection.default_channel).declare()
        assert queue_row(conn, schema, "kw") == (7000, None, 3, None)


def test_a_plain_declare_of_an_existing_queue_changes_none_of_its_arguments(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """Another process's plain declare (``Queue(name)``, a ``SimpleQueue``: no arguments)
    leaves the queue's expiry, time to live, priority cap and limit as its declare with
    arguments set them (it cleared all but the limit: the messages then outlived their time to
    live and the priorities went uncapped). ``auto_delete`` is what the last declare says (a
    plain declare never leaves a queue that goes with its last consumer). A declare with
    arguments still sets them all."""
    settings = (
        "SELECT expires_ms, message_ttl_ms, max_priority, auto_delete FROM {}.queue "
        "WHERE name = 'jobs'"
    )

    def row() -> tuple[Any, ...] | None:
        return conn.execute(sql.SQL(settings).format(sql.Identifier(schema))).fetchone()

    configured = Queue(
        "jobs", message_ttl=0.2, expires=3600, max_priority=5, max_length=100, auto_delete=True
    )
    with make_connection() as first, make_connection() as second:
        configured(first.default_channel).declare()
        assert row() == (3_600_000, 200, 5, True)
        Queue("jobs")(second.default_channel).declare()
        jobs = second.SimpleQueue("jobs")
        assert row() == (3_600_000, 200, 5, False)
        limits = queue_row(conn, schema, "jobs")
        assert limits is not None and limits[2] == 100  # (the limit, as before)
        jobs.put({"late": True}, priority=9)
        time.sleep(0.4)
        with pytest.raises(jobs.Empty):  # (past its time to live: dropped, not delivered)
            jobs.get(timeout=0.5)
        jobs.close()
        Queue("jobs", expires=7)(first.default_channel).declare()
        assert row() == (7000, None, None, False)


def test_queue_message_ttl_in_seconds_drops_undelivered_messages(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    with make_connection() as connection:
        q = Queue("short", message_ttl=0.2)
        q(connection.default_channel).declare()
        connection.Producer().publish("old", routing_key="short")
        time.sleep(0.4)
        assert q(connection.default_channel).get(no_ack=True) is None
        assert lonnymq.Broker(schema).queue("short").stats(conn).total == 0


@pytest.mark.parametrize(
    ("queue", "needle"),
    [
        (lambda: Queue("b", max_length_bytes=1000), "x-max-length-bytes"),
        (
            lambda: Queue("d", max_length=5, queue_arguments={"x-overflow": "drop-head"}),
            "x-overflow",
        ),
        (lambda: Queue("p", max_priority=256), "x-max-priority"),
        (lambda: Queue("p0", max_priority=0), "x-max-priority"),
        (lambda: Queue("m", max_length=-1), "x-max-length"),
        (lambda: Queue("e", expires=0.0001), "x-expires"),
    ],
    ids=["max_length_bytes", "drop-head", "priority-256", "priority-0", "length-neg", "tiny"],
)
def test_queue_arguments_that_cannot_be_honoured_are_refused(
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
    queue: Callable[[], Queue],
    needle: str,
) -> None:
    with make_connection() as connection:
        q = queue()
        with pytest.raises(InvalidArgument, match=needle):
            q(connection.default_channel).declare()
        assert queue_row(conn, schema, q.name) is None  # nothing was written


def test_reject_publish_overflow_is_accepted(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    with make_connection() as connection:
        Queue("r", max_length=1, queue_arguments={"x-overflow": "reject-publish"})(
            connection.default_channel
        ).declare()
        assert queue_row(conn, schema, "r") == (None, None, 1, None)


# --------------------------------------------------------------------------------------------
# Celery processes


APP = r'''
"""Celery app of tests/test_queue_expiry.py."""
import os
import sys

from celery import Celery

import lonnymq  # noqa: F401  registers lonnymq://

app = Celery("lmqexp", broker=__URL__, backend="rpc://")
app.conf.update(
    broker_transport_options={
        "schema": __SCHEMA__,
        "expire_interval": float(os.environ.get("LMQ_EXPIRE_INTERVAL", "0.5")),
    },
    result_expires=float(os.environ.get("LMQ_RESULT_EXPIRES", "3")),
    control_queue_expires=float(os.environ.get("LMQ_CONTROL_EXPIRES", "3")),
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)


@app.task(name="t.add", shared=False)
def add(x, y):
    return x + y


@app.task(name="t.slow", shared=False)
def slow(seconds):
    import time

    time.sleep(seconds)
    return seconds


if __name__ == "__main__":
    if sys.argv[1] == "late":
        # a client that waits a little for a slow task's result, gives up and goes away
        pending = slow.delay(float(sys.argv[2]))
        print(app.backend.oid, flush=True)
        try:
            pending.get(timeout=0.5)
        except Exception as exc:
            print("gave up:", type(exc).__name__, flush=True)
        sys.exit(0)
    # a client: send tasks and go away without reading their results
    results = [add.delay(2, i) for i in range(int(sys.argv[1]))]
    print(app.backend.oid, flush=True)
'''


class App:
    def __init__(self, directory: Path, pg_dsn: str, schema: str) -> None:
        self.dir = directory
        self.schema = schema
        self.module = f"lmqexp_{uuid.uuid4().hex[:10]}"
        self.path = directory / f"{self.module}.py"
        self.path.write_text(
            APP.replace("__URL__", repr(lonnymq_url(pg_dsn))).replace("__SCHEMA__", repr(schema))
        )
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.dir), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env.update(extra or {})
        return env

    def worker(self, name: str, extra: dict[str, str] | None = None) -> tuple[Any, Path]:
        log = self.dir / f"{name}.log"
        argv = [sys.executable, "-m", "celery", "-A", self.module, "worker", "--pool", "solo"]
        argv += ["-n", f"{name}@%h", "-l", "INFO"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=self.dir,
                env=self.env(extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        wait_for(lambda: " ready." in log.read_text(errors="replace"), 30, f"{name} ready", log)
        return proc, log

    def client(self, tasks: int | str, *args: str, extra: dict[str, str] | None = None) -> str:
        """Run the app module as a client that sends ``tasks`` tasks (or, ``"late"``, one
        slow task whose result it waits 0.5 s for) and exits; its reply queue's name."""
        done = subprocess.run(
            [sys.executable, str(self.path), str(tasks), *args],
            cwd=self.dir,
            env=self.env(extra),
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done.stdout.decode().split()[0]

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@pytest.fixture
def app(tmp_path: Path, pg_dsn: str, schema: str) -> Iterator[App]:
    made = App(tmp_path, pg_dsn, schema)
    try:
        yield made
    finally:
        made.stop()


@pytest.mark.slow
def test_rpc_reply_queue_of_a_client_that_went_away_expires_with_its_results(
    app: App, conn: Conn, schema: str
) -> None:
    """Celery's ``rpc://`` backend declares each client's reply queue with ``expires`` =
    ``result_expires``. A client that sent tasks and exited without reading their results
    leaves that queue and the results in it; they go once it has been unused that long."""
    _, log = app.worker("w1")
    reply = app.client(3)
    # the worker ran the tasks and sent the results to the client's (gone) reply queue
    wait_for(lambda: messages_of(conn, schema, reply) == 3, 20, "3 results", log)
    row = queue_row(conn, schema, reply)
    assert row is not None and row[0] == 3000, row  # result_expires=3 s -> x-expires 3000 ms
    # ... and both go after 3 s unused (the live worker sweeps every 0.5 s)
    wait_for(lambda: queue_row(conn, schema, reply) is None, 20, "the reply queue to go", log)
    assert messages_of(conn, schema, reply) == 0


@pytest.mark.slow
def test_a_late_rpc_result_does_not_re_create_a_reply_queue_that_went(
    app: App, conn: Conn, schema: str
) -> None:
    """A client waited 0.5 s for a slow task's result, gave up and exited: its reply queue
    (``auto_delete``) went with its consumer, as on RabbitMQ. The result the worker sends
    later is dropped: it used to re-create the queue, without its ``x-expires``, for ever.
    (A reply queue that goes at its ``x-expires``: the test below.)"""
    _, log = app.worker("w0")
    reply = app.client("late", "2")
    assert queue_row(conn, schema, reply) is None  # gone with the client's consumer
    wait_for(lambda: "succeeded in" in log.read_text(errors="replace"), 20, "the task", log)
    time.sleep(1.0)  # the result was published, and ingested were it anywhere
    assert queue_row(conn, schema, reply) is None
    assert messages_of(conn, schema, reply) == 0
    gone = conn.execute(
        sql.SQL("SELECT reason FROM {} WHERE name = %s").format(
            sql.Identifier(schema, "queue_gone")
        ),
        (reply,),
    ).fetchone()
    assert gone == ("auto_delete",)


def test_a_publish_does_not_wait_for_the_sweep_it_starts(
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer's sweep runs beside the publish that found it due: the publish returns
    without it (here a sweep held up for 1 s before it runs), the sweep still removes the
    expired queue, and closing the connection waits for it (no thread left behind)."""
    from lonnymq.transport.sweep import Sweeper

    real = Sweeper.sweep

    def held_up(self: Sweeper, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return real(self, *args, **kwargs)

    with make_connection(expire_interval=0.1) as c:
        Queue("reply.slow", expires=0.5)(c.default_channel).declare()
        c.Producer().publish("x", routing_key="elsewhere")  # (the process's first sweep)
        time.sleep(0.8)  # > x-expires, > expire_interval
        monkeypatch.setattr(Sweeper, "sweep", held_up)
        started = time.monotonic()
        c.Producer().publish("y", routing_key="elsewhere")
        assert time.monotonic() - started < 0.5
        sweeping = c.transport._sweeping
        assert sweeping is not None and sweeping.is_alive()  # held up: closing waits for it
        assert queue_row(conn, schema, "reply.slow") is not None
    assert not sweeping.is_alive()
    assert queue_row(conn, schema, "reply.slow") is None


def test_a_late_publish_does_not_re_create_a_queue_swept_at_its_expiry(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A reply queue that nobody read goes at its ``x-expires``; a result published to it
    after that (by the default exchange, as an ``rpc://`` result is) is dropped, as on
    RabbitMQ, instead of re-creating the queue without its ``x-expires``."""
    with make_connection(expire_interval=0.1) as c:
        Queue("reply.late", expires=0.5)(c.default_channel).declare()
        assert queue_row(conn, schema, "reply.late") is not None
        time.sleep(0.8)  # > x-expires
        c.Producer().publish("x", routing_key="elsewhere")  # starts a sweep, beside it
        wait_for(lambda: queue_row(conn, schema, "reply.late") is None, 5, "the sweep")
        gone = conn.execute(
            sql.SQL("SELECT reason FROM {} WHERE name = %s").format(
                sql.Identifier(schema, "queue_gone")
            ),
            ("reply.late",),
        ).fetchone()
        assert gone == ("expired",)
        c.Producer().publish({"result": 2}, routing_key="reply.late")  # the late result
        assert queue_row(conn, schema, "reply.late") is None
        assert messages_of(conn, schema, "reply.late") == 0


@pytest.mark.parametrize("expires", [0.5, 3.0], ids=["half_a_second", "three_seconds"])
def test_a_queue_declared_again_and_again_never_expires(
    make_connection: Callable[..., Connection], conn: Conn, schema: str, expires: float
) -> None:
    """A queue declared again more often than its ``x-expires`` (as Celery's ``rpc://``
    client declares its reply queue before every task) is in use: no sweep takes it, and
    the message it holds stays. (A declare records its use lazily, so a queue declared
    every 0.15 s with an ``x-expires`` of 0.5 s was swept as unused: the second before
    version 26 records no use.)"""
    broker = lonnymq.Broker(schema)
    with make_connection() as c:
        q = Queue("reply.busy", expires=expires)
        q(c.default_channel).declare()
        c.Producer().publish("kept", routing_key="reply.busy")
        deadline = time.monotonic() + max(2.0, 1.5 * expires)
        while time.monotonic() < deadline:
            time.sleep(0.15)
            q(c.default_channel).declare()
            broker.expire(conn)  # another client's sweep, right after the declare
        assert messages_of(conn, schema, "reply.busy") == 1
        # and it still goes when it is no longer used
        time.sleep(expires * 1.2)
        wait_for(lambda: broker.expire(conn)[1] == 1, expires + 5, "its expiry")
        assert queue_row(conn, schema, "reply.busy") is None


def test_a_reply_queue_declared_again_writes_nothing(
    broker: lonnymq.Broker, conn: Conn, schema: str
) -> None:
    """Celery's ``rpc://`` client declares its reply queue (``x-expires`` a day) before
    every task it sends: a declare a second after the last one writes nothing (no durable
    commit to wait for); a declare that changes an argument does."""
    declare = sql.SQL(
        "SELECT * FROM {}.queue_declare_v2('reply.rpc', %s, NULL, true, NULL)"
    ).format(sql.Identifier(schema))
    written = "SELECT pg_current_xact_id_if_assigned() IS NOT NULL"
    with conn.transaction():
        conn.execute(declare, (86_400_000,))
        assert conn.execute(written).fetchone() == (True,)  # created
    time.sleep(1.1)
    with conn.transaction():
        assert conn.execute(declare, (86_400_000,)).fetchone() == (0, 0)
        assert conn.execute(written).fetchone() == (False,)
    with conn.transaction():
        conn.execute(declare, (3_600_000,))
        assert conn.execute(written).fetchone() == (True,)


@pytest.mark.slow
def test_pidbox_queue_of_a_killed_worker_is_swept_by_a_producer(
    app: App, pg_dsn: str, conn: Conn, schema: str
) -> None:
    """A worker's pidbox queue (``control_queue_expires``) outlives its worker, and broadcast
    commands keep landing in it. With no consumer of the schema left, a producer (a Celery
    client sending a task) sweeps it once it has been unused that long."""
    proc, log = app.worker("w2")
    pidbox = "w2@" + socket.gethostname() + ".celery.pidbox"
    wait_for(lambda: queue_row(conn, schema, pidbox) is not None, 10, "the pidbox queue", log)
    assert queue_row(conn, schema, pidbox)[0] == 3000  # type: ignore[index]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    # broadcasts to the dead worker: they pile up in its pidbox queue
    with Connection(lonnymq_url(pg_dsn), transport_options={"schema": schema}) as c:
        producer = c.Producer()
        exchange = Exchange("celery.pidbox", type="fanout")
        for _ in range(5):
            producer.publish({"method": "ping"}, exchange=exchange, routing_key="")
    assert messages_of(conn, schema, pidbox) == 5
    time.sleep(3.5)
    assert queue_row(conn, schema, pidbox) is not None  # nobody swept: nobody is left
    # a producer of the schema comes by (sends a task no worker runs) and sweeps
    app.client(1)
    assert queue_row(conn, schema, pidbox) is None
    assert messages_of(conn, schema, pidbox) == 0


# --------------------------------------------------------------------------------------------
# 2. queues of processes that are gone: kombu consumers and producers, status, housekeep

CONSUMER = r"""
import sys, time
import kombu
import lonnymq  # noqa: F401

url, schema, queue = sys.argv[1:4]
with kombu.Connection(url, transport_options={"schema": schema}) as c:
    q = kombu.Queue(queue, queue_arguments={"x-expires": 1500})
    got = []
    with c.Consumer(q, callbacks=[lambda body, m: (got.append(body), m.ack())]):
        while not got:
            c.drain_events(timeout=10)
print("consumed", got, flush=True)
"""


@pytest.fixture
def run_consumer(
    tmp_path: Path, pg_dsn: str, schema: str
) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Start a kombu consumer process that declares ``queue`` (``x-expires`` 1.5 s), takes
    one message and exits."""
    started: list[subprocess.Popen[bytes]] = []
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)

    def start(queue: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, str(script), lonnymq_url(pg_dsn), schema, queue],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.slow
def test_queue_of_an_exited_consumer_is_swept_by_a_producer(
    run_consumer: Callable[[str], subprocess.Popen[bytes]],
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
) -> None:
    """Expiry used to be swept only by live consumers: once the last consumer of the schema
    exited, a queue past its ``x-expires`` stayed forever with its messages. Producers sweep
    too (at most every ``expire_interval``)."""
    consumer = run_consumer("gone")
    wait_for(lambda: queue_row(conn, schema, "gone") is not None, 20, "the consumer's queue")
    with make_connection(expire_interval=0.2) as producer:
        producer.Producer().publish("first", routing_key="gone")
        out, _ = consumer.communicate(timeout=30)
        assert consumer.returncode == 0, out
        for i in range(5):  # the consumer is gone: these wait
            producer.Producer().publish(i, routing_key="gone")
        assert messages_of(conn, schema, "gone") == 5
        time.sleep(2.0)  # > x-expires 1.5 s
        assert queue_row(conn, schema, "gone") is not None
        producer.Producer().publish("x", routing_key="elsewhere")  # starts a sweep, beside it
        wait_for(lambda: queue_row(conn, schema, "gone") is None, 5, "the sweep")
        assert messages_of(conn, schema, "gone") == 0


@pytest.mark.slow
def test_status_shows_queues_past_their_expiry_and_housekeep_removes_them(
    run_consumer: Callable[[str], subprocess.Popen[bytes]],
    pg_dsn: str,
    make_connection: Callable[..., Connection],
    conn: Conn,
    schema: str,
) -> None:
    consumer = run_consumer("left")
    wait_for(lambda: queue_row(conn, schema, "left") is not None, 20, "the consumer's queue")
    with make_connection(expire_interval=3600) as producer:
        producer.Producer().publish("first", routing_key="left")
        out, _ = consumer.communicate(timeout=30)
        assert consumer.returncode == 0, out
        for i in range(4):
            producer.Producer().publish(i, routing_key="left")
    time.sleep(2.0)

    def lmq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lonnymq", *args, "--dsn", pg_dsn, "--schema", schema],
            capture_output=True,
            text=True,
            timeout=60,
        )

    js = lmq("status", "--json")
    assert js.returncode == 0, js.stderr
    left = {s["queue"]: s for s in json.loads(js.stdout)}["left"]
    assert left["total"] == 4
    assert left["expiry"]["expires_ms"] == 1500
    assert left["expiry"]["expired"] is True and left["expiry"]["unused_seconds"] >= 1.5
    assert "1 queue(s) past their x-expires" in js.stderr and "left" in js.stderr
    table = lmq("status", "--color", "never")
    assert table.returncode == 0, table.stderr
    assert "1 queue(s) past their x-expires, holding 4 message(s): left (4)" in table.stdout
    assert "lonnymq housekeep" in table.stdout

    done = lmq("housekeep", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["expired_queues"] == 1
    assert queue_row(conn, schema, "left") is None and messages_of(conn, schema, "left") == 0
    again = lmq("status", "--color", "never")
    assert "past their x-expires" not in again.stdout


@pytest.mark.slow
def test_a_live_consumer_keeps_its_expiring_queue(
    make_connection: Callable[..., Connection], conn: Conn, schema: str
) -> None:
    """A queue with consumers is never unused (as on RabbitMQ): a live consumer marks its
    queues used often enough for their ``x-expires``, even with a 60 s lock heartbeat, while
    other clients sweep."""
    broker = lonnymq.Broker(schema)
    with make_connection() as consumer, make_connection(expire_interval=0.05) as producer:
        got: list[Any] = []
        q = Queue("alive", queue_arguments={"x-expires": 1500})

        def on_message(body: Any, message: Any) -> None:
            got.append(body)
            message.ack()

        with consumer.Consumer(q, callbacks=[on_message]):
            deadline, sent = time.monotonic() + 4, 0
            while time.monotonic() < deadline:
                producer.Producer().publish("tick", routing_key="alive")
                sent += 1
                broker.expire(conn)  # another client's sweep
                with contextlib.suppress(TimeoutError):
                    consumer.drain_events(timeout=0.1)
            drain_until = time.monotonic() + 5
            while len(got) < sent and time.monotonic() < drain_until:
                with contextlib.suppress(TimeoutError):
                    consumer.drain_events(timeout=0.1)
        # never deleted (a publish after a deletion would have made a queue without x-expires)
        assert queue_row(conn, schema, "alive") == (1500, None, None, None)
        assert len(got) == sent > 10  # none lost with a deleted queue


def test_clients_do_not_all_sweep(pg_dsn: str, schema: str, broker: lonnymq.Broker) -> None:
    """A sweep is skipped when another client swept the schema less than ``interval`` ago,
    or is sweeping now."""
    from lonnymq.transport.sweep import Sweeper

    with (
        psycopg.connect(pg_dsn, autocommit=True) as a,
        psycopg.connect(pg_dsn, autocommit=True) as b,
        psycopg.connect(pg_dsn, autocommit=True) as holder,
    ):
        first, second = Sweeper(schema, 30.0), Sweeper(schema, 30.0)
        assert first.sweep(a) is not None
        assert second.sweep(b) is None  # swept by another client 0 s ago
        assert Sweeper(schema, 0.001).sweep(b) is not None
        with holder.transaction():
            holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (first.key,))
            assert Sweeper(schema, 0.001).sweep(b) is None  # another client is sweeping
