"""The consumer's background thread: extends the locks of every message the process holds,
keeps its expiring queues alive, sweeps expired messages and queues, prunes old dead letters."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING

from .queue.finalize import heartbeat_op
from .queue.operate import housekeep_op
from .queue.routing import expire_op, touch_op

if TYPE_CHECKING:
    from .transport import Transport

logger = logging.getLogger("lonnymq.transport")
Held = tuple[int, uuid.UUID]


class Heartbeat(threading.Thread):
    """Extends the locks of every message the process holds; touches expiring queues;
    sweeps expired messages and queues."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(name="lonnymq-heartbeat", daemon=True)
        self.transport = transport
        self.stopped = threading.Event()
        self.pid = os.getpid()

    def run(self) -> None:
        options = self.transport.options
        last_expire = 0.0
        while not self.stopped.wait(options.heartbeat_seconds):
            try:
                self.beat()
                if time.monotonic() - last_expire >= options.expire_interval:
                    last_expire = time.monotonic()
                    self.transport.pg.run(expire_op(options.schema))
                    self.transport.pg.run(housekeep_op(options.schema))
            except Exception as exc:  # keep beating: the next tick may succeed
                logger.warning("lonnymq: heartbeat failed: %s", exc)

    def beat(self) -> None:
        transport = self.transport
        schema = transport.options.schema
        held: list[Held] = []
        queues: set[str] = set()
        for channel in list(transport.channels):
            if getattr(channel, "_qos", None) is not None:
                held.extend(channel.qos.held())
            queues.update(channel._active_queues)
        if held:
            op = heartbeat_op(schema, held, lock_ms=transport.options.lock_ms)
            kept = transport.pg.run(transport.consumer_op(op))
            lost = [ref[0] for ref in held if ref[0] not in kept]
            if lost:
                logger.warning(
                    "lonnymq: lost the lock of %d message(s) %s: they were delivered again "
                    "elsewhere (raise visibility_timeout?)",
                    len(lost),
                    lost[:10],
                )
        if queues:
            transport.pg.run(touch_op(schema, sorted(queues)))
