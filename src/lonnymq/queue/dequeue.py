"""Dequeue a batch of messages across queues, fairly across channels."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from .._compat import LiteralString
from . import _checks
from ._ops import Op, Rows, render, require_sync, run
from .finalize import KEEP, defer_op, delete_op, heartbeat_op, reject_op
from .results import Outcome

_COLUMNS: LiteralString = (
    "SELECT message_id, queue_name, channel_name, message_name, message_priority, "
    "message_attempts, message_lock_token, message_created_at, message_content, "
    "message_state, retry_ms, event "
)
#: (In binary both ways: the ack arrays are not written out as text, nor the rows' bytea,
#: uuid and timestamps parsed back from it.)
_DEQUEUE: LiteralString = (
    _COLUMNS + "FROM {schema}.message_dequeue_v3(%b::text[], %b::integer, %b::bigint, "
    "%b::bigint[], %b::uuid[], %b::boolean)"
)
_DEQUEUE_HINTED: LiteralString = (
    _COLUMNS + "FROM {schema}.message_dequeue_hinted_v1(%b::text[], %b::bigint[], %b::integer, "
    "%b::bigint, %b::bigint[], %b::uuid[], %b::boolean)"
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
    #: True when its previous holder's lock expired (the holder died or hung) and it was
    #: taken over; False for a first delivery or after a requeue.
    lock_expired: bool = False
    #: False for a message handed to a consumer that takes its queue without acks (schema
    #: version 23): it has no row, so nothing to delete or release; its ``lock_token`` is
    #: the nil UUID.
    stored: bool = True

    def delete(self, conn: psycopg.Connection[Any]) -> Outcome:
        """Delete (acknowledge) the message."""
        return run(require_sync(conn), delete_op(self.schema, self.id, self.lock_token))

    def reject(self, conn: psycopg.Connection[Any], *, reason: str = "rejected") -> Outcome:
        """Give up on the message: it moves to the dead letters of its queue with ``reason``
        (or is deleted where the queue keeps no dead letters)."""
        return run(
            require_sync(conn), reject_op(self.schema, self.id, self.lock_token, reason=reason)
        )

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
class DeadLettered:
    """A message the dequeue did not deliver because it had been delivered ``max_attempts``
    times already: it went to the dead letters of its queue (or was dropped, where the queue
    keeps none)."""

    id: int
    queue: str
    channel: str
    name: str | None
    attempts: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class DequeueResult:
    """What a dequeue returned: messages in delivery order, or, when there are none,
    ``retry_ms``: how long until something may become available (None: nothing pending; a
    new message will send a NOTIFY). ``dead``: messages dead-lettered instead of delivered."""

    messages: list[Message]
    retry_ms: int | None = None
    dead: list[DeadLettered] = field(default_factory=list)
    #: Outcome of each ack sent with this dequeue (``Broker.dequeue(..., ack=...)``).
    acked: dict[int, Outcome] = field(default_factory=dict)
    #: A hinted dequeue (schema version 19) took all that waited in its queues: nothing else
    #: can be delivered now, and ``retry_ms`` says when something may fall due, as for a
    #: call that found nothing. A caller that sleeps on these queues (it was woken by their
    #: hint) need not look again before the next NOTIFY or that time.
    settled: bool = False

    def __bool__(self) -> bool:
        return bool(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


def dequeue_op(
    schema: str,
    queues: Sequence[str],
    *,
    limit: int = 1,
    lock_ms: float = DEFAULT_LOCK_MS,
    ack: Iterable[_checks.Held] = (),
    listen: bool = True,
    hints: Sequence[int] = (),
) -> Op[DequeueResult]:
    """Dequeue; with ``ack`` (held messages' ids and lock tokens), delete those first, in
    the same statement (one round trip, one transaction for both). With ``listen``, a call
    that gets nothing registers the connection's session as waiting for a NOTIFY on these
    queues until its next dequeue: their producers then send one (they send none while
    every consumer is busy). ``hints``: ids of messages that woke the caller (the
    ``<schema>_hint`` notifications of :func:`lonnymq.migrator.hint_channel`): taken by their
    ids when nothing else of these queues waits, else the call is a plain dequeue."""
    names = _checks.queues(queues)
    count = _checks.integer(limit, "limit", low=1, high=_checks.MAX_LIMIT)
    lock = _checks.milliseconds(lock_ms, "lock_ms", low=1, high=_checks.MAX_LOCK_MS)
    pairs = _checks.held(ack, "message to ack")
    ids = [a[0] for a in pairs]
    tokens = [a[1] for a in pairs]

    def parse(rows: Rows) -> DequeueResult:
        messages: list[Message] = []
        dead: list[DeadLettered] = []
        acked = dict.fromkeys(ids, Outcome.OK)
        retry_ms = None
        settled = False
        for row in rows:
            event = row[11]
            if event is not None and event.startswith("ack_"):
                acked[row[0]] = Outcome(event[4:])
            elif event == "settled":
                settled, retry_ms = True, row[10]
            elif event == "dead":
                dead.append(DeadLettered(row[0], row[1], row[2], row[3], row[5], row[7]))
            elif row[0] is None:
                retry_ms = row[10]
            else:
                ident, queue, lane, name, priority, attempts = row[:6]
                token, created, content, state = row[6:10]
                expired = event == "redelivered"
                messages.append(
                    Message(
                        schema,
                        ident,
                        queue,
                        lane,
                        name,
                        priority,
                        attempts,
                        token,
                        created,
                        content,
                        state,
                        expired,
                    )
                )
        return DequeueResult(messages, retry_ms, dead, acked, settled)

    if hints:
        hinted = [_checks.message_id(h, "hint") for h in hints]
        params_h = (names, hinted, count, lock, ids or None, tokens or None, bool(listen))
        return Op(schema, render(_DEQUEUE_HINTED, schema), params_h, parse, binary=True)
    params = (names, count, lock, ids or None, tokens or None, bool(listen))
    return Op(schema, render(_DEQUEUE, schema), params, parse, binary=True)


_SLEEP: LiteralString = (
    "SELECT {schema}.sleep_v3(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], "
    "%s::bigint, %s::text, %s::bigint, %s::text[], %s::text[])"
)


def sleep_op(
    schema: str,
    take: Sequence[str],
    drop: Sequence[str],
    check: Sequence[str],
    *,
    hand_take: Sequence[str] = (),
    hand_drop: Sequence[str] = (),
    holder: int | None = None,
    secret: str | None = None,
    lock_ms: int | None = None,
    queues: Sequence[str] | None = None,
    no_ack: Sequence[str] = (),
) -> Op[list[str]]:
    """On the session it runs on (one that LISTENs): hold the ``sleep`` keys of the queues of
    ``take`` (their producers then NOTIFY) and release those of ``drop``; returns the queues
    of ``check`` that have a producer transaction open (it may have looked for sleepers
    before the key was taken: look again once it is gone). Look for messages again after a
    ``take`` and after a queue leaves that list. ``holder`` (schema version 21): the
    session's own id for hand-offs: publishes to the queues of ``hand_take`` (until they are
    in ``hand_drop``) then hand a message to it, locked for ``lock_ms``, in a NOTIFY on
    ``lonnymq_hand_<holder>`` signed with ``secret``; ``queues``: the queues it consumes,
    when they changed (None: unchanged; empty: it closes, see ``sleep_v3``), with ``no_ack``,
    those of them it consumes without acks (schema version 23: handed without a row, see
    ``handoff_v1``)."""
    params = (
        *(
            [_checks.name(q, "queue") for q in names]
            for names in (take, drop, check, hand_take, hand_drop)
        ),
        holder,
        secret,
        lock_ms,
        None if queues is None else [_checks.name(q, "queue") for q in queues],
        [_checks.name(q, "queue") for q in no_ack],
    )

    def parse(rows: Rows) -> list[str]:
        return list(rows[0][0] or ())

    return Op(schema, render(_SLEEP, schema), params, parse)
