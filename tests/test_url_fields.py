"""kombu's Connection fields for lonnymq URLs, as amqp and redis have them: hostname, port,
userid, password, virtual_host (the database); masking; kombu's failover between URLs."""

from __future__ import annotations

import pickle
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
    assert (info["hostname"], info["port"], info["userid"], info["virtual_host"]) == (
        s["host"],
        int(s["port"]),
        s["user"],
        s["db"],
    )
    # kombu has no field for sslmode: the transport option connection_params holds it (and
    # clone() and pickling keep it); the caller's transport options are left as they were
    assert c.transport_options == {
        "schema": schema,
        "connection_params": {"application_name": "from-url", "sslmode": "disable"},
    }
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
    assert _session(clone)["application_name"] == "from-url"
    revived = pickle.loads(pickle.dumps(c))
    connections.append(revived)
    assert revived.as_uri() == c.as_uri()
    _round_trip(revived, "fields-pickled")
    assert _session(revived)["application_name"] == "from-url"


def test_a_host_list_with_a_port_per_host(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    """libpq tries the hosts in turn: the first is down, the second answers. kombu's fields
    say the hosts and the first port; the ports of each go to connection_params."""
    s = server
    url = f"lonnymq://{s['user']}@127.0.0.1:1,{s['host']}:{s['port']}/{s['db']}"
    c = Connection(url, transport_options={"schema": schema})
    connections.append(c)
    assert (c.hostname, c.port) == (f"127.0.0.1,{s['host']}", 1)
    assert (c.transport_options or {})["connection_params"] == {
        "host": f"127.0.0.1,{s['host']}",
        "port": f"1,{s['port']}",
    }
    assert c.as_uri() == url
    _round_trip(c, "host-list")
    assert c.transport.pg.connection().info.port == int(s["port"])


def test_connection_params_with_separate_fields(
    server: dict[str, str], schema: str, connections: list[Connection]
) -> None:
    """A Connection made of separate fields takes libpq parameters from the transport option;
    a typo in their names, or a value libpq would refuse, is named at once."""
    s = server
    c = Connection(
        hostname=s["host"],
        port=int(s["port"]),
        userid=s["user"],
        virtual_host=s["db"],
        transport="lonnymq",
        transport_options={"schema": schema, "connection_params": {"application_name": "byhand"}},
    )
    connections.append(c)
    assert c.as_uri().endswith("?application_name=byhand")
    _round_trip(c, "by-hand")
    assert _session(c)["application_name"] == "byhand"
    for params, message in (
        ({"sslmod": "require"}, "'sslmod' is not a libpq parameter (did you mean 'sslmode'?)"),
        ({"sslmode": "requir"}, "invalid sslmode 'requir' in transport option connection_params"),
        ("sslmode=require", "must be a dict of libpq parameters"),
    ):
        bad = Connection(
            s["host"], transport="lonnymq", transport_options={"connection_params": params}
        )
        with pytest.raises(lonnymq.ConfigurationError) as err:
            bad.connect()
        assert message in str(err.value)
        bad.release()


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
    # no host (libpq's socket) in one of them: kombu's fields cannot say it for a failover
    c = Connection("lonnymq:///db?user=u;lonnymq://u@b:5432/db")
    with pytest.raises(lonnymq.ConfigurationError, match="no host in 'lonnymq:///db") as err:
        c.connect()
    assert "give each its host" in str(err.value)
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
    # with libpq parameters: the fields as without them, the parameters in connection_params
    options = {"schema": "s"}
    c = Connection(
        "lonnymq://alice:s3cr3t@db.example:5433/app?sslmode=require", transport_options=options
    )
    assert (c.hostname, c.port, c.userid, c.password, c.virtual_host) == (
        "db.example",
        5433,
        "alice",
        "s3cr3t",
        "app",
    )
    assert c.transport_options == {"schema": "s", "connection_params": {"sslmode": "require"}}
    assert options == {"schema": "s"}  # the caller's dict is not changed
    assert "transport" not in c.__dict__
    # no host: libpq's default (its socket), not localhost over TCP
    c = Connection("lonnymq:///app?user=alice")
    assert (c.hostname, c.userid, c.virtual_host) == ("localhost", "alice", "app")
    assert c.transport_options == {"connection_params": {"host": ""}}
    assert c.as_uri() == "lonnymq://alice@/app"
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
