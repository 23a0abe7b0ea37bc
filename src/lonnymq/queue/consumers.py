"""The consumers of the queues, as every process sees them: the Kombu transport registers each
consumer of its connection (:func:`consumer_sync_op`, when one starts or stops and from its
heartbeat thread, never from a dequeue); anyone may list them (:func:`consumer_list_op`).
A queue declared ``auto_delete`` goes when its last consumer does."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from .._compat import LiteralString
from . import _checks
from ._ops import Op, Rows, render

_SYNC: LiteralString = (
    "SELECT queue_name, state FROM {schema}.consumer_sync_v1(%s::uuid, %s::text, %s::integer, "
    "%s::text, %s::integer, %s::text[], %s::text[], %s::boolean[], %s::integer[], "
    "%s::timestamptz[])"
)
_LIST: LiteralString = "SELECT * FROM {schema}.consumer_list_v1(%s::text)"


@dataclass(frozen=True, slots=True)
class ConsumerEntry:
    """One consumer of a client, as it registers it."""

    #: unique within the client (the transport: its kombu channel's id and consumer tag)
    tag: str
    queue: str
    no_ack: bool
    prefetch: int | None
    #: its last delivery (None: none yet)
    delivered_at: datetime | None


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """A consumer as listed: which queue, who (host, pid, Celery node name when known),
    since when, when last heard of, its last delivery; ``alive`` is false for one not heard
    of for three of its beats (presumed gone; the next sweep removes it)."""

    queue: str
    client: uuid.UUID
    tag: str
    host: str
    pid: int
    node: str | None
    no_ack: bool
    prefetch: int | None
    started_at: datetime
    seen_at: datetime
    delivered_at: datetime | None
    alive: bool


@dataclass(frozen=True, slots=True)
class Synced:
    """What a sync changed beyond the consumer rows: the ``auto_delete`` queues deleted
    because their last consumer went, and the queues consumed that do not exist."""

    deleted: tuple[str, ...]
    missing: tuple[str, ...]


def consumer_sync_op(
    schema: str,
    client: uuid.UUID,
    *,
    host: str,
    pid: int,
    node: str | None,
    beat_ms: int,
    entries: Sequence[ConsumerEntry],
) -> Op[Synced]:
    """Make the client's registered consumers ``entries``: the others are removed (and an
    ``auto_delete`` queue with its last consumer), these added or marked seen now."""
    params = (
        client,
        host,
        _checks.integer(pid, "pid", low=0, high=_checks.MAX_INT4),
        node,
        _checks.integer(beat_ms, "beat_ms", low=1, high=_checks.MAX_INT4),
        [e.tag for e in entries],
        [_checks.name(e.queue, "queue") for e in entries],
        [e.no_ack for e in entries],
        [e.prefetch for e in entries],
        [e.delivered_at for e in entries],
    )

    def parse(rows: Rows) -> Synced:
        def of(kind: Literal["deleted", "missing"]) -> tuple[str, ...]:
            return tuple(str(r[0]) for r in rows if r[1] == kind)

        return Synced(of("deleted"), of("missing"))

    return Op(schema, render(_SYNC, schema), params, parse)


def consumer_list_op(schema: str, queue: str | None = None) -> Op[list[ConsumerInfo]]:
    """The consumers of ``queue`` (of every queue when None), by queue, oldest first."""

    def parse(rows: Rows) -> list[ConsumerInfo]:
        return [ConsumerInfo(*row) for row in rows]

    return Op(schema, render(_LIST, schema), (_checks.optional_name(queue, "queue"),), parse)
