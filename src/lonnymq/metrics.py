"""Prometheus metrics of a whole lonnymq database, read at each scrape.

    lonnymq metrics --port 9808 --dsn postgresql://...

or, in a process of your own::

    from prometheus_client import REGISTRY
    from lonnymq.metrics import DatabaseCollector
    REGISTRY.register(DatabaseCollector("postgresql://...", schema="lonnymq"))

Per queue (label ``queue``): gauges ``lonnymq_queue_messages`` (label ``state``: ready,
delayed, in_flight, dead), ``lonnymq_queue_oldest_ready_age_seconds``,
``lonnymq_queue_channels``; counters ``lonnymq_queue_<event>_total`` for enqueued, delivered,
redelivered, acked, deferred, dead_lettered, expired and dropped (refused by a full channel);
gauges ``lonnymq_queue_rate_held_messages`` and ``lonnymq_queue_rate_held_channels`` (messages
due now that wait for their channel's rate, and those channels).
Plus ``lonnymq_up`` and ``lonnymq_scrape_duration_seconds``. Worker-side metrics (dequeue
latency histogram, per-process counters) come from the transport: see
:mod:`lonnymq.transport.events`.

Needs ``prometheus_client`` (``pip install 'lonnymq[metrics]'``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from .dsn import mask_password
from .exceptions import ConfigurationError, LonnyMQError
from .queue import Broker, HorizonHolder, QueueStatus, RateHeld

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ConfigurationError(
        "lonnymq metrics need prometheus_client: pip install 'lonnymq[metrics]'"
    ) from exc

logger = logging.getLogger("lonnymq.metrics")

_COUNTERS = (
    ("enqueued", "Messages created"),
    ("delivered", "Deliveries (redeliveries included)"),
    ("redelivered", "Deliveries after the previous holder's lock expired"),
    ("acked", "Messages acked (deleted by their consumer)"),
    ("deferred", "Messages deferred or requeued by their consumer"),
    ("dead", "Messages moved to the dead letters (rejected, or at max_attempts)"),
    ("expired", "Messages dropped past their time to live"),
    ("dropped", "Publishes refused because the channel was full"),
)


class DatabaseCollector(Collector):
    """Reads ``queue_status_v1`` at each scrape, on a connection of its own (reconnecting
    after an error). ``count_ready=False`` skips splitting waiting messages into ready and
    delayed, which reads them (cost grows with the backlog)."""

    def __init__(self, dsn: str, schema: str = "lonnymq", *, count_ready: bool = True) -> None:
        self.dsn = dsn
        self.broker = Broker(schema)
        self.count_ready = count_ready
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        #: the last error reading the database (password masked), for the log
        self.last_error: str | None = None

    def _read(self) -> tuple[list[QueueStatus], Any, list[HorizonHolder], list[RateHeld]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        try:
            statuses = self.broker.status(self._conn, count_ready=self.count_ready)
            holders = self.broker.horizon(self._conn, limit=5)
            held = self.broker.rate_held(self._conn)
            row = self._conn.execute("SELECT clock_timestamp()").fetchone()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        assert row is not None
        return statuses, row[0], holders, held

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not read the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("lonnymq_up", "1 when the last scrape could read the database")
        try:
            with self._lock:
                statuses, now, holders, held = self._read()
        except (psycopg.Error, LonnyMQError, OSError) as exc:
            error = mask_password(str(exc)).strip()
            if error != self.last_error:
                logger.warning("cannot read the database: %s", error)
            self.last_error = error
            up.add_metric([], 0)
            yield up
            return
        if self.last_error is not None:
            logger.warning("reading the database again")
            self.last_error = None
        up.add_metric([], 1)
        yield up
        messages = GaugeMetricFamily(
            "lonnymq_queue_messages", "Messages in a queue by state", labels=["queue", "state"]
        )
        oldest = GaugeMetricFamily(
            "lonnymq_queue_oldest_ready_age_seconds",
            "How long the oldest ready message of a queue has been waiting (0: none)",
            labels=["queue"],
        )
        channels = GaugeMetricFamily(
            "lonnymq_queue_channels", "Channels holding messages", labels=["queue"]
        )
        counters = {
            name: CounterMetricFamily(
                f"lonnymq_queue_{'dead_lettered' if name == 'dead' else name}",
                text,
                labels=["queue"],
            )
            for name, text in _COUNTERS
        }
        for s in statuses:
            q = [s.queue]
            if s.ready is not None:
                messages.add_metric([s.queue, "ready"], s.ready)
            if s.delayed is not None:
                messages.add_metric([s.queue, "delayed"], s.delayed)
            messages.add_metric([s.queue, "in_flight"], s.in_flight)
            messages.add_metric([s.queue, "dead"], s.dead)
            if self.count_ready:
                oldest.add_metric(q, s.oldest_ready_age(now) or 0.0)
            channels.add_metric(q, s.channels)
            for name, _ in _COUNTERS:
                counters[name].add_metric(q, getattr(s.counters, name))
        yield messages
        if self.count_ready:
            yield oldest
        yield channels
        yield from counters.values()
        held_messages = GaugeMetricFamily(
            "lonnymq_queue_rate_held_messages",
            "Messages due now that wait for their channel's rate (its next token)",
            labels=["queue"],
        )
        held_channels = GaugeMetricFamily(
            "lonnymq_queue_rate_held_channels",
            "Channels whose rate holds back messages due now",
            labels=["queue"],
        )
        by_queue = {h.queue: h for h in held}
        for s in statuses:
            h = by_queue.get(s.queue)
            held_messages.add_metric([s.queue], h.messages if h else 0)
            held_channels.add_metric([s.queue], h.channels if h else 0)
        yield held_messages
        yield held_channels
        snapshot = GaugeMetricFamily(
            "lonnymq_oldest_snapshot_age_seconds",
            "How long the oldest transaction or snapshot of a session of this database (or a "
            "prepared transaction) has held back the cleanup horizon (0: none)",
        )
        snapshot.add_metric(
            [],
            max(
                (h.age_s or 0.0 for h in holders if h.kind in ("session", "prepared")),
                default=0.0,
            ),
        )
        yield snapshot
        xids = GaugeMetricFamily(
            "lonnymq_oldest_snapshot_xid_age",
            "Transactions since the oldest cleanup horizon held back (sessions, prepared "
            "transactions, replication slots; 0: none)",
        )
        xids.add_metric([], max((h.xid_age or 0 for h in holders), default=0))
        yield xids
        took = GaugeMetricFamily(
            "lonnymq_scrape_duration_seconds", "How long reading the database took"
        )
        took.add_metric([], time.perf_counter() - started)
        yield took

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


@dataclass
class Server:
    port: int
    registry: CollectorRegistry
    collector: DatabaseCollector
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.collector.close()


def serve(
    dsn: str,
    schema: str = "lonnymq",
    *,
    port: int = 9808,
    addr: str = "0.0.0.0",
    count_ready: bool = True,
) -> Server:
    """Serve the database's metrics on ``http://addr:port/metrics`` from a background
    thread (port 0: any free port, see ``Server.port``)."""
    registry = CollectorRegistry()
    collector = DatabaseCollector(dsn, schema, count_ready=count_ready)
    registry.register(collector)
    server, thread = start_http_server(port, addr, registry=registry)
    return Server(server.server_address[1], registry, collector, server, thread)
