"""The kombu channel of the transport: publishing, and consuming (fetch, deliver, settle).
Its declarations (exchanges, queues, bindings) are in :mod:`.topology`, its prefetch window
and held locks in :mod:`.qos`."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from queue import Empty
from typing import Any

from kombu.entity import TRANSIENT_DELIVERY_MODE
from kombu.utils.json import dumps, loads

from ..enqueue import current_connection
from ..exceptions import ChannelFull, LonnyMQError
from ..queue import Message as QueueMessage
from ..queue import Outcome
from ..queue._ops import Op, async_commit, run
from ..queue.dequeue import DequeueResult, dequeue_op
from ..queue.finalize import defer_op, delete_many_op, delete_op, reject_op
from ..queue.operate import settings_op
from ..queue.routing import publish_op
from . import events, rounds
from .acks import Held
from .headers import delay_ms, make_eta_aware, priority, str_or_none, ttl_ms
from .interfaces import Delivery, TransportLike, Where
from .qos import QoS
from .topology import TopologyChannel

logger = logging.getLogger("lonnymq.transport")


class Channel(TopologyChannel):
    """A kombu (AMQP-style) channel on lonnymq. Not to be confused with lonnymq's tenant
    channels, called *lanes* in this module."""

    QoS = QoS
    supports_fanout = True
    connection: TransportLike

    def __init__(self, connection: TransportLike, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: (kept: kombu sets ``self.connection`` to None when the channel closes, and Celery
        #: cancels its consumers after that when it restarts them on a lost connection)
        self._registry = connection.registry
        self._no_ack_queues: set[str] = set()
        #: its last fetch found nothing (the consumer sleeps on its queues, see .sleep)
        self.idle = False
        #: fetches in a row that brought messages
        self.busy_rounds = 0
        #: when its last fetch, which found nothing, said to look again (time.monotonic)
        self.retry_at: float | None = None

    @property
    def has_room(self) -> bool:
        """Its prefetch window can take one more message (hand-offs are welcome then)."""
        return self._qos is None or not self.qos._window_full()

    @property
    def acks_nothing(self) -> bool:
        """It consumes only without acks (Celery's pidbox, gossip, events, rpc replies)."""
        return set(self._active_queues) <= self._no_ack_queues

    # -- helpers -----------------------------------------------------------------------------

    def _consume(self, op: Op[Any], *, beside: bool = False) -> Any:
        """Run a dequeue, ack, reject or release: with ``consumer_commit="async"`` it does not
        wait for the WAL flush (losing it in a database crash only means a redelivery).
        ``beside``: on the side connection (see ``Transport.side_pg``)."""
        client = self.connection.side_pg if beside else self.connection.pg
        return client.run(self.connection.consumer_op(op))

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
            events.dead_lettered(ref[0], queue, lane, "rejected", attempts, kept=kept)
        if outcome is not Outcome.OK:
            logger.warning(
                "lonnymq: %s of message %d ignored: %s (its lock expired and it was "
                "delivered again, or it is gone)",
                why,
                ref[0],
                outcome.value,
            )

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
        make_eta_aware(headers)
        caller = current_connection()
        op = publish_op(
            self.options.schema,
            exchange,
            routing_key,
            dumps(message).encode(),
            channel=str_or_none(headers.get("x-channel"), "x-channel"),
            name=str_or_none(headers.get("x-dedup-name"), "x-dedup-name"),
            delay_ms=delay_ms(headers),
            priority=priority(props.get("priority")),
            ttl_ms=ttl_ms(headers, props),
            max_message_bytes=self.options.max_message_bytes,
            # (in the caller's transaction the lock would run from the create, not the commit)
            handoff=self.options.handoff and caller is None,
        )
        if caller is not None:
            # inside lonnymq.transaction(conn): in the caller's transaction, on its connection
            routed = run(caller, op)
        elif props.get("delivery_mode") == TRANSIENT_DELIVERY_MODE:
            # a transient message (Celery's rpc:// replies, events, pidbox broadcasts) does
            # not wait for the WAL flush: a database crash can lose the last of them, as a
            # RabbitMQ restart loses every transient message. Persistent ones (kombu's
            # default) are durable when the publish returns.
            routed = self._run(async_commit(op))
        elif self.options.publish_commit != "flush_first":
            # visible (and notified) at its commit, durable before the publish returns: the
            # fsync is not between the publish and its consumer (see publish_commit); with
            # "flush_after_wake" (the default) only when the publish woke one
            routed = self.connection.pg.run_flushed(
                op, only_if_woke=self.options.publish_commit == "flush_after_wake"
            )
        else:
            routed = self._run(op)
        if caller is None:  # never while the caller's transaction is open
            self.connection.sweep()
        lane = str(headers.get("x-channel") or routing_key)
        for queue, code, message_id in routed.results:
            if code == "created" and message_id is not None:
                events.enqueued(queue, lane or queue, message_id)
        if routed.dropped:
            for queue in routed.dropped:
                events.channel_full(queue, lane or queue)
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
            events.serve_metrics(self.options.metrics_port)
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        before = set(self._consumers)
        tag = super().basic_consume(queue, no_ack, *args, **kwargs)
        for started in self._consumers - before:  # who consumes, for every process to see
            self.connection.registry.consumed(self, started)
        self.connection._ensure_heartbeat()
        # the LISTEN session now, not at the first wait: a consumer that is handed its first
        # message before it ever slept (Celery's rpc:// client at its first get()) would
        # otherwise open it, and plan its first sleep, while its second message waits
        self.connection.waiter.listening()
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
        # (an auto_delete queue goes with its last consumer, of any process; a consumer of
        # a closed channel, whose connection may be gone, goes with the next sync)
        self._registry.cancelled(self, consumer_tag, sync=self.connection is not None)
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
        events.dequeued(
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
        events.dequeued(
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
            listen=False,  # a get does not sleep (consumers sleep on the LISTEN session)
        )
        started = time.perf_counter()
        result: DequeueResult = self._consume(op)
        events.dequeue_time(time.perf_counter() - started)
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

    def accept(self, result: DequeueResult) -> tuple[list[Delivery], int | None]:
        """Take charge of what a fetch dequeued: dead-lettered messages are reported, those
        of queues no longer consumed (cancelled while the fetch ran in the background)
        released at once, undecodable ones put aside, no-ack ones deleted, the others' locks
        held. Returns the messages to deliver (in delivery order) with their payloads, and
        retry_ms when the fetch found nothing (0: look again at once). The channel must be
        open; :func:`deliver` delivers."""
        self._report_dead(result)
        if not result.messages:
            self.idle, self.busy_rounds = True, 0
            self._retry_in(result.retry_ms)
            return [], result.retry_ms
        settled = self.idle and result.settled and self._asleep_on_all()
        timer, self.idle, self.retry_at = self.retry_at, False, None
        self.busy_rounds += 1
        # (one handed without a row is for a queue consumed without acks: one consumed with
        # acks by now is given back, created again, as one of a queue no longer consumed)
        messages = [
            m
            for m in result.messages
            if m.queue in self._active_queues and (m.stored or m.queue in self._no_ack_queues)
        ]
        if len(messages) < len(result.messages):
            kept = {id(m) for m in messages}
            gone = [m for m in result.messages if id(m) not in kept]
            with contextlib.suppress(LonnyMQError):  # else their locks expire: they come back
                rounds.give_back(self.connection, gone)
        batch = self._decodable(messages)
        if not batch:
            return [], 0  # all put aside or released: look again at once
        no_ack = [m for m, _ in batch if m.queue in self._no_ack_queues and m.stored]
        if no_ack:
            self._consume(
                delete_many_op(self.options.schema, [(m.id, m.lock_token) for m in no_ack])
            )
        for message, _ in batch:
            events.dequeued(
                message.id, message.queue, message.channel, message.attempts, message.lock_expired
            )
            if message.queue not in self._no_ack_queues:
                self.qos.hold(
                    self._tag(message),
                    (message.id, message.lock_token),
                    (message.queue, message.channel, message.attempts),
                )
        if settled and self._room_after(batch):
            # woken by a hint, it took all that waited: nothing else can be delivered now,
            # and a create from now on sends a NOTIFY (its keys are held and settled), so it
            # is asleep again, with no look owed (one cold round trip less per wake-up). Not
            # when this batch fills its prefetch window: a NOTIFY read while it is full
            # fetches nothing, and the ack that frees it wakes only channels awake.
            self._retry_in(result.retry_ms)
            if result.retry_ms is None:  # handed (no dequeue): the timer stays as it was
                self.retry_at = timer
            self.idle, self.busy_rounds = True, 0
        return batch, None

    def _retry_in(self, retry_ms: int | None) -> None:
        """Its timer: what a fetch said of when to look again (None: no timer)."""
        self.retry_at = None if retry_ms is None else time.monotonic() + retry_ms / 1000

    def _room_after(self, batch: list[Delivery]) -> bool:
        """Whether the prefetch window has room left once ``batch`` is delivered (no-ack
        deliveries take none)."""
        free = self.qos.can_consume_max_estimate()
        if free is None:
            return True
        return free - sum(1 for m, _ in batch if m.queue not in self._no_ack_queues) > 0

    def _asleep_on_all(self) -> bool:
        """The transport holds the ``sleep`` keys of all this channel's queues, settled (no
        producer transaction of theirs was open when they were taken)."""
        sleep = self.connection.sleep
        queues = set(self._active_queues)
        return sleep.held.issuperset(queues) and not sleep.unsettled & queues

    def unhold(self, messages: list[QueueMessage]) -> None:
        """Give back accepted messages that were not delivered (their locks released)."""
        rest = [m for m in messages if m.queue not in self._no_ack_queues]
        for m in rest:
            self.qos._release(self._tag(m))
        with contextlib.suppress(LonnyMQError):  # else their locks expire: they come back
            self.connection.release((m.id, m.lock_token) for m in rest)

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
        if not message.stored:  # (created again: a dequeue then puts its row aside)
            rounds.give_back(self.connection, [message])
            return
        schema = self.options.schema
        if self._keeps_dead_letters(message.queue):
            op = reject_op(schema, message.id, message.lock_token, reason="undecodable")
            if self._run(op) is Outcome.OK:
                events.dead_lettered(
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
            events.dead_lettered(
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
