"""The web view's database connections: a few autocommit connections kept for reuse, each
with a statement timeout (a slow page fails instead of piling up), opened on first use and
closed by :meth:`Pool.close` (the app's shutdown)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from ..dsn import mask_password
from ..exceptions import ConnectionLost

Conn = psycopg.Connection[Any]

APPLICATION_NAME = "lonnymq-web"


class Unavailable(Exception):
    """The database cannot be reached, or every connection is busy (HTTP 503)."""


class Pool:
    """At most ``size`` connections to ``dsn``; a request waits up to ``wait_s`` seconds for
    one. A connection that broke, or that a request left inside a transaction, is closed
    instead of being reused."""

    def __init__(
        self,
        dsn: str,
        *,
        size: int = 4,
        statement_timeout_ms: int = 10_000,
        wait_s: float = 10.0,
    ) -> None:
        self._dsn = dsn
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._timeout_ms = statement_timeout_ms
        self._wait_s = wait_s
        self._closed = False

    def _open(self) -> Conn:
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, application_name=APPLICATION_NAME)
        except psycopg.Error as exc:
            raise Unavailable(
                f"cannot connect to the database: {mask_password(str(exc)).strip()}"
            ) from None
        conn.execute(
            sql.SQL("SET statement_timeout = {}").format(sql.Literal(f"{self._timeout_ms}ms"))
        )
        return conn

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        if self._closed:
            raise Unavailable("the web view is shutting down")
        if not self._slots.acquire(timeout=self._wait_s):
            raise Unavailable("every database connection of the web view is busy")
        conn: Conn | None = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._open()
            try:
                yield conn
            except (psycopg.OperationalError, ConnectionLost) as exc:
                conn.close()
                raise Unavailable(f"database error: {mask_password(str(exc)).strip()}") from exc
        finally:
            if conn is not None:
                reusable = (
                    not conn.closed
                    and not self._closed
                    and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                )
                if reusable:
                    with self._lock:
                        self._idle.append(conn)
                else:
                    conn.close()
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
