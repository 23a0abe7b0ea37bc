"""kombu's Connection fields for lonnymq URLs, as amqp and redis have them: hostname, port,
userid, password, virtual_host (the database); masking; kombu's failover between URLs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kombu.connection import Connection
from psycopg.conninfo import conninfo_to_dict

import lonnymq


@pytest.fixture
def server(pg_dsn: str) -> dict[str, str]:
    params = conninfo_to_dict(pg_dsn)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server listens on a unix socket only")
    return {
        "host": host,
        "port": str(params.get("port") or 5432),
        "user": str(params.get("user") or "postgres"),
        "db": str(params.get("dbname") or "postgres"),
    }


@pytest.fixture
def connections() -> Iterator[list[Connection]]:
    opened: list[Connection] = []
    yield opened
    for c in opened:
        c.release()


def _round_trip(c: Connection, name: str) -> None:
    simple = c.SimpleQueue(name)
    try:
        simple.put({"via": c.hostname})
        message = simple.get(timeout=10)
        assert message.payload == {"via": c.hostname}
        message.ack()
    finally:
        simple.close()


def _session(c: Connection) -> dict[str, Any]:
    pg = c.transport.pg.connection()
    return dict(pg.info.get_parameters())


def test_fields_of_a_url_as_for_amqp() -> None:
    c = Connection("lonnymq://alice:s3cr3t@db.example:5433/app")
    info = c.info()  # what Celery's `inspect stats` and Flower show, password removed
    assert (info["hostname"], info["port"], info["userid"], info["virtual_host"]) == (
        "db.example",
        5433,
        "alice",
        "app",
    )
    assert (c.hostname, c.port, c.userid, c.password, c.virtual_host) == (
        "db.example",
        5433,
        "alice",
        "s3cr3t",
        "app",
    )
    assert c.host == "db.example:5433"
    assert c.as_uri() == "lonnymq://alice:**@db.example:5433/app"
    assert c.as_uri(include_password=True) == "lonnymq://alice:s3cr3t@db.example:5433/app"
    assert "s3cr3t" not in repr(c)


def test_a_url_with_libpq_parameters_keeps_them_and_hides_its_password(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    s = server
    url = (
        f"lonnymq://{s['user']}:pw1@{s['host']}:{s['port']}/{s['db']}"
        "?application_name=from-url&sslmode=disable"
    )
    c = Connection(url, transport_options={"schema": schema})
    connections.append(c)
    info = c.info()
    assert (info["port"], info["userid"], info["virtual_host"]) == (
        int(s["port"]),
        s["user"],
        s["db"],
    )
    # kombu has no field for sslmode: the URL stays in hostname (for clone()), password apart
    assert "pw1" not in info["hostname"] and "sslmode=disable" in info["hostname"]
    assert c.password == "pw1"
    assert c.as_uri() == (
        f"lonnymq://{s['user']}:**@{s['host']}:{s['port']}/{s['db']}"
        "?application_name=from-url&sslmode=disable"
    )
    assert "pw1" in c.as_uri(include_password=True)
    clone = c.clone()
    connections.append(clone)
    _round_trip(clone, "fields-clone")
    assert _session(clone)["sslmode"] == "disable"


def test_failover_to_the_second_url_with_libpq_parameters_in_both(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    s = server
    down = f"lonnymq://{s['user']}@127.0.0.1:1/{s['db']}?connect_timeout=2"
    up = f"lonnymq://{s['user']}@{s['host']}:{s['port']}/{s['db']}?connect_timeout=3"
    c = Connection(f"{down};{up}", transport_options={"schema": schema})
    connections.append(c)
    c.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
    assert (c.hostname, c.port, c.userid, c.virtual_host) == (
        s["host"],
        int(s["port"]),
        s["user"],
        s["db"],
    )
    assert c.connect_timeout == 3
    assert c.as_uri() == f"lonnymq://{s['user']}@{s['host']}:{s['port']}/{s['db']}"
    _round_trip(c, "failover")
    assert _session(c)["connect_timeout"] == "3"


def test_first_url_of_several_with_libpq_parameters(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    s = server
    up = f"lonnymq://{s['user']}@{s['host']}:{s['port']}/{s['db']}?connect_timeout=4"
    down = f"lonnymq://{s['user']}@127.0.0.1:1/{s['db']}?connect_timeout=2"
    c = Connection(
        f"{up};{down}", transport_options={"schema": schema}, failover_strategy="shuffle"
    )
    connections.append(c)
    c.ensure_connection(max_retries=4, interval_start=0, interval_step=0)
    assert c.port == int(s["port"])
    _round_trip(c, "first")
    assert _session(c)["connect_timeout"] == "4"


def test_failover_urls_with_parameters_kombu_cannot_take_are_refused_at_once() -> None:
    """kombu parses each URL it fails over to itself: sslmode would be a TypeError at the
    first failover. It is refused on first use instead, saying what to write."""
    c = Connection("lonnymq://u@a:5432/db?sslmode=require;lonnymq://u@b:5432/db")
    with pytest.raises(lonnymq.ConfigurationError, match="several hosts") as err:
        c.connect()
    assert "lonnymq://USER@HOST1:PORT,HOST2:PORT/DB" in str(err.value)
    c.release()


def test_fields_are_filled_when_the_connection_is_made() -> None:
    """As for amqp and redis, before any connect: kombu's own failover test reads
    ``conn.port`` of the first URL before it connects; ``hostname`` never holds the URL with
    its password."""
    c = Connection("lonnymq://alice:s3cr3t@db.example:5433/app")
    assert "transport" not in c.__dict__  # nothing made yet
    assert (c.hostname, c.port, c.userid, c.password, c.virtual_host) == (
        "db.example",
        5433,
        "alice",
        "s3cr3t",
        "app",
    )
    # with libpq parameters: they stay in hostname, the password does not
    c = Connection("lonnymq://alice:s3cr3t@db.example:5433/app?sslmode=require")
    assert (c.port, c.userid, c.password, c.virtual_host) == (5433, "alice", "s3cr3t", "app")
    assert c.hostname == "lonnymq://alice@db.example:5433/app?sslmode=require"
    assert "transport" not in c.__dict__
    # the class path instead of the alias; a URL given as a list of alternates
    c = Connection(
        ["lonnymq://u:pw@h1:6001/d1", "lonnymq://v@h2:6002/d2"],
        transport="lonnymq.transport:Transport",
    )
    assert (c.hostname, c.port, c.userid, c.password, c.virtual_host) == (
        "h1",
        6001,
        "u",
        "pw",
        "d1",
    )
    # a URL that does not parse is left for the transport to refuse on first use
    c = Connection("lonnymq://u@h:99999/d")
    with pytest.raises(lonnymq.ConfigurationError, match="invalid port"):
        c.connect()
    c.release()


def test_failover_switches_to_alternate_url(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    """kombu's ``t/integration`` failover test, on lonnymq: ``conn.port`` is the first (dead)
    URL's before connecting, the live one's after."""
    s = server
    dead = f"lonnymq://{s['user']}:pw@127.0.0.1:1/{s['db']}"
    live = f"lonnymq://{s['user']}:pw@{s['host']}:{s['port']}/{s['db']}"
    c = Connection([dead, live], transport_options={"schema": schema})
    connections.append(c)
    assert len(c.alt) > 1
    assert c.port == 1 and c.hostname == "127.0.0.1" and "pw" not in c.hostname
    assert c.connect()
    assert c.connected
    assert c.port == int(s["port"])
    _round_trip(c, "failover-alternate")
