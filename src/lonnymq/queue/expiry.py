"""Expiry and housekeeping: what goes with time. Messages past their time to live and queues
unused past their ``x-expires`` (Kombu's queue arguments) go at a sweep; consumers mark their
queues used; dead letters past their queue's retention are pruned (and the counters folded) by
the housekeeping. Clients of the schema run these now and then (the transport's sweep,
``lonnymq housekeep``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._compat import LiteralString
from . import _checks
from ._ops import Op, Rows, no_result, render

_TOUCH: LiteralString = "SELECT {schema}.queue_touch_v1(%s::text[])"
_EXPIRE: LiteralString = "SELECT messages, queues FROM {schema}.expire_v1(%s::integer)"
_EXPIRING: LiteralString = (
    "SELECT name, expires_ms, unused_seconds FROM {schema}.queue_expiring_v1()"
)
_HOUSEKEEP: LiteralString = "SELECT {schema}.housekeep_v1(%s::integer)"


@dataclass(frozen=True, slots=True)
class QueueExpiry:
    """A queue with an ``x-expires``: how long it may stay unused, how long it has been at
    least (no consumer touched it, nobody declared it; a use is recorded lazily, up to a
    tenth of the ``x-expires`` and at most a minute late). ``expired``: past it, and still
    here because no client of the schema has swept since (``lonnymq housekeep`` does)."""

    queue: str
    expires_ms: int
    unused_seconds: float

    @property
    def expired(self) -> bool:
        return self.unused_seconds * 1000 > self.expires_ms


def touch_op(schema: str, queues: Sequence[str]) -> Op[None]:
    return Op(schema, render(_TOUCH, schema), (list(queues),), no_result)


def expire_op(schema: str, limit: int = 10_000) -> Op[tuple[int, int]]:
    def parse(rows: Rows) -> tuple[int, int]:
        return int(rows[0][0]), int(rows[0][1])

    return Op(schema, render(_EXPIRE, schema), (limit,), parse)


def expiring_op(schema: str) -> Op[list[QueueExpiry]]:
    def parse(rows: Rows) -> list[QueueExpiry]:
        return [QueueExpiry(r[0], int(r[1]), max(0.0, float(r[2]))) for r in rows]

    return Op(schema, render(_EXPIRING, schema), (), parse)


def housekeep_op(schema: str, *, limit: int = 10_000) -> Op[int]:
    """Prune dead letters past their retention (at most ``limit``); fold counter rows."""
    count = _checks.integer(limit, "limit", low=1, high=1_000_000)

    def parse(rows: Rows) -> int:
        return int(rows[0][0])

    return Op(schema, render(_HOUSEKEEP, schema), (count,), parse)
