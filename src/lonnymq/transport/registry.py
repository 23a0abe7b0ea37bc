"""The consumers of a transport (one kombu connection in one process), registered in the
schema's ``consumer`` table so that every process sees who consumes a queue (the web view,
``lonnymq status``) and a queue declared ``auto_delete`` goes when its last consumer does,
as on RabbitMQ.

What it costs: one round trip (``consumer_sync_v1``) when a consumer starts (``basic_consume``)
or stops (``basic_cancel``, a channel or connection that closes), and one from the heartbeat
thread every few seconds (at most :data:`BEAT_S`), which refreshes the consumers' rows and
marks their queues used (``x-expires``). Nothing per dequeue: a delivery only notes the time
in this process (a dict write), and the next sync reports it (``delivered_at``, so "last
delivery" is at most :data:`BEAT_S` old). A consumer not heard of for three beats (its process
killed or cut off) is presumed gone, and the next sweep of the schema removes it (and an
``auto_delete`` queue with its last consumer).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any, Protocol

from ..queue._ops import Op
from ..queue.consumers import ConsumerEntry, Synced, consumer_sync_op

logger = logging.getLogger("lonnymq.transport")

#: A registered consumer is refreshed at least this often (seconds); one not heard of for
#: three times as long is presumed gone.
BEAT_S = 5.0

_node: str | None = None
_LIVE: weakref.WeakSet[Registry] = weakref.WeakSet()


def _unregister_at_exit() -> None:
    """A process that exits without closing its kombu connections (a Celery client, most
    scripts) unregisters their consumers, as RabbitMQ forgets those of a connection that
    ends: its auto_delete queues go now, not when a sweep finds the process gone. (Run
    before the connections close: this module's handler is registered after theirs.)"""
    for registry in list(_LIVE):
        with contextlib.suppress(Exception):
            registry.forget()


atexit.register(_unregister_at_exit)


def set_node(name: str | None) -> None:
    """The Celery node name of this process (``name@host``), shown with its consumers (set
    by :mod:`lonnymq.celery_steps` when a worker starts)."""
    global _node
    _node = name


class Consuming(Protocol):
    """A kombu channel, as the registry reads its consumers (kombu's attributes)."""

    channel_id: Any
    closed: bool
    _tag_to_queue: dict[str, str]
    _consumers: set[str]
    _no_ack_queues: set[str]


class Host(Protocol):
    """The transport, as the registry uses it."""

    @property
    def channels(self) -> Iterable[Any]: ...

    def run_consumer_op(self, op: Op[Synced]) -> Synced: ...


class Registry:
    """The consumers of one transport, kept in sync with the ``consumer`` table."""

    def __init__(self, transport: Host, schema: str) -> None:
        self.transport = transport
        self.schema = schema
        self._lock = threading.RLock()
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        self.pid = os.getpid()
        #: this transport in this process (a forked child is another client)
        self.client = uuid.uuid4()
        #: (channel id, consumer tag) of the consumers started in this process
        self._tags: set[tuple[Any, str]] = set()
        #: queue -> time of its last delivery (time.time())
        self._delivered: dict[str, float] = {}
        self._registered = False
        self._queues: frozenset[str] = frozenset()
        self._told: set[str] = set()

    def _own(self) -> None:
        if self.pid != os.getpid():  # a forked child: its parent's consumers are not its own
            self._reset()

    def delivered(self, queue: str) -> None:
        """Note a delivery from ``queue`` (reported with the next sync)."""
        self._delivered[queue] = time.time()

    def consumed(self, channel: Consuming, tag: str) -> None:
        """A consumer started: register it now."""
        with self._lock:
            self._own()
            self._tags.add((channel.channel_id, tag))
            self.sync()

    def cancelled(self, channel: Consuming, tag: str, *, sync: bool = True) -> None:
        """A consumer stopped: unregister it now (an ``auto_delete`` queue goes with its last
        consumer), or with the next sync when not ``sync``. A failure is logged: the heartbeat
        syncs again, and the sweep removes the consumer of a process that stopped beating."""
        with self._lock:
            self._own()
            if (channel.channel_id, tag) not in self._tags:
                return
            self._tags.discard((channel.channel_id, tag))
            if not sync:
                return
            try:
                self.sync()
            except Exception as exc:
                logger.warning("lonnymq: could not unregister consumer %s: %s", tag, exc)

    def queues(self) -> set[str]:
        """The queues of the consumers the last sync registered."""
        return set(self._queues)

    def _redeclare(self, queue: str) -> bool:
        """Declare ``queue`` again, with its bindings, as this process declared them (it went
        while consumed: see ``TopologyChannel.redeclare``); whether it could."""
        for channel in list(self.transport.channels):
            if not getattr(channel, "closed", True):
                return bool(channel.redeclare(queue))
        return False

    def forget(self) -> None:
        """Unregister every consumer of this client (its process exits)."""
        with self._lock:
            if self.pid != os.getpid() or not self._registered:
                return
            self._tags.clear()
            self.sync()

    def entries(self) -> list[ConsumerEntry]:
        """The consumers started in this process whose channel still has them."""
        out = []
        live: set[tuple[Any, str]] = set()
        for channel in list(self.transport.channels):
            if getattr(channel, "closed", True):
                continue
            prefetch = getattr(getattr(channel, "_qos", None), "prefetch_count", None)
            for tag in list(channel._consumers):
                key = (channel.channel_id, tag)
                queue = channel._tag_to_queue.get(tag)
                if key not in self._tags or queue is None:
                    continue
                live.add(key)
                at = self._delivered.get(queue)
                out.append(
                    ConsumerEntry(
                        tag=f"{channel.channel_id}/{tag}",
                        queue=queue,
                        no_ack=queue in channel._no_ack_queues,
                        prefetch=prefetch or None,
                        delivered_at=None
                        if at is None
                        else datetime.fromtimestamp(at, timezone.utc),
                    )
                )
        self._tags &= live
        return out

    def sync(self) -> None:
        """Make the ``consumer`` rows of this client what its channels consume now."""
        with self._lock:
            self._own()
            entries = self.entries()
            if not entries and not self._registered:
                return
            op = consumer_sync_op(
                self.schema,
                self.client,
                host=socket.gethostname(),
                pid=self.pid,
                node=_node,
                beat_ms=int(BEAT_S * 1000),
                entries=entries,
            )
            synced = self.transport.run_consumer_op(op)
            self._registered = bool(entries)
            self._queues = frozenset(e.queue for e in entries)
        for queue in synced.deleted:
            logger.info(
                "lonnymq: queue %r deleted: it is auto_delete and its last consumer went", queue
            )
        for queue in synced.missing:
            if self._redeclare(queue):
                logger.warning(
                    "lonnymq: queue %r went while consumed here (its consumers were presumed "
                    "gone: this process was cut off from the database for a while); declared "
                    "it again, with its bindings (what was in it went with it)",
                    queue,
                )
                continue
            if queue not in self._told:
                self._told.add(queue)
                logger.warning(
                    "lonnymq: queue %r is consumed here but does not exist: never declared, "
                    "or deleted while consumed (an auto_delete queue whose consumers were all "
                    "presumed gone, an expiry); declare it (again) for its arguments to apply",
                    queue,
                )
