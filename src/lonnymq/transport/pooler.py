"""Connection poolers between the transport and Postgres (PgBouncer, and the like).

A pooler in transaction mode (PgBouncer's ``pool_mode = transaction``, the usual set-up for
producers) hands each transaction of a client to any of its server sessions. Two things the
transport does rely on a session of its own:

- psycopg's prepared statements (a statement run 5 times is prepared on the session that ran
  it): PgBouncer before 1.21 loses them, and a later call fails with ``prepared statement
  "_pg3_0" already exists`` or ``does not exist``. On a connection through a pooler the
  transport does not prepare (:func:`adapt`).
- LISTEN: the notifications go to the server session that ran the LISTEN, not to the client,
  so an idle consumer would wake only at its fallback poll. :func:`check_listen` finds that
  out when the LISTEN connection opens, and refuses it with :class:`ListenUnavailable`, which
  says what to do (the transport option ``listen_dsn``: a direct connection for consumers).

A connection goes through a pooler when the backend process id Postgres reports in the session
differs from the one the connection was given at its start: a pooler makes up its own (it
cannot give a client the id of a server session the client does not own).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from ..dsn import mask_password
from ..exceptions import ListenUnavailable

#: Seconds :func:`check_listen` waits for its own notification through a pooler (a session-mode
#: pooler relays it within milliseconds; a transaction-mode one never does).
PROBE_SECONDS = 3.0


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` goes through a connection pooler (see the module docstring)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row is not None and row[0] != conn.info.backend_pid


def pooled(conn: psycopg.Connection[Any]) -> bool:
    """Whether :func:`adapt` found that ``conn`` goes through a pooler (it turned psycopg's
    prepared statements off)."""
    return conn.prepare_threshold is None


def adapt(conn: psycopg.Connection[Any]) -> bool:
    """Make a new connection fit for a pooler it goes through (no prepared statements);
    returns whether it goes through one."""
    pooled = behind_pooler(conn)
    if pooled:
        conn.prepare_threshold = None
    return pooled


def check_listen(
    conn: psycopg.Connection[Any],
    conninfo: str,
    other: Callable[[], psycopg.Connection[Any]],
) -> None:
    """Raise :class:`ListenUnavailable` (and close ``conn``) when notifications cannot reach
    ``conn``, a connection through a pooler: a NOTIFY sent from another connection (opened
    by ``other``) on a channel of its own must arrive within :data:`PROBE_SECONDS`. Does
    nothing on a direct connection."""
    try:
        if not behind_pooler(conn) or _notified(conn, other):
            return
    except BaseException:
        conn.close()
        raise
    conn.close()
    raise ListenUnavailable(
        f"LISTEN does not work through {mask_password(conninfo)!r}: it goes through a "
        "connection pooler in transaction mode (PgBouncer's pool_mode = transaction?), which "
        "sends the notifications elsewhere, so an idle consumer would wake only every "
        "polling_interval. Set the transport option listen_dsn to a direct connection to "
        "Postgres (or through PgBouncer in session mode) for the consumers, or use_listen="
        "False to poll every polling_interval seconds"
    )


def _notified(conn: psycopg.Connection[Any], other: Callable[[], psycopg.Connection[Any]]) -> bool:
    """Whether a NOTIFY from another connection reaches ``conn`` (on a channel of its own)."""
    name = f"lonnymq_probe_{uuid.uuid4().hex}"
    channel = sql.Identifier(name)
    conn.execute(sql.SQL("LISTEN {}").format(channel))
    with other() as sender:
        sender.execute("SELECT pg_notify(%s, '')", (name,))
    arrived = any(True for _ in conn.notifies(timeout=PROBE_SECONDS, stop_after=1))
    conn.execute(sql.SQL("UNLISTEN {}").format(channel))
    return arrived
