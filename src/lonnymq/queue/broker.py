"""The public queue API: :class:`Broker` (a lonnymq schema), :class:`Queue`, :class:`Channel`.

Every method takes the caller's psycopg connection and runs in the caller's transaction: the
API never commits for the caller (an autocommit connection commits each call by itself).
Producer-side methods (create, policies, batches) accept a ``psycopg.AsyncConnection`` too and
then return an awaitable.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime

from .. import migrator
from . import _checks
from ._ops import Conn, require_sync, run
from .batch import Batch
from .consumers import ConsumerInfo, consumer_list_op
from .create import ChannelMessages
from .dequeue import DEFAULT_LOCK_MS, DequeueResult, Message, dequeue_op
from .expiry import QueueExpiry, expire_op, expiring_op, housekeep_op
from .finalize import KEEP, defer_op, delete_many_op, delete_op, heartbeat_op, reject_op
from .listing import MessageInfo, Order, State, list_op
from .operate import (
    DEFAULT_SETTINGS,
    UNSET,
    ChannelStatus,
    HorizonHolder,
    MessageDetail,
    QueueSettings,
    QueueStatus,
    RateHeld,
    RetryResult,
    UpdateResult,
    channels_op,
    configure_op,
    dead_purge_op,
    get_op,
    horizon_op,
    rate_held_op,
    remove_op,
    retry_op,
    settings_op,
    status_op,
    update_op,
)
from .policy import ChannelInfo, ChannelPolicy, QueuePolicy, channel_get_op
from .queues import delete_queue_op, list_queues_op, purge_op, stats_op
from .results import Outcome, QueueStats


class Broker:
    """A lonnymq schema in a database: the entry point of the queue API."""

    def __init__(
        self,
        schema: str = migrator.DEFAULT_SCHEMA,
        *,
        max_message_bytes: int = _checks.DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.schema = migrator.validate_schema(schema)
        self.max_message_bytes = _checks.integer(
            max_message_bytes, "max_message_bytes", low=1, high=1024**3
        )

    def __repr__(self) -> str:
        return f"Broker(schema={self.schema!r})"

    @property
    def wake_channel(self) -> str:
        """The NOTIFY channel on which this schema announces available messages (the
        payload is the queue name). LISTEN on it with ``psycopg.sql.Identifier``."""
        return migrator.wake_channel(self.schema)

    def queue(self, name: str) -> Queue:
        return Queue(name, broker=self)

    def install(self, conn: Conn) -> list[str]:
        """Install or upgrade the schema (see :func:`lonnymq.migrator.install`)."""
        return migrator.install(conn, self.schema)

    def check(self, conn: Conn) -> int:
        """Raise :class:`~lonnymq.SchemaNotInstalled` unless the schema is installed."""
        return migrator.check(conn, self.schema)

    def dequeue(
        self,
        conn: Conn,
        queues: Sequence[str],
        *,
        limit: int = 1,
        lock_ms: float = DEFAULT_LOCK_MS,
        ack: Sequence[Message | tuple[int, uuid.UUID]] = (),
        listen: bool = True,
    ) -> DequeueResult:
        """Dequeue up to ``limit`` messages from ``queues`` and lock them for ``lock_ms``.

        Messages whose lock expired come first; then channels with a due message take turns,
        the one that has waited longest first; within a channel, highest priority, then
        earliest due, then oldest. Run it in its own transaction (autocommit is fine).

        ``ack``: held messages (or ``(id, lock_token)`` pairs) to delete first, in the same
        statement: a worker's acks travel with its next dequeue (``result.acked`` has their
        outcomes).

        ``listen``: when the call gets nothing, this connection's session counts as a consumer
        waiting on ``wake_channel`` for these queues until its next dequeue, and their
        producers send a NOTIFY (they send none while every consumer is busy). Pass False on
        a connection that does not wait for notifications (a pooled one, say).
        """
        op = dequeue_op(self.schema, queues, limit=limit, lock_ms=lock_ms, ack=ack, listen=listen)
        return run(require_sync(conn), op)

    def delete(self, conn: Conn, message_id: int, lock_token: uuid.UUID) -> Outcome:
        """Delete (ack) a held message by id and lock token."""
        return run(require_sync(conn), delete_op(self.schema, message_id, lock_token))

    def defer(
        self,
        conn: Conn,
        message_id: int,
        lock_token: uuid.UUID,
        *,
        delay_ms: float | None = 0,
        state: object = KEEP,
    ) -> Outcome:
        """Unlock a held message; due again after ``delay_ms`` (``None``: back in its old
        place), optionally with new state."""
        op = defer_op(self.schema, message_id, lock_token, delay_ms=delay_ms, state=state)
        return run(require_sync(conn), op)

    def heartbeat(
        self,
        conn: Conn,
        held: Iterable[Message | tuple[int, uuid.UUID]],
        *,
        lock_ms: float,
    ) -> set[int]:
        """Extend the locks of held messages to ``lock_ms`` from now, in one call. Returns
        the ids still held; the others were lost (lock expired and taken over, or gone)."""
        held = list(held)
        if not held:
            return set()
        return run(require_sync(conn), heartbeat_op(self.schema, held, lock_ms=lock_ms))

    def delete_many(
        self, conn: Conn, held: Iterable[Message | tuple[int, uuid.UUID]]
    ) -> dict[int, Outcome]:
        """Delete (ack) many held messages in one call; an outcome per id."""
        held = list(held)
        if not held:
            return {}
        return run(require_sync(conn), delete_many_op(self.schema, held))

    def expire(self, conn: Conn, *, limit: int = 10_000) -> tuple[int, int]:
        """Delete messages past their TTL (not held by a consumer; at most ``limit``) and
        queues unused for longer than their ``x-expires``. Returns (messages, queues)."""
        return run(require_sync(conn), expire_op(self.schema, limit))

    def expiring(self, conn: Conn) -> list[QueueExpiry]:
        """The queues with an ``x-expires``, and how long each has been unused; those past
        it (``.expired``) go at the next sweep (:meth:`expire`, run by every client of the
        schema now and then, and by ``lonnymq housekeep``)."""
        return run(require_sync(conn), expiring_op(self.schema))

    def batch(self) -> Batch:
        """A batch of creates and policy changes across queues: ``batch.queue(q).channel(c)``."""
        return Batch(self.schema, self.max_message_bytes)

    def queues(self, conn: Conn) -> list[str]:
        """Names of the queues known to the schema."""
        return run(require_sync(conn), list_queues_op(self.schema))

    def reject(
        self, conn: Conn, message_id: int, lock_token: uuid.UUID, *, reason: str = "rejected"
    ) -> Outcome:
        """Reject a held message without requeue: it moves to the dead letters of its queue
        with ``reason`` (or is deleted where the queue keeps no dead letters)."""
        op = reject_op(self.schema, message_id, lock_token, reason=reason)
        return run(require_sync(conn), op)

    # -- operating ---------------------------------------------------------------------------

    def status(self, conn: Conn, *, count_ready: bool = True) -> list[QueueStatus]:
        """Every queue's gauges, cumulative counters and settings. Splitting waiting messages
        into ready and delayed reads them (cost grows with the backlog): ``count_ready=False``
        skips it."""
        return run(require_sync(conn), status_op(self.schema, count_ready=count_ready))

    def rate_held(self, conn: Conn) -> list[RateHeld]:
        """Per queue, the channels whose rate holds back messages that are due now (they wait
        for their next token), and how many such messages they hold."""
        return run(require_sync(conn), rate_held_op(self.schema))

    def horizon(self, conn: Conn, *, limit: int = 5) -> list[HorizonHolder]:
        """What holds back the database's cleanup horizon, oldest first (sessions with an
        old snapshot or transaction, prepared transactions, replication slots). Every row
        deleted since the oldest began stays until it ends: lonnymq's scans start past such
        rows, but its tables grow (see docs/operations.md, "A held snapshot")."""
        return run(require_sync(conn), horizon_op(self.schema, limit=limit))

    def messages(
        self,
        conn: Conn,
        *,
        queue: str | None = None,
        channel: str | None = None,
        state: State | None = None,
        after: int = 0,
        limit: int = 50,
        order: Order = "id",
        after_due: datetime | None = None,
        peek: int = 0,
    ) -> list[MessageInfo]:
        """Messages (live and dead letters) by id, after ``after`` (page with the last id
        seen), filtered by queue, channel and state (ready, delayed, locked, dead). With
        ``order="due"``: the live messages in the order they fall due (page with the last
        one's ``dequeue_at`` as ``after_due`` and its id as ``after``). ``peek``: that many
        bytes of each end of every message's content (``.head``, ``.tail``), where a Kombu
        message keeps its headers."""
        op = list_op(
            self.schema,
            queue=queue,
            channel=channel,
            state=state,
            after=after,
            limit=limit,
            order=order,
            after_due=after_due,
            peek=peek,
        )
        return run(require_sync(conn), op)

    def consumers(self, conn: Conn, queue: str | None = None) -> list[ConsumerInfo]:
        """The Kombu consumers of ``queue`` (of every queue when None), as their
        transports registered them: who (host, pid, Celery node), since when, when last heard
        of, their last delivery (reported every few seconds)."""
        return run(require_sync(conn), consumer_list_op(self.schema, queue))

    def message(self, conn: Conn, message_id: int) -> MessageDetail | None:
        """One message or dead letter, with its content; None when there is no such id."""
        return run(require_sync(conn), get_op(self.schema, message_id))

    def remove(self, conn: Conn, ids: Iterable[int]) -> dict[int, str]:
        """Delete messages (whatever their state) and dead letters by id:
        ``{id: "deleted" | "not_found"}``. A consumer holding one finds it gone when it acks."""
        return run(require_sync(conn), remove_op(self.schema, list(ids)))

    def retry(self, conn: Conn, ids: Iterable[int]) -> list[RetryResult]:
        """Put dead letters back in their queue (as new messages, attempts from zero) and make
        delayed messages due now (a Celery task's ``eta`` header is removed, so that a worker
        runs it at once)."""
        return run(require_sync(conn), retry_op(self.schema, list(ids)))

    def update(
        self,
        conn: Conn,
        message_id: int,
        *,
        delay_ms: float | None = None,
        at: datetime | None = None,
        priority: int | None = None,
        content: _checks.Content | None = None,
    ) -> UpdateResult:
        """Reschedule or edit a ready or delayed message: due in ``delay_ms`` (0: now) or at
        ``at`` (an aware datetime; a time past means now), a new ``priority``, new
        ``content``; what is None is kept. A message already due that is made due now keeps
        its place. A Celery task's ``eta`` header is rewritten to agree (removed when due
        now), so a worker runs it when the database hands it out. Idle consumers are woken.

        Raises :class:`~lonnymq.MessageLocked` when a consumer holds the message (a dequeue
        that is taking it at that moment is waited for, then refused) and
        :class:`~lonnymq.MessageNotFound` for a missing id or a dead letter."""
        op = update_op(
            self.schema,
            message_id,
            delay_ms=delay_ms,
            at=at,
            priority=priority,
            content=content,
            max_message_bytes=self.max_message_bytes,
        )
        return run(require_sync(conn), op)

    def housekeep(self, conn: Conn, *, limit: int = 10_000) -> int:
        """Prune dead letters past their queue's retention (at most ``limit``) and fold the
        counter rows; returns how many dead letters went. Consumers run it periodically."""
        return run(require_sync(conn), housekeep_op(self.schema, limit=limit))


class Queue:
    """A queue (a Kombu queue: ``celery``, ``default``...) split into channels."""

    def __init__(
        self,
        name: str = "default",
        *,
        schema: str = migrator.DEFAULT_SCHEMA,
        broker: Broker | None = None,
    ) -> None:
        self.name = _checks.name(name, "queue")
        self.broker = broker if broker is not None else Broker(schema)

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, schema={self.broker.schema!r})"

    @property
    def schema(self) -> str:
        return self.broker.schema

    def channel(self, name: str) -> Channel:
        return Channel(self, name)

    @property
    def policy(self) -> QueuePolicy:
        """The queue-wide default policy, for channels without a policy of their own."""
        return QueuePolicy(self.schema, self.name)

    def dequeue(
        self,
        conn: Conn,
        *,
        limit: int = 1,
        lock_ms: float = DEFAULT_LOCK_MS,
        ack: Sequence[Message | tuple[int, uuid.UUID]] = (),
        listen: bool = True,
    ) -> DequeueResult:
        return self.broker.dequeue(
            conn, [self.name], limit=limit, lock_ms=lock_ms, ack=ack, listen=listen
        )

    def batch(self) -> Batch:
        """A batch whose ``channel(name)`` is a channel of this queue."""
        return Batch(self.schema, self.broker.max_message_bytes, default_queue=self.name)

    def purge(self, conn: Conn) -> int:
        """Delete the messages not held by a consumer; returns how many."""
        return run(require_sync(conn), purge_op(self.schema, self.name))

    def delete(self, conn: Conn) -> int:
        """Delete the queue: every message (held ones too), channel and policy."""
        return run(require_sync(conn), delete_queue_op(self.schema, self.name))

    def stats(self, conn: Conn, *, count_ready: bool = True) -> QueueStats:
        """Exact counters. Splitting waiting messages into ready and delayed counts them
        (cost grows with the backlog); pass ``count_ready=False`` to skip it."""
        return run(require_sync(conn), stats_op(self.schema, self.name, count_ready=count_ready))

    def size(self, conn: Conn) -> int:
        """Messages waiting (ready or delayed, not held by a consumer), from the counters."""
        return self.stats(conn, count_ready=False).waiting

    def channels(self, conn: Conn, *, limit: int = 20) -> list[ChannelStatus]:
        """The largest channels, with their policies and counters."""
        return run(require_sync(conn), channels_op(self.schema, self.name, limit=limit))

    def channel_status(self, conn: Conn, channel: str) -> ChannelStatus | None:
        """One channel's figures, as :meth:`channels` lists them (None: it never held a
        message and has no policy)."""
        found = run(
            require_sync(conn), channels_op(self.schema, self.name, limit=1, channel=channel)
        )
        return found[0] if found else None

    def purge_dead(self, conn: Conn) -> int:
        """Delete the queue's dead letters; returns how many."""
        return run(require_sync(conn), dead_purge_op(self.schema, self.name))

    def settings(self, conn: Conn) -> QueueSettings:
        """The queue's dead-letter settings (the defaults for a queue not created yet)."""
        found = run(require_sync(conn), settings_op(self.schema, self.name))
        return DEFAULT_SETTINGS if found is None else found

    def configure(
        self,
        conn: Conn,
        *,
        dead_letter: bool = UNSET,
        max_attempts: int | None = UNSET,
        dead_retention_ms: float = UNSET,
    ) -> None:
        """Change the queue's settings; those not given stay. ``dead_letter``: keep rejected
        and poison messages as dead letters (default True) or drop them; ``max_attempts``:
        deliveries before a message is dead-lettered (default 20; None: no limit);
        ``dead_retention_ms``: how long dead letters are kept (default 14 days)."""
        op = configure_op(
            self.schema,
            self.name,
            dead_letter=dead_letter,
            max_attempts=max_attempts,
            dead_retention_ms=dead_retention_ms,
        )
        run(require_sync(conn), op)


class Channel:
    """A channel (tenant sub-queue) of a queue. Costs nothing until used."""

    def __init__(self, queue: Queue, name: str) -> None:
        self.queue = queue
        self.name = _checks.name(name, "channel")

    def __repr__(self) -> str:
        return f"Channel({self.queue.name!r}, {self.name!r})"

    @property
    def message(self) -> ChannelMessages:
        q = self.queue
        return ChannelMessages(q.schema, q.name, self.name, q.broker.max_message_bytes)

    @property
    def policy(self) -> ChannelPolicy:
        q = self.queue
        return ChannelPolicy(q.schema, q.name, self.name)

    def info(self, conn: Conn) -> ChannelInfo:
        """The channel's policies and counters."""
        q = self.queue
        return run(require_sync(conn), channel_get_op(q.schema, q.name, self.name))
