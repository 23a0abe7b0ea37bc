"""Least privilege: what each kind of database role may do with a lonnymq schema.

The schema's entry-point functions run with the rights of the schema's owner (``SECURITY
DEFINER`` with a fixed ``search_path``) and no function is executable by ``PUBLIC``, so a role
needs no rights on the tables: it gets ``EXECUTE`` on the functions of its kind.

* ``producer``: create and publish messages, and declare what it publishes to (kombu and Celery
  declare exchanges, queues and bindings before publishing); read the queue counters and
  status (``lonnymq status`` and ``lonnymq metrics`` need no more).
* ``worker``: everything a producer may do (a Celery worker publishes retries, results and
  events) plus dequeue, ack (delete), defer, heartbeat, and the housekeeping its transport
  does (touching expiring queues, dropping expired messages, pruning old dead letters), and
  reject to the dead letters.
* ``admin``: everything, including policies, queue settings, purge and delete, listing,
  showing, deleting, retrying and updating (rescheduling) messages and dead letters, and
  reading every table (messages included). Installing and upgrading (``lonnymq migrate``)
  needs the owner.

Every kind may read the metadata tables (migration, queue, exchange, binding).

    lonnymq.grant(conn, "worker", "celery_worker", schema="lonnymq")

or ``lonnymq grant worker celery_worker``. Run it as the schema's owner (or a superuser).
"""

from __future__ import annotations

from typing import Any, Literal

import psycopg
from psycopg import sql

from .exceptions import InvalidArgument, InvalidName, SchemaError
from .migrator import DEFAULT_SCHEMA, expected_objects, validate_schema

Kind = Literal["producer", "worker", "admin"]
KINDS: tuple[Kind, ...] = ("producer", "worker", "admin")

_METADATA = ("migration", "queue", "exchange", "binding")
_PRODUCER = (
    "message_create_v1",
    "message_create_many_v1",
    "message_publish_v1",
    "message_publish_v2",
    "exchange_declare_v1",
    "queue_declare_v1",
    "queue_declare_v2",
    "queue_bind_v1",
    "queue_stats_v1",
    "queue_status_v1",
    "queue_expiring_v1",
    "horizon_v1",
    "rate_held_v1",
    "consumer_list_v1",
)
_WORKER = (
    *_PRODUCER,
    "message_dequeue_v3",
    "message_dequeue_hinted_v1",
    "sleep_v1",
    "sleep_v2",
    "sleep_v3",
    "message_reject_v1",
    "housekeep_v1",
    "message_delete_v1",
    "message_delete_many_v1",
    "message_defer_v1",
    "message_heartbeat_v1",
    "queue_unbind_v1",
    "queue_touch_v1",
    "consumer_sync_v1",
    "expire_v1",
)
_ADMIN = (
    *_WORKER,
    "channel_policy_set_v2",
    "channel_policy_clear_v1",
    "channel_get_v1",
    "channel_get_v2",
    "queue_policy_set_v2",
    "queue_purge_v1",
    "queue_delete_v1",
    "exchange_delete_v1",
    "channel_list_v2",
    "channel_list_v3",
    "message_list_v1",
    "message_list_v2",
    "message_get_v1",
    "message_remove_v1",
    "message_retry_v1",
    "message_update_v1",
    "dead_purge_v1",
    "queue_configure_v1",
)
FUNCTIONS: dict[Kind, tuple[str, ...]] = {
    "producer": _PRODUCER,
    "worker": _WORKER,
    "admin": _ADMIN,
}


def _role(role: object) -> str:
    if not isinstance(role, str) or not role or len(role) > 63 or "\x00" in role:
        raise InvalidName(f"invalid role name {role!r}")
    return role


def _statements(kind: Kind, role: str, schema: str, grant: bool) -> list[sql.Composed]:
    verb = sql.SQL("GRANT" if grant else "REVOKE")
    prep = sql.SQL("TO" if grant else "FROM")
    who = sql.Identifier(role)
    ns = sql.Identifier(schema)
    tables = [t for k, t in expected_objects() if k == "table"]
    readable = tables if kind == "admin" else list(_METADATA)
    out = [sql.SQL("{} USAGE ON SCHEMA {} {} {}").format(verb, ns, prep, who)]
    out.append(
        sql.SQL("{} SELECT ON {} {} {}").format(
            verb, sql.SQL(", ").join(sql.Identifier(schema, t) for t in readable), prep, who
        )
    )
    out.append(
        sql.SQL("{} EXECUTE ON FUNCTION {} {} {}").format(
            verb,
            sql.SQL(", ").join(sql.Identifier(schema, f) for f in FUNCTIONS[kind]),
            prep,
            who,
        )
    )
    return out


def grant(
    conn: psycopg.Connection[Any], kind: Kind, role: str, *, schema: str = DEFAULT_SCHEMA
) -> None:
    """Give ``role`` the rights of ``kind`` (producer, worker or admin) on ``schema``, in one
    transaction. Adds to what the role has; :func:`revoke` first to narrow it."""
    if kind not in KINDS:
        raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    _run(conn, _statements(kind, _role(role), validate_schema(schema), True), schema)


def revoke(conn: psycopg.Connection[Any], role: str, *, schema: str = DEFAULT_SCHEMA) -> None:
    """Take every lonnymq right on ``schema`` from ``role``."""
    _run(conn, _statements("admin", _role(role), validate_schema(schema), False), schema)


def _run(conn: psycopg.Connection[Any], statements: list[sql.Composed], schema: str) -> None:
    try:
        with conn.transaction():
            for statement in statements:
                conn.execute(statement)
    except psycopg.Error as exc:
        raise SchemaError(
            f"changing the lonnymq grants on schema {schema!r} failed: {str(exc).splitlines()[0]}"
        ) from exc
