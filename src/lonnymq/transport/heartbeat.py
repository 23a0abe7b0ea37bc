"""The consumer's background thread: extends the locks of every message the process holds
(every ``heartbeat_interval``), marks its expiring queues used (often enough for their
``x-expires``), sweeps expired messages and queues and prunes old dead letters (every
``expire_interval``, see :mod:`lonnymq.transport.sweep`)."""

from __future__ import annotations

import logging
import os
import threading
import time

from ..queue.expiry import touch_op
from ..queue.finalize import heartbeat_op
from .acks import Held
from .interfaces import TransportLike
from .rounds import release_handed

logger = logging.getLogger("lonnymq.transport")


class Heartbeat(threading.Thread):
    """Extends the locks of every message the process holds; touches expiring queues;
    sweeps expired messages and queues, with the other clients of the schema."""

    def __init__(self, transport: TransportLike) -> None:
        super().__init__(name="lonnymq-heartbeat", daemon=True)
        self.transport = transport
        self.stopped = threading.Event()
        self.pid = os.getpid()

    def run(self) -> None:
        options = self.transport.options
        last_beat = last_touch = time.monotonic()
        while True:
            # wake for the next lock heartbeat or touch of expiring queues (see
            # Transport.touch_seconds), and at least every expire_interval for the sweep
            touch = self.transport.touch_seconds()
            due = min(last_beat + options.heartbeat_seconds, last_touch + touch)
            wait = min(max(0.0, due - time.monotonic()), options.expire_interval)
            if self.stopped.wait(wait):
                return
            now = time.monotonic()
            try:
                if now - last_beat >= options.heartbeat_seconds:
                    last_beat = now
                    self.extend_locks()
                if now - last_touch >= touch and not self.stopped.is_set():
                    last_touch = now
                    self.touch()
                if not self.stopped.is_set():  # the transport may be closing
                    self.transport.sweep(background=True)
            except Exception as exc:  # keep beating: the next tick may succeed
                logger.warning("lonnymq: heartbeat failed: %s", exc)

    def beat(self) -> None:
        """Extend the locks and touch the expiring queues now."""
        self.extend_locks()
        self.touch()

    def extend_locks(self) -> None:
        transport = self.transport
        held: list[Held] = []
        for channel in list(transport.channels):
            if getattr(channel, "_qos", None) is not None:
                held.extend(channel.qos.held())
        # handed to it: those for queues no longer consumed go back, those not delivered yet
        # (a full prefetch window) are kept
        handoffs = transport.waiter.handoffs
        waiting = []
        if handoffs is not None:
            release_handed(transport, handoffs, handoffs.orphans())
            waiting = handoffs.pending(take=False)
        held.extend((m.id, m.lock_token) for m in waiting if m.stored)
        if held:
            op = heartbeat_op(transport.options.schema, held, lock_ms=transport.options.lock_ms)
            kept = transport.pg.run(transport.consumer_op(op))
            if handoffs is not None and waiting:
                handoffs.extended(kept, transport.options.lock_ms / 1000)
            lost = [ref[0] for ref in held if ref[0] not in kept]
            if lost:
                logger.warning(
                    "lonnymq: lost the lock of %d message(s) %s: they were delivered again "
                    "elsewhere (raise visibility_timeout?)",
                    len(lost),
                    lost[:10],
                )

    def touch(self) -> None:
        """Refresh this connection's registered consumers (see :mod:`.registry`) and mark
        the consumed queues used now, so that no sweep takes them for unused (their
        ``x-expires``)."""
        transport = self.transport
        transport.registry.sync()
        queues: set[str] = set()
        for channel in list(transport.channels):
            queues.update(channel._active_queues)
        others = sorted(queues - transport.registry.queues())
        if others:  # consumed by no registered consumer (started in another process)
            transport.pg.run(touch_op(transport.options.schema, others))
