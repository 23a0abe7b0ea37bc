"""Queue-wide operations: declare (with Kombu's queue arguments), exists, purge, delete,
stats, the list of queues."""

from __future__ import annotations

from .._compat import LiteralString
from . import _checks
from ._ops import Op, Rows, render
from .results import QueueStats

_DECLARE: LiteralString = (
    "SELECT waiting, in_flight FROM {schema}.queue_declare_v2(%s::text, %s::bigint, %s::bigint, "
    "%s::boolean, %s::integer)"
)
_EXISTS: LiteralString = (
    "SELECT EXISTS (SELECT 1 FROM {schema}.queue WHERE name = %s) "
    "OR EXISTS (SELECT 1 FROM {schema}.binding WHERE queue = %s)"
)
_PURGE: LiteralString = "SELECT {schema}.queue_purge_v1(%s::text)"
_DELETE: LiteralString = "SELECT {schema}.queue_delete_v1(%s::text)"
_STATS: LiteralString = (
    "SELECT total, in_flight, ready, delayed, channels, max_concurrency, max_size "
    "FROM {schema}.queue_stats_v1(%s::text, %s::boolean)"
)
#: (From the status function, as ``status`` lists them: the queue table alone lacks the queues
#: whose messages no consumer has ingested yet.)
_LIST: LiteralString = "SELECT queue_name FROM {schema}.queue_status_v1(false)"


def _count(rows: Rows) -> int:
    return int(rows[0][0])


def queue_declare_op(
    schema: str,
    queue: str,
    *,
    expires_ms: int | None = None,
    message_ttl_ms: int | None = None,
    auto_delete: bool = False,
    max_priority: int | None = None,
) -> Op[tuple[int, int]]:
    """Declare ``queue`` with Kombu's arguments: ``x-expires``, ``x-message-ttl``,
    ``auto_delete`` (it goes when its last consumer does), ``x-max-priority`` (a higher
    message priority is taken as it)."""
    params = (
        _checks.name(queue, "queue"),
        None if expires_ms is None else _checks.integer(expires_ms, "x-expires", low=1, high=2**62),
        None
        if message_ttl_ms is None
        else _checks.integer(message_ttl_ms, "x-message-ttl", low=0, high=2**62),
        _checks.boolean(auto_delete, "auto_delete"),
        None
        if max_priority is None
        else _checks.integer(max_priority, "x-max-priority", low=1, high=_checks.MAX_PRIORITY),
    )

    def parse(rows: Rows) -> tuple[int, int]:
        return int(rows[0][0]), int(rows[0][1])

    return Op(schema, render(_DECLARE, schema), params, parse)


def queue_exists_op(schema: str, queue: str) -> Op[bool]:
    def parse(rows: Rows) -> bool:
        return bool(rows[0][0])

    queue = _checks.name(queue, "queue")
    return Op(schema, render(_EXISTS, schema), (queue, queue), parse)


def purge_op(schema: str, queue: str) -> Op[int]:
    return Op(schema, render(_PURGE, schema), (_checks.name(queue, "queue"),), _count)


def delete_queue_op(schema: str, queue: str) -> Op[int]:
    return Op(schema, render(_DELETE, schema), (_checks.name(queue, "queue"),), _count)


def stats_op(schema: str, queue: str, *, count_ready: bool = True) -> Op[QueueStats]:
    queue = _checks.name(queue, "queue")

    def parse(rows: Rows) -> QueueStats:
        return QueueStats(queue, *rows[0])

    return Op(schema, render(_STATS, schema), (queue, count_ready), parse)


def list_queues_op(schema: str) -> Op[list[str]]:
    def parse(rows: Rows) -> list[str]:
        return [row[0] for row in rows]

    return Op(schema, render(_LIST, schema), (), parse)
