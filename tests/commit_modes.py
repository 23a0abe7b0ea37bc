"""How the transactions that create messages commit, seen from inside Postgres: a trigger on
the message table, deferred to the commit, records each new message's id, the
``synchronous_commit`` setting its transaction commits with (the one in force at the commit,
after whatever the statement set), and the WAL insert position then (its commit record comes
after it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

Conn = psycopg.Connection[Any]


def record_commit_modes(conn: Conn, schema: str) -> Callable[[], list[tuple[str, bool]]]:
    """Install the trigger in ``schema`` (installed already); returns a reader of (setting,
    whether the WAL is flushed past that position now) for each message created since, newest
    first."""
    s = sql.Identifier(schema)
    conn.execute(sql.SQL("CREATE TABLE {}.seen (id bigint, mode text, at pg_lsn)").format(s))
    conn.execute(
        sql.SQL(
            # (SECURITY DEFINER: a deferred trigger runs as the role that commits, outside the
            # publish's own SECURITY DEFINER function)
            "CREATE FUNCTION {s}.record_mode() RETURNS trigger LANGUAGE plpgsql "
            "SECURITY DEFINER AS $$ "
            "BEGIN INSERT INTO {s}.seen VALUES (NEW.id, current_setting('synchronous_commit'), "
            "pg_current_wal_insert_lsn()); RETURN NULL; END $$"
        ).format(s=s)
    )
    conn.execute(
        sql.SQL(
            "CREATE CONSTRAINT TRIGGER record_mode AFTER INSERT ON {s}.message "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {s}.record_mode()"
        ).format(s=s)
    )
    query = sql.SQL(
        "SELECT mode, pg_current_wal_flush_lsn() >= at FROM {}.seen ORDER BY id DESC"
    ).format(s)

    def read() -> list[tuple[str, bool]]:
        return [(str(mode), bool(flushed)) for mode, flushed in conn.execute(query).fetchall()]

    return read


def recorded_statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bytes]]:
    """From now on, (session, query) of each statement the transport's command connections
    run (``lonnymq.transport.connection``'s ``run``), in order."""
    from lonnymq.queue import _ops
    from lonnymq.transport import connection

    ran: list[tuple[int, bytes]] = []
    plain = _ops.run

    def recorded(pg: Any, op: Any) -> Any:
        ran.append((id(pg), op.query))
        return plain(pg, op)

    monkeypatch.setattr(connection, "run", recorded)
    return ran
