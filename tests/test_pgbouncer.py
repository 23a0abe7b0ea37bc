# mypy: allow-untyped-calls
# (kombu and celery are untyped)
"""lonnymq behind a real PgBouncer (Debian's package, started here for each test).

In transaction pooling mode, the usual set-up for producers, each transaction of a client may
run on another server session: Kombu publishes, Celery ``delay()`` and
``lonnymq.transaction(conn)`` work through it (the transport prepares no statement there); a
consumer needs a session for its LISTEN and for the dequeue that marks it as waiting, so it
either takes a direct connection for those (the transport option ``listen_dsn``) and then
wakes as fast as a direct consumer, or refuses to start (``ListenUnavailable``), never
waking late in silence. In session mode everything works as on a direct connection.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu.connection import Connection
from psycopg.conninfo import conninfo_to_dict

import lonnymq
import lonnymq.celery
from tests.apps import close_app
from tests.commit_modes import recorded_statements
from tests.conftest import free_port, lonnymq_url
from tests.test_celery_worker import (
    WHEN_TASK,
    Env,
    Worker,
    _stop,
    app_env,
    launch,
    ran_at,
    wait_for,
    worker_args,
)

Conn = psycopg.Connection[Any]

#: an idle consumer woken by NOTIFY takes milliseconds (tests/test_transport_processes.py:
#: median < 50 ms); its fallback poll here is 30 s, so a late wake-up cannot pass for this
FAST = 0.5
OPTIONS = {"polling_interval": 30.0, "visibility_timeout": 30}


@dataclass
class Bouncer:
    """A PgBouncer in front of the test database."""

    port: int
    dbname: str
    proc: subprocess.Popen[bytes]
    log: Path

    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def url(self) -> str:
        return lonnymq_url(self.dsn())


def _pgbouncer() -> str:
    exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(exe):
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (.ci/run installs Debian's pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    return exe


@pytest.fixture
def pgbouncer(pg_dsn: str) -> Iterator[Callable[..., Bouncer]]:
    """Start PgBouncers in front of the test database (``pool_mode``, ``pool_size`` server
    sessions at most); each is stopped after the test, and its server sessions with it."""
    exe = _pgbouncer()
    started: list[Bouncer] = []
    params = conninfo_to_dict(pg_dsn)
    dbname = str(params.get("dbname") or "postgres")
    user = str(params.get("user") or "postgres")

    def start(pool_mode: str = "transaction", pool_size: int = 4) -> Bouncer:
        root = Path(tempfile.mkdtemp(prefix="lonnymq-pgbouncer-"))
        port = free_port()
        server = f"host={params.get('host') or '127.0.0.1'} port={params.get('port') or 5432}"
        (root / "users.txt").write_text(f'"postgres" ""\n"{user}" ""\n')
        (root / "pgbouncer.ini").write_text(
            f"[databases]\n{dbname} = {server} dbname={dbname} user={user}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
            "max_client_conn = 200\nignore_startup_parameters = extra_float_digits\n"
        )
        cmd = [exe, str(root / "pgbouncer.ini")]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            shutil.chown(root, "postgres")
            for f in root.iterdir():
                shutil.chown(f, "postgres")
            cmd[1:1] = ["-u", "postgres"]
        log = root / "log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        bouncer = Bouncer(port, dbname, proc, log)
        started.append(bouncer)
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(bouncer.dsn(), connect_timeout=2) as c:
                    c.execute("SELECT 1")
                return bouncer
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"pgbouncer did not start: {log.read_text()}") from None
                time.sleep(0.05)

    yield start
    for bouncer in started:
        bouncer.proc.terminate()
        try:
            bouncer.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            bouncer.proc.kill()
            bouncer.proc.wait()
        shutil.rmtree(bouncer.log.parent, ignore_errors=True)


@pytest.fixture
def kombu(pgbouncer: Callable[..., Bouncer], schema: str) -> Iterator[Callable[..., Connection]]:
    """kombu Connections on the test's schema (released before the PgBouncers stop)."""
    opened: list[Connection] = []

    def make(url: str, **options: Any) -> Connection:
        connection = Connection(url, transport_options={"schema": schema, **OPTIONS, **options})
        opened.append(connection)
        return connection

    yield make
    for connection in opened:
        connection.release()


def receive_in_thread(inbox: Any) -> tuple[threading.Thread, list[Any]]:
    """A thread that gets one message from ``inbox`` (acks it) and notes when (or the error)."""
    got: list[Any] = []

    def consume() -> None:
        try:
            message = inbox.get(timeout=20)
            got.append(time.monotonic())
            message.ack()
        except Exception as exc:  # (reported by the caller)
            got.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.3)  # idle: blocked on its LISTEN connection
    return thread, got


def received_after(thread: threading.Thread, got: list[Any], sent: float) -> float:
    thread.join(timeout=30)
    assert got and isinstance(got[0], float), got
    return float(got[0] - sent)


def wake_ups(consumer: Connection, producer: Connection, queue: str, n: int = 3) -> list[float]:
    """Seconds from each of ``n`` publishes by ``producer`` to its delivery to ``consumer``,
    idle (blocked in ``get``) when the message is published."""
    inbox = consumer.SimpleQueue(queue)
    outbox = producer.SimpleQueue(queue)
    try:
        with pytest.raises(Empty):
            inbox.get(timeout=0.5)  # its LISTEN is open: it is idle
        seconds = []
        for i in range(n):
            thread, got = receive_in_thread(inbox)
            sent = time.monotonic()
            outbox.put({"i": i})
            seconds.append(received_after(thread, got, sent))
        return seconds
    finally:
        inbox.close()
        outbox.close()


def consume(connection: Connection, queue: str, n: int) -> list[Any]:
    """``n`` messages' ``i`` from ``queue`` (acked), then nothing more within half a second."""
    inbox = connection.SimpleQueue(queue)
    try:
        seen = []
        for _ in range(n):
            message = inbox.get(timeout=5)
            seen.append(message.payload["i"])
            message.ack()
        with pytest.raises(Empty):
            inbox.get(timeout=0.5)
        return seen
    finally:
        inbox.close()


def waiting(broker: lonnymq.Broker, conn: Conn, queue: str) -> int:
    return broker.queue(queue).stats(conn).waiting


# --- producers through transaction pooling ----------------------------------------------------


def test_kombu_publishes_through_transaction_pooling(
    pgbouncer: Callable[..., Bouncer],
    kombu: Callable[..., Connection],
    url: str,
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    """50 publishes on one kombu connection through PgBouncer (psycopg would have prepared
    the publish after 5 and PgBouncer 1.18 lost it on the next server session), consumed
    directly."""
    bouncer = pgbouncer(pool_size=2)
    with kombu(bouncer.url()) as producer:
        jobs = producer.SimpleQueue("jobs")
        for i in range(50):
            jobs.put({"i": i}, headers={"x-channel": f"tenant-{i % 3}"})
        jobs.close()
    assert waiting(broker, conn, "jobs") == 50
    with kombu(url) as consumer:
        assert sorted(consume(consumer, "jobs", 50)) == list(range(50))


@pytest.mark.parametrize("mode", ["flush_after", "flush_after_wake"])
def test_a_publish_through_a_pooler_commits_durably_in_one_statement(
    pgbouncer: Callable[..., Bouncer],
    kombu: Callable[..., Connection],
    broker: lonnymq.Broker,
    conn: Conn,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """``publish_commit="flush_after"`` (and ``"flush_after_wake"``, the default, when the
    publish wakes a consumer) commits, then flushes with a second transaction of the same
    session; a pooler may run the two on different server sessions (of a server that
    restarted in between, whose flush says nothing of the first), so through one the publish
    is one durable statement."""
    ran = recorded_statements(monkeypatch)
    bouncer = pgbouncer(pool_size=2)
    with kombu(bouncer.url(), publish_commit=mode) as producer:
        jobs = producer.SimpleQueue("durable")
        jobs.put({"i": 0})
        ran.clear()
        jobs.put({"i": 1})
        jobs.close()
    queries = [query for _, query in ran]
    assert len(queries) == 1 and b"message_publish_v2" in queries[0], queries
    assert b"synchronous_commit" not in queries[0]
    assert waiting(broker, conn, "durable") == 2


def test_celery_delay_through_transaction_pooling(
    pgbouncer: Callable[..., Bouncer], schema: str, broker: lonnymq.Broker, conn: Conn
) -> None:
    bouncer = pgbouncer(pool_size=2)
    app = Celery("viabouncer", broker=bouncer.url(), set_as_current=False)
    app.conf.update(broker_transport_options={"schema": schema}, task_ignore_result=True)
    lonnymq.celery.setup(app)

    @app.task(name="bouncer.add", shared=False)  # type: ignore[untyped-decorator]
    def add(x: int, y: int) -> int:
        return x + y

    try:
        for i in range(20):
            add.delay(i, i)
        add.apply_async((1, 2), countdown=60)
    finally:
        close_app(app)
    stats = broker.queue("celery").stats(conn)
    assert (stats.waiting, stats.delayed) == (21, 1)


def test_transactional_enqueue_through_transaction_pooling(
    pgbouncer: Callable[..., Bouncer],
    kombu: Callable[..., Connection],
    broker: lonnymq.Broker,
    conn: Conn,
) -> None:
    """``lonnymq.transaction(conn)`` on the application's own connection through PgBouncer:
    opened with ``prepare_threshold=None`` as psycopg documents for it, its publishes commit
    and roll back with the application's writes."""
    bouncer = pgbouncer(pool_size=2)
    conn.execute("CREATE TABLE IF NOT EXISTS public.lmq_bouncer_orders (id int)")
    try:
        with (
            psycopg.connect(bouncer.dsn(), prepare_threshold=None) as app_conn,
            kombu(bouncer.url()) as producer,
        ):
            jobs = producer.SimpleQueue("orders")
            for i in range(10):  # (more than psycopg's prepare threshold of 5)
                with lonnymq.transaction(app_conn):
                    app_conn.execute("INSERT INTO public.lmq_bouncer_orders VALUES (%s)", (i,))
                    jobs.put({"order": i})
                if i % 2:
                    app_conn.rollback()
                else:
                    app_conn.commit()
            jobs.close()
        rows = conn.execute("SELECT count(*) FROM public.lmq_bouncer_orders").fetchone()
        assert rows == (5,)
        assert waiting(broker, conn, "orders") == 5
    finally:
        conn.execute("DROP TABLE public.lmq_bouncer_orders")


def test_a_connection_that_prepares_through_transaction_pooling_gets_told_what_to_do(
    pgbouncer: Callable[..., Bouncer], broker: lonnymq.Broker
) -> None:
    """The application's connection with psycopg's default prepare_threshold: PgBouncer 1.18
    loses the statement psycopg prepared, and the error says how to open the connection."""
    bouncer = pgbouncer(pool_size=2)
    channel = broker.queue("orders").channel("a")
    with (
        psycopg.connect(bouncer.dsn(), autocommit=True) as app_conn,
        psycopg.connect(bouncer.dsn(), prepare_threshold=None) as other,
        pytest.raises(lonnymq.DatabaseError, match="prepare_threshold=None") as failed,
    ):
        for i in range(20):
            if i % 2:  # holds the server session app_conn used last: it gets the other one
                other.execute("SELECT 1")
            channel.message.create(app_conn, f"m{i}")
            if i % 2:
                other.commit()
    assert "PgBouncer" in str(failed.value)


# --- consumers --------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_idle_consumer_through_transaction_pooling_refuses_to_start(
    pgbouncer: Callable[..., Bouncer], kombu: Callable[..., Connection]
) -> None:
    """Its LISTEN cannot work there: rather than wake only every polling_interval, it fails
    at its first wait with an error that names the remedies."""
    bouncer = pgbouncer()
    with kombu(bouncer.url()) as consumer:
        jobs = consumer.SimpleQueue("jobs")
        started = time.monotonic()
        with pytest.raises(lonnymq.ListenUnavailable) as refused:
            jobs.get(timeout=10)
        jobs.close()
    assert time.monotonic() - started < 8
    text = str(refused.value)
    assert "listen_dsn" in text and "use_listen=False" in text and "PgBouncer" in text


def test_an_idle_consumer_with_a_direct_listen_dsn_wakes_as_fast_as_a_direct_one(
    pgbouncer: Callable[..., Bouncer], kombu: Callable[..., Connection], pg_dsn: str
) -> None:
    bouncer = pgbouncer()
    consumer = kombu(bouncer.url(), listen_dsn=pg_dsn)
    seconds = wake_ups(consumer, kombu(bouncer.url()), "jobs")
    assert max(seconds) < FAST, seconds


def test_consumers_sharing_one_server_session_each_wake_at_once(
    pgbouncer: Callable[..., Bouncer], kombu: Callable[..., Connection], pg_dsn: str
) -> None:
    """Through a pool of one server session: another consumer's dequeues and acks meanwhile
    do not undo the first one's sleep (it sleeps on its direct LISTEN session; the dequeues
    of both go through the one pooled session)."""
    bouncer = pgbouncer(pool_size=1)
    idle = kombu(bouncer.url(), listen_dsn=pg_dsn)
    busy = kombu(bouncer.url(), listen_dsn=pg_dsn)
    producer = kombu(bouncer.url())
    other = busy.SimpleQueue("other")
    inbox = idle.SimpleQueue("jobs")
    outbox = producer.SimpleQueue("jobs")
    try:
        with pytest.raises(Empty):
            inbox.get(timeout=0.5)
        thread, got = receive_in_thread(inbox)
        for i in range(3):  # the other consumer dequeues and acks, through the same pool
            producer.SimpleQueue("other").put({"i": i})
            other.get(timeout=5).ack()
        sent = time.monotonic()
        outbox.put({"hello": 1})
        assert received_after(thread, got, sent) < FAST
    finally:
        for q in (other, inbox, outbox):
            q.close()


def test_session_pooling_needs_no_listen_dsn(
    pgbouncer: Callable[..., Bouncer], kombu: Callable[..., Connection]
) -> None:
    """In session mode LISTEN works through PgBouncer: no refusal, and prompt wake-ups."""
    bouncer = pgbouncer(pool_mode="session", pool_size=6)
    seconds = wake_ups(kombu(bouncer.url()), kombu(bouncer.url()), "jobs")
    assert max(seconds) < FAST, seconds


def test_a_polling_consumer_works_through_transaction_pooling(
    pgbouncer: Callable[..., Bouncer], kombu: Callable[..., Connection]
) -> None:
    """With use_listen=False the consumer polls (every polling_interval), as documented."""
    bouncer = pgbouncer()
    with kombu(bouncer.url(), use_listen=False, polling_interval=0.2) as consumer:
        outbox = kombu(bouncer.url()).SimpleQueue("jobs")
        for i in range(10):
            outbox.put({"i": i})
        outbox.close()
        assert sorted(consume(consumer, "jobs", 10)) == list(range(10))


# --- a Celery worker ----------------------------------------------------------------------------


def _worker_app(pg_dsn: str, **options: Any) -> str:
    """App source (``make_env``'s ``extra_source``): ``t.when``, and transport options."""
    lines = [WHEN_TASK, "app.conf.broker_transport_options['polling_interval'] = 30"]
    lines += [f"app.conf.broker_transport_options[{k!r}] = {v!r}" for k, v in options.items()]
    return "\n".join(lines) + "\n"


def has_run(env: Env, tag: str) -> Callable[[], bool]:
    return lambda: tag in ran_at(env)


@pytest.mark.slow
def test_an_idle_celery_worker_through_transaction_pooling_wakes_at_once_with_listen_dsn(
    tmp_path: Path, pgbouncer: Callable[..., Bouncer], pg_dsn: str, schema: str
) -> None:
    """A worker whose broker URL is PgBouncer's and listen_dsn direct runs a ``delay()``
    made through PgBouncer within milliseconds, idle as it was (its fallback poll is 30 s)."""
    bouncer = pgbouncer()
    started: list[Worker] = []
    with app_env(tmp_path, bouncer.dsn(), schema, _worker_app(pg_dsn, listen_dsn=pg_dsn)) as env:
        try:
            worker = launch(
                env.dir, env.module, "wb", worker_args("wb", "celery", "-P", "solo"), started
            )
            for tag in ("a", "b", "c"):
                time.sleep(1.0)  # idle
                sent = time.time()
                env.task("when").delay(tag)
                wait_for(has_run(env, tag), 10, f"task {tag}", worker)
                assert ran_at(env)[tag] - sent < FAST, worker.log_tail()
        finally:
            for w in started:
                _stop(w)


@pytest.mark.slow
def test_a_celery_worker_through_transaction_pooling_without_listen_dsn_stops_at_start(
    tmp_path: Path, pgbouncer: Callable[..., Bouncer], pg_dsn: str, schema: str
) -> None:
    """Without listen_dsn, the worker does not start consuming in silence: it stops, and its
    log says why and what to set."""
    bouncer = pgbouncer()
    started: list[Worker] = []
    with app_env(tmp_path, bouncer.dsn(), schema, _worker_app(pg_dsn)) as env:
        try:
            # (it stops before it is ready: mingle's first wait for replies is on LISTEN)
            args = worker_args("wn", "celery", "-P", "solo")
            worker = launch(env.dir, env.module, "wn", args, started, ready="")
            wait_for(lambda: not worker.alive(), 30, "the worker to stop", worker)
            log = worker.log_tail(200)
            assert "ListenUnavailable" in log and "listen_dsn" in log, log
            assert worker.proc.returncode != 0
        finally:
            for w in started:
                _stop(w)
