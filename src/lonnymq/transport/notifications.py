"""Reading what arrives on a LISTEN session (see :class:`~.connection.Waiter`).

An idle consumer's wake-up starts with this read, so it uses libpq's own calls
(``consume_input``, ``notifies``): psycopg's ``notifies(timeout=0)`` sets up a wait at each
call: 0.24-0.28 ms from the socket's readiness to the first notification's parse, cold,
against 0.16-0.17 this way (docs/benchmarks.md). What psycopg reads while a statement runs
on the session (the sleep keys are taken there) reaches its notify handler, which keeps it
for the next read.
"""

from __future__ import annotations

from typing import Any

import psycopg


class Arrivals:
    """The notifications of one LISTEN session at a time. Not thread-safe: its user holds
    the session's lock."""

    def __init__(self) -> None:
        self._held: list[psycopg.Notify] = []  # (read by psycopg during a statement)
        self._encoding = "utf-8"

    def attach(self, conn: psycopg.Connection[Any]) -> None:
        """Read ``conn``, a new LISTEN session, from now on (what was held is dropped)."""
        self._held, self._encoding = [], conn.info.encoding
        conn.add_notify_handler(self._held.append)

    def clear(self) -> None:
        """Drop what was held (the session is closed)."""
        self._held.clear()

    def read(self, conn: psycopg.Connection[Any]) -> list[psycopg.Notify]:
        """What arrived, without blocking: what psycopg read during statements, then what
        the socket holds. Raises ``psycopg.OperationalError`` when the connection is lost."""
        pgconn = conn.pgconn
        pgconn.consume_input()
        arrived = self._held[:]
        self._held.clear()  # (the list the handler appends to)
        encoding = self._encoding
        while (n := pgconn.notifies()) is not None:
            arrived.append(
                psycopg.Notify(n.relname.decode(encoding), n.extra.decode(encoding), n.be_pid)
            )
        return arrived
