"""Create a message in a (queue, channel)."""

from __future__ import annotations

from typing import LiteralString

from ..exceptions import ChannelFull
from . import _checks
from ._ops import Op, Rows, render
from .results import Created, CreateResult, Deduplicated, Dropped

_CREATE: LiteralString = (
    "SELECT result_code, message_id FROM {schema}.message_create_v1("
    "%s::text, %s::text, %s::text, %s::bytea, %s::integer, %s::bigint, %s::bigint)"
)


def create_op(
    schema: str,
    queue: str,
    channel: str,
    content: object,
    *,
    name: str | None = None,
    delay_ms: float = 0,
    priority: int = 0,
    ttl_ms: float | None = None,
    raise_if_dropped: bool = True,
    max_message_bytes: int = _checks.DEFAULT_MAX_MESSAGE_BYTES,
) -> Op[CreateResult]:
    queue = _checks.name(queue, "queue")
    channel = _checks.name(channel, "channel")
    data = _checks.content(content, max_message_bytes)
    name = _checks.optional_name(name, "message")
    delay = _checks.milliseconds(delay_ms, "delay_ms", low=0, high=_checks.MAX_DELAY_MS)
    prio = _checks.integer(priority, "priority", low=0, high=_checks.MAX_PRIORITY)
    ttl = (
        None
        if ttl_ms is None
        else _checks.milliseconds(ttl_ms, "ttl_ms", low=0, high=_checks.MAX_DELAY_MS)
    )

    def parse(rows: Rows) -> CreateResult:
        code, message_id = rows[0]
        if code == "created":
            return Created(message_id)
        if code == "deduplicated":
            return Deduplicated(message_id)
        if raise_if_dropped:
            raise ChannelFull(queue, channel)
        return Dropped(queue, channel)

    params = (queue, channel, name, data, prio, delay, ttl)
    return Op(schema, render(_CREATE, schema), params, parse)
