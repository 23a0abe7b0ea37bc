# mypy: allow-untyped-calls
"""Bad input, through the core API and the Kombu transport: every case gets a clear, typed error,
writes nothing, and loses nothing (a message queued before it is still there and deliverable).

Each case runs against a freshly installed schema holding one message created with the core API
(queue "keep") and one published through kombu (queue "kq"). The rows of the schema's tables
(queue, channel, message, exchange, binding) and its catalog (tables and functions) are compared
before and after the bad call. Cases that show a bug are marked xfail(strict=True) with the bug
in the reason.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import celery
import kombu.exceptions
import psycopg
import pytest
from kombu.connection import Connection
from kombu.entity import Exchange
from kombu.entity import Queue as KQueue
from psycopg import sql

import lonnymq
from lonnymq import (
    ConfigurationError,
    ConnectionLost,
    InvalidArgument,
    InvalidName,
    MessageTooLarge,
    SchemaNotInstalled,
    SchemaTooNew,
)
from tests.apps import close_app
from tests.conftest import lonnymq_url

Conn = psycopg.Connection[Any]
MB = 1024 * 1024


@dataclass
class Ctx:
    """What a case gets: a seeded schema, a core broker on it, and kombu connections."""

    pg_dsn: str
    schema: str
    conn: Conn
    broker: lonnymq.Broker
    opened: list[Connection] = field(default_factory=list)
    apps: list[celery.Celery] = field(default_factory=list)

    @property
    def url(self) -> str:
        return lonnymq_url(self.pg_dsn)

    def kombu(self, url: str | None = None, **options: Any) -> Connection:
        options.setdefault("schema", self.schema)
        options.setdefault("visibility_timeout", 30)
        c = Connection(url or self.url, transport_options=options, connect_timeout=5)
        self.opened.append(c)
        return c

    def connect(self, url: str | None = None, **options: Any) -> None:
        """Connect a kombu connection (once, no retry loop)."""
        self.kombu(url, **options).connect()

    def simple(self, name: str = "kq", **options: Any) -> Any:
        return self.kombu(**options).SimpleQueue(name)

    def celery_app(self) -> celery.Celery:
        app = celery.Celery("bad_input", broker=self.url, set_as_current=False)
        app.conf.broker_transport_options = {"schema": self.schema}
        self.apps.append(app)
        return app

    def exec(self, query: str) -> None:
        self.conn.execute(sql.SQL(query).format(s=sql.Identifier(self.schema)))


_SNAPSHOT = {
    "queue": "id, name, max_concurrency, max_size, expires_ms, message_ttl_ms",
    "channel": (
        "queue, name, has_policy, own_max_concurrency, own_max_size, current_size, "
        "current_concurrency"
    ),
    "message": (
        "id, queue, channel, priority, attempts, dequeue_at, locked_until, name, content, state"
    ),
    "exchange": "name, type, durable, auto_delete",
    "binding": "exchange, routing_key, queue, pattern",
}


def rows_snapshot(conn: Conn, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for table, columns in _SNAPSHOT.items():
        exists = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL",
            (sql.Identifier(schema, table).as_string(conn),),
        ).fetchone()
        if exists and exists[0]:
            out[table] = conn.execute(
                sql.SQL("SELECT {} FROM {} ORDER BY 1, 2, 3").format(
                    sql.SQL(columns),
                    sql.Identifier(schema, table),
                )
            ).fetchall()
    return out


def catalog_snapshot(conn: Conn, schema: str) -> list[tuple[Any, ...]]:
    """The tables, indexes, sequences and functions of ``schema``, and the migration record."""
    rows = conn.execute(
        "SELECT 'rel', c.relname, c.relkind::text FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
        "UNION ALL SELECT 'proc', p.proname, pg_get_function_identity_arguments(p.oid) "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s "
        "ORDER BY 1, 2, 3",
        (schema, schema),
    ).fetchall()
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (sql.Identifier(schema, "migration").as_string(conn),)
    ).fetchone()
    if exists and exists[0]:
        rows += conn.execute(
            sql.SQL("SELECT 'migration', version::text, name FROM {} ORDER BY 2").format(
                sql.Identifier(schema, "migration")
            )
        ).fetchall()
    return rows


KOMBU_KEEP = {"kombu": "keep"}


@pytest.fixture
def ctx(pg_dsn: str, schema: str, conn: Conn) -> Iterator[Ctx]:
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    c = Ctx(pg_dsn, schema, conn, broker)
    assert isinstance(
        broker.queue("keep").channel("c").message.create(conn, b"keep"), lonnymq.Created
    )
    seed = c.kombu()
    simple = seed.SimpleQueue("kq")
    simple.put(KOMBU_KEEP)
    simple.close()
    seed.release()
    yield c
    for connection in c.opened:
        connection.release()
    for app in c.apps:
        close_app(app)


def assert_kept(c: Ctx) -> None:
    """Both seeded messages are still queued, ready, and deliverable (then acked)."""
    got = c.broker.dequeue(c.conn, ["keep", "kq"], limit=10, lock_ms=60_000).messages
    by_queue = {m.queue: m for m in got}
    assert sorted(by_queue) == ["keep", "kq"], got
    assert by_queue["keep"].content == b"keep"
    payload = json.loads(by_queue["kq"].content)
    body = payload["body"]
    if payload["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    assert json.loads(body) == KOMBU_KEEP
    for m in got:
        assert m.delete(c.conn) is lonnymq.Outcome.OK


@dataclass(frozen=True)
class Case:
    id: str
    action: Callable[[Ctx], object]
    raises: type[BaseException] | tuple[type[BaseException], ...]
    match: str | None = None
    setup: Callable[[Ctx], object] | None = None
    bug: str | None = None  # set: the case shows a bug, xfail(strict=True) with this reason
    # what the bug raises today (so that the xfail does not hide another failure)
    now: type[BaseException] | tuple[type[BaseException], ...] | None = None

    def param(self) -> Any:
        marks = (
            [pytest.mark.xfail(strict=True, reason=self.bug, raises=self.now)] if self.bug else []
        )
        return pytest.param(self, id=self.id, marks=marks)


def core_create(queue: str = "q", channel: str = "c", content: object = b"x", **kw: Any) -> Any:
    def action(c: Ctx) -> object:
        ch = c.broker.queue(queue).channel(channel)
        create: Callable[..., object] = ch.message.create
        return create(c.conn, content, **kw)

    return action


def kombu_put(body: Any = "x", queue: str = "kq", **kw: Any) -> Callable[[Ctx], object]:
    def action(c: Ctx) -> object:
        c.simple(queue).put(body, **kw)
        return None

    return action


def kombu_publish(**kw: Any) -> Callable[[Ctx], object]:
    def action(c: Ctx) -> object:
        kw.setdefault("routing_key", "kq")
        c.kombu().Producer().publish("x", **kw)
        return None

    return action


def bind(exchange: str, routing_key: str, kind: str = "direct") -> Callable[[Ctx], object]:
    def action(c: Ctx) -> object:
        KQueue("kq", Exchange(exchange, type=kind), routing_key=routing_key)(
            c.kombu().default_channel
        ).declare()
        return None

    return action


def kombu_url(url: str) -> Callable[[Ctx], object]:
    return lambda c: c.connect(url)


def kombu_options(**options: Any) -> Callable[[Ctx], object]:
    def action(c: Ctx) -> object:
        c.connect(**options)
        return None

    return action


def host_of(c: Ctx, query: str) -> str:
    return c.url + ("&" if "?" in c.url else "?") + query


HUGE = "x" * 10_000
SURROGATE = "bad\udc80name"  # a lone surrogate: not encodable in UTF-8


def _drop_function(name: str) -> Callable[[Ctx], object]:
    def setup(c: Ctx) -> None:
        row = c.conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n "
            "ON n.oid = p.pronamespace WHERE n.nspname = %s AND p.proname = %s",
            (c.schema, name),
        ).fetchone()
        assert row is not None
        c.conn.execute(f"DROP FUNCTION {row[0]}".encode())

    return setup


def _newer_version(c: Ctx) -> None:
    c.exec("INSERT INTO {s}.migration (version, name) VALUES (9999, 'from_the_future')")


def _other_schema(c: Ctx) -> str:
    return f"lmq_missing_{uuid.uuid4().hex[:10]}"


def _missing_schema_create(c: Ctx) -> object:
    return lonnymq.Broker(_other_schema(c)).queue("q").channel("c").message.create(c.conn, b"x")


def _missing_schema_dequeue(c: Ctx) -> object:
    return lonnymq.Broker(_other_schema(c)).dequeue(c.conn, ["q"])


def _missing_schema_policy(c: Ctx) -> object:
    return lonnymq.Broker(_other_schema(c)).queue("q").channel("c").policy.set(c.conn, max_size=1)


def _missing_schema_kombu(c: Ctx) -> object:
    c.connect(schema=_other_schema(c), auto_install=False)
    return None


def _celery_countdown(seconds: int) -> Callable[[Ctx], object]:
    def action(c: Ctx) -> object:
        return c.celery_app().send_task("bad_input.task", queue="kq", countdown=seconds)

    return action


CASES = [
    # -- broker URLs ------------------------------------------------------------------------
    Case("url-port-zero", kombu_url("lonnymq://u@127.0.0.1:0/db"), ConfigurationError, "port"),
    Case("url-port-70000", kombu_url("lonnymq://u@127.0.0.1:70000/db"), ConfigurationError, "port"),
    Case("url-port-negative", kombu_url("lonnymq://u@h:-1/db"), ConfigurationError, "port"),
    Case(
        "url-second-port-bad", kombu_url("lonnymq://u@h:5432,h2:xx/db"), ConfigurationError, "port"
    ),
    Case(
        "url-unknown-query-param",
        kombu_url("lonnymq://u@h:5432/db?frobnicate=1"),
        ConfigurationError,
        "invalid URI query parameter",
    ),
    Case("url-host-with-space", kombu_url("lonnymq://u@bad host/db"), ConfigurationError, "spaces"),
    Case("url-bad-percent-escape", kombu_url("lonnymq://%zz@h/db"), ConfigurationError, "%zz"),
    # kombu's own URL parsing (urllib) refuses this before the transport sees it
    Case("url-broken-ipv6", kombu_url("lonnymq://u@[::1/db"), ValueError, "IPv6"),
    Case(
        "url-sslmode-bogus",
        lambda c: c.connect(host_of(c, "sslmode=bogus")),
        ConfigurationError,
        "sslmode",
    ),
    Case(
        "url-target-session-attrs-bogus",
        lambda c: c.connect(host_of(c, "target_session_attrs=nope")),
        ConfigurationError,
        "target_session_attrs",
    ),
    Case(
        "url-unreachable-port",
        lambda c: c.kombu("lonnymq://u:pw@127.0.0.1:1/db?connect_timeout=3").ensure_connection(
            max_retries=1, interval_start=0
        ),
        kombu.exceptions.OperationalError,
        "Connection refused|connection failed",
    ),
    Case(
        "url-no-such-database",
        lambda c: c.connect(c.url.rsplit("/", 1)[0] + "/no_such_db_lmq"),
        ConnectionLost,
        "no_such_db_lmq",
    ),
    # -- transport options --------------------------------------------------------------------
    Case("opt-typo", kombu_options(polling_intervall=1), ConfigurationError, "unknown lonnymq"),
    Case(
        "opt-visibility-str",
        kombu_options(visibility_timeout="10"),
        ConfigurationError,
        "visibility",
    ),
    Case("opt-batch-float", kombu_options(batch_size=1.5), ConfigurationError, "batch_size"),
    Case(
        "opt-max-bytes-neg", kombu_options(max_message_bytes=-1), ConfigurationError, "max_message"
    ),
    Case(
        "opt-polling-nan",
        kombu_options(polling_interval=float("nan")),
        ConfigurationError,
        "polling",
    ),
    Case(
        "opt-connect-timeout-str", kombu_options(connect_timeout="x"), ConfigurationError, "connect"
    ),
    Case(
        "opt-commit-none",
        kombu_options(consumer_commit=None),
        ConfigurationError,
        "consumer_commit",
    ),
    Case(
        "opt-heartbeat-bool",
        kombu_options(heartbeat_interval=True),
        ConfigurationError,
        "heartbeat",
    ),
    Case("opt-listen-int", kombu_options(use_listen=1), ConfigurationError, "use_listen"),
    Case(
        "opt-listen-dsn-scheme",
        kombu_options(listen_dsn="mysql://u@db/app"),
        ConfigurationError,
        "listen_dsn: unknown URL scheme 'mysql'",
    ),
    Case("opt-listen-dsn-int", kombu_options(listen_dsn=5432), ConfigurationError, "listen_dsn"),
    Case(
        "opt-auto-install-str", kombu_options(auto_install="no"), ConfigurationError, "auto_install"
    ),
    Case(
        "opt-expire-zero", kombu_options(expire_interval=0), ConfigurationError, "expire_interval"
    ),
    Case("opt-policies-int-key", kombu_options(policies={1: {}}), ConfigurationError, "policies"),
    # -- schema names (transport option; the core constructors are covered in test_validation) --
    Case("schema-64-bytes", kombu_options(schema="a" * 64), InvalidName, "schema name"),
    Case("schema-quote", kombu_options(schema='x";drop'), InvalidName, "schema name"),
    Case("schema-semicolon", kombu_options(schema="a;b"), InvalidName, "schema name"),
    Case("schema-empty", kombu_options(schema=""), InvalidName, "schema name"),
    Case("schema-not-str", kombu_options(schema=7), InvalidName, "schema name"),
    # -- names, core API ----------------------------------------------------------------------
    Case("core-queue-empty", core_create(queue=""), InvalidName, "must not be empty"),
    Case("core-queue-huge", core_create(queue=HUGE), InvalidName, "10000 characters"),
    Case("core-channel-nul", core_create(channel="a\x00b"), InvalidName, "NUL"),
    Case("core-channel-huge", core_create(channel=HUGE), InvalidName, "10000 characters"),
    Case("core-dedup-empty", core_create(name=""), InvalidName, "must not be empty"),
    Case("core-dedup-nul", core_create(name="x\x00"), InvalidName, "NUL"),
    Case("core-dedup-huge", core_create(name=HUGE), InvalidName, "10000 characters"),
    Case(
        "core-policy-channel-nul",
        lambda c: c.broker.queue("q").channel("\x00").policy.set(c.conn, max_size=1),
        InvalidName,
        "NUL",
    ),
    Case(
        "core-dequeue-nul",
        lambda c: c.broker.dequeue(c.conn, ["keep", "k\x00"]),
        InvalidName,
        "NUL",
    ),
    Case(
        "core-queue-surrogate",
        core_create(queue=SURROGATE),
        InvalidName,
    ),
    Case(
        "core-channel-surrogate",
        core_create(channel=SURROGATE),
        InvalidName,
    ),
    Case(
        "core-dedup-surrogate",
        core_create(name=SURROGATE),
        InvalidName,
    ),
    Case(
        "core-dequeue-surrogate",
        lambda c: c.broker.dequeue(c.conn, [SURROGATE]),
        InvalidName,
    ),
    Case(
        "core-content-surrogate",
        core_create(content=SURROGATE),
        InvalidArgument,
    ),
    # -- sizes, delays, priorities, core API -----------------------------------------------------
    Case(
        "core-50mb-default-limit", core_create(content=bytes(50 * MB)), MessageTooLarge, "8388608"
    ),
    Case(
        "core-50mb-explicit-limit",
        lambda c: (
            lonnymq.Broker(c.schema, max_message_bytes=10 * MB)
            .queue("q")
            .channel("c")
            .message.create(c.conn, bytes(50 * MB))
        ),
        MessageTooLarge,
        "10485760",
    ),
    Case("core-delay-10e12-s", core_create(delay_ms=10**15), InvalidArgument, "delay_ms"),
    Case("core-priority-str", core_create(priority="high"), InvalidArgument, "priority"),
    Case("core-ttl-negative", core_create(ttl_ms=-1), InvalidArgument, "ttl_ms"),
    # -- names, kombu -----------------------------------------------------------------------
    Case("kombu-queue-nul", lambda c: c.simple("a\x00b"), InvalidName, "NUL"),
    Case("kombu-queue-huge", lambda c: c.simple(HUGE), InvalidName, "10000 characters"),
    Case(
        "kombu-queue-surrogate",
        lambda c: c.simple(SURROGATE),
        InvalidName,
    ),
    Case(
        "kombu-exchange-nul",
        lambda c: Exchange("e\x00", type="direct")(c.kombu().default_channel).declare(),
        InvalidName,
        "NUL",
    ),
    Case(
        "kombu-exchange-huge",
        lambda c: Exchange(HUGE, type="direct")(c.kombu().default_channel).declare(),
        InvalidName,
        "10000 characters",
    ),
    Case(
        "kombu-exchange-type-headers",
        lambda c: Exchange("eh", type="headers")(c.kombu().default_channel).declare(),
        InvalidArgument,
        "not supported",
    ),
    Case(
        "kombu-bind-routing-key-nul",
        bind("kq", "r\x00k"),
        InvalidName,
    ),
    Case(
        "kombu-bind-exchange-nul",
        lambda c: c.kombu().default_channel.queue_bind("kq", "e\x00x", "kq"),
        InvalidName,
    ),
    Case(
        "kombu-bind-routing-key-huge",
        bind("kq", HUGE),
        InvalidName,
    ),
    Case(
        "kombu-bind-topic-key-huge",
        bind("kq_topic", HUGE, "topic"),
        InvalidName,
        # the exchange exists already: kombu declares it before the binding
        setup=lambda c: Exchange("kq_topic", type="topic")(c.kombu().default_channel).declare(),
    ),
    Case("kombu-publish-routing-key-nul", kombu_publish(routing_key="k\x00q"), InvalidName, "NUL"),
    Case(
        "kombu-publish-routing-key-huge",
        kombu_publish(routing_key=HUGE),
        InvalidName,
        "routing key",
    ),
    Case(
        "kombu-publish-exchange-huge",
        kombu_publish(exchange=HUGE),
        InvalidName,
        "exchange",
    ),
    Case("kombu-x-channel-nul", kombu_put(headers={"x-channel": "a\x00"}), InvalidName, "NUL"),
    Case("kombu-x-channel-huge", kombu_put(headers={"x-channel": HUGE}), InvalidName, "10000"),
    Case(
        "kombu-x-channel-surrogate",
        kombu_put(headers={"x-channel": SURROGATE}),
        InvalidName,
    ),
    Case("kombu-dedup-nul", kombu_put(headers={"x-dedup-name": "a\x00"}), InvalidName, "NUL"),
    Case("kombu-dedup-huge", kombu_put(headers={"x-dedup-name": HUGE}), InvalidName, "10000"),
    # -- sizes, delays, priorities, kombu and Celery --------------------------------------------
    Case("kombu-50mb-default-limit", kombu_put(b"x" * (50 * MB)), MessageTooLarge, "8388608"),
    Case(
        "kombu-50mb-explicit-limit",
        lambda c: c.simple(max_message_bytes=MB).put(b"x" * (50 * MB)),
        MessageTooLarge,
        "1048576",
    ),
    Case("kombu-priority-negative", kombu_put(priority=-1), InvalidArgument, "priority"),
    Case("kombu-priority-256", kombu_put(priority=256), InvalidArgument, "priority"),
    Case("kombu-priority-str", kombu_put(priority="high"), InvalidArgument, "priority"),
    Case(
        "kombu-delay-negative", kombu_put(headers={"x-delay-ms": -1}), InvalidArgument, "x-delay-ms"
    ),
    Case("kombu-delay-not-a-number", kombu_put(headers={"x-delay-ms": "soon"}), InvalidArgument),
    Case("kombu-delay-bool", kombu_put(headers={"x-delay-ms": True}), InvalidArgument, "x-delay"),
    Case(
        "kombu-x-channel-list",
        kombu_put(headers={"x-channel": ["a"]}),
        InvalidArgument,
        "x-channel",
    ),
    Case(
        "kombu-dedup-dict",
        kombu_put(headers={"x-dedup-name": {"a": 1}}),
        InvalidArgument,
        "x-dedup-name",
    ),
    Case("kombu-delay-1e20", kombu_put(headers={"x-delay-ms": 1e20}), InvalidArgument, "delay_ms"),
    Case("kombu-delay-inf", kombu_put(headers={"x-delay-ms": float("inf")}), InvalidArgument),
    Case("kombu-delay-nan", kombu_put(headers={"x-delay-ms": float("nan")}), InvalidArgument),
    Case(
        "kombu-eta-year-9999",
        kombu_put(headers={"eta": "9999-12-31T00:00:00+00:00"}),
        InvalidArgument,
        "delay_ms",
    ),
    Case("kombu-eta-garbage", kombu_put(headers={"eta": "tomorrow"}), InvalidArgument, "ISO 8601"),
    Case("kombu-expiration-huge", kombu_publish(expiration=1e15), InvalidArgument, "ttl_ms"),
    Case(
        "kombu-expiration-negative",
        kombu_publish(expiration=-1),
        InvalidArgument,
        "expiration must be milliseconds >= 0",
    ),
    Case(
        "kombu-queue-arg-expires-str",
        lambda c: c.kombu().default_channel.queue_declare("qa", arguments={"x-expires": "abc"}),
        InvalidArgument,
        "x-expires",
    ),
    Case(
        "kombu-queue-arg-ttl-huge",
        lambda c: c.kombu().default_channel.queue_declare(
            "qa", arguments={"x-message-ttl": 10**30}
        ),
        InvalidArgument,
        "x-message-ttl",
    ),
    # 31 years: Celery computes the eta, lonnymq refuses delays over ten years
    Case("celery-countdown-1e9-s", _celery_countdown(10**9), InvalidArgument, "delay_ms"),
    # 31,700 years: Celery itself overflows computing the eta, before lonnymq sees it
    Case("celery-countdown-1e12-s", _celery_countdown(10**12), OverflowError, "out of range"),
    # -- schema state ----------------------------------------------------------------------------
    Case("missing-schema-create", _missing_schema_create, SchemaNotInstalled, "lonnymq migrate"),
    Case("missing-schema-dequeue", _missing_schema_dequeue, SchemaNotInstalled, "lonnymq migrate"),
    Case("missing-schema-policy", _missing_schema_policy, SchemaNotInstalled, "lonnymq migrate"),
    Case("missing-schema-kombu", _missing_schema_kombu, SchemaNotInstalled, "lonnymq migrate"),
    Case(
        "half-installed-create",
        core_create(queue="keep"),
        SchemaNotInstalled,
        "message_create_v1",
        setup=_drop_function("message_create_v1"),
    ),
    Case(
        "newer-schema-install",
        lambda c: c.broker.install(c.conn),
        SchemaTooNew,
        "9999",
        _newer_version,
    ),
    Case(
        "newer-schema-check",
        lambda c: c.broker.check(c.conn),
        SchemaTooNew,
        "upgrade lonnymq",
        _newer_version,
    ),
    Case(
        "newer-schema-kombu", lambda c: c.connect(), SchemaTooNew, "upgrade lonnymq", _newer_version
    ),
    Case(
        "newer-schema-kombu-put",
        kombu_put(),
        SchemaTooNew,
        "upgrade lonnymq",
        _newer_version,
    ),
]


@pytest.mark.parametrize("case", [case.param() for case in CASES])
def test_bad_input(ctx: Ctx, case: Case) -> None:
    from lonnymq.transport.connection import _INSTALLED

    _INSTALLED.clear()  # each case sees the schema as it is now, not as an earlier case saw it
    if case.setup is not None:
        case.setup(ctx)
    rows = rows_snapshot(ctx.conn, ctx.schema)
    catalog = catalog_snapshot(ctx.conn, ctx.schema)

    with pytest.raises(case.raises, match=case.match) as err:
        case.action(ctx)
    message = str(err.value)
    assert message.strip(), "the error has no message"
    assert len(message) < 2_000, "the error message echoes the whole input"

    assert rows_snapshot(ctx.conn, ctx.schema) == rows, "rows were written"
    assert catalog_snapshot(ctx.conn, ctx.schema) == catalog, "the schema was changed"
    # a missing schema was not created by the failed call
    missing = ctx.conn.execute(
        "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'lmq\\_missing\\_%'"
    ).fetchone()
    assert missing == (0,)
    assert_kept(ctx)


def test_case_matrix_is_large_and_unique() -> None:
    assert len(CASES) >= 30
    assert len({case.id for case in CASES}) == len(CASES)


def test_body_not_in_declared_content_encoding(ctx: Ctx) -> None:
    """A body that is not valid in its declared content-encoding is stored as sent (kombu does
    not check at publish); the consumer gets kombu's DecodeError, and the message is not lost:
    when the consumer's connection closes, it is back in the queue, unlocked, bytes intact."""
    producer_conn = ctx.kombu()
    producer_conn.Producer().publish(
        b"\xff\xfe not utf-8 \xc3\x28",
        routing_key="enc",
        declare=[KQueue("enc")],
        content_type="text/plain",
        content_encoding="utf-8",
    )
    consumer_conn = ctx.kombu()
    simple = consumer_conn.SimpleQueue("enc")
    with pytest.raises(kombu.exceptions.DecodeError, match="utf-8"):
        simple.get(timeout=10)
    consumer_conn.release()
    stats = ctx.broker.queue("enc").stats(ctx.conn)
    assert (stats.total, stats.in_flight) == (1, 0)
    # read it without decoding: the raw bytes are intact
    again = ctx.kombu().default_channel.basic_get("enc")
    assert again is not None
    assert again.body == b"\xff\xfe not utf-8 \xc3\x28"
    assert again.content_encoding == "utf-8"
    again.ack()
    assert ctx.broker.queue("enc").stats(ctx.conn).total == 0
    assert_kept(ctx)


def test_half_installed_schema_keeps_old_messages_deliverable(ctx: Ctx) -> None:
    """With one function dropped, the error at use names the missing piece and says what to
    run; the messages already queued are still delivered through the parts that remain."""
    _drop_function("message_create_v1")(ctx)
    with pytest.raises(SchemaNotInstalled, match="lonnymq migrate"):
        ctx.broker.queue("keep").channel("c").message.create(ctx.conn, b"x")
    assert_kept(ctx)


@pytest.mark.parametrize("what", ["function", "table"])
def test_half_installed_schema_is_detected_or_repaired(ctx: Ctx, what: str) -> None:
    if what == "function":
        _drop_function("message_create_v1")(ctx)
    else:
        ctx.exec("DROP TABLE {s}.exchange CASCADE")
    try:
        ctx.broker.check(ctx.conn)
    except SchemaNotInstalled:
        pass  # detected: the advice below must then work
    else:
        pytest.fail("check() accepted a schema with a missing " + what)
    ctx.broker.install(ctx.conn)  # what the error message says to do
    ctx.broker.check(ctx.conn)
    assert isinstance(
        ctx.broker.queue("keep").channel("c").message.create(ctx.conn, b"x"), lonnymq.Created
    )


def test_newer_schema_refused_by_migrate_cli(ctx: Ctx) -> None:
    """`lonnymq migrate` against a schema recorded by a newer lonnymq refuses, exits non-zero,
    and changes nothing."""
    import os
    import shutil
    import subprocess
    import sys

    _newer_version(ctx)
    catalog = catalog_snapshot(ctx.conn, ctx.schema)
    exe = shutil.which("lonnymq", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "lonnymq"]
    out = subprocess.run(
        [*cmd, "migrate", "--dsn", ctx.pg_dsn, "--schema", ctx.schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "newer" in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert catalog_snapshot(ctx.conn, ctx.schema) == catalog
    assert_kept(ctx)


@pytest.mark.parametrize("auto_install", [True, False])
def test_half_installed_schema_through_the_transport(ctx: Ctx, auto_install: bool) -> None:
    """A function and a table dropped behind a running producer's back: with auto_install
    (the default) the transport repairs the schema and the publish goes through; without, the
    error names what is missing and what to run. Queued messages are kept either way."""
    ctx.simple("hq", auto_install=auto_install).put("before")  # connected, schema checked
    _drop_function("message_publish_v1")(ctx)
    ctx.exec("DROP TABLE {s}.exchange CASCADE")
    if auto_install:
        ctx.simple("hq", auto_install=auto_install).put("after")
        assert ctx.broker.check(ctx.conn) == lonnymq.migrator.CURRENT_VERSION
    else:
        with pytest.raises(SchemaNotInstalled, match="lonnymq migrate"):
            ctx.simple("hq", auto_install=auto_install).put("after")
        with pytest.raises(SchemaNotInstalled, match="function message_publish_v1"):
            ctx.broker.check(ctx.conn)
    assert_kept(ctx)
