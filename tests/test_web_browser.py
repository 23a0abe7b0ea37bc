# mypy: allow-untyped-calls
# (kombu is untyped)
"""The web view in a real headless browser (Debian's chromium and chromedriver, driven by
Selenium): the overview during live traffic refreshes its figures without reloading the page,
draws its chart, and runs none of a hostile payload's script; the pages for people who run
workers (a queue's consumers, a channel's rates, Celery tasks in message lists, delayed
messages in due order). Also: the app mounted inside
another Starlette app (served by uvicorn in a thread), links and static files under its
prefix.

Skipped when chromium is missing, except in CI (``CI`` set), where it must run: .ci/run
installs it."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

import lonnymq
from lonnymq.transport import registry
from lonnymq.web import create_app
from tests.conftest import free_port

from ._web import SCRIPT, celery_payload, fill, web_server

Conn = psycopg.Connection[Any]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing in CI: .ci/run installs them")
        pytest.skip(
            "chromium or chromedriver not installed (apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lonnymq-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1366,900",
    ):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Traffic:
    """A thread that creates and consumes messages of queue ``live`` until stopped."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.run, args=(dsn, schema), daemon=True)

    def run(self, dsn: str, schema: str) -> None:
        try:
            queue = lonnymq.Queue("live", schema=schema)
            with psycopg.connect(dsn, autocommit=True) as conn:
                n = 0
                while not self.stop.is_set():
                    batch = queue.batch()
                    for _ in range(20):
                        batch.channel(f"tenant-{n % 7}").message(f"job {n}")
                        n += 1
                    batch.execute(conn)
                    got = queue.dequeue(conn, limit=12, lock_ms=30_000)
                    for message in got.messages:
                        message.delete(conn)
                    self.stop.wait(0.1)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_overview_updates_without_reload_during_traffic(
    browser: Any, pg_dsn: str, schema: str, conn: Conn
) -> None:
    from selenium.webdriver.common.by import By

    scene = fill(conn, schema)
    with web_server(pg_dsn, schema, "--refresh", "1") as srv, Traffic(pg_dsn, schema) as traffic:
        browser.get(srv.base + "/")
        assert "Queues" in browser.title or "lonnymq" in browser.title
        browser.execute_script("window.__loaded_once = 'yes';")  # gone if the page reloads

        def figures() -> tuple[str, str]:
            # (read in one script: the page's refresh replaces these elements, and between two
            # WebDriver calls the one found first may be gone, StaleElementReferenceException)
            read_at, row = browser.execute_script(
                "const t = document.getElementById('read-at');"
                "const r = document.querySelector('tr[data-queue=\"live\"]');"
                "return [t && t.getAttribute('datetime'), r && r.innerText];"
            )
            assert row, "no row for the queue 'live'"
            return read_at or "", row

        first = figures()
        seen = {first}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(seen) < 3:
            time.sleep(0.5)
            seen.add(figures())
        assert len(seen) >= 3, f"figures did not change: {seen}"
        assert browser.execute_script("return window.__loaded_once;") == "yes"
        # the chart: polylines drawn by the page's own script once two points are in (three
        # readings kept, at least a second apart: refreshes a second apart may keep fewer)
        lines = browser.find_elements(By.CSS_SELECTOR, ".chart svg polyline")
        while time.monotonic() < deadline and not lines:
            time.sleep(0.5)
            lines = browser.find_elements(By.CSS_SELECTOR, ".chart svg polyline")
        assert len(lines) == 4
        assert browser.execute_script("return window.__loaded_once;") == "yes"
        status = browser.execute_script(
            "const s = document.getElementById('live-status'); return s ? s.className : null;"
        )
        assert status is not None and "stale" not in status, status
        # a hostile payload shows as text and runs nothing
        browser.get(f"{srv.base}/messages/{scene.script}")
        body = browser.find_element(By.CSS_SELECTOR, "pre.body").text
        assert body == SCRIPT
        assert browser.execute_script("return window.__xss;") is None
        assert not traffic.errors, traffic.errors


def test_mounted_in_another_app(pg_dsn: str, schema: str, conn: Conn) -> None:
    fill(conn, schema)
    web = create_app(pg_dsn, schema=schema)
    host = Starlette(routes=[Mount("/ops/queues", app=web)])

    async def dispatcher(scope: Any, receive: Any, send: Any) -> None:
        """As docs/web.md's Django asgi.py: /other/ to the view, the rest to the host."""
        if scope["type"] == "http" and scope["path"].startswith("/other/"):
            await web(dict(scope, root_path=scope.get("root_path", "") + "/other"), receive, send)
        else:
            await host(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(dispatcher, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            page = http.get("/ops/queues/")
            assert page.status_code == 200
            assert 'href="/ops/queues/queue?q=emails"' in page.text
            assert 'src="/ops/queues/static/app.js"' in page.text
            assert http.get("/ops/queues/static/app.js").status_code == 200
            api = http.get("/ops/queues/api/queue", params={"q": "emails"})
            assert api.json()["channels"][0]["channel"] == "a"
            assert http.get("/ops/queues/api/messages", params={"limit": "x"}).status_code == 400
            other = http.get("/other/queue", params={"q": "emails"})
            assert other.status_code == 200 and 'href="/other/messages?queue=emails' in other.text
            assert http.get("/other/static/app.css").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        web.state.lonnymq.close()


# (slow: 7-10 s with its teardown; the full suite runs it, the per-version subsets do not)
@pytest.mark.slow
def test_pages_for_people_who_run_workers(
    browser: Any, pg_dsn: str, schema: str, conn: Conn, make_connection: Any
) -> None:
    """A queue's consumers (who, since when, last delivery) and its consumer count; a
    channel's page, whose rates and chart refresh without reloading; message lists with the
    Celery task and its arguments; delayed messages in the order they fall due."""
    from kombu.entity import Queue
    from selenium.webdriver.common.by import By

    fill(conn, schema)
    emails = lonnymq.Queue("emails", schema=schema)
    later = emails.channel("sched")
    for task, seconds in (("report.late", 90), ("report.soon", 30), ("report.middle", 60)):
        later.message.create(
            conn, celery_payload(task, [seconds], {}, f"id-{seconds}"), delay_ms=seconds * 1000
        )
    registry.set_node("w7@box")
    kombu_conn = make_connection()
    consumer = kombu_conn.Consumer(Queue("live"), callbacks=[lambda body, m: m.ack()])
    try:
        consumer.consume()
        with web_server(pg_dsn, schema, "--refresh", "1") as srv, Traffic(pg_dsn, schema):
            # the overview counts the consumers of each queue
            browser.get(srv.base + "/")
            row = browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="live"]')
            assert row.find_element(By.CSS_SELECTOR, 'td[data-key="consumers"]').text == "1"
            # the queue page lists them: node, host, pid
            browser.get(srv.base + "/queue?q=live")
            cells = browser.find_element(By.CSS_SELECTOR, "#consumers tbody tr").text
            assert "w7@box" in cells and str(os.getpid()) in cells
            # ... and the consumers page, by process
            browser.get(srv.base + "/consumers")
            assert "w7@box" in browser.find_element(By.ID, "processes").text
            # a channel's page: its rates refresh, its chart draws
            browser.get(srv.base + "/channel?queue=live&channel=tenant-1")
            browser.execute_script("window.__loaded_once = 'yes';")
            seen = set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                counters = browser.find_element(By.ID, "counters").text
                seen.add(counters)
                lines = browser.find_elements(By.CSS_SELECTOR, ".chart svg polyline")
                if len(seen) >= 3 and len(lines) == 4:
                    break
                time.sleep(0.5)
            assert len(seen) >= 3, seen
            assert len(browser.find_elements(By.CSS_SELECTOR, ".chart svg polyline")) == 4
            assert browser.execute_script("return window.__loaded_once;") == "yes"
            # message lists: the Celery task and its arguments; delayed ones, soonest first
            browser.get(srv.base + "/messages?queue=emails&state=delayed")
            tasks = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#messages td.task")]
            assert tasks == ["report.soon", "report.middle", "report.late"]
            args = browser.find_elements(By.CSS_SELECTOR, "#messages td.args")
            assert [a.text for a in args] == ["(30,)", "(60,)", "(90,)"]
            browser.get(srv.base + "/messages?queue=emails&channel=tenant-7")
            assert browser.find_element(By.CSS_SELECTOR, "#messages td.task").text == (
                "billing.charge"
            )
    finally:
        consumer.cancel()
        registry.set_node(None)
