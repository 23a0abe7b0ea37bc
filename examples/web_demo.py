"""The web view on the demo's tenants, with traffic: ``lonnymq web`` to look at in a browser.

The demo's Celery app (examples/demo.py) enqueues its tenants' tasks in the ``celery`` queue:
``acme`` 400 (limited to 2 running at a time by its channel policy), ``globex`` 100,
``initech`` 20, ``hooli`` 5. A consumer thread here takes them as a worker with 4 slots would
(each task "runs" half a second), the producers keep adding a few tasks a second, and a small
``emails`` queue gets a dead letter. Then ``lonnymq web`` serves the schema:

    python examples/web_demo.py                # prints the URL; Ctrl-C stops it all
    python examples/web_demo.py --screenshots docs/images --seconds 60

``--screenshots DIR`` waits ``--seconds`` for the chart to fill, saves the overview and the
``celery`` queue's channels (tenants) as DIR/web-overview.png and DIR/web-channels.png with
headless chromium (Debian's ``chromium`` and ``chromium-driver``), and stops. It uses
$DATABASE_URL when set, else a throwaway Postgres (see lonnymq.testing), and a schema of its
own, dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

import lonnymq
from lonnymq.testing import database, where

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def enqueue_demo(dsn: str, schema: str) -> None:
    """The demo's tasks, published by the demo's own Celery app."""
    sys.path.insert(0, str(HERE))
    import demo  # examples/demo.py: the Celery app, its task and its tenants

    demo.configure(dsn, schema)
    with demo.app.producer_or_acquire() as producer:
        for tenant, count in demo.TENANTS.items():
            for n in range(count):
                demo.work.apply_async((tenant, n), producer=producer)
    demo.app.close()


class Traffic:
    """A consumer with 6 slots (a task holds its slot 1.2 s) and a producer adding a task
    every 0.3 s (most for acme; umbrella, a tenant the demo does not have, at most 1 running
    and 40 held), until stopped."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self.consume),
            threading.Thread(target=self.produce),
        ]

    def consume(self) -> None:
        queue = lonnymq.Queue("celery", schema=self.schema)
        held: list[tuple[float, lonnymq.Message]] = []
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                now = time.monotonic()
                for _, message in [h for h in held if h[0] <= now]:
                    message.delete(conn)
                held = [h for h in held if h[0] > now]
                if len(held) < 6:
                    got = queue.dequeue(conn, limit=6 - len(held), lock_ms=60_000)
                    held += [(now + 1.2, m) for m in got.messages]
                self.stop.wait(0.1)
            for _, message in held:
                message.defer(conn, delay_ms=0)

    def produce(self) -> None:
        queue = lonnymq.Queue("celery", schema=self.schema)
        tenants = ["acme", "umbrella", "acme", "globex", "umbrella", "initech", "acme", "hooli"]
        tenants += ["umbrella", "wayne"]
        n = 0
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            queue.channel("umbrella").policy.set(conn, max_concurrency=1, max_size=40)
            while not self.stop.wait(0.3):
                tenant = tenants[n % len(tenants)]
                body = json.dumps({"tenant": tenant, "n": n}).encode()
                queue.channel(tenant).message.create(conn, body, raise_if_dropped=False)
                n += 1

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def emails(dsn: str, schema: str) -> None:
    """A small second queue, with a dead letter."""
    queue = lonnymq.Queue("emails", schema=schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(12):
            queue.channel(f"customer-{i % 3}").message.create(conn, f"welcome mail {i}")
        got = queue.dequeue(conn, limit=1)
        for m in got.messages:
            lonnymq.Broker(schema).reject(conn, m.id, m.lock_token, reason="SMTP 550: no such user")


def screenshots(base: str, out: Path, seconds: float) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lonnymq-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1366,800", "--hide-scrollbars",
    ):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(base + "/")
        print(f"waiting {seconds:g} s for the chart to fill", flush=True)
        time.sleep(seconds)
        out.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out / "web-overview.png"))
        driver.get(base + "/queue?q=celery")
        time.sleep(3)
        driver.save_screenshot(str(out / "web-channels.png"))
        print(f"saved {out / 'web-overview.png'} and {out / 'web-channels.png'}")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--screenshots", type=Path, help="save the screenshots there and stop")
    ap.add_argument("--seconds", type=float, default=60.0, help="traffic before the screenshots")
    args = ap.parse_args()
    with database() as dsn:
        print(where(dsn), flush=True)
        schema = f"lonnymq_web_demo_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            lonnymq.install(conn, schema=schema)
        try:
            enqueue_demo(dsn, schema)
            emails(dsn, schema)
            port = args.port or free_port()
            cmd = [sys.executable, "-m", "lonnymq", "web", "--dsn", dsn, "--schema", schema]
            server = subprocess.Popen([*cmd, "--port", str(port)], env=os.environ.copy())
            base = f"http://127.0.0.1:{port}"
            try:
                with Traffic(dsn, schema):
                    if args.screenshots:
                        time.sleep(2)
                        screenshots(base, args.screenshots, args.seconds)
                    else:
                        print(f"open {base}/ (Ctrl-C to stop)", flush=True)
                        while server.poll() is None:
                            time.sleep(1)
            except KeyboardInterrupt:
                pass
            finally:
                server.terminate()
                server.wait(timeout=15)
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
