"""Create a message in a (queue, channel): the op, and ``channel.message`` that runs it."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import overload

from .._compat import LiteralString
from ..exceptions import ChannelFull
from . import _checks
from ._ops import AConn, Conn, Op, Rows, execute, render
from .results import Created, CreateResult, Deduplicated, Dropped

#: (The function in the select list, its two results one record, rather than ``SELECT ...
#: FROM`` it: a function scan stores its row in a tuplestore first, 4-6 us of the server's
#: CPU a create.)
_CREATE: LiteralString = (
    "SELECT {schema}.message_create_v1("
    "%s::text, %s::text, %s::text, %s::bytea, %s::integer, %s::bigint, %s::bigint)"
)


#: (The arrays go in binary (``%b``): psycopg writes a list's elements one by one in Python,
#: and a bytea array of 1,000 in text, each escaped, took 4 ms against 0.2 in binary.)
_CREATE_MANY: LiteralString = (
    "SELECT ord, result_code, message_id FROM {schema}.message_create_many_v1("
    "%b::text[], %b::text[], %b::text[], %b::bytea[], %b::integer[], %b::bigint[], %b::bigint[])"
)

#: A create's validated arguments: queue, channel, name, content, priority, delay, ttl.
CreateArgs = tuple[str, str, str | None, bytes, int, int, int | None]


def create_args(
    queue: str,
    channel: str,
    content: object,
    *,
    name: str | None = None,
    delay_ms: float = 0,
    priority: int = 0,
    ttl_ms: float | None = None,
    max_message_bytes: int = _checks.DEFAULT_MAX_MESSAGE_BYTES,
) -> CreateArgs:
    """Validate a create's arguments (raises InvalidArgument, InvalidName, MessageTooLarge)."""
    return (
        _checks.name(queue, "queue"),
        _checks.name(channel, "channel"),
        *_checks.message(name, content, priority, delay_ms, ttl_ms, max_message_bytes),
    )


def _result(code: str, message_id: int | None, queue: str, channel: str) -> CreateResult:
    if code == "created" and message_id is not None:
        return Created(message_id)
    if code == "deduplicated" and message_id is not None:
        return Deduplicated(message_id)
    return Dropped(queue, channel)


def create_many_op(schema: str, rows: list[CreateArgs]) -> Op[list[CreateResult]]:
    """Many creates in one call (a batch's): one result per row, in order; refused ones are
    :class:`Dropped` (the caller decides whether that is an error)."""

    def parse(found: Rows) -> list[CreateResult]:
        by_ord = {r[0]: (r[1], r[2]) for r in found}
        out = []
        for i, row in enumerate(rows, start=1):
            code, message_id = by_ord[i]
            out.append(_result(code, message_id, row[0], row[1]))
        return out

    params = tuple([row[i] for row in rows] for i in range(7))
    return Op(schema, render(_CREATE_MANY, schema), params, parse)


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
    params = create_args(
        queue,
        channel,
        content,
        name=name,
        delay_ms=delay_ms,
        priority=priority,
        ttl_ms=ttl_ms,
        max_message_bytes=max_message_bytes,
    )

    raise_if_dropped = _checks.boolean(raise_if_dropped, "raise_if_dropped")

    def parse(rows: Rows) -> CreateResult:
        code, message_id = rows[0][0]  # (a record, read in text: its fields are strings)
        result = _result(code, None if message_id is None else int(message_id), *params[:2])
        if raise_if_dropped and isinstance(result, Dropped):
            raise ChannelFull(params[0], params[1])
        return result

    return Op(schema, render(_CREATE, schema), params, parse)


class ChannelMessages:
    """``channel.message``: creates in a channel."""

    def __init__(self, schema: str, queue: str, channel: str, max_message_bytes: int) -> None:
        self._schema = schema
        self._queue = queue
        self._channel = channel
        self._max_message_bytes = max_message_bytes

    @overload
    def create(
        self,
        conn: Conn,
        content: bytes | str,
        *,
        name: str | None = ...,
        delay_ms: float = ...,
        priority: int = ...,
        ttl_ms: float | None = ...,
        raise_if_dropped: bool = ...,
    ) -> CreateResult: ...
    @overload
    def create(
        self,
        conn: AConn,
        content: bytes | str,
        *,
        name: str | None = ...,
        delay_ms: float = ...,
        priority: int = ...,
        ttl_ms: float | None = ...,
        raise_if_dropped: bool = ...,
    ) -> Awaitable[CreateResult]: ...
    def create(
        self,
        conn: Conn | AConn,
        content: bytes | str,
        *,
        name: str | None = None,
        delay_ms: float = 0,
        priority: int = 0,
        ttl_ms: float | None = None,
        raise_if_dropped: bool = True,
    ) -> CreateResult | Awaitable[CreateResult]:
        """Create a message in the caller's transaction.

        ``name`` de-duplicates: while a never-dequeued message of that name is in the channel,
        nothing is created and the result is ``Deduplicated(existing_id)``. ``delay_ms`` keeps
        it invisible until due; ``priority`` (0-255, higher first) orders it within the
        channel. ``ttl_ms`` drops it if it is not dequeued within that time after it is due
        (expired messages are removed by :meth:`lonnymq.Broker.expire`). A full channel raises
        :class:`~lonnymq.ChannelFull`, or gives ``Dropped`` when ``raise_if_dropped=False``.
        """
        op = create_op(
            self._schema,
            self._queue,
            self._channel,
            content,
            name=name,
            delay_ms=delay_ms,
            priority=priority,
            ttl_ms=ttl_ms,
            raise_if_dropped=raise_if_dropped,
            max_message_bytes=self._max_message_bytes,
        )
        return execute(conn, op)
