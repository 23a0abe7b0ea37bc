"""What the transport tells the outside world about messages: structured log events on the
``lonnymq.events`` logger, and client-side Prometheus metrics when ``prometheus_client`` is
installed (``pip install 'lonnymq[metrics]'``).

Log events carry their fields as attributes of the log record (``record.event``,
``record.message_id``, ``record.queue``, ``record.channel``, and ``record.attempts`` /
``record.reason`` where they apply), so a JSON formatter (:class:`lonnymq.logs.JsonFormatter`)
or any structured-logging handler picks them up. Levels: DEBUG for the steady flow
(enqueued, dequeued, acked, deferred), WARNING for what someone should look at (redelivered
after a lock expired, dead-lettered, discarded (given up on where the queue keeps no dead
letters), channel full).

Metrics are per process, in ``prometheus_client``'s default registry: expose them with
``prometheus_client.start_http_server(port)`` or the ``metrics_port`` transport option.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("lonnymq.events")

prometheus_client: Any
try:  # optional dependency
    import prometheus_client
except ImportError:  # pragma: no cover - exercised where prometheus_client is absent
    prometheus_client = None

DEQUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Metrics:
    def __init__(self) -> None:
        assert prometheus_client is not None
        c = prometheus_client.Counter
        self.published = c(
            "lonnymq_client_messages_published",
            "Messages this process created (one per queue a publish reached)",
            ["queue"],
        )
        self.refused = c(
            "lonnymq_client_publish_refused",
            "Publishes this process had refused because the channel was full",
            ["queue"],
        )
        self.delivered = c(
            "lonnymq_client_messages_delivered",
            "Messages this process dequeued (redeliveries included)",
            ["queue"],
        )
        self.redelivered = c(
            "lonnymq_client_messages_redelivered",
            "Messages this process dequeued after their previous holder's lock expired",
            ["queue"],
        )
        self.acked = c("lonnymq_client_messages_acked", "Messages this process acked", ["queue"])
        self.requeued = c(
            "lonnymq_client_messages_requeued",
            "Messages this process rejected with requeue or released at shutdown",
            ["queue"],
        )
        self.dead = c(
            "lonnymq_client_messages_dead_lettered",
            "Messages this process sent to the dead letters (or saw dead-lettered at dequeue)",
            ["queue", "reason"],
        )
        self.discarded = c(
            "lonnymq_client_messages_discarded",
            "Messages given up on and dropped because their queue keeps no dead letters",
            ["queue", "reason"],
        )
        self.dequeue = prometheus_client.Histogram(
            "lonnymq_client_dequeue_duration_seconds",
            "Round trip of one dequeue call (acks sent with it included)",
            buckets=DEQUEUE_BUCKETS,
        )


_metrics: _Metrics | None = None
_metrics_lock = threading.Lock()


def metrics() -> _Metrics | None:
    """The process's client metrics, registered on first use; None without prometheus_client."""
    global _metrics
    if prometheus_client is None:
        return None
    if _metrics is None:
        with _metrics_lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


_servers: dict[int, Any] = {}


def serve_metrics(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve this process's metrics over HTTP on ``port`` (once per port per process).
    False when prometheus_client is not installed or the port is taken."""
    if prometheus_client is None:
        logger.warning("lonnymq: metrics_port is set but prometheus_client is not installed")
        return False
    metrics()
    with _metrics_lock:
        if port in _servers:
            return True
        try:
            _servers[port] = prometheus_client.start_http_server(port, addr)
        except OSError as exc:
            logger.warning("lonnymq: cannot serve metrics on port %d: %s", port, exc)
            return False
    return True


def _log(level: int, event: str, text: str, *args: Any, **fields: Any) -> None:
    fields["event"] = event
    logger.log(level, text, *args, extra=fields)


def _debug(event: str, message_id: int, queue: str | None, channel: str | None) -> None:
    """Log ``<event> message <id> (queue=... channel=...)`` at DEBUG."""
    if logger.isEnabledFor(logging.DEBUG):
        _log(
            logging.DEBUG,
            event,
            event + " message %d (queue=%s channel=%s)",
            message_id,
            queue,
            channel,
            message_id=message_id,
            queue=queue,
            channel=channel,
        )


def enqueued(queue: str, channel: str, message_id: int) -> None:
    m = metrics()
    if m is not None:
        m.published.labels(queue).inc()
    _debug("enqueued", message_id, queue, channel)


def channel_full(queue: str, channel: str) -> None:
    m = metrics()
    if m is not None:
        m.refused.labels(queue).inc()
    _log(
        logging.WARNING,
        "channel_full",
        "channel full: publish refused (queue=%s channel=%s)",
        queue,
        channel,
        queue=queue,
        channel=channel,
    )


def dequeued(message_id: int, queue: str, channel: str, attempts: int, lock_expired: bool) -> None:
    m = metrics()
    if m is not None:
        m.delivered.labels(queue).inc()
        if lock_expired:
            m.redelivered.labels(queue).inc()
    if lock_expired:
        level, event = logging.WARNING, "redelivered"
        text = (
            "redelivered message %d after its lock expired, attempt %d (queue=%s channel=%s): "
            "its previous holder died or hung"
        )
    elif logger.isEnabledFor(logging.DEBUG):
        level, event = logging.DEBUG, "dequeued"
        text = "dequeued message %d, attempt %d (queue=%s channel=%s)"
    else:
        return
    _log(
        level,
        event,
        text,
        message_id,
        attempts,
        queue,
        channel,
        message_id=message_id,
        queue=queue,
        channel=channel,
        attempts=attempts,
    )


def acked(message_id: int, queue: str | None, channel: str | None) -> None:
    m = metrics()
    if m is not None and queue is not None:
        m.acked.labels(queue).inc()
    _debug("acked", message_id, queue, channel)


def deferred(message_id: int, queue: str | None, channel: str | None, why: str) -> None:
    m = metrics()
    if m is not None and queue is not None:
        m.requeued.labels(queue).inc()
    if logger.isEnabledFor(logging.DEBUG):
        _log(
            logging.DEBUG,
            "deferred",
            "deferred message %d: %s (queue=%s channel=%s)",
            message_id,
            why,
            queue,
            channel,
            message_id=message_id,
            queue=queue,
            channel=channel,
            reason=why,
        )


def dead_lettered(
    message_id: int,
    queue: str | None,
    channel: str | None,
    reason: str,
    attempts: int | None,
    *,
    kept: bool = True,
) -> None:
    """A message given up on: moved to the dead letters (``kept``), or dropped where its
    queue keeps none (event ``discarded``)."""
    m = metrics()
    if m is not None and queue is not None:
        (m.dead if kept else m.discarded).labels(queue, reason).inc()
    if kept:
        event = "dead_lettered"
        text = (
            "dead-lettered message %(id)d: %(reason)s after %(tries)s attempt(s) (queue=%(queue)s "
            "channel=%(channel)s); `lonnymq messages show %(id)d` shows it, `lonnymq messages "
            "retry %(id)d` puts it back"
        )
    else:
        event = "discarded"
        text = (
            "discarded message %(id)d: %(reason)s after %(tries)s attempt(s) (queue=%(queue)s "
            "channel=%(channel)s keeps no dead letters)"
        )
    _log(
        logging.WARNING,
        event,
        text,
        {
            "id": message_id,
            "reason": reason,
            "tries": "?" if attempts is None else attempts,
            "queue": queue,
            "channel": channel,
        },
        message_id=message_id,
        queue=queue,
        channel=channel,
        reason=reason,
        attempts=attempts,
    )


def dequeue_time(seconds: float) -> None:
    m = metrics()
    if m is not None:
        m.dequeue.observe(seconds)
