"""``lonnymq web`` checks before it announces: a refused login, a missing schema, a role without
rights and a port in use each exit with status 1, the error and what to run, before any
``on http://`` line; a database that goes away later gives 503 pages with the reason, and the
view recovers when it comes back. Real Postgres (reached through a TCP relay the test can cut),
``lonnymq web`` as a subprocess."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import lonnymq
from tests.conftest import dsn_as, free_port

from ._web import web_server

Conn = psycopg.Connection[Any]


def web(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "lonnymq", "web", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_a_refused_login_exits_with_the_error_and_what_to_check(pg_dsn: str, schema: str) -> None:
    out = web("--dsn", dsn_as(pg_dsn, "no_such_role_27"), "--port", str(free_port()))
    assert out.returncode == 1
    assert 'role "no_such_role_27" does not exist' in out.stderr
    assert "check the user name in --dsn" in out.stderr
    assert "http://" not in out.stderr.split("cannot connect to", 1)[0]
    assert "on http://" not in out.stderr


def test_a_missing_schema_exits_with_what_to_run(pg_dsn: str, schema: str) -> None:
    out = web("--dsn", pg_dsn, "--schema", schema, "--port", str(free_port()))
    assert out.returncode == 1
    assert f"schema {schema!r} is not installed" in out.stderr
    assert f"run: lonnymq migrate --dsn {pg_dsn} --schema {schema}" in out.stderr
    assert "on http://" not in out.stderr


def test_a_role_without_rights_exits_with_the_grant_to_run(
    pg_dsn: str, schema: str, roles: dict[str, str]
) -> None:
    role = roles["nobody"]
    out = web("--dsn", dsn_as(pg_dsn, role), "--schema", schema, "--port", str(free_port()))
    assert out.returncode == 1
    assert f"lonnymq grant admin {role} --schema {schema}" in out.stderr
    assert "on http://" not in out.stderr


def test_a_port_in_use_exits_before_announcing(pg_dsn: str, schema: str, conn: Conn) -> None:
    lonnymq.install(conn, schema)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = web("--dsn", pg_dsn, "--schema", schema, "--port", str(port))
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "pick another --port" in out.stderr
    assert "on http://" not in out.stderr


class Relay:
    """A TCP relay to the test's Postgres that the test can cut (the database "goes away":
    open connections are closed, new ones refused) and restore."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self._server: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        server.setblocking(False)
        self._server = server
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        assert self._server is not None
        sel.register(self._server, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._server:
                    client, _ = sock.accept()
                    upstream = socket.create_connection(self.target)
                    peers[client], peers[upstream] = upstream, client
                    with self._lock:
                        self._pairs.append((client, upstream))
                    sel.register(client, selectors.EVENT_READ)
                    sel.register(upstream, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                other = peers.get(sock)
                if not data or other is None:
                    for s in (sock, other):
                        if s is not None:
                            with contextlib.suppress(KeyError, ValueError):
                                sel.unregister(s)
                            s.close()
                            peers.pop(s, None)
                    continue
                with contextlib.suppress(OSError):
                    other.sendall(data)
        for s in list(peers):
            s.close()
        sel.close()

    def cut(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._server is not None:
            self._server.close()
            self._server = None


@pytest.fixture
def relay(pg_dsn: str) -> Iterator[Relay]:
    params = conninfo_to_dict(pg_dsn)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server listens on a unix socket only")
    r = Relay(host, int(params.get("port") or 5432))
    r.start()
    yield r
    r.cut()


def test_a_database_that_goes_away_later_gives_503_with_the_reason(
    pg_dsn: str, schema: str, conn: Conn, relay: Relay
) -> None:
    lonnymq.install(conn, schema)
    lonnymq.Queue("jobs", schema=schema).channel("a").message.create(conn, b"x")
    params = conninfo_to_dict(pg_dsn) | {"host": "127.0.0.1", "port": str(relay.port)}
    dsn = make_conninfo("", **params)
    with web_server(dsn, schema) as srv, srv.client() as http:
        assert "lonnymq web: schema" in srv.stderr() and "on http://" in srv.stderr()
        assert http.get("/").status_code == 200
        relay.cut()
        page = http.get("/messages?queue=jobs")
        assert page.status_code == 503
        assert "database" in page.text
        api = http.get("/api/messages?queue=jobs")
        assert api.status_code == 503 and "error" in api.json()
        relay.start()  # it comes back
        assert http.get("/messages?queue=jobs").status_code == 200
        assert httpx.get(srv.base + "/healthz").status_code == 200
