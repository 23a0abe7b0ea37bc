"""A consumer's rounds: which kombu channels to fetch for, the fetches, and the delivery of
what they brought, for ``drain_events`` (:mod:`.transport`) and Celery's event loop
(:mod:`.loop`) alike."""

from __future__ import annotations

import heapq
import logging
import time

from ..exceptions import LonnyMQError
from ..queue.dequeue import DequeueResult, Message
from ..queue.finalize import heartbeat_op
from ..queue.routing import publish_op
from .handoff import Handoffs, Unstored
from .interfaces import ChannelLike, Delivery, Job, TransportLike
from .sleep import Wanted, sooner

logger = logging.getLogger("lonnymq.transport")
#: what a round of fetches brought: each kombu channel with its dequeue's result
Fetched = list[tuple[ChannelLike, DequeueResult]]


def fetch_jobs(transport: TransportLike, wanted: Wanted) -> tuple[list[Job], int | None]:
    """The fetches to run now, one per consuming kombu channel that ``wanted`` names
    and that has room (a channel asleep on its queues is left alone until a NOTIFY for
    them, its timer or the fallback poll): those that ack first, then those that consume
    without acks (control, events, replies), so that a task seen implies that a control
    message published before it is seen too (:func:`deliver_in_order` then delivers them
    in order); and the ms until a channel waiting for its refill may fetch."""
    jobs: list[Job] = []
    retry_ms: int | None = None
    now = time.monotonic()
    for channel in sorted(transport.channels, key=lambda c: c.acks_nothing):
        if not transport.sleep.wanted(channel, wanted, now):
            continue
        if channel._consumers:
            transport._ensure_heartbeat()
        plan = channel.fetch_plan()
        if isinstance(plan, int):
            retry_ms = sooner(retry_ms, plan)
            # (its timer too: a channel asleep, asked for by a NOTIFY, is then fetched when
            # the wait is over, not left asleep until the next NOTIFY or the fallback poll)
            channel.retry_at = sooner(channel.retry_at, now + plan / 1000)
        elif plan is not None:
            jobs.append((channel, *plan))
    return jobs, retry_ms


def channel_timer(transport: TransportLike, now: float) -> float | None:
    """When the soonest timer of a consuming channel still to come is due (monotonic time,
    just after it): a delayed message, a lock or a rate's next token its last fetch was told
    of. Looked up afresh each time, so a sooner timer never hides a later one: the consumer
    arms only the soonest, and finds the next one here once that has fired. One already due
    makes its channel awake (see ``SleepKeys.asleep``); it is not a timer any more."""
    dues = [
        c.retry_at
        for c in transport.channels
        if c.retry_at is not None and c.retry_at > now and c._consumers and not c.closed
    ]
    return min(dues) + 0.001 if dues else None


def run_fetches(transport: TransportLike, jobs: list[Job]) -> Fetched:
    """Run ``jobs`` (each dequeue carries the acks buffered since the last). When one
    fails, the messages the others brought are released and the error raised."""
    results: Fetched = []
    try:
        for channel, queues, limit in jobs:
            results.append((channel, transport.ack_and_dequeue(queues, limit, idle=channel.idle)))
    except BaseException:
        release(transport, results)
        raise
    return results


def deliver(transport: TransportLike, results: Fetched) -> tuple[int, int | None, bool]:
    """Deliver a round of fetches (see :func:`deliver_in_order`). Returns the messages
    delivered, the ms until something may become available where a fetch found nothing,
    and whether to fetch again at once (a fetch brought messages and may have left more,
    or asked so)."""
    accepted: list[tuple[ChannelLike, list[Delivery]]] = []
    retry_ms: int | None = None
    again = False
    for i, (channel, result) in enumerate(results):
        if channel.closed:  # closed while its fetch ran
            release(transport, [(channel, result)])
            continue
        try:
            batch, retry = channel.accept(result)
        except BaseException:
            for accepted_channel, accepted_batch in accepted:
                accepted_channel.unhold([m for m, _ in accepted_batch])
            release(transport, results[i + 1 :])
            raise
        accepted.append((channel, batch))
        # (a channel that took all that waited is asleep again: see Channel.accept)
        again = again or (bool(batch) and not channel.idle) or retry == 0
        if retry is not None:
            retry_ms = sooner(retry_ms, retry)
    return deliver_in_order(accepted), retry_ms, again


def release(transport: TransportLike, results: Fetched) -> None:
    """Unlock messages fetched and not delivered (else they come back when their lock
    expires)."""
    held = [m for _, result in results for m in result.messages]
    if held:
        try:
            give_back(transport, held)
        except LonnyMQError as exc:
            logger.warning(
                "lonnymq: could not release %d fetched message(s) (%s); they come back "
                "when their lock expires",
                len(held),
                exc,
            )


def deliver_in_order(accepted: list[tuple[ChannelLike, list[Delivery]]]) -> int:
    """Hand what channels accepted from one round of fetches to the consumers: each
    channel's messages in their order, those of different channels in the order they were
    created (by id), so that a message published before another is delivered first even
    when kombu channels of the connection consume them (a Celery revoke, then the task it
    names). Returns how many were delivered; on an error the rest are given back."""
    merged = list(
        heapq.merge(
            *[[(channel, m, payload) for m, payload in batch] for channel, batch in accepted],
            key=lambda item: item[1].id,
        )
    )
    if not merged:
        return 0
    acks = merged[0][0].connection.acks
    delivered = 0
    acks.delivering(True)
    try:
        for channel, message, payload in merged:
            delivered += 1
            channel.connection._deliver(payload, message.queue)
    except BaseException:
        for channel, message, _ in merged[delivered:]:
            channel.unhold([message])
        raise
    finally:
        acks.delivering(False)
    return delivered


def deliverable(
    transport: TransportLike, handoffs: Handoffs, queues: list[str], limit: int, *, idle: bool
) -> DequeueResult | None:
    """What a fetch of ``queues`` (room for ``limit``) delivers of what was handed, instead
    of a dequeue (None: nothing; then it dequeues). What the window has no room for and the
    orphans go back at once (the acks wait for the next round trip). Settled (the channel
    sleeps again, see ``Channel.accept``) when it was idle and nothing but hand-offs named
    its queues since: a NOTIFY or a hint means something else waits."""
    others = handoffs.woken_by_others(queues)
    release_handed(transport, handoffs, handoffs.orphans())
    handed = handoffs.take(queues)
    if not handed:
        return None
    release_handed(transport, handoffs, handed[limit:])
    handed = _still_held(transport, handoffs, handed[:limit])
    return DequeueResult(handed, settled=idle and not others) if handed else None


def release_handed(transport: TransportLike, handoffs: Handoffs, messages: list[Message]) -> None:
    """Give back messages handed to this consumer and not delivered (orphans, no room)."""
    give_back(transport, messages)
    handoffs.done(messages)


def give_back(transport: TransportLike, messages: list[Message]) -> None:
    """Give back messages fetched or handed and not delivered: those with a row are
    released (unlocked, in their place); those handed without one (of a queue consumed
    without acks, schema version 23) are created again in their queue, with what is left of
    their time to live, else they would be lost. (Created again, a message is counted as
    created twice.)"""
    transport.release((m.id, m.lock_token) for m in messages if m.stored)
    for message in messages:
        if not isinstance(message, Unstored):
            continue
        op = publish_op(
            transport.options.schema,
            "",
            message.queue,
            message.content,
            channel=message.channel,
            priority=message.priority,
            ttl_ms=message.ttl_ms(),
            max_message_bytes=max(transport.options.max_message_bytes, len(message.content)),
        )
        try:
            transport.pg.run(op)
        except LonnyMQError as exc:
            logger.error(
                "lonnymq: message %d of queue %r, handed without a row and not delivered, "
                "could not be created again (%s): it is lost",
                message.id,
                message.queue,
                exc,
            )


def _still_held(
    transport: TransportLike, handoffs: Handoffs, messages: list[Message]
) -> list[Message]:
    """``messages``, less those read so late that their lock expired and another consumer
    may have them: those are checked first, their locks extended when still this
    consumer's (a heartbeat), and dropped when not."""
    options = transport.options
    late = handoffs.late(messages, min(30.0, options.handoff_lock_ms / 3000))
    handoffs.done(messages)
    if not late:
        return messages
    op = heartbeat_op(options.schema, [(m.id, m.lock_token) for m in late], lock_ms=options.lock_ms)
    kept = transport.pg.run(transport.consumer_op(op))
    gone = {m.id for m in late if m.id not in kept}
    if gone:
        logger.warning(
            "lonnymq: hand-off of message(s) %s read after its lock expired: not delivered",
            sorted(gone)[:10],
        )
    return [m for m in messages if m.id not in gone]
