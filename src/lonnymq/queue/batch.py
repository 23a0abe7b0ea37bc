"""Batches: creates and policy changes collected, sorted into one consistent order
(queue, queue-level first, channel, policy before messages, message name) and executed in one
transaction and one round trip (pipeline). Consecutive creates go as one call
(``message_create_many_v1``: one INSERT for the channels without a max_size). Because every
batch locks in the same order, two batches never deadlock each other."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import psycopg
from psycopg.rows import tuple_row

from ..exceptions import ChannelFull, InvalidArgument
from . import _checks
from ._ops import Op, translate
from .create import CreateArgs, create_many_op
from .policy import RateArg, channel_clear_op, channel_set_op, queue_set_op
from .results import CreateResult, Dropped

T = TypeVar("T")
_UNSET: Any = object()


class Pending(Generic[T]):
    """The result of one batched operation, available once the batch has executed."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value: Any = _UNSET

    def get(self) -> T:
        if self._value is _UNSET:
            raise InvalidArgument("the batch has not been executed yet")
        value: T = self._value
        return value


@dataclass(slots=True)
class _Item:
    key: tuple[str, int, str, int, str, int]
    #: a policy change, or None for a create (its arguments in ``create``)
    op: Op[Any] | None
    pending: Pending[Any]
    create: CreateArgs | None = None


def _calls(schema: str, items: list[_Item]) -> list[tuple[Op[Any], list[_Item]]]:
    """The calls that run ``items`` in order: each run of consecutive creates is one call."""
    calls: list[tuple[Op[Any], list[_Item]]] = []
    run: list[_Item] = []
    for item in items:
        if item.create is not None:
            run.append(item)
            continue
        if run:
            calls.append((create_many_op(schema, [i.create for i in run if i.create]), run))
            run = []
        assert item.op is not None
        calls.append((item.op, [item]))
    if run:
        calls.append((create_many_op(schema, [i.create for i in run if i.create]), run))
    return calls


def _results(items: list[_Item], value: Any) -> list[Any]:
    return list(value) if len(items) > 1 or items[0].create is not None else [value]


class Batch:
    """Collect creates and policy changes; run them with :meth:`execute`."""

    def __init__(
        self, schema: str, max_message_bytes: int, default_queue: str | None = None
    ) -> None:
        self._schema = schema
        self._default_queue = default_queue
        self._max_message_bytes = max_message_bytes
        self._items: list[_Item] = []
        self._executed = False

    def __len__(self) -> int:
        return len(self._items)

    def _add(
        self,
        key: tuple[str, int, str, int, str],
        op: Op[T] | None,
        create: CreateArgs | None = None,
    ) -> Pending[T]:
        if self._executed:
            raise InvalidArgument("this batch has already been executed; start a new one")
        pending: Pending[T] = Pending()
        self._items.append(_Item((*key, len(self._items)), op, pending, create))
        return pending

    def queue(self, name: str) -> BatchQueue:
        return BatchQueue(self, _checks.name(name, "queue"))

    def channel(self, name: str) -> BatchChannel:
        """A channel of the batch's queue (for batches made by ``Queue.batch()``)."""
        if self._default_queue is None:
            raise InvalidArgument("this batch has no queue of its own: use batch.queue(name)")
        return self.queue(self._default_queue).channel(name)

    def _ordered(self) -> list[_Item]:
        self._executed = True
        return sorted(self._items, key=lambda item: item.key)

    def _finish(self, items: list[_Item], results: list[Any], raise_if_dropped: bool) -> None:
        for item, result in zip(items, results, strict=True):
            item.pending._value = result
        if raise_if_dropped:
            for result in results:
                if isinstance(result, Dropped):
                    raise ChannelFull(result.queue, result.channel)

    @overload
    def execute(
        self, conn: psycopg.Connection[Any], *, raise_if_dropped: bool = True
    ) -> list[Any]: ...
    @overload
    def execute(
        self, conn: psycopg.AsyncConnection[Any], *, raise_if_dropped: bool = True
    ) -> Awaitable[list[Any]]: ...
    def execute(
        self,
        conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
        *,
        raise_if_dropped: bool = True,
    ) -> list[Any] | Awaitable[list[Any]]:
        """Execute the batch in one transaction (a savepoint inside the caller's transaction),
        pipelined. Returns the results in the order the operations were added.

        With ``raise_if_dropped`` (the default), a create refused by a full channel raises
        :class:`~lonnymq.ChannelFull` and the whole batch is rolled back; otherwise the
        refused creates give :class:`~lonnymq.Dropped` results and the rest is kept.
        """
        raise_if_dropped = _checks.boolean(raise_if_dropped, "raise_if_dropped")
        if isinstance(conn, psycopg.AsyncConnection):
            return self._aexecute(conn, raise_if_dropped)
        if not isinstance(conn, psycopg.Connection):
            raise InvalidArgument(f"expected a psycopg connection, not {type(conn).__name__}")
        items = self._ordered()
        if not items:
            return []
        calls = _calls(self._schema, items)
        try:
            with _atomic(conn):
                cursors = []
                with conn.pipeline():
                    for op, _ in calls:
                        cur = psycopg.Cursor(conn, row_factory=tuple_row)  # (see _ops.run)
                        cur.execute(op.query, op.params, binary=op.binary)
                        cursors.append(cur)
                results = []
                for (op, run), cur in zip(calls, cursors, strict=True):
                    results.extend(_results(run, op.parse(cur.fetchall())))
                self._finish(items, results, raise_if_dropped)
        except psycopg.Error as exc:
            raise translate(exc, self._schema) from exc
        return [item.pending.get() for item in self._items]

    async def _aexecute(
        self, conn: psycopg.AsyncConnection[Any], raise_if_dropped: bool
    ) -> list[Any]:
        items = self._ordered()
        if not items:
            return []
        calls = _calls(self._schema, items)
        try:
            async with _aatomic(conn):
                cursors = []
                async with conn.pipeline():
                    for op, _ in calls:
                        cur = psycopg.AsyncCursor(conn, row_factory=tuple_row)
                        await cur.execute(op.query, op.params, binary=op.binary)
                        cursors.append(cur)
                results = []
                for (op, run), cur in zip(calls, cursors, strict=True):
                    results.extend(_results(run, op.parse(await cur.fetchall())))
                self._finish(items, results, raise_if_dropped)
        except psycopg.Error as exc:
            raise translate(exc, self._schema) from exc
        return [item.pending.get() for item in self._items]


_SAVEPOINT = b"SAVEPOINT lonnymq_batch"
_RELEASE = b"RELEASE SAVEPOINT lonnymq_batch"
_ROLLBACK = b"ROLLBACK TO SAVEPOINT lonnymq_batch"


@contextmanager
def _atomic(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """All or nothing, without committing the caller's transaction: a transaction of its own
    on an autocommit connection, else a savepoint inside the caller's transaction (psycopg's
    ``transaction()`` would commit an idle non-autocommit connection's transaction)."""
    if conn.autocommit:
        with conn.transaction():
            yield
        return
    conn.execute(_SAVEPOINT)
    try:
        yield
    except BaseException:
        conn.execute(_ROLLBACK)
        conn.execute(_RELEASE)
        raise
    conn.execute(_RELEASE)


@asynccontextmanager
async def _aatomic(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    if conn.autocommit:
        async with conn.transaction():
            yield
        return
    await conn.execute(_SAVEPOINT)
    try:
        yield
    except BaseException:
        await conn.execute(_ROLLBACK)
        await conn.execute(_RELEASE)
        raise
    await conn.execute(_RELEASE)


class BatchQueue:
    def __init__(self, batch: Batch, name: str) -> None:
        self._batch = batch
        self.name = name

    def channel(self, name: str) -> BatchChannel:
        return BatchChannel(self, _checks.name(name, "channel"))

    @property
    def policy(self) -> BatchQueuePolicy:
        """The queue-wide default policy."""
        return BatchQueuePolicy(self)


class BatchQueuePolicy:
    def __init__(self, queue: BatchQueue) -> None:
        self._queue = queue

    def set(
        self,
        *,
        max_concurrency: int | None = None,
        max_size: int | None = None,
        rate: RateArg = None,
        burst: int | None = None,
    ) -> Pending[None]:
        """Set the queue-wide default policy (None: no limit)."""
        batch = self._queue._batch
        op = queue_set_op(batch._schema, self._queue.name, max_concurrency, max_size, rate, burst)
        return batch._add((self._queue.name, 0, "", 0, ""), op)

    def clear(self) -> Pending[None]:
        return self.set()


class BatchChannel:
    def __init__(self, queue: BatchQueue, name: str) -> None:
        self._queue = queue
        self.name = name

    def message(
        self,
        content: object,
        *,
        name: str | None = None,
        delay_ms: float = 0,
        priority: int = 0,
        ttl_ms: float | None = None,
    ) -> Pending[CreateResult]:
        batch = self._queue._batch
        # (the queue's and the channel's names were checked when they were named)
        args: CreateArgs = (
            self._queue.name,
            self.name,
            *_checks.message(name, content, priority, delay_ms, ttl_ms, batch._max_message_bytes),
        )
        return batch._add((self._queue.name, 1, self.name, 1, name or ""), None, args)

    @property
    def policy(self) -> BatchChannelPolicy:
        return BatchChannelPolicy(self)


class BatchChannelPolicy:
    def __init__(self, channel: BatchChannel) -> None:
        self._channel = channel

    def set(
        self,
        *,
        max_concurrency: int | None = None,
        max_size: int | None = None,
        rate: RateArg = None,
        burst: int | None = None,
    ) -> Pending[None]:
        """Set the channel's own policy (None: no limit)."""
        queue = self._channel._queue
        op = channel_set_op(
            queue._batch._schema,
            queue.name,
            self._channel.name,
            max_concurrency,
            max_size,
            rate,
            burst,
        )
        return queue._batch._add((queue.name, 1, self._channel.name, 0, ""), op)

    def clear(self) -> Pending[None]:
        """Remove the channel's own policy (it falls back to the queue default)."""
        queue = self._channel._queue
        op = channel_clear_op(queue._batch._schema, queue.name, self._channel.name)
        return queue._batch._add((queue.name, 1, self._channel.name, 0, ""), op)


__all__ = ["Batch", "BatchChannel", "BatchQueue", "Pending"]
