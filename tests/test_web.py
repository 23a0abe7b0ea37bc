"""The web view (``lonnymq web``) as a subprocess against a real Postgres: its pages and their
JSON API, escaping of hostile data, paging, bad parameters, and read-only refusal of actions.
The actions themselves (token, CSRF, audit log) are in tests/test_web_actions.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import psycopg
import pytest

import lonnymq

from ._web import HOSTILE_CHANNEL, HOSTILE_QUEUE, SCRIPT, Server, fill, web_server

#: multi-second tests (Celery workers, processes, servers): not in the fast subset
pytestmark = pytest.mark.slow

Conn = psycopg.Connection[Any]


@pytest.fixture
def server(pg_dsn: str, schema: str, conn: Conn) -> Any:
    scene = fill(conn, schema)
    with web_server(pg_dsn, schema) as srv:
        yield srv, scene


def cli_json(dsn: str, schema: str, *args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "lonnymq", *args, "--dsn", dsn, "--schema", schema, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_overview_is_status_json_and_escapes_names(
    server: tuple[Server, Any], pg_dsn: str, schema: str
) -> None:
    srv, _ = server
    with srv.client() as http:
        page = http.get("/")
        api = http.get("/api/status").json()
        http.get("/api/status")  # a second reading: rates
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    html = page.text
    assert "emails" in html and "doomed" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert HOSTILE_QUEUE not in html  # never raw
    # the queues are what `lonnymq status --json` prints, with the rates of `top --json`
    status = cli_json(pg_dsn, schema, "status")
    volatile = ("oldest_ready_age_seconds", "rates")
    assert [{k: v for k, v in q.items() if k not in volatile} for q in api["queues"]] == [
        {k: v for k, v in q.items() if k not in volatile} for q in status
    ]
    emails = next(q for q in api["queues"] if q["queue"] == "emails")
    assert emails["ready"] == 11 and emails["dead"] == 0
    assert set(emails["rates"]) == {"enqueued", "delivered", "acked", "dead"}
    assert next(q for q in api["queues"] if q["queue"] == "doomed")["dead"] == 1
    assert api["totals"]["ready"] == 12 and api["totals"]["dead"] == 1
    assert isinstance(api["history"], list) and isinstance(api["warnings"], list)


def test_queue_page_lists_channels_by_backlog_with_policies(server: tuple[Server, Any]) -> None:
    srv, _ = server
    with srv.client() as http:
        page = http.get("/queue", params={"q": "emails"})
        api = http.get("/api/queue", params={"q": "emails", "limit": 2}).json()
        live = http.get("/queue", params={"q": "emails", "part": "live"})
        channel = http.get("/api/channel", params={"queue": "emails", "channel": "a"}).json()
        missing = http.get("/queue", params={"q": "no-such-queue"})
    assert page.status_code == 200 and live.status_code == 200
    assert "<html" not in live.text and 'id="channels"' in live.text
    rows = re.findall(r'<tr data-channel="([^"]*)">', page.text)
    assert rows[:2] == ["a", "b"]  # by backlog: a 5, b 4
    assert "it&#39;s &#34;quoted&#34; &lt;b&gt;bold&lt;/b&gt; &amp; naïve ✓" in page.text
    assert "<b>bold</b>" not in page.text
    assert [c["channel"] for c in api["channels"]] == ["a", "b"]
    a = api["channels"][0]
    assert (a["size"], a["max_concurrency"], a["max_size"], a["has_policy"]) == (5, 2, 1000, True)
    # how long its oldest ready message has waited (from its lane's positions)
    assert a["oldest_ready_seconds"] is not None and 0 <= a["oldest_ready_seconds"] < 600
    assert ">oldest ready</th>" in page.text
    assert api["queue"]["channels"] == 4 and api["limit"] == 2
    assert channel["own_policy"] == {
        "max_concurrency": 2,
        "max_size": 1000,
        "rate": None,
        "burst": None,
    }
    assert channel["size"] == 5
    assert missing.status_code == 404


def test_message_pages_escape_payloads_and_show_celery_tasks(server: tuple[Server, Any]) -> None:
    srv, scene = server
    with srv.client() as http:
        script = http.get(f"/messages/{scene.script}")
        api = http.get(f"/api/messages/{scene.script}").json()
        celery = http.get(f"/messages/{scene.celery}")
        celery_api = http.get(f"/api/messages/{scene.celery}").json()
        big = http.get(f"/messages/{scene.big}")
        big_api = http.get(f"/api/messages/{scene.big}").json()
        content = http.get(f"/messages/{scene.big}/content")
        dead = http.get(f"/messages/{scene.dead}")
    assert script.status_code == 200
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in script.text
    assert SCRIPT not in script.text
    assert api["body"] == SCRIPT and api["channel"] == HOSTILE_CHANNEL
    assert "billing.charge" in celery.text and "task-id-1" in celery.text
    assert "&#34;&lt;eur&gt;&#34;" in celery.text  # the args, as JSON, escaped
    assert celery_api["celery"]["task"] == "billing.charge"
    assert celery_api["celery"]["args"] == [42, "<eur>"]
    assert celery_api["celery"]["kwargs"] == {"retry": True}
    assert big_api["body_truncated"] is True and big_api["body"] is None
    assert big_api["content_bytes"] == 200_005 and len(big_api["body_preview"]) == 64 * 1024
    assert "Download the full content" in big.text and "&lt;end&gt;" not in big.text
    assert len(big.text) < 120_000
    assert content.content == b"x" * 200_000 + b"<end>"
    assert content.headers["content-type"] == "application/octet-stream"
    assert content.headers["content-disposition"].startswith("attachment")
    assert "&lt;b&gt;boom&lt;/b&gt; it&#39;s broken" in dead.text and "<b>boom</b>" not in dead.text


def test_messages_are_paged_and_filtered(pg_dsn: str, schema: str, conn: Conn) -> None:
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    batch = broker.queue("jobs").batch()
    for i in range(120):
        batch.channel("t1" if i % 2 else "t2").message(f"m{i}", delay_ms=3_600_000 if i < 10 else 0)
    batch.execute(conn)
    with web_server(pg_dsn, schema) as srv, srv.client() as http:
        ids: list[int] = []
        after = 0
        pages = 0
        while True:
            page = http.get("/api/messages", params={"queue": "jobs", "after": after}).json()
            ids += [m["id"] for m in page["messages"]]
            pages += 1
            if page["next_after"] is None:
                break
            after = page["next_after"]
        assert pages == 3 and len(ids) == 120 and ids == sorted(ids)
        html = http.get("/messages", params={"queue": "jobs", "limit": 50}).text
        assert html.count('<tr>\n      <td class="num"><a href="/messages/') == 50
        assert f"after={ids[49]}" in html and 'rel="next"' in html
        t1 = http.get("/api/messages", params={"queue": "jobs", "channel": "t1", "limit": 500})
        assert len(t1.json()["messages"]) == 60
        assert {m["channel"] for m in t1.json()["messages"]} == {"t1"}
        delayed = http.get("/api/messages", params={"queue": "jobs", "state": "delayed"}).json()
        assert len(delayed["messages"]) == 10
        assert {m["state"] for m in delayed["messages"]} == {"delayed"}
        dead = http.get("/messages", params={"state": "dead"})
        assert dead.status_code == 200 and "Dead letters" in dead.text


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/messages", {"after": "abc"}),
        ("/messages", {"after": "-1"}),
        ("/messages", {"limit": "0"}),
        ("/messages", {"limit": "100000"}),
        ("/messages", {"state": "bogus"}),
        ("/messages", {"channel": "a"}),  # a channel needs its queue
        ("/api/messages", {"queue": "x" * 300}),
        ("/api/messages", {"queue": "a\x00b"}),
        ("/queue", {}),
        ("/queue", {"q": "emails", "limit": "1e9"}),
        ("/api/queue", {"q": ["a", "b"]}),
        ("/messages/99999999999999999999", {}),
    ],
)
def test_bad_parameters_are_400_not_500(
    server: tuple[Server, Any], path: str, params: dict[str, Any]
) -> None:
    srv, _ = server
    with srv.client() as http:
        response = http.get(path, params=params)
    assert response.status_code == 400, response.text
    if path.startswith("/api/"):
        assert "error" in response.json()
    assert "Traceback" not in response.text and "Traceback" not in srv.stderr()


def test_read_only_refuses_actions(server: tuple[Server, Any], schema: str, conn: Conn) -> None:
    srv, scene = server
    form = {"queue": "emails", "csrf": "x"}
    with srv.client() as http:
        origin = {"origin": srv.base}
        assert http.post("/actions/purge", data=form, headers=origin).status_code == 403
        assert http.get("/actions/purge", params={"queue": "emails"}).status_code == 403
        assert http.post("/actions/delete", data={"ids": str(scene.dead)}).status_code == 403
        assert http.get("/login").status_code == 403
        assert http.post("/").status_code == 405
        assert http.put("/api/status").status_code == 405
        assert http.delete(f"/api/messages/{scene.dead}").status_code == 405
        page = http.get("/queue", params={"q": "emails"}).text
    assert "read-only" in page and "/actions/" not in page
    broker = lonnymq.Broker(schema)
    assert broker.queue("emails").stats(conn).total == 11
    assert broker.message(conn, scene.dead) is not None


def test_web_needs_a_token_for_actions(pg_dsn: str, schema: str) -> None:
    base = [sys.executable, "-m", "lonnymq", "web", "--dsn", pg_dsn, "--schema", schema]
    env = {k: v for k, v in os.environ.items() if k != "LONNYMQ_WEB_TOKEN"}
    no_token = subprocess.run(
        [*base, "--allow-actions"], capture_output=True, text=True, timeout=30, env=env
    )
    assert no_token.returncode == 2 and "needs an access token" in no_token.stderr
    short = subprocess.run(
        [*base, "--allow-actions", "--token", "short"], capture_output=True, text=True, timeout=30
    )
    assert short.returncode == 2 and "at least 16 characters" in short.stderr


def test_queue_page_shows_rates_and_what_they_hold(pg_dsn: str, schema: str, conn: Conn) -> None:
    """A rated channel shows its rate, burst and tokens (or how long until its next one) in
    the queue page and its API; the status API carries what rates hold back, as ``lonnymq
    status --json`` does."""
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    queue = broker.queue("rated")
    queue.channel("slow").policy.set(conn, rate="2/m", burst=2)
    batch = queue.batch()
    for i in range(6):
        batch.channel("slow").message(f"s{i}")
        batch.channel("free").message(f"f{i}")
    batch.execute(conn)
    held: list[lonnymq.Message] = []
    for _ in range(3):
        held += broker.dequeue(conn, ["rated"], limit=100, listen=False).messages
    assert sum(1 for m in held if m.channel == "slow") == 2
    other = broker.queue("defaulted")
    other.policy.set(conn, rate="100/s", burst=3)
    other.channel("x").message.create(conn, b"x")
    with web_server(pg_dsn, schema) as srv, srv.client() as http:
        page = http.get("/queue", params={"q": "rated"})
        api = http.get("/api/queue", params={"q": "rated"}).json()
        status = http.get("/api/status").json()
        defaulted = http.get("/queue", params={"q": "defaulted"})
        defaulted_api = http.get("/api/queue", params={"q": "defaulted"}).json()
    assert "rate <b>100/s</b> (burst 3)" in defaulted.text
    assert defaulted_api["queue"]["policy"]["rate"] == "100/s"
    assert api["queue"]["policy"] == {"max_concurrency": None, "max_size": None}
    slow = next(c for c in api["channels"] if c["channel"] == "slow")
    free = next(c for c in api["channels"] if c["channel"] == "free")
    assert (slow["rate"], slow["burst"], slow["tokens"]) == ("2/m", 2, 0)
    assert 25 < slow["next_token_seconds"] <= 30
    assert (free["rate"], free["tokens"]) == (None, None)
    assert api["has_rate"] is True
    assert ">rate</th>" in page.text and ">2/m<" in page.text and "next in" in page.text
    rated = next(q for q in status["queues"] if q["queue"] == "rated")
    assert rated["rate_held"] == {"channels": 1, "messages": 4}
