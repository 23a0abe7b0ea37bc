"""The web view's server for tests: ``python -m lonnymq web`` as a subprocess on a free port,
against the test database, stopped (and waited for) at the end; and the data the tests of
tests/test_web*.py look at."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

import lonnymq
from tests.conftest import created, free_port

TOKEN = "test-token-0123456789abcdef"
HOSTILE_QUEUE = "<img src=x onerror=alert(1)>"
HOSTILE_CHANNEL = 'it\'s "quoted" <b>bold</b> & naïve ✓'
SCRIPT = "<script>window.__xss = 1</script>"


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=30, **kwargs)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def web_server(
    dsn: str, schema: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """``lonnymq web`` on the schema, up (its ``/healthz`` answers) until the block ends."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "web.log"
        cmd = [sys.executable, "-m", "lonnymq", "web", "--dsn", dsn, "--schema", schema]
        cmd += ["--port", str(port), *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | (env or {}),
            )
        server = Server(f"http://127.0.0.1:{port}", proc, log)
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"lonnymq web exited: {server.stderr()}")
                try:
                    if httpx.get(server.base + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"lonnymq web did not answer: {server.stderr()}")
                time.sleep(0.1)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def celery_payload(task: str, args: list[Any], kwargs: dict[str, Any], task_id: str) -> bytes:
    """A message as Celery (protocol 2) publishes it through kombu."""
    body = json.dumps([args, kwargs, {"callbacks": None, "errbacks": None}])
    return json.dumps(
        {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py",
                "task": task,
                "id": task_id,
                "retries": 0,
                "argsrepr": repr(tuple(args)),
                "kwargsrepr": repr(kwargs),
                "origin": "gen1@host",
            },
            "properties": {"body_encoding": "base64", "delivery_tag": "x"},
        }
    ).encode()


@dataclass
class Scene:
    """What :func:`fill` made: ids of interesting messages."""

    script: int
    celery: int
    big: int
    dead: int
    hostile: int


def fill(conn: psycopg.Connection[Any], schema: str) -> Scene:
    """Queue ``emails``: channels a (5 messages, a policy), b (3), a hostile channel with a
    ``<script>`` payload; a Celery task; a 200 KiB payload; a dead letter with a hostile
    reason; and a queue with a hostile name."""
    broker = lonnymq.Broker(schema)
    broker.install(conn)
    emails = broker.queue("emails")
    for i in range(5):
        emails.channel("a").message.create(conn, f"a-{i}")
    for i in range(3):
        emails.channel("b").message.create(conn, f"b-{i}")
    emails.channel("a").policy.set(conn, max_concurrency=2, max_size=1000)
    script = created(emails.channel(HOSTILE_CHANNEL).message.create(conn, SCRIPT))
    payload = celery_payload("billing.charge", [42, "<eur>"], {"retry": True}, "task-id-1")
    celery = created(emails.channel("tenant-7").message.create(conn, payload))
    big = created(emails.channel("b").message.create(conn, b"x" * 200_000 + b"<end>"))
    doomed = broker.queue("doomed")
    doomed.channel("c").message.create(conn, "will die")
    got = doomed.dequeue(conn, limit=1)
    msg = got.messages[0]
    broker.reject(conn, msg.id, msg.lock_token, reason="<b>boom</b> it's broken")
    hostile = created(broker.queue(HOSTILE_QUEUE).channel("x").message.create(conn, "hi"))
    return Scene(script=script, celery=celery, big=big, dead=msg.id, hostile=hostile)
