"""Actions of the web view: only with --allow-actions and the token; a signed-in session, a
CSRF token and a same-origin request for each; every action logged with who and what."""

from __future__ import annotations

import re
from typing import Any

import httpx
import psycopg
import pytest

import lonnymq

from ._web import TOKEN, Server, fill, web_server

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]


@pytest.fixture
def server(pg_dsn: str, schema: str, conn: Conn) -> Any:
    scene = fill(conn, schema)
    env = {"LONNYMQ_WEB_TOKEN": TOKEN}
    with web_server(pg_dsn, schema, "--allow-actions", env=env) as srv:
        yield srv, scene


def hidden(html: str, name: str) -> str:
    found = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)">', html)
    assert found, f"no hidden field {name} in {html[:3000]}"
    return found[1]


def sign_in(http: httpx.Client, srv: Server, token: str = TOKEN, name: str = "alice") -> int:
    page = http.get("/login")
    assert page.status_code == 200
    form = {"name": name, "token": token, "csrf": hidden(page.text, "csrf"), "next": "/"}
    return http.post("/login", data=form, headers={"origin": srv.base}).status_code


def test_an_action_needs_a_session_a_csrf_token_and_the_same_origin(
    server: tuple[Server, Any], schema: str, conn: Conn
) -> None:
    srv, _ = server
    broker = lonnymq.Broker(schema)
    origin = {"origin": srv.base}
    with srv.client() as http:
        # not signed in: the confirmation sends to the sign-in page, the POST is refused
        confirm = http.get("/actions/purge", params={"queue": "emails"})
        assert confirm.status_code == 303 and "/login?next=" in confirm.headers["location"]
        assert (
            http.post("/actions/purge", data={"queue": "emails"}, headers=origin).status_code == 403
        )
        # a wrong token, a sign-in without its CSRF token
        assert sign_in(http, srv, token="wrong-token-0123456789") == 403
        bare = {"name": "alice", "token": TOKEN}
        assert http.post("/login", data=bare, headers=origin).status_code == 403
        assert sign_in(http, srv) == 303
        page = http.get("/actions/purge", params={"queue": "emails", "back": "/queue?q=emails"})
        assert page.status_code == 200, srv.stderr()[-3000:]
        assert "delete every message of queue &#39;emails&#39;" in page.text
        csrf = hidden(page.text, "csrf")
        form = {"queue": "emails", "csrf": csrf}
        # no CSRF token, a wrong one, another origin, no origin at all: refused
        assert (
            http.post("/actions/purge", data={"queue": "emails"}, headers=origin).status_code == 403
        )
        wrong = form | {"csrf": "x" + csrf[1:]}
        assert http.post("/actions/purge", data=wrong, headers=origin).status_code == 403
        evil = {"origin": "http://evil.example"}
        assert http.post("/actions/purge", data=form, headers=evil).status_code == 403
        assert http.post("/actions/purge", data=form).status_code == 403
        assert broker.queue("emails").stats(conn).total == 11
        # all there: done, and logged
        done = http.post("/actions/purge", data=form, headers=origin)
        assert done.status_code == 200, done.text
        assert "purged 11 message(s) from queue &#39;emails&#39;" in done.text
    assert broker.queue("emails").stats(conn).total == 0
    log = srv.stderr()
    assert re.search(
        r"lonnymq\.web\.audit INFO action: purge .*queue 'emails'.*name='alice' from=127\.0\.0\.1; "
        r"result: purged 11 message\(s\)",
        log,
    ), log
    assert "refused POST /actions/purge: bad CSRF token" in log
    assert "refused POST /actions/purge: cross-origin request" in log
    assert "refused POST /login: wrong token" in log
    assert TOKEN not in log


def test_retry_delete_and_policies(server: tuple[Server, Any], schema: str, conn: Conn) -> None:
    srv, scene = server
    broker = lonnymq.Broker(schema)
    origin = {"origin": srv.base}
    with srv.client() as http:
        assert sign_in(http, srv, name="bob <admin>") == 303
        csrf = hidden(http.get("/actions/retry", params={"ids": scene.dead}).text, "csrf")
        retried = http.post(
            "/actions/retry", data={"ids": scene.dead, "csrf": csrf}, headers=origin
        )
        assert retried.status_code == 200 and f"{scene.dead}: retried" in retried.text
        dead = broker.message(conn, scene.dead)
        assert dead is None or dead.state != "dead"
        deleted = http.post(
            "/actions/delete",
            data={"ids": f"{scene.script},{scene.big}", "csrf": csrf},
            headers=origin,
        )
        assert deleted.status_code == 200 and f"{scene.script}: deleted" in deleted.text
        assert broker.message(conn, scene.script) is None
        policy = {
            "queue": "emails",
            "channel": "b",
            "max_concurrency": "3",
            "max_size": "",
            "csrf": csrf,
        }
        assert http.post("/actions/policy_set", data=policy, headers=origin).status_code == 200
        own = broker.queue("emails").channel("b").policy.get(conn)
        assert own is not None and (own.max_concurrency, own.max_size) == (3, None)
        bad = policy | {"max_concurrency": "-1"}
        assert http.post("/actions/policy_set", data=bad, headers=origin).status_code == 400
        clear = {"queue": "emails", "channel": "b", "csrf": csrf}
        assert http.post("/actions/policy_clear", data=clear, headers=origin).status_code == 200
        assert broker.queue("emails").channel("b").policy.get(conn) is None
        unknown = http.post("/actions/drop_database", data={"csrf": csrf}, headers=origin)
        assert unknown.status_code == 400
        # signing out ends the session
        assert http.post("/logout", data={"csrf": csrf}, headers=origin).status_code == 303
        after = http.post("/actions/purge", data={"queue": "emails", "csrf": csrf}, headers=origin)
        assert after.status_code == 403
    log = srv.stderr()
    assert "action: retry" in log and "name='bob <admin>'" in log
    assert "action: policy_set" in log and "max_concurrency=3" in log
    assert "signed out: name='bob <admin>'" in log
