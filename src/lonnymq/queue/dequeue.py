"""Dequeue a batch of messages across queues, fairly across channels."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, LiteralString

import psycopg

from . import _checks
from ._ops import Op, Rows, render, require_sync, run
from .finalize import KEEP, defer_op, delete_op, heartbeat_op
from .results import Outcome

_DEQUEUE: LiteralString = (
    "SELECT message_id, queue_name, channel_name, message_name, message_priority, "
    "message_attempts, message_lock_token, message_created_at, message_content, "
    "message_state, retry_ms "
    "FROM {schema}.message_dequeue_v1(%s::text[], %s::integer, %s::bigint)"
)

DEFAULT_LOCK_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class Message:
    """A dequeued message, locked for its holder until it is deleted or deferred, or until
    its lock expires."""

    schema: str = field(repr=False)
    id: int
    queue: str
    channel: str
    name: str | None
    priority: int
    #: How many times it has been dequeued, this time included.
    attempts: int
    lock_token: uuid.UUID = field(repr=False)
    created_at: datetime
    content: bytes = field(repr=False)
    #: State saved by an earlier defer, if any.
    state: bytes | None = field(repr=False)

    def delete(self, conn: psycopg.Connection[Any]) -> Outcome:
        """Delete (acknowledge) the message."""
        return run(require_sync(conn), delete_op(self.schema, self.id, self.lock_token))

    def defer(
        self, conn: psycopg.Connection[Any], *, delay_ms: float | None = 0, state: object = KEEP
    ) -> Outcome:
        """Unlock the message; it is due again after ``delay_ms``, behind the messages due
        before then (``delay_ms=None``: back in its old place, ahead of later messages). Pass
        ``state`` (bytes or None) to replace the saved state; attempts are kept."""
        op = defer_op(self.schema, self.id, self.lock_token, delay_ms=delay_ms, state=state)
        return run(require_sync(conn), op)

    def heartbeat(self, conn: psycopg.Connection[Any], *, lock_ms: float) -> bool:
        """Extend the lock to ``lock_ms`` from now; False when this holder lost it."""
        op = heartbeat_op(self.schema, [(self.id, self.lock_token)], lock_ms=lock_ms)
        return self.id in run(require_sync(conn), op)


@dataclass(frozen=True, slots=True)
class DequeueResult:
    """What a dequeue returned: messages in delivery order, or, when there are none,
    ``retry_ms``: how long until something may become available (None: nothing pending; a
    new message will send a NOTIFY)."""

    messages: list[Message]
    retry_ms: int | None = None

    def __bool__(self) -> bool:
        return bool(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


def dequeue_op(
    schema: str, queues: Sequence[str], *, limit: int = 1, lock_ms: float = DEFAULT_LOCK_MS
) -> Op[DequeueResult]:
    names = _checks.queues(queues)
    count = _checks.integer(limit, "limit", low=1, high=_checks.MAX_LIMIT)
    lock = _checks.milliseconds(lock_ms, "lock_ms", low=1, high=_checks.MAX_LOCK_MS)

    def parse(rows: Rows) -> DequeueResult:
        if len(rows) == 1 and rows[0][0] is None:
            return DequeueResult([], rows[0][10])
        return DequeueResult([Message(schema, *row[:10]) for row in rows])

    return Op(schema, render(_DEQUEUE, schema), (names, count, lock), parse)
