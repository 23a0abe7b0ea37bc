"""Operating a broker: queue status and counters, what holds back the cleanup horizon,
channel listings, messages by id (list, show, delete, retry, update), dead letters and queue
settings. Each is one SQL function call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg.types.json import Jsonb

from .._compat import LiteralString
from ..exceptions import InvalidArgument, MessageLocked, MessageNotFound
from . import _checks
from ._ops import Op, Rows, no_result, render
from .listing import State
from .rate import Rate, rate_of

_STATUS: LiteralString = "SELECT * FROM {schema}.queue_status_v1(%s::boolean)"
_CHANNELS: LiteralString = "SELECT * FROM {schema}.channel_list_v3(%s::text, %s::integer, %s::text)"
_GET: LiteralString = "SELECT * FROM {schema}.message_get_v1(%s::bigint)"
_REMOVE: LiteralString = "SELECT * FROM {schema}.message_remove_v1(%s::bigint[])"
_RETRY: LiteralString = "SELECT * FROM {schema}.message_retry_v1(%s::bigint[])"
_UPDATE: LiteralString = (
    "SELECT * FROM {schema}.message_update_v1("
    "%s::bigint, %s::bigint, %s::timestamptz, %s::integer, %s::bytea)"
)
_DEAD_PURGE: LiteralString = "SELECT {schema}.dead_purge_v1(%s::text)"
_CONFIGURE: LiteralString = "SELECT {schema}.queue_configure_v1(%s::text, %s::jsonb)"
_HORIZON: LiteralString = "SELECT * FROM {schema}.horizon_v1(%s::integer)"
_RATE_HELD: LiteralString = "SELECT * FROM {schema}.rate_held_v1()"
_SETTINGS: LiteralString = (
    "SELECT q.dead_letter, q.max_attempts, q.dead_retention_ms FROM {schema}.queue q "
    "WHERE q.name = %s::text"
)

#: Most ids one call of delete or retry takes.
MAX_IDS = 10_000


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """Per-queue settings: dead letters on or off, deliveries before a message is
    dead-lettered (None: no limit), how long dead letters are kept."""

    dead_letter: bool
    max_attempts: int | None
    dead_retention_ms: int


#: What a queue gets when created (the column defaults of the queue table).
DEFAULT_SETTINGS = QueueSettings(dead_letter=True, max_attempts=20, dead_retention_ms=1_209_600_000)


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative counts since the queue was created."""

    enqueued: int
    delivered: int
    #: deliveries after the previous holder's lock expired (included in ``delivered``)
    redelivered: int
    acked: int
    deferred: int
    #: dead-lettered (rejected without requeue, or at max_attempts)
    dead: int
    #: dropped past their time to live
    expired: int
    #: refused because the channel was full
    dropped: int


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """A queue's gauges (now), counters (since it was created) and settings. ``ready``,
    ``delayed`` and ``oldest_ready_at`` are None unless counted."""

    queue: str
    total: int
    in_flight: int
    ready: int | None
    delayed: int | None
    oldest_ready_at: datetime | None
    dead: int
    channels: int
    counters: Counters
    max_concurrency: int | None
    max_size: int | None
    settings: QueueSettings

    @property
    def waiting(self) -> int:
        return self.total - self.in_flight

    def oldest_ready_age(self, now: datetime) -> float | None:
        """Seconds the oldest ready message has been waiting, at ``now``."""
        if self.oldest_ready_at is None:
            return None
        return max(0.0, (now - self.oldest_ready_at).total_seconds())


@dataclass(frozen=True, slots=True)
class ChannelStatus:
    channel: str
    size: int
    in_flight: int
    max_concurrency: int | None
    max_size: int | None
    has_policy: bool
    #: since when the channel has been waiting for its turn (None: nothing to hand out)
    waiting_since: datetime | None
    served_at: datetime | None
    enqueued: int
    delivered: int
    acked: int
    deferred: int
    dead: int
    expired: int
    dropped: int
    #: the rate in force (its own or the queue's), and its burst
    rate: Rate | None = None
    burst: int | None = None
    #: deliveries the rate allows now (None: no rate), and when none does, when the next one is
    tokens: int | None = None
    next_token_at: datetime | None = None
    #: since when its oldest ready message has been due (None: none is ready)
    oldest_ready_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class MessageDetail:
    """One message with its content and saved state."""

    id: int
    queue: str
    channel: str
    name: str | None
    priority: int
    attempts: int
    state: State
    dequeue_at: datetime | None
    locked_until: datetime | None
    expires_at: datetime | None
    created_at: datetime
    dead_at: datetime | None
    reason: str | None
    content: bytes
    saved_state: bytes | None

    def payload(self) -> dict[str, Any] | None:
        """The content as a kombu message (a JSON object), or None if it is not one."""
        try:
            data = json.loads(self.content)
        except (ValueError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) else None


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """Something that holds back the database's cleanup horizon (see
    :meth:`lonnymq.Broker.horizon`). ``kind``: ``session`` (a transaction or snapshot of a
    session of this database: ``pid``, ``application_name``, ``state``, ``since`` its
    transaction began, ``detail`` its query), ``prepared`` (a prepared transaction: its gid
    in ``application_name``), ``slot`` (a replication slot: its name), or ``hidden``
    (``detail``: how many sessions of other roles the schema's owner may not see)."""

    kind: str
    pid: int | None
    application_name: str | None
    state: str | None
    since: datetime | None
    #: seconds since ``since``
    age_s: float | None
    #: transactions since its horizon
    xid_age: int | None
    detail: str | None


def horizon_op(schema: str, *, limit: int = 5) -> Op[list[HorizonHolder]]:
    count = _checks.integer(limit, "limit", low=1, high=1000)

    def parse(rows: Rows) -> list[HorizonHolder]:
        return [HorizonHolder(*row) for row in rows]

    return Op(schema, render(_HORIZON, schema), (count,), parse)


@dataclass(frozen=True, slots=True)
class RateHeld:
    """A queue's channels whose rate holds back messages due now, and those messages."""

    queue: str
    channels: int
    messages: int


def rate_held_op(schema: str) -> Op[list[RateHeld]]:
    def parse(rows: Rows) -> list[RateHeld]:
        return [RateHeld(str(q), int(c), int(m)) for q, c, m in rows]

    return Op(schema, render(_RATE_HELD, schema), (), parse)


def _nonneg(value: Any) -> int:
    return int(value or 0)


def status_op(schema: str, *, count_ready: bool = True) -> Op[list[QueueStatus]]:
    def parse(rows: Rows) -> list[QueueStatus]:
        out = []
        for r in rows:
            counters = Counters(*(_nonneg(v) for v in r[8:16]))
            settings = QueueSettings(bool(r[19]), r[18], int(r[20]))
            out.append(
                QueueStatus(
                    r[0],
                    int(r[1]),
                    int(r[2]),
                    r[3],
                    r[4],
                    r[5],
                    int(r[6]),
                    int(r[7]),
                    counters,
                    r[16],
                    r[17],
                    settings,
                )
            )
        return out

    return Op(schema, render(_STATUS, schema), (bool(count_ready),), parse)


#: the columns of channel_list_v2 before its rate, in order
_CHANNEL_FIELDS = ChannelStatus.__slots__[:15]


def channels_op(
    schema: str, queue: str, *, limit: int = 20, channel: str | None = None
) -> Op[list[ChannelStatus]]:
    """The largest channels of ``queue`` (by backlog, at most ``limit``); with ``channel``,
    that one alone (its figures, whatever it holds)."""
    queue = _checks.name(queue, "queue")
    count = _checks.integer(limit, "limit", low=1, high=_checks.MAX_LIMIT)
    only = _checks.optional_name(channel, "channel")

    def parse(rows: Rows) -> list[ChannelStatus]:
        out = []
        for row in rows:
            count, per_ms, burst, tokens, next_at, oldest = row[15:21]
            values = dict(zip(_CHANNEL_FIELDS, row[:15], strict=True))
            status = ChannelStatus(
                **values,
                rate=rate_of(count, per_ms),
                burst=burst,
                tokens=tokens,
                next_token_at=next_at,
                oldest_ready_at=oldest,
            )
            out.append(status)
        return out

    return Op(schema, render(_CHANNELS, schema), (queue, count, only), parse)


def get_op(schema: str, message_id: int) -> Op[MessageDetail | None]:
    ident = _checks.message_id(message_id)

    def parse(rows: Rows) -> MessageDetail | None:
        return MessageDetail(*rows[0]) if rows else None

    return Op(schema, render(_GET, schema), (ident,), parse)


def _ids(ids: object) -> list[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidArgument("message ids must be a list of integers")
    out = [_checks.message_id(i) for i in ids]
    if len(out) > MAX_IDS:
        raise InvalidArgument(f"at most {MAX_IDS} message ids per call, not {len(out)}")
    return out


def remove_op(schema: str, ids: object) -> Op[dict[int, str]]:
    """Delete messages (any state) and dead letters by id: ``{id: 'deleted' | 'not_found'}``."""

    def parse(rows: Rows) -> dict[int, str]:
        return {row[0]: row[1] for row in rows}

    return Op(schema, render(_REMOVE, schema), (_ids(ids),), parse)


@dataclass(frozen=True, slots=True)
class RetryResult:
    """``retried`` (a dead letter is back in its queue as ``new_id``), ``due_now`` (a delayed
    message), ``ready`` (nothing to do), ``locked`` (held by a consumer), ``channel_full`` or
    ``deduplicated`` (a never-delivered message of the same name waits: ``new_id``; the dead
    letter stays in both cases) or ``not_found``."""

    id: int
    result: str
    new_id: int | None


def retry_op(schema: str, ids: object) -> Op[list[RetryResult]]:
    def parse(rows: Rows) -> list[RetryResult]:
        return [RetryResult(*row) for row in rows]

    return Op(schema, render(_RETRY, schema), (_ids(ids),), parse)


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """A message after :meth:`lonnymq.Broker.update`: when it is due and its priority."""

    id: int
    dequeue_at: datetime
    priority: int


def update_op(
    schema: str,
    message_id: int,
    *,
    delay_ms: float | None = None,
    at: datetime | None = None,
    priority: int | None = None,
    content: _checks.Content | None = None,
    max_message_bytes: int = _checks.DEFAULT_MAX_MESSAGE_BYTES,
) -> Op[UpdateResult]:
    """Reschedule or edit a ready or delayed message (None keeps what it has). Raises
    :class:`~lonnymq.MessageLocked` for a message in flight and
    :class:`~lonnymq.MessageNotFound` for a missing id or a dead letter."""
    ident = _checks.message_id(message_id)
    if delay_ms is not None and at is not None:
        raise InvalidArgument("give delay_ms or at, not both")
    delay = (
        None
        if delay_ms is None
        else _checks.milliseconds(delay_ms, "delay_ms", low=0, high=_checks.MAX_DELAY_MS)
    )
    if at is not None:
        if not isinstance(at, datetime):
            raise InvalidArgument(f"at must be a datetime, not {type(at).__name__}")
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidArgument(f"at must be an aware datetime (with a tzinfo), not {at!r}")
        if at - datetime.now(at.tzinfo) > timedelta(milliseconds=_checks.MAX_DELAY_MS):
            raise InvalidArgument(f"at is more than ten years ahead: {at.isoformat()}")
    prio = (
        None
        if priority is None
        else _checks.integer(priority, "priority", low=0, high=_checks.MAX_PRIORITY)
    )
    data = None if content is None else _checks.content(content, max_message_bytes)
    if delay is None and at is None and prio is None and data is None:
        raise InvalidArgument("nothing to change: give delay_ms or at, priority, or content")

    def parse(rows: Rows) -> UpdateResult:
        code, due, new_priority = rows[0]
        if code == "updated":
            return UpdateResult(ident, due, int(new_priority))
        if code == "locked":
            raise MessageLocked(ident)
        raise MessageNotFound(ident, dead=code == "dead")

    return Op(schema, render(_UPDATE, schema), (ident, delay, at, prio, data), parse)


def dead_purge_op(schema: str, queue: str) -> Op[int]:
    def parse(rows: Rows) -> int:
        return int(rows[0][0])

    return Op(schema, render(_DEAD_PURGE, schema), (_checks.name(queue, "queue"),), parse)


UNSET: Any = object()


def configure_op(
    schema: str,
    queue: str,
    *,
    dead_letter: bool = UNSET,
    max_attempts: int | None = UNSET,
    dead_retention_ms: float = UNSET,
) -> Op[None]:
    settings: dict[str, Any] = {}
    if dead_letter is not UNSET:
        if not isinstance(dead_letter, bool):
            raise InvalidArgument(f"dead_letter must be True or False, not {dead_letter!r}")
        settings["dead_letter"] = dead_letter
    if max_attempts is not UNSET:
        settings["max_attempts"] = (
            None
            if max_attempts is None
            else _checks.integer(max_attempts, "max_attempts", low=1, high=_checks.MAX_INT4)
        )
    if dead_retention_ms is not UNSET:
        settings["dead_retention_ms"] = _checks.milliseconds(
            dead_retention_ms, "dead_retention_ms", low=1, high=_checks.MAX_DELAY_MS
        )

    params = (_checks.name(queue, "queue"), Jsonb(settings))
    return Op(schema, render(_CONFIGURE, schema), params, no_result)


def settings_op(schema: str, queue: str) -> Op[QueueSettings | None]:
    """A queue's settings, read from its row; None for a queue not created yet (it would get
    the defaults)."""

    def parse(rows: Rows) -> QueueSettings | None:
        return QueueSettings(*rows[0]) if rows else None

    return Op(schema, render(_SETTINGS, schema), (_checks.name(queue, "queue"),), parse)
