"""The QoS of a kombu channel: its prefetch window, and the lock of every message it delivered
and has not settled yet (ack, reject, restore)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kombu.transport import virtual

from ..exceptions import LonnyMQError
from . import events
from .acks import Held
from .interfaces import ChannelLike, Where

logger = logging.getLogger("lonnymq.transport")


class QoS(virtual.QoS):
    """Prefetch accounting plus the lock of every delivered, unacked message: ack deletes the
    row, reject with requeue (and restore at shutdown) unlocks it, reject without requeue
    moves it to the dead letters. Acks may come from any thread."""

    channel: ChannelLike

    def __init__(self, channel: ChannelLike, prefetch_count: int = 0) -> None:
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
                events.acked(ref[0], queue, lane)
            elif requeue:
                events.deferred(ref[0], queue, lane, why)
        if ref is not None and why == "ack":
            ack = transport.acks.offer(ref)
            if ack is not None:
                self._quick_ack(delivery_tag)
                if ack.sent is None:
                    if transport.in_event_loop:
                        transport.loop_acked()  # the loop's own: goes with a look soon
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
