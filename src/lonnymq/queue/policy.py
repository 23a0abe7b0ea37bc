"""Channel policies: max_concurrency (messages held by consumers at once) and max_size
(messages held in all). Per (queue, channel), with a queue-wide default for channels without
their own. Enforced inside the SQL functions, under the channel's row lock (only channels with
a limit in force have one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import LiteralString, overload

from . import _checks
from ._ops import AConn, Conn, Op, Rows, execute, no_result, render, require_sync, run

_CHANNEL_SET: LiteralString = (
    "SELECT {schema}.channel_policy_set_v1(%s::text, %s::text, %s::integer, %s::integer)"
)
_CHANNEL_CLEAR: LiteralString = "SELECT {schema}.channel_policy_clear_v1(%s::text, %s::text)"
_QUEUE_SET: LiteralString = (
    "SELECT {schema}.queue_policy_set_v1(%s::text, %s::integer, %s::integer)"
)
_CHANNEL_GET: LiteralString = (
    "SELECT has_policy, own_max_concurrency, own_max_size, max_concurrency, max_size, size, "
    "in_flight FROM {schema}.channel_get_v1(%s::text, %s::text)"
)
_QUEUE_GET: LiteralString = "SELECT max_concurrency, max_size FROM {schema}.queue WHERE name = %s"


@dataclass(frozen=True, slots=True)
class Policy:
    """Limits of a channel or a queue default; None means no limit."""

    max_concurrency: int | None = None
    max_size: int | None = None


@dataclass(frozen=True, slots=True)
class ChannelInfo:
    """A channel's own policy (None when it has none), the queue default, the limits in
    force, and its counters."""

    own: Policy | None
    default: Policy
    size: int
    in_flight: int

    @property
    def effective(self) -> Policy:
        return self.own if self.own is not None else self.default


def _limits(max_concurrency: object, max_size: object) -> tuple[int | None, int | None]:
    return (
        _checks.limit_or_none(max_concurrency, "max_concurrency"),
        _checks.limit_or_none(max_size, "max_size"),
    )


def channel_set_op(
    schema: str, queue: str, channel: str, max_concurrency: object, max_size: object
) -> Op[None]:
    names = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))
    return Op(
        schema, render(_CHANNEL_SET, schema), names + _limits(max_concurrency, max_size), no_result
    )


def channel_clear_op(schema: str, queue: str, channel: str) -> Op[None]:
    params = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))
    return Op(schema, render(_CHANNEL_CLEAR, schema), params, no_result)


def queue_set_op(schema: str, queue: str, max_concurrency: object, max_size: object) -> Op[None]:
    params = (_checks.name(queue, "queue"), *_limits(max_concurrency, max_size))
    return Op(schema, render(_QUEUE_SET, schema), params, no_result)


def channel_get_op(schema: str, queue: str, channel: str) -> Op[ChannelInfo]:
    params = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))

    def parse(rows: Rows) -> ChannelInfo:
        if not rows:
            return ChannelInfo(None, Policy(), 0, 0)
        has, own_c, own_s, def_c, def_s, size, in_flight = rows[0]
        own = Policy(own_c, own_s) if has else None
        return ChannelInfo(own, Policy(def_c, def_s), size or 0, in_flight or 0)

    return Op(schema, render(_CHANNEL_GET, schema), params, parse)


def queue_get_op(schema: str, queue: str) -> Op[Policy]:
    def parse(rows: Rows) -> Policy:
        return Policy(*rows[0]) if rows else Policy()

    return Op(schema, render(_QUEUE_GET, schema), (_checks.name(queue, "queue"),), parse)


class _PolicyHandle(ABC):
    """``set`` and ``clear`` of a policy, on a sync connection or, returning an awaitable, on
    an async one."""

    @abstractmethod
    def _set_op(self, max_concurrency: int | None, max_size: int | None) -> Op[None]: ...

    @abstractmethod
    def _clear_op(self) -> Op[None]: ...

    @overload
    def set(
        self, conn: Conn, *, max_concurrency: int | None = ..., max_size: int | None = ...
    ) -> None: ...
    @overload
    def set(
        self, conn: AConn, *, max_concurrency: int | None = ..., max_size: int | None = ...
    ) -> Awaitable[None]: ...
    def set(
        self, conn: Conn | AConn, *, max_concurrency: int | None = None, max_size: int | None = None
    ) -> Awaitable[None] | None:
        """Set the limits (None: no limit)."""
        return execute(conn, self._set_op(max_concurrency, max_size))

    @overload
    def clear(self, conn: Conn) -> None: ...
    @overload
    def clear(self, conn: AConn) -> Awaitable[None]: ...
    def clear(self, conn: Conn | AConn) -> Awaitable[None] | None:
        return execute(conn, self._clear_op())


class QueuePolicy(_PolicyHandle):
    """``queue.policy``: the queue-wide default, for every channel without a policy of its own
    (``clear``: no limits)."""

    def __init__(self, schema: str, queue: str) -> None:
        self._schema = schema
        self._queue = queue

    def _set_op(self, max_concurrency: int | None, max_size: int | None) -> Op[None]:
        return queue_set_op(self._schema, self._queue, max_concurrency, max_size)

    def _clear_op(self) -> Op[None]:
        return queue_set_op(self._schema, self._queue, None, None)

    def get(self, conn: Conn) -> Policy:
        return run(require_sync(conn), queue_get_op(self._schema, self._queue))


class ChannelPolicy(_PolicyHandle):
    """``channel.policy``: the channel's own policy, in place of the queue default; it applies
    to the messages the channel holds. ``clear`` removes it: the queue default applies again."""

    def __init__(self, schema: str, queue: str, channel: str) -> None:
        self._schema = schema
        self._queue = queue
        self._channel = channel

    def _set_op(self, max_concurrency: int | None, max_size: int | None) -> Op[None]:
        return channel_set_op(self._schema, self._queue, self._channel, max_concurrency, max_size)

    def _clear_op(self) -> Op[None]:
        return channel_clear_op(self._schema, self._queue, self._channel)

    def get(self, conn: Conn) -> Policy | None:
        """The channel's own policy, or None when it follows the queue default."""
        op = channel_get_op(self._schema, self._queue, self._channel)
        return run(require_sync(conn), op).own
