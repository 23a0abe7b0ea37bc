"""The kombu Transport on lonnymq (its spec is the docstring of :mod:`lonnymq.transport`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterable
from queue import Empty
from typing import Any, TypeVar

import psycopg
from amqp.protocol import queue_declare_ok_t
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.utils.json import dumps, loads

from ..enqueue import current_connection
from ..exceptions import ChannelFull, ConfigurationError, ConnectionLost, LonnyMQError
from ..migrator import wake_channel
from ..queue import Broker, Outcome
from ..queue import Message as QueueMessage
from ..queue._ops import Op, async_commit, run
from ..queue.admin import delete_queue_op, purge_op, stats_op
from ..queue.dequeue import DequeueResult, dequeue_op
from ..queue.finalize import defer_op, delete_op
from ..queue.operate import configure_op, reject_op, settings_op
from ..queue.policy import queue_get_op, queue_set_op
from ..queue.routing import (
    all_bindings_op,
    bind_op,
    bindings_op,
    delete_many_op,
    exchange_declare_op,
    exchange_delete_op,
    exchange_type_op,
    publish_op,
    queue_declare_op,
    queue_exists_op,
    topic_pattern,
    unbind_op,
)
from . import events as _events
from . import headers as _headers
from . import url as _url
from .acks import Ack, AckBuffer
from .connection import PgClient, Waiter
from .heartbeat import Heartbeat
from .loop import LoopConsumer
from .options import Options
from .sweep import Sweeper, sweeper_for

logger = logging.getLogger("lonnymq.transport")
_APPLIED: set[tuple[int, str, str, str]] = set()
_APPLIED_LOCK = threading.Lock()

Held = tuple[int, uuid.UUID]
#: where a delivered message came from: (queue, channel, attempts)
Where = tuple[str, str, int]
T = TypeVar("T")


class QoS(virtual.QoS):
    """Prefetch accounting plus the lock of every delivered, unacked message: ack deletes the
    row, reject with requeue (and restore at shutdown) unlocks it, reject without requeue
    moves it to the dead letters. Acks may come from any thread."""

    def __init__(self, channel: Channel, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        self._held: dict[str, Held] = {}
        self._where: dict[str, Where] = {}
        self._held_lock = threading.Lock()
        self._refill_since: float | None = None

    def hold(self, delivery_tag: str, ref: Held, where: Where | None = None) -> None:
        with self._held_lock:
            self._held[delivery_tag] = ref
            if where is not None:
                self._where[delivery_tag] = where

    def held(self) -> list[Held]:
        with self._held_lock:
            return list(self._held.values())

    def _release(self, delivery_tag: str) -> Held | None:
        with self._held_lock:
            self._where.pop(delivery_tag, None)
            return self._held.pop(delivery_tag, None)

    def _release_where(self, delivery_tag: str) -> tuple[Held | None, Where | None]:
        with self._held_lock:
            return self._held.pop(delivery_tag, None), self._where.pop(delivery_tag, None)

    def _window_full(self) -> bool:
        return bool(self.prefetch_count) and not self.can_consume()

    def refill_wait(self) -> float:
        """Seconds the consumer should still wait before fetching (0: fetch now). A consumer
        that holds less than half its prefetch window, or nothing, fetches at once. One that
        holds more waits up to ``refill_delay`` for more of it to come free, so that a window
        of 16 is refilled a few slots per dequeue instead of one (each dequeue is a round
        trip and a transaction); it still holds half a window of work meanwhile."""
        if not self.prefetch_count:
            return 0.0
        free = self.can_consume_max_estimate() or 0
        if free >= (self.prefetch_count + 1) // 2:
            self._refill_since = None
            return 0.0
        now = time.monotonic()
        if self._refill_since is None:
            self._refill_since = now
        left = self.channel.options.refill_delay - (now - self._refill_since)
        if left <= 0:
            self._refill_since = None
            return 0.0
        return left

    def ack(self, delivery_tag: str) -> None:
        self._settle(delivery_tag, requeue=False, why="ack")

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self._settle(delivery_tag, requeue=requeue, why="reject")

    def _settle(self, delivery_tag: str, *, requeue: bool, why: str) -> None:
        """Delete or release the row, and free the prefetch slot even if that fails (the
        message then comes back when its lock expires). A delete may be handed to the
        thread draining events, which sends it with its next dequeue (see :mod:`.acks`)."""
        ref, where = self._release_where(delivery_tag)
        full = self._window_full()
        transport = self.channel.connection
        if ref is not None:
            queue, lane, _ = where if where is not None else (None, None, None)
            if why == "ack":
                _events.acked(ref[0], queue, lane)
            elif requeue:
                _events.deferred(ref[0], queue, lane, why)
        if ref is not None and why == "ack":
            ack = transport.acks.offer(ref)
            if ack is not None:
                self._quick_ack(delivery_tag)
                if ack.sent is None:
                    if transport.in_event_loop:
                        transport.wake()  # the loop's own: goes with its next look, now
                    return  # the drainer's own: goes with its next round trip
                transport.wake()
                if transport.acks.wait(ack):
                    return
                # not taken in time, or its send failed: send it here
                self.channel._finalize(ref, requeue=False, why=why, beside=True)
                return
        try:
            if ref is not None:
                beside = transport.acks.beside_drainer()
                self.channel._finalize(ref, requeue=requeue, why=why, where=where, beside=beside)
        finally:
            self._quick_ack(delivery_tag)
            if full:
                transport.wake()  # the consumer may fetch again

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Unlock every held message (same rows, no copies), e.g. at shutdown."""
        self._flush()
        self.channel.connection.send_acks(self.channel.connection.acks.take())
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
            self._where = {}
        self._delivered.clear()
        if held:
            try:
                self.channel.connection.release(held)
            except LonnyMQError as exc:
                # Not lost: the locks expire after visibility_timeout and they come back.
                logger.warning(
                    "lonnymq: could not release %d unacked message(s) (%s); they will be "
                    "redelivered when their lock expires",
                    len(held),
                    exc,
                )
        return []


class Channel(virtual.Channel):
    """A kombu (AMQP-style) channel on lonnymq. Not to be confused with lonnymq's tenant
    channels, called *lanes* in this module."""

    QoS = QoS
    supports_fanout = True
    connection: Transport

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._no_ack_queues: set[str] = set()

    # -- helpers -----------------------------------------------------------------------------

    @property
    def options(self) -> Options:
        return self.connection.options

    def _run(self, op: Op[Any]) -> Any:
        return self.connection.pg.run(op)

    def _consume(self, op: Op[Any], *, beside: bool = False) -> Any:
        """Run a dequeue, ack, reject or release: with ``consumer_commit="async"`` it does not
        wait for the WAL flush (losing it in a database crash only means a redelivery).
        ``beside``: on the side connection (see ``Transport.side_pg``)."""
        client = self.connection.side_pg if beside else self.connection.pg
        return client.run(self.connection.consumer_op(op))

    def _exchange_type(self, exchange: str) -> str:
        cache = self.connection.exchange_types
        if exchange not in cache:
            found = self._run(exchange_type_op(self.options.schema, exchange))
            if found is None:
                return "direct"
            cache[exchange] = found
        return cache[exchange]

    def _finalize(
        self,
        ref: Held,
        *,
        requeue: bool,
        why: str,
        where: Where | None = None,
        beside: bool = False,
    ) -> None:
        """Ack (delete), requeue (defer in place) or, for a reject without requeue, move the
        message to the dead letters. ``beside``: sent by another thread while the consumer
        drains (a Celery pool thread), on a connection of its own, so that the consumer's
        next fetch does not wait for this round trip."""
        schema = self.options.schema
        if requeue:
            op = defer_op(schema, ref[0], ref[1], delay_ms=None)
        elif why == "ack":
            op = delete_op(schema, ref[0], ref[1])
        else:
            op = reject_op(schema, ref[0], ref[1], reason="rejected")
        outcome = self._consume(op, beside=beside)
        if outcome is Outcome.OK and not requeue and why != "ack":
            queue, lane, attempts = where if where is not None else (None, None, None)
            kept = queue is None or self._keeps_dead_letters(queue)
            _events.dead_lettered(ref[0], queue, lane, "rejected", attempts, kept=kept)
        if outcome is not Outcome.OK:
            logger.warning(
                "lonnymq: %s of message %d ignored: %s (its lock expired and it was "
                "delivered again, or it is gone)",
                why,
                ref[0],
                outcome.value,
            )

    # -- exchanges, queues, bindings -----------------------------------------------------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        type = type or "direct"
        exchange = exchange or f"amq.{type}"
        if passive:
            if self._run(exchange_type_op(self.options.schema, exchange)) is None:
                raise ChannelError(
                    f"NOT_FOUND - no exchange {exchange!r}",
                    (50, 10),
                    "Channel.exchange_declare",
                    "404",
                )
            return
        self._run(
            exchange_declare_op(
                self.options.schema, exchange, type, durable=durable, auto_delete=auto_delete
            )
        )
        self.connection.exchange_types[exchange] = type

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self._run(exchange_delete_op(self.options.schema, exchange))
        self.connection.exchange_types.pop(exchange, None)

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        queue = queue or f"amq.gen-{uuid.uuid4()}"
        if passive:
            if not self._run(queue_exists_op(self.options.schema, queue)):
                raise ChannelError(
                    f"NOT_FOUND - no queue {queue!r}", (50, 10), "Channel.queue_declare", "404"
                )
            waiting = self._size(queue)
        else:
            waiting = self._declare(queue, _headers.queue_arguments(kwargs.get("arguments") or {}))
        return queue_declare_ok_t(queue, waiting, 0)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """kombu's ``Queue(expires=, message_ttl=, max_length=, max_length_bytes=,
        max_priority=)`` as the ``x-`` arguments of amqp (seconds become milliseconds), as
        kombu's amqp and redis transports map them; ``queue_declare`` then takes both
        spellings alike (see ``_headers.queue_arguments``)."""
        return to_rabbitmq_queue_arguments(arguments or {}, **kwargs)

    def _declare(self, queue: str, arguments: _headers.QueueArguments) -> int:
        """Declare ``queue`` with its arguments; ``x-max-length`` sets the queue's default
        ``max_size`` (in the same transaction; only when it differs, so that a role without
        policy rights may redeclare). Returns the messages waiting."""
        schema = self.options.schema
        op = queue_declare_op(
            schema, queue, expires_ms=arguments.expires_ms, message_ttl_ms=arguments.message_ttl_ms
        )
        if arguments.max_length is None:
            waiting, _ = self._run(op)
        else:
            with self.connection.pg.locked() as conn, conn.transaction():
                waiting, _ = run(conn, op)
                default = run(conn, queue_get_op(schema, queue))
                if default.max_size != arguments.max_length:
                    run(
                        conn,
                        queue_set_op(schema, queue, default.max_concurrency, arguments.max_length),
                    )
        self.connection.queue_expires[queue] = arguments.expires_ms
        return int(waiting)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        kind = self._exchange_type(exchange)
        pattern = topic_pattern(routing_key or "") if kind == "topic" else None
        self._run(bind_op(self.options.schema, exchange, routing_key or "", queue, pattern))

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        self._run(unbind_op(self.options.schema, exchange or "amq.direct", routing_key, queue))

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int | None:
        if if_empty and self._size(queue):
            return None
        return int(self._run(delete_queue_op(self.options.schema, queue)))

    def queue_purge(self, queue: str, **kwargs: Any) -> int:
        return int(self._run(purge_op(self.options.schema, queue)))

    def _purge(self, queue: str) -> int:
        return self.queue_purge(queue)

    def _size(self, queue: str) -> int:
        stats = self._run(stats_op(self.options.schema, queue, count_ready=False))
        return int(stats.waiting)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._run(delete_queue_op(self.options.schema, queue))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self._run(queue_exists_op(self.options.schema, queue)))

    def get_table(self, exchange: str) -> list[tuple[str, str | None, str]]:
        rows = self._run(bindings_op(self.options.schema, exchange))
        return [(rkey, pattern, queue) for _, rkey, queue, pattern in rows]

    def list_bindings(self) -> Iterable[tuple[str, str, str]]:
        return iter(self._run(all_bindings_op(self.options.schema)))

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        return self.exchange_types[self._exchange_type(exchange) or default]

    # -- publish ----------------------------------------------------------------------------

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kw: Any
    ) -> None:
        self._inplace_augment_message(message, exchange, routing_key)
        self._publish(message, exchange or "", routing_key or "")

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self._publish(message, "", queue)

    def _publish(self, message: dict[str, Any], exchange: str, routing_key: str) -> None:
        headers = message.get("headers") or {}
        props = message.get("properties") or {}
        _headers.make_eta_aware(headers)
        op = publish_op(
            self.options.schema,
            exchange,
            routing_key,
            dumps(message).encode(),
            channel=_headers.str_or_none(headers.get("x-channel"), "x-channel"),
            name=_headers.str_or_none(headers.get("x-dedup-name"), "x-dedup-name"),
            delay_ms=_headers.delay_ms(headers),
            priority=_headers.priority(props.get("priority")),
            ttl_ms=_headers.expiration_ms(props.get("expiration")),
            max_message_bytes=self.options.max_message_bytes,
        )
        caller = current_connection()
        # inside lonnymq.transaction(conn): in the caller's transaction, on its connection
        routed = self._run(op) if caller is None else run(caller, op)
        if caller is None:  # never while the caller's transaction is open
            self.connection.sweep()
        lane = str(headers.get("x-channel") or routing_key)
        for queue, code, message_id in routed.results:
            if code == "created" and message_id is not None:
                _events.enqueued(queue, lane or queue, message_id)
        if routed.dropped:
            for queue in routed.dropped:
                _events.channel_full(queue, lane or queue)
            raise ChannelFull(routed.dropped[0], lane or routed.dropped[0])
        if not routed.queues:
            # as on RabbitMQ, unroutable messages are dropped. Broadcasts nobody listens to
            # (Celery's pidbox on a fanout exchange, its events on a topic exchange) are
            # normal; a direct exchange with no matching queue is usually a mistake.
            direct = self._exchange_type(exchange) == "direct"
            logger.log(
                logging.WARNING if direct else logging.DEBUG,
                "lonnymq: message to exchange %r with routing key %r matched no queue and "
                "was dropped (declare and bind the queue first)",
                exchange,
                routing_key,
            )

    # -- consume ----------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if self.options.metrics_port is not None:
            # served by the process that consumes (a Celery worker's main process), not by
            # every process that publishes (its pool processes)
            _events.serve_metrics(self.options.metrics_port)
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        tag = super().basic_consume(queue, no_ack, *args, **kwargs)
        self.connection.wake()  # in an event loop: look at once
        return tag

    def basic_qos(self, *args: Any, **kwargs: Any) -> Any:
        result = super().basic_qos(*args, **kwargs)
        self.connection.wake()  # the prefetch window may have grown
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack_queues.discard(queue)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        result = self._dequeue([queue], 1)
        if not result.messages:
            return None
        message = result.messages[0]
        payload = self._payload(message)
        if no_ack:
            self._consume(delete_many_op(self.options.schema, [(message.id, message.lock_token)]))
            return self.Message(payload, channel=self)
        tag = payload["properties"]["delivery_tag"]
        _events.dequeued(
            message.id, message.queue, message.channel, message.attempts, message.lock_expired
        )
        self.qos.hold(
            tag,
            (message.id, message.lock_token),
            (message.queue, message.channel, message.attempts),
        )
        msg = self.Message(payload, channel=self)
        self.qos.append(msg, tag)
        return msg

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        result = self._dequeue([queue], 1)
        if not result.messages:
            raise Empty()
        message = result.messages[0]
        _events.dequeued(
            message.id, message.queue, message.channel, message.attempts, message.lock_expired
        )
        self.qos.hold(
            self._tag(message),
            (message.id, message.lock_token),
            (message.queue, message.channel, message.attempts),
        )
        return self._payload(message)

    def _dequeue(self, queues: list[str], limit: int) -> DequeueResult:
        op = dequeue_op(
            self.options.schema,
            queues,
            limit=limit,
            lock_ms=self.options.lock_ms,
            listen=self.options.use_listen,
        )
        started = time.perf_counter()
        result: DequeueResult = self._consume(op)
        _events.dequeue_time(time.perf_counter() - started)
        self._report_dead(result)
        return result

    @staticmethod
    def _tag(message: QueueMessage) -> str:
        return f"{message.id}:{message.lock_token.hex}"

    def _payload(self, message: QueueMessage) -> dict[str, Any]:
        payload: dict[str, Any] = loads(message.content)
        props = payload.setdefault("properties", {})
        props["delivery_tag"] = self._tag(message)
        info = props.setdefault("delivery_info", {})
        info["redelivered"] = message.attempts > 1
        info["lonnymq"] = {
            "id": message.id,
            "channel": message.channel,
            "attempts": message.attempts,
        }
        payload["redelivered"] = message.attempts > 1
        return payload

    def fetch(self) -> tuple[int, int | None]:
        """Dequeue up to the free prefetch window across the consumed queues and deliver.
        Returns (messages delivered, retry_ms when nothing was available)."""
        plan = self.fetch_plan()
        if plan is None:
            return 0, None
        if isinstance(plan, int):
            return 0, plan
        queues, limit = plan
        return self.take(self.connection.ack_and_dequeue(queues, limit))

    def fetch_plan(self) -> tuple[list[str], int] | int | None:
        """What a fetch now would ask for: (queues, limit); or the ms to wait first (a
        refill wait, see ``QoS.refill_wait``); None when there is nothing to fetch for."""
        if self.closed or not self._consumers or not self.qos.can_consume():
            return None
        wait = self.qos.refill_wait()
        if wait > 0:
            return math.ceil(wait * 1000)
        free = self.qos.can_consume_max_estimate()
        limit = min(free or self.options.batch_size, self.options.batch_size)
        return list(dict.fromkeys(self._active_queues)), limit

    def take(self, result: DequeueResult) -> tuple[int, int | None]:
        """Deliver what a fetch dequeued. Returns (messages delivered, retry_ms when nothing
        was available). Messages of queues no longer consumed (cancelled while the fetch ran
        in the background) are released at once. The channel must be open."""
        self._report_dead(result)
        if not result.messages:
            return 0, result.retry_ms
        messages = [m for m in result.messages if m.queue in self._active_queues]
        if len(messages) < len(result.messages):
            gone = [m for m in result.messages if m.queue not in self._active_queues]
            with contextlib.suppress(LonnyMQError):  # else their locks expire: they come back
                self.connection.release((m.id, m.lock_token) for m in gone)
        batch = self._decodable(messages)
        if not batch:
            return 0, 0  # all put aside or released: look again at once
        no_ack = [m for m, _ in batch if m.queue in self._no_ack_queues]
        if no_ack:
            self._consume(
                delete_many_op(self.options.schema, [(m.id, m.lock_token) for m in no_ack])
            )
        for message, _ in batch:
            _events.dequeued(
                message.id, message.queue, message.channel, message.attempts, message.lock_expired
            )
            if message.queue not in self._no_ack_queues:
                self.qos.hold(
                    self._tag(message),
                    (message.id, message.lock_token),
                    (message.queue, message.channel, message.attempts),
                )
        delivered = 0
        acks = self.connection.acks
        acks.delivering(True)
        try:
            for message, payload in batch:
                delivered += 1
                self.connection._deliver(payload, message.queue)
        except BaseException:
            rest = [m for m, _ in batch[delivered:] if m.queue not in self._no_ack_queues]
            for m in rest:
                self.qos._release(self._tag(m))
            with contextlib.suppress(LonnyMQError):  # else their locks expire: they come back
                self.connection.release((m.id, m.lock_token) for m in rest)
            raise
        finally:
            acks.delivering(False)
        return delivered, None

    def _decodable(self, messages: list[QueueMessage]) -> list[tuple[QueueMessage, dict[str, Any]]]:
        """The messages with their kombu payloads. One that is not a kombu payload (written by
        something else) is logged and moved to the dead letters (reason ``undecodable``)
        instead of failing the consumer on every redelivery: it is kept for a person to look
        at (``lonnymq messages show ID``). Where the queue keeps no dead letters, it is put
        aside for an hour instead."""
        out = []
        for message in messages:
            try:
                out.append((message, self._payload(message)))
            except (ValueError, TypeError, AttributeError) as exc:
                logger.error(
                    "lonnymq: message %d in queue %r is not a kombu message (%s)",
                    message.id,
                    message.queue,
                    exc,
                )
                with contextlib.suppress(LonnyMQError):
                    self._put_aside(message)
        return out

    def _put_aside(self, message: QueueMessage) -> None:
        schema = self.options.schema
        if self._keeps_dead_letters(message.queue):
            op = reject_op(schema, message.id, message.lock_token, reason="undecodable")
            if self._run(op) is Outcome.OK:
                _events.dead_lettered(
                    message.id, message.queue, message.channel, "undecodable", message.attempts
                )
            return
        self._run(defer_op(schema, message.id, message.lock_token, delay_ms=3_600_000))

    def _keeps_dead_letters(self, queue: str) -> bool:
        try:
            found = self._run(settings_op(self.options.schema, queue))
            return found is None or bool(found.dead_letter)
        except LonnyMQError:
            return True

    def _report_dead(self, result: DequeueResult) -> None:
        for dead in result.dead:
            _events.dead_lettered(
                dead.id,
                dead.queue,
                dead.channel,
                "max_attempts",
                dead.attempts,
                kept=self._keeps_dead_letters(dead.queue),
            )

    def _restore(self, message: Any) -> None:
        ref = self.qos._release(message.delivery_tag)
        if ref is not None:
            self._finalize(ref, requeue=True, why="restore")

    def _restore_at_beginning(self, message: Any) -> None:
        self._restore(message)

    def basic_recover(self, requeue: bool = False) -> Any:
        if requeue:
            return self.qos.restore_unacked()
        raise NotImplementedError("lonnymq does not support recover(requeue=False)")


class Transport(virtual.Transport):
    """Kombu transport on lonnymq (see the module docstring)."""

    Channel = Channel
    can_parse_url = True
    default_port = 5432  # type: ignore[assignment]
    driver_type = "lonnymq"
    driver_name = "lonnymq"
    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )
    connection_errors = (ConnectionLost, psycopg.OperationalError, OSError)  # type: ignore[assignment]
    channel_errors = (LonnyMQError, psycopg.Error, ChannelError)  # type: ignore[assignment]
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        _url.check_alternates(list(getattr(client, "alt", None) or []))
        _adopt_url(client)
        self.options = Options.from_mapping(
            dict(client.transport_options or {}), _client_connect_timeout(client)
        )
        self.polling_interval = self.options.polling_interval
        self.conninfo = _client_conninfo(client)
        self.pg = PgClient(
            self.conninfo,
            schema=self.options.schema,
            connect_timeout=self.options.connect_timeout,
            auto_install=self.options.auto_install,
        )
        self.exchange_types: dict[str, str] = {}
        #: x-expires (ms) of the queues this process declared: how often consumers touch them
        self.queue_expires: dict[str, int | None] = {}
        self._waiter: Waiter | None = None
        self._heartbeat: Heartbeat | None = None
        self._said_polling = False
        self._policies_applied = False
        self.acks = AckBuffer()
        self._side_pg: PgClient | None = None
        if not self.options.event_loop:  # Celery then drives the consumer by drain_events
            self.implements = type(self).implements.extend(asynchronous=False)
        self._looper: LoopConsumer | None = None  # while registered with an event loop

    @property
    def side_pg(self) -> PgClient:
        """A second command connection, opened on first use: for the acks that threads other
        than the consumer's send themselves while the consumer drains (see :mod:`.acks`)."""
        if self._side_pg is None:
            self._side_pg = PgClient(
                self.conninfo,
                schema=self.options.schema,
                connect_timeout=self.options.connect_timeout,
                auto_install=self.options.auto_install,
            )
        return self._side_pg

    def consumer_op(self, op: Op[T]) -> Op[T]:
        return async_commit(op) if self.options.consumer_commit == "async" else op

    def ack_and_dequeue(self, queues: list[str], limit: int) -> DequeueResult:
        """Delete the buffered acks and dequeue, in one statement. When that fails, the acks
        go back to the buffer (or to the threads that made them)."""
        acks = self.acks.take()
        op = dequeue_op(
            self.options.schema,
            queues,
            limit=limit,
            lock_ms=self.options.lock_ms,
            ack=[ack.ref for ack in acks],
            listen=self.options.use_listen,
        )
        started = time.perf_counter()
        result = self._carrying(acks, op)
        _events.dequeue_time(time.perf_counter() - started)
        self._log_acks(result.acked)
        return result

    def release(self, held: Iterable[Held]) -> None:
        """Unlock held messages (the same rows, back in their place): the unacked ones when
        a channel closes, or ones dequeued and never delivered; else they come back only when
        their lock expires. Works when their kombu channel is already closed."""
        schema = self.options.schema
        for ref in held:
            self.pg.run(self.consumer_op(defer_op(schema, ref[0], ref[1], delay_ms=None)))

    def send_acks(self, acks: list[Ack]) -> None:
        """Delete the buffered ``acks``. When that fails, they go back to the buffer (or to
        the threads that made them)."""
        if acks:
            op = delete_many_op(self.options.schema, [ack.ref for ack in acks])
            self._log_acks(self._carrying(acks, op))

    def _carrying(self, acks: list[Ack], op: Op[T]) -> T:
        """Run ``op``, which carries ``acks``: tell their threads once it is done, or put
        them back for the next round trip when it fails."""
        try:
            result = self.pg.run(self.consumer_op(op))
        except BaseException:
            self.acks.put_back(acks)
            raise
        self.acks.done(acks)
        return result

    @staticmethod
    def _log_acks(outcomes: dict[int, Outcome]) -> None:
        for message_id, outcome in outcomes.items():
            if outcome is not Outcome.OK:
                logger.warning(
                    "lonnymq: ack of message %d ignored: %s (its lock expired and it was "
                    "delivered again, or it is gone)",
                    message_id,
                    outcome.value,
                )

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """The URL to show (``kombu.Connection.as_uri()``, logs, Celery's banner): the
        password masked unless asked for, from the URL or from the Connection's fields."""
        client = self.client
        password = getattr(client, "password", None)
        if uri and "://" in uri:
            if callable(password):
                password = None
            return _url.as_uri(uri, include_password, mask, password=password)
        if client is None:
            raise NotImplementedError  # kombu then shows the hostname
        return _url.from_client(client, include_password, mask)

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def establish_connection(self) -> Any:
        self.pg.connection()
        if self.options.policies and not self._policies_applied:
            # once per process and database: Celery opens several connections
            key = (os.getpid(), self.conninfo, self.options.schema, repr(self.options.policies))
            with _APPLIED_LOCK:
                if key not in _APPLIED:
                    self._apply_policies(self.options.policies)
                    _APPLIED.add(key)
            self._policies_applied = True
        return super().establish_connection()

    def _apply_policies(self, policies: dict[str, Any]) -> None:
        """Apply the policies and queue settings declared in the transport options, in one
        transaction."""
        schema = self.options.schema
        batch = Broker(schema).batch()
        for queue, spec in policies.items():
            if "default" in spec:
                batch.queue(queue).policy.set(**spec["default"])
            for channel, limits in spec.get("channels", {}).items():
                batch.queue(queue).channel(channel).policy.set(**limits)
        with self.pg.locked() as conn, conn.transaction():
            batch.execute(conn)
            for queue, spec in policies.items():
                if "settings" in spec:
                    run(conn, configure_op(schema, queue, **spec["settings"]))
        logger.info("lonnymq: applied the channel policies of %d queue(s)", len(policies))

    def close_connection(self, connection: Any) -> None:
        try:
            self._leave_loop()
            super().close_connection(connection)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stopped.set()
                self._heartbeat = None
            if self._waiter is not None:
                self._waiter.dispose()
                self._waiter = None
            if self._side_pg is not None:
                self._side_pg.close()
                self._side_pg = None
            self.pg.close()

    @property
    def sweeper(self) -> Sweeper:
        return sweeper_for(self.conninfo, self.options.schema, self.options.expire_interval)

    def sweep(self, *, background: bool = False) -> None:
        """Sweep what expired in the schema when this process is due to (every
        ``expire_interval``; see :mod:`.sweep`): from a consumer's background thread, or from a
        producer on its way back from a publish (then at most 1,000 messages, and at most
        0.2 s of waiting for locks)."""
        sweeper = self.sweeper
        if not sweeper.due():
            return
        limit, lock_ms = (10_000, 1000) if background else (1_000, 200)
        with contextlib.suppress(LonnyMQError), self.pg.locked() as conn:
            sweeper.sweep(conn, limit=limit, lock_timeout_ms=lock_ms)

    def touch_seconds(self) -> float:
        """How often a consumer marks the queues it consumes used, so that no sweep takes a
        queue with a live consumer for unused: every 5 s, or often enough for the shortest
        ``x-expires`` among them that this process declared (a touch writes only when the
        last one is a second old, so a queue is at most 1 s + this interval unused: half of
        what its x-expires leaves beyond that second, at least 0.25 s; enough for an
        x-expires of 1.5 s or more)."""
        active: set[str] = set()
        for channel in list(self.channels):
            active.update(channel._active_queues)
        known = [self.queue_expires.get(q) for q in active]
        shortest = min((ms for ms in known if ms), default=None)
        if shortest is None:
            return 5.0
        return min(5.0, max(0.25, (shortest - 1000) / 2000))

    def _ensure_heartbeat(self) -> None:
        beat = self._heartbeat
        if beat is None or not beat.is_alive() or beat.pid != os.getpid():
            self._heartbeat = Heartbeat(self)
            self._heartbeat.start()

    @property
    def waiter(self) -> Waiter:
        if self._waiter is None:
            self._waiter = Waiter(
                self.conninfo,
                wake_channel(self.options.schema),
                self.options.connect_timeout,
                listen=self.options.use_listen,
            )
        return self._waiter

    def wake(self) -> None:
        """End the consumer's wait now (an ack freed room in a full prefetch window, or wants
        sending with the next fetch)."""
        looper = self._looper
        if looper is not None:
            looper.want()
        if self._waiter is not None:
            self._waiter.wake()

    def _wait(self, seconds: float, queues: set[str]) -> None:
        if not self.options.use_listen and not self._said_polling:
            self._said_polling = True
            logger.info(
                "lonnymq: use_listen is off: idle consumers poll every %s s",
                self.options.polling_interval,
            )
        self.waiter.wait(seconds, queues)

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        if not self.acks.begin():  # another thread drains: no ack buffering for this one
            return self._drain(timeout, owner=False)
        try:
            return self._drain(timeout, owner=True)
        finally:
            self.send_acks(self.acks.end())

    def _drain(self, timeout: float | None, *, owner: bool) -> None:
        """Fetch and deliver; wait (LISTEN, timers) while there is nothing. The owner of the
        ack buffer keeps fetching (each dequeue carrying the acks of the messages delivered
        before it) while deliveries keep coming, up to ``batch_size`` messages or 50 ms."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        total = 0
        while True:
            delivered = 0
            retry_ms: int | None = None
            queues: set[str] = set()
            for channel in list(self.channels):
                if channel._consumers:
                    self._ensure_heartbeat()
                    queues.update(channel._active_queues)
                got, retry = channel.fetch()
                delivered += got
                if retry is not None:
                    retry_ms = retry if retry_ms is None else min(retry_ms, retry)
            if delivered:
                total += delivered
                if owner and total < self.options.batch_size and time.monotonic() - started < 0.05:
                    continue
                return
            if total:
                return
            if owner and self.acks.pending():
                self.send_acks(self.acks.take())
                continue  # acks free prefetch room: look again before sleeping
            wait = self.options.polling_interval
            if retry_ms is not None:
                wait = min(wait, retry_ms / 1000 + 0.001)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError()
                wait = min(wait, left)
            self._wait(wait, queues)

    # -- Celery's event loop (see .loop) -------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        if not self.implements.asynchronous:
            return
        if self._looper is not None and self._looper.loop is loop:
            return
        self._leave_loop()
        self._looper = LoopConsumer(self, loop)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self._leave_loop()

    @property
    def in_event_loop(self) -> bool:
        return self._looper is not None

    def _leave_loop(self) -> None:
        looper, self._looper = self._looper, None
        if looper is not None:
            looper.close()


def _adopt_url(client: Any) -> None:
    """Fill the kombu Connection's fields from its URL (kombu leaves the whole URL in
    ``hostname``, since the transport parses its own URLs): ``hostname``, ``port``, ``userid``,
    ``password``, ``virtual_host`` (the database) and ``connect_timeout``, as kombu does for
    amqp and redis, so ``Connection.info()`` (Celery's ``inspect stats``, Flower) shows them, and
    never the password. A URL with more than those (libpq parameters, several hosts) stays in
    ``hostname``, without its password, so that ``Connection.clone()`` keeps it whole."""
    hostname = client.hostname
    if not isinstance(hostname, str) or "://" not in hostname:
        return
    fields = _url.split(hostname)
    client.hostname = fields.hostname
    client.port = fields.port or client.port
    client.userid = fields.userid or client.userid
    client.password = fields.password or client.password
    if fields.virtual_host:
        client.virtual_host = fields.virtual_host
    if fields.connect_timeout is not None:
        client.connect_timeout = fields.connect_timeout


def _client_connect_timeout(client: Any) -> float | None:
    """kombu's ``connect_timeout``, a number even when kombu took it, as text, from a URL it
    parsed (an alternate it failed over to): then it is made a number for kombu too."""
    value = getattr(client, "connect_timeout", None)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigurationError(
                f"invalid connect_timeout {value!r} in the broker URL: expected seconds"
            ) from None
        client.connect_timeout = value
    return value


def _client_conninfo(client: Any) -> str:
    hostname = client.hostname or "localhost"
    if "://" in hostname:
        password = client.password() if callable(client.password) else client.password
        return _url.with_password(_url.to_conninfo(hostname), password)
    vhost = client.virtual_host
    return _url.from_fields(
        hostname,
        client.port,
        client.userid,
        client.password() if callable(client.password) else client.password,
        None if vhost in (None, "", "/") else vhost,
    )
