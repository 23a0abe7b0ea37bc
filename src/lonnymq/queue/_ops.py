"""One queue operation = one SQL function call in one round trip.

An :class:`Op` is the rendered query, its parameters and the function that turns the result
rows into a typed value. The same op runs on a sync or an async psycopg connection, alone or
pipelined in a batch. Driver errors are translated here, at the boundary.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar, overload

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.rows import tuple_row

from .._compat import LiteralString
from ..exceptions import (
    ChannelBusy,
    ConnectionLost,
    DatabaseError,
    InvalidArgument,
    LonnyMQError,
    PermissionDenied,
    SchemaNotInstalled,
)

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


@cache
def render(template: LiteralString, schema: str) -> bytes:
    """A query template with ``{schema}`` filled in as a quoted identifier (cached, so the
    bytes are identical on every call and psycopg prepares the statement)."""
    return sql.SQL(template).format(schema=sql.Identifier(schema)).as_bytes()


@dataclass(frozen=True, slots=True)
class Op(Generic[T]):
    schema: str
    query: bytes
    params: Sequence[Any]
    parse: Callable[[Rows], T]
    #: Rows come back in binary (a dequeue's: its bytea, uuid and timestamps are not
    #: written out as text and parsed back, 0.1 ms of a 100-message call's client time).
    binary: bool = False


def no_result(rows: Rows) -> None:
    """The parse of an op whose function returns nothing to the caller (void)."""
    return None


_SCHEMA_ERRORS = (
    pgerrors.UndefinedFunction,
    pgerrors.UndefinedTable,
    pgerrors.InvalidSchemaName,
    pgerrors.UndefinedObject,
    pgerrors.UndefinedColumn,
)
_ARGUMENT_ERRORS = (
    pgerrors.CheckViolation,
    pgerrors.NumericValueOutOfRange,
    pgerrors.InvalidParameterValue,
    pgerrors.StringDataRightTruncation,
    pgerrors.CharacterNotInRepertoire,
    pgerrors.UntranslatableCharacter,
    pgerrors.ProgramLimitExceeded,
)


_ASYNC_COMMIT = (
    b"SELECT q.* FROM (SELECT set_config('synchronous_commit', 'off', true)) AS c(v) "
    b"CROSS JOIN LATERAL ("
)


def async_commit(op: Op[T]) -> Op[T]:
    """``op`` committing with ``synchronous_commit = off``: no wait for the WAL flush. Only
    for a statement that is its own transaction (an autocommit connection) and whose loss in
    a database crash is harmless: a dequeue or an ack lost that way means a redelivery, which
    at-least-once delivery allows. Never for a create, except of a message its publisher
    marked transient (kombu's delivery_mode 1), whose loss in a crash is its contract."""
    return Op(op.schema, _ASYNC_COMMIT + op.query + b") AS q", op.params, op.parse, op.binary)


_ASYNC_COMMIT_IF_WOKE = (
    b"SELECT q.*, CASE WHEN current_setting('lonnymq.hinted', true) = 'on' THEN "
    # (the bytea form: (boolean, text, bytea) before Postgres 17, with a flush argument since)
    b"CASE WHEN (SELECT bool_or(has_function_privilege(p.oid, 'EXECUTE')) "
    b"FROM pg_catalog.pg_proc p WHERE p.proname = 'pg_logical_emit_message' "
    b"AND p.pronamespace = 'pg_catalog'::regnamespace AND p.proargtypes[2] = 'bytea'::regtype) "
    b"THEN set_config('synchronous_commit', 'off', true) IS NOT NULL ELSE false END "
    b"ELSE false END FROM ("
)


def async_commit_if_woke(op: Op[T]) -> Op[tuple[T, bool]]:
    """``op``, a publish that is its own transaction (an autocommit connection), committing
    with ``synchronous_commit = off`` when it woke a consumer asleep on a queue it reached
    (its first create due now handed its message to it or sent it the message's id: the
    transaction's setting ``lonnymq.hinted``, see handoff_v1 and wake_v2), durably
    otherwise; and whether it did, so that the caller runs ``flush_op`` before the publish
    returns. (The setting is read as the function's rows are projected, after it ran to its
    end, and a setting changed before the commit is the one the commit obeys. Not where the
    role may not write the flush's logical message, which a hardened server may revoke: its
    publish would raise after its commit, and a retry run the message twice.)"""

    def parse(rows: Rows) -> tuple[T, bool]:
        return op.parse([row[:-1] for row in rows]), any(row[-1] for row in rows)

    query = _ASYNC_COMMIT_IF_WOKE + op.query + b") AS q"
    return Op(op.schema, query, op.params, parse, op.binary)


def flush_op(schema: str) -> Op[None]:
    """Wait until every commit before it is flushed to the WAL (durable), so that an
    ``async_commit`` of this session before it is durable when it returns. A transaction
    commits with its flush only when it has a transaction ID *and* wrote WAL (Postgres'
    ``RecordTransactionCommit``; a transaction ID alone, ``SELECT pg_current_xact_id()``,
    commits without waiting: measured, 0.01 WAL syncs per call): a transactional logical
    message does both, writes no row (no dead tuple, no row lock shared by producers), and
    its flush covers all WAL before it. Logical decoding sees it (prefix ``lonnymq.flush``,
    empty; ``pgoutput`` passes messages on only when asked to). (The schema names the
    subquery, so that pg_stat_activity tells whose publish a session flushes.)"""
    return Op(schema, render(_FLUSH, schema), (), no_result)


_FLUSH: LiteralString = (
    "SELECT pg_logical_emit_message(true, 'lonnymq.flush', ''::bytea) FROM (SELECT) AS {schema}"
)


def translate(exc: Exception, schema: str) -> LonnyMQError:
    """The lonnymq error for a psycopg error."""
    if isinstance(exc, pgerrors.InsufficientPrivilege):
        return PermissionDenied(
            f"{str(exc).splitlines()[0]}: the database role lacks a lonnymq grant (run "
            f"`lonnymq grant producer|worker|admin ROLE --schema {schema}` as the owner)"
        )
    if getattr(exc, "sqlstate", None) == "LM002":
        return ChannelBusy(str(exc).splitlines()[0])
    if getattr(exc, "sqlstate", None) == "LM001":  # an exchange declared with another type
        return InvalidArgument(str(exc).splitlines()[0])
    if isinstance(exc, _SCHEMA_ERRORS):
        return SchemaNotInstalled(schema, str(exc).splitlines()[0])
    if isinstance(exc, _ARGUMENT_ERRORS):
        return InvalidArgument(f"rejected by Postgres: {str(exc).splitlines()[0]}")
    if _connection_lost(exc):
        return ConnectionLost(f"connection to Postgres failed: {exc}")
    if isinstance(exc, _POOLER_ERRORS):
        return DatabaseError(
            f"{str(exc).splitlines()[0]}: this connection goes through a pooler in transaction "
            "mode (PgBouncer before 1.21), which does not keep psycopg's prepared statements: "
            "open it with psycopg.connect(..., prepare_threshold=None), or set "
            "max_prepared_statements in PgBouncer 1.21 or later"
        )
    return DatabaseError(f"{type(exc).__name__}: {exc}")


#: psycopg prepared a statement on one server session and a pooler ran the next call on another
_POOLER_ERRORS = (pgerrors.DuplicatePreparedStatement, pgerrors.InvalidSqlStatementName)


_CONNECTION_ERRORS = (
    pgerrors.ConnectionException,  # class 08
    pgerrors.AdminShutdown,  # pg_terminate_backend, server shutting down
    pgerrors.CrashShutdown,
    pgerrors.CannotConnectNow,
)


def _connection_lost(exc: Exception) -> bool:
    """A lost or unusable connection (retry on a new one), as opposed to an error of the
    statement (a deadlock, a serialization failure, a cancelled query: DatabaseError)."""
    if isinstance(exc, _CONNECTION_ERRORS):
        return True
    return isinstance(exc, psycopg.OperationalError) and getattr(exc, "sqlstate", None) is None


def run(conn: psycopg.Connection[Any], op: Op[T]) -> T:
    try:
        # (a cursor of psycopg's own kind, rows as tuples, whatever the caller's connection
        # makes: an application's dict_row connection, or one whose cursor_factory binds
        # parameters on the client (Django's, psycopg.ClientCursor: no binary rows), runs
        # lonnymq's calls too)
        with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
            cur.execute(op.query, op.params, binary=op.binary)
            rows = cur.fetchall()
    except psycopg.Error as exc:
        raise translate(exc, op.schema) from exc
    return op.parse(rows)


async def arun(conn: psycopg.AsyncConnection[Any], op: Op[T]) -> T:
    try:
        async with psycopg.AsyncCursor(conn, row_factory=tuple_row) as cur:  # (see run)
            await cur.execute(op.query, op.params, binary=op.binary)
            rows = await cur.fetchall()
    except psycopg.Error as exc:
        raise translate(exc, op.schema) from exc
    return op.parse(rows)


Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]
AnyConnection = Conn | AConn


@overload
def execute(conn: psycopg.Connection[Any], op: Op[T]) -> T: ...
@overload
def execute(conn: psycopg.AsyncConnection[Any], op: Op[T]) -> Awaitable[T]: ...
def execute(conn: AnyConnection, op: Op[T]) -> T | Awaitable[T]:
    """Run ``op`` on ``conn``; on an async connection, return an awaitable."""
    if isinstance(conn, psycopg.AsyncConnection):
        return arun(conn, op)
    if isinstance(conn, psycopg.Connection):
        return run(conn, op)
    raise InvalidArgument(
        f"expected a psycopg Connection or AsyncConnection, not {type(conn).__name__}"
    )


def require_sync(conn: object) -> psycopg.Connection[Any]:
    if isinstance(conn, psycopg.Connection):
        return conn
    raise InvalidArgument(
        f"this operation needs a psycopg (sync) Connection, not {type(conn).__name__}"
    )
