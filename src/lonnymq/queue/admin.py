"""Queue-wide operations: purge, size, stats, delete, expiry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import LiteralString

from . import _checks
from ._ops import Op, Rows, render
from .results import QueueStats

_PURGE: LiteralString = "SELECT {schema}.queue_purge_v1(%s::text)"
_DELETE: LiteralString = "SELECT {schema}.queue_delete_v1(%s::text)"
_STATS: LiteralString = (
    "SELECT total, in_flight, ready, delayed, channels, max_concurrency, max_size "
    "FROM {schema}.queue_stats_v1(%s::text, %s::boolean)"
)
_LIST: LiteralString = "SELECT name FROM {schema}.queue ORDER BY name"
# the queue table is readable by every role kind (lonnymq.roles)
_EXPIRING: LiteralString = (
    "SELECT q.name, q.expires_ms, extract(epoch FROM clock_timestamp() - q.used_at)::float8 "
    "FROM {schema}.queue q WHERE q.expires_ms IS NOT NULL ORDER BY q.name"
)


@dataclass(frozen=True, slots=True)
class QueueExpiry:
    """A queue with an ``x-expires``: how long it may stay unused, how long it has been
    (no consumer touched it, nobody declared it). ``expired``: past it, and still here
    because no client of the schema has swept since (``lonnymq housekeep`` does)."""

    queue: str
    expires_ms: int
    unused_seconds: float

    @property
    def expired(self) -> bool:
        return self.unused_seconds * 1000 > self.expires_ms


def _count(rows: Rows) -> int:
    return int(rows[0][0])


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


def expiring_op(schema: str) -> Op[list[QueueExpiry]]:
    def parse(rows: Rows) -> list[QueueExpiry]:
        return [QueueExpiry(r[0], int(r[1]), max(0.0, float(r[2]))) for r in rows]

    return Op(schema, render(_EXPIRING, schema), (), parse)
