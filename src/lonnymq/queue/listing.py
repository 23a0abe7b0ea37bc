"""Messages and dead letters as listed (no content): by id, or the live ones in the order they
fall due, filtered by queue, channel and state; optionally with the two ends of each one's
content, where a Kombu message keeps its headers (a Celery task's name and arguments). One
SQL function call (``message_list_v2``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal

from .._compat import LiteralString
from ..exceptions import InvalidArgument
from . import _checks
from ._ops import Op, Rows, render

State = Literal["ready", "delayed", "locked", "dead"]
STATES: tuple[State, ...] = ("ready", "delayed", "locked", "dead")
Order = Literal["id", "due"]
ORDERS: tuple[Order, ...] = ("id", "due")
#: Most bytes of each end of a message's content a listing returns (``peek``).
MAX_PEEK = 64 * 1024

_LIST: LiteralString = (
    "SELECT * FROM {schema}.message_list_v2(%s::text, %s::text, %s::text, %s::bigint, "
    "%s::integer, %s::text, %s::timestamptz, %s::integer)"
)


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """A message as listed: no content (but its ends, when asked for: ``head``, its first
    ``peek`` bytes, or all of it; ``tail``, its last ``peek`` bytes, when it is longer)."""

    id: int
    queue: str
    channel: str
    name: str | None
    priority: int
    attempts: int
    state: State
    dequeue_at: datetime | None
    locked_until: datetime | None
    created_at: datetime
    dead_at: datetime | None
    reason: str | None
    size: int
    head: bytes | None = None
    tail: bytes | None = None


def state_arg(state: object) -> State | None:
    if state is None:
        return None
    if state not in STATES:
        raise InvalidArgument(
            f"state must be one of {', '.join(STATES)} (or None for all), not {state!r}"
        )
    return state


def list_op(
    schema: str,
    *,
    queue: str | None = None,
    channel: str | None = None,
    state: State | None = None,
    after: int = 0,
    limit: int = 50,
    order: Order = "id",
    after_due: datetime | None = None,
    peek: int = 0,
) -> Op[list[MessageInfo]]:
    """Messages by id after ``after``; or, with ``order="due"``, the live messages (no dead
    letters) by due time, then id, after (``after_due``, ``after``)."""
    if order not in ORDERS:
        raise InvalidArgument(f"order must be 'id' or 'due', not {order!r}")
    if order == "due" and state == "dead":
        raise InvalidArgument("dead letters are not due: list them by id")
    if after_due is not None and (not isinstance(after_due, datetime) or after_due.tzinfo is None):
        raise InvalidArgument(f"after_due must be an aware datetime, not {after_due!r}")
    params = (
        None if queue is None else _checks.name(queue, "queue"),
        None if channel is None else _checks.name(channel, "channel"),
        state_arg(state),
        _checks.integer(after, "after", low=0, high=_checks.MAX_ID),
        _checks.integer(limit, "limit", low=1, high=_checks.MAX_LIMIT),
        order,
        after_due,
        _checks.integer(peek, "peek", low=0, high=MAX_PEEK),
    )

    def parse(rows: Rows) -> list[MessageInfo]:
        out = []
        for row in rows:
            info = MessageInfo(*row[:13])
            if row[13] is not None:
                tail = None if row[14] is None else bytes(row[14])
                info = replace(info, head=bytes(row[13]), tail=tail)
            out.append(info)
        return out

    return Op(schema, render(_LIST, schema), params, parse)
