"""Channel policies: max_concurrency (messages held by consumers at once), max_size (messages
held in all) and a rate (deliveries per interval, with a burst). Per (queue, channel), with a
queue-wide default for channels without their own. Enforced inside the SQL functions, under the
channel's row lock (only channels with a limit in force have one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime
from typing import overload

from .._compat import LiteralString
from . import _checks
from ._ops import AConn, Conn, Op, Rows, execute, no_result, render, require_sync, run
from .rate import Rate, burst_or_none, rate_of, rate_or_none

_CHANNEL_SET: LiteralString = (
    "SELECT {schema}.channel_policy_set_v2(%s::text, %s::text, %s::integer, %s::integer, "
    "%s::integer, %s::bigint, %s::integer)"
)
_CHANNEL_CLEAR: LiteralString = "SELECT {schema}.channel_policy_clear_v1(%s::text, %s::text)"
_QUEUE_SET: LiteralString = (
    "SELECT {schema}.queue_policy_set_v2(%s::text, %s::integer, %s::integer, %s::integer, "
    "%s::bigint, %s::integer)"
)
_CHANNEL_GET: LiteralString = (
    "SELECT has_policy, own_max_concurrency, own_max_size, own_rate_count, own_rate_per_ms, "
    "own_burst, max_concurrency, max_size, rate_count, rate_per_ms, burst, size, in_flight, "
    "tokens, next_token_at FROM {schema}.channel_get_v2(%s::text, %s::text)"
)
_QUEUE_GET: LiteralString = (
    "SELECT max_concurrency, max_size, rate_count, rate_per_ms, burst FROM {schema}.queue "
    "WHERE name = %s"
)


@dataclass(frozen=True, slots=True)
class Policy:
    """Limits of a channel or a queue default; None means no limit. ``rate``: at most that
    many deliveries per interval, ``burst`` of them at once (``burst`` is set with a rate)."""

    max_concurrency: int | None = None
    max_size: int | None = None
    rate: Rate | None = None
    burst: int | None = None


@dataclass(frozen=True, slots=True)
class ChannelInfo:
    """A channel's own policy (None when it has none), the queue default, the limits in
    force, its counters, and the state of its rate: deliveries allowed now (``tokens``, None
    without a rate) and, when none is, when the next one is (``next_token_at``)."""

    own: Policy | None
    default: Policy
    size: int
    in_flight: int
    tokens: int | None = None
    next_token_at: datetime | None = None

    @property
    def effective(self) -> Policy:
        return self.own if self.own is not None else self.default


Limits = tuple[int | None, int | None, int | None, int | None, int | None]


def _limits(max_concurrency: object, max_size: object, rate: object, burst: object) -> Limits:
    """The SQL arguments of a policy: max_concurrency, max_size, rate count, rate interval in
    milliseconds, burst (checked in that order)."""
    conc = _checks.limit_or_none(max_concurrency, "max_concurrency")
    size = _checks.limit_or_none(max_size, "max_size")
    parsed = rate_or_none(rate)
    return (
        conc,
        size,
        None if parsed is None else parsed.count,
        None if parsed is None else parsed.per_ms,
        burst_or_none(burst, parsed),
    )


def policy_of(
    conc: int | None, size: int | None, count: int | None, per_ms: int | None, burst: int | None
) -> Policy:
    rate = rate_of(count, per_ms)
    return Policy(conc, size, rate, burst if rate is not None else None)


def channel_set_op(
    schema: str,
    queue: str,
    channel: str,
    max_concurrency: object,
    max_size: object,
    rate: object = None,
    burst: object = None,
) -> Op[None]:
    names = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))
    limits = _limits(max_concurrency, max_size, rate, burst)
    return Op(schema, render(_CHANNEL_SET, schema), names + limits, no_result)


def channel_clear_op(schema: str, queue: str, channel: str) -> Op[None]:
    params = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))
    return Op(schema, render(_CHANNEL_CLEAR, schema), params, no_result)


def queue_set_op(
    schema: str,
    queue: str,
    max_concurrency: object,
    max_size: object,
    rate: object = None,
    burst: object = None,
) -> Op[None]:
    params = (_checks.name(queue, "queue"), *_limits(max_concurrency, max_size, rate, burst))
    return Op(schema, render(_QUEUE_SET, schema), params, no_result)


def channel_get_op(schema: str, queue: str, channel: str) -> Op[ChannelInfo]:
    params = (_checks.name(queue, "queue"), _checks.name(channel, "channel"))

    def parse(rows: Rows) -> ChannelInfo:
        if not rows:
            return ChannelInfo(None, Policy(), 0, 0)
        has, *own, def_c, def_s, def_n, def_ms, def_b, size, in_flight, tokens, next_at = rows[0]
        return ChannelInfo(
            policy_of(*own) if has else None,
            policy_of(def_c, def_s, def_n, def_ms, def_b),
            size or 0,
            in_flight or 0,
            tokens,
            next_at,
        )

    return Op(schema, render(_CHANNEL_GET, schema), params, parse)


def queue_get_op(schema: str, queue: str) -> Op[Policy]:
    def parse(rows: Rows) -> Policy:
        return policy_of(*rows[0]) if rows else Policy()

    return Op(schema, render(_QUEUE_GET, schema), (_checks.name(queue, "queue"),), parse)


RateArg = Rate | str | None


class _PolicyHandle(ABC):
    """``set`` and ``clear`` of a policy, on a sync connection or, returning an awaitable, on
    an async one."""

    @abstractmethod
    def _set_op(
        self, max_concurrency: object, max_size: object, rate: object, burst: object
    ) -> Op[None]: ...

    @abstractmethod
    def _clear_op(self) -> Op[None]: ...

    @overload
    def set(
        self,
        conn: Conn,
        *,
        max_concurrency: int | None = ...,
        max_size: int | None = ...,
        rate: RateArg = ...,
        burst: int | None = ...,
    ) -> None: ...
    @overload
    def set(
        self,
        conn: AConn,
        *,
        max_concurrency: int | None = ...,
        max_size: int | None = ...,
        rate: RateArg = ...,
        burst: int | None = ...,
    ) -> Awaitable[None]: ...
    def set(
        self,
        conn: Conn | AConn,
        *,
        max_concurrency: int | None = None,
        max_size: int | None = None,
        rate: RateArg = None,
        burst: int | None = None,
    ) -> Awaitable[None] | None:
        """Set the limits (None: no limit). ``rate``: at most that many deliveries per
        interval across every consumer (``"10/s"``, ``"600/m"``, ``"1/h"`` or a
        :class:`lonnymq.Rate`), ``burst`` of them at once (default 1). The policy set replaces
        the whole previous one: a limit not given is no limit."""
        return execute(conn, self._set_op(max_concurrency, max_size, rate, burst))

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

    def _set_op(
        self, max_concurrency: object, max_size: object, rate: object, burst: object
    ) -> Op[None]:
        return queue_set_op(self._schema, self._queue, max_concurrency, max_size, rate, burst)

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

    def _set_op(
        self, max_concurrency: object, max_size: object, rate: object, burst: object
    ) -> Op[None]:
        return channel_set_op(
            self._schema, self._queue, self._channel, max_concurrency, max_size, rate, burst
        )

    def _clear_op(self) -> Op[None]:
        return channel_clear_op(self._schema, self._queue, self._channel)

    def get(self, conn: Conn) -> Policy | None:
        """The channel's own policy, or None when it follows the queue default."""
        op = channel_get_op(self._schema, self._queue, self._channel)
        return run(require_sync(conn), op).own
