"""Transport options: names, defaults, validation. Documented in the transport's docstring
and docs/transport.md; an unknown option is an error, not a silent no-op."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .. import migrator
from ..dsn import meant
from ..exceptions import ConfigurationError, InvalidArgument
from ..queue._checks import DEFAULT_MAX_MESSAGE_BYTES
from ..queue.rate import burst_or_none, rate_or_none
from . import url

# Options kombu itself reads, or writes into transport_options (Producer.publish with
# retry=True merges its retry_policy, the keywords of Connection.ensure, into them): accepted
# and left to kombu.
KOMBU_OPTIONS = frozenset(
    {
        "body_encoding",
        "deadletter_queue",
        "client_properties",
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "connect_retries_timeout",
        "errback",
        "on_revive",
        "retry_errors",
    }
)


@dataclass(frozen=True)
class Options:
    #: Postgres schema holding the queue.
    schema: str = migrator.DEFAULT_SCHEMA
    #: Seconds a delivered, unacked message stays locked before another consumer may get it.
    #: A live consumer extends the locks it holds (see heartbeat_interval), so this is the time
    #: it takes to redeliver the messages of a consumer that died.
    visibility_timeout: float = 3600.0
    #: Seconds between lock extensions by a live consumer (default: visibility_timeout / 4,
    #: at most 60).
    heartbeat_interval: float | None = None
    #: Fallback poll, seconds: an idle consumer looks again at least this often even without a
    #: NOTIFY. With use_listen off, this is the pickup latency.
    polling_interval: float = 5.0
    #: Wait on LISTEN/NOTIFY (one extra connection per consuming process). Behind a pooler in
    #: transaction mode (PgBouncer) it cannot work: set listen_dsn, or turn this off to poll.
    use_listen: bool = True
    #: Let a publish hand its message to a consumer asleep on its queue (schema version 21):
    #: created locked for that consumer and sent in the NOTIFY that wakes it, so that it
    #: delivers without a dequeue. Only for publishes in their own transaction, due now, of
    #: at most 4,800 bytes, to a channel without a limit, when nothing else of the queue
    #: waits (docs/design.md, "The hand-off"). Off: woken consumers dequeue what woke them.
    handoff: bool = True
    #: A connection straight to Postgres (``postgresql://`` or ``lonnymq://`` URL, or a libpq
    #: ``key=value`` string) for what a consumer needs a session of its own for: its LISTEN
    #: connection, and its dequeues, acks and releases (a dequeue that finds nothing marks its
    #: session as waiting for a NOTIFY). Publishes, heartbeats and everything else keep to the
    #: broker URL (through PgBouncer). None: the broker URL for everything.
    listen_dsn: str | None = None
    #: Let a Celery worker run the consumer in its event loop (and the prefork pool as
    #: its asynchronous pool), as it does with RabbitMQ and Redis. False: Celery's blocking
    #: loop calls drain_events, as with kombu's other database transports.
    event_loop: bool = True
    #: Most messages fetched in one dequeue (when the prefetch window allows more).
    batch_size: int = 100
    #: Seconds a consumer holding more than half its prefetch window waits for more of it to
    #: come free before it refills it (a few slots per dequeue rather than one; it still holds
    #: half a window of work meanwhile). 0: refill at once.
    refill_delay: float = 0.005
    #: Install or upgrade the schema on first use (advisory-locked, safe under concurrency).
    auto_install: bool = True
    #: Largest message (serialized payload) accepted, bytes.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Seconds between expiry sweeps (message TTLs, x-expires queues, old dead letters) by
    #: each process (consumers and producers), skipped when another client swept more recently.
    expire_interval: float = 10.0
    #: How the consumer's own transactions commit (dequeue, ack, reject, lock heartbeat):
    #: "async" (synchronous_commit off: no wait for the WAL flush; a database crash can lose
    #: the last few, which means redeliveries, never a lost message) or "sync". Publishes
    #: are durable when they return (publish_commit), but for transient messages
    #: (delivery_mode 1: Celery's rpc:// replies, events and broadcasts), which do not wait
    #: for the WAL flush.
    consumer_commit: str = "async"
    #: How a persistent message's publish commits (not in a caller's transaction, see
    #: lonnymq.transaction). "flush_after_wake" (the default): when the publish woke a
    #: consumer asleep on a queue it reached (handed it the message, or sent it the message's
    #: id), it commits without waiting for the WAL flush, so that the consumer is told at
    #: once, then waits for the flush in a second statement on the same session before it
    #: returns; otherwise it is one durable transaction. "flush_first": always one durable
    #: transaction, visible to consumers once its commit is flushed. "flush_after": always
    #: committed without the wait, then flushed in a second statement. The flush is a
    #: transaction that writes a transactional logical message (prefix "lonnymq.flush",
    #: empty), whose commit waits for the flush, which covers the first. Either way a publish
    #: that returned is durable; when it is visible first, a consumer may start a message
    #: before it is durable (a database crash or a cut connection in that window makes the
    #: publish raise; a retried one runs it again: at-least-once). The second statement is a
    #: round trip more for the publisher. Through a pooler, always "flush_first".
    publish_commit: str = "flush_after_wake"
    #: Seconds to wait for a connection to Postgres.
    connect_timeout: float | None = None
    #: libpq parameters kombu's Connection has no field for (``{"sslmode": "require"}``,
    #: ``application_name``, ``target_session_attrs``; ``host`` and ``port`` lists for a port
    #: per host). Filled from the broker URL's query when the Connection is made (the URL's
    #: win over the ones given here), so that kombu's fields hold what they do for amqp.
    connection_params: dict[str, Any] | None = None
    #: Channel policies declared in configuration, applied when a process first connects:
    #: ``{queue: {"default": {"max_concurrency": n, "max_size": n},
    #: "channels": {channel: {...}}, "settings": {"max_attempts": n, "dead_letter": bool,
    #: "dead_retention_ms": n}}}``. A declared policy replaces the one in the database.
    policies: dict[str, Any] | None = None
    #: Serve this process's client metrics (Prometheus) over HTTP on this port, from the
    #: first connection on (needs prometheus_client). None: not served (they are still in
    #: prometheus_client's default registry).
    metrics_port: int | None = None

    @property
    def lock_ms(self) -> int:
        return max(1, int(self.visibility_timeout * 1000))

    @property
    def handoff_lock_ms(self) -> int:
        """How long a message handed to this consumer is locked from its create: the lock of
        a take, but at most two heartbeats and 30 s (the heartbeat extends it once the
        consumer has it), so that one whose NOTIFY was lost comes back that soon."""
        return min(self.lock_ms, int((2 * self.heartbeat_seconds + 30) * 1000))

    @property
    def heartbeat_seconds(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return max(0.05, min(self.visibility_timeout / 4, 60.0))

    @classmethod
    def from_mapping(cls, options: dict[str, Any], connect_timeout: float | None) -> Options:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known - KOMBU_OPTIONS, key=str)
        if unknown:
            named = ", ".join(f"{k!r}{meant(str(k), known)}" for k in unknown)
            raise ConfigurationError(
                f"unknown lonnymq transport option(s) {named}; "
                f"valid options: {', '.join(sorted(known))}"
            )
        values = {k: v for k, v in options.items() if k in known}
        if connect_timeout and "connect_timeout" not in values:
            values["connect_timeout"] = connect_timeout
        opts = cls(**values)
        opts.validate()
        return opts

    def validate(self) -> None:
        migrator.validate_schema(self.schema)
        _seconds("visibility_timeout", self.visibility_timeout, low=0.001)
        _seconds("polling_interval", self.polling_interval, low=0.001)
        _seconds("expire_interval", self.expire_interval, low=0.001)
        _seconds("refill_delay", self.refill_delay, low=0)
        if self.refill_delay > 1:
            raise ConfigurationError("transport option refill_delay is at most 1 (second)")
        if self.heartbeat_interval is not None:
            _seconds("heartbeat_interval", self.heartbeat_interval, low=0.001)
            if self.heartbeat_interval >= self.visibility_timeout:
                raise ConfigurationError(
                    "heartbeat_interval must be shorter than visibility_timeout, or locks "
                    "expire between two heartbeats"
                )
        if self.connect_timeout is not None:
            _seconds("connect_timeout", self.connect_timeout, low=0)
        if self.connection_params is not None:
            url.check_connection_params(self.connection_params)
        if self.listen_dsn is not None:
            try:
                url.to_conninfo(self.listen_dsn)
            except ConfigurationError as exc:
                raise ConfigurationError(f"transport option listen_dsn: {exc}") from None
        for name in ("use_listen", "handoff", "auto_install", "event_loop"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"transport option {name} must be True or False")
        _integer("batch_size", self.batch_size, 1, 10_000)
        if self.consumer_commit not in ("async", "sync"):
            raise ConfigurationError('transport option consumer_commit must be "async" or "sync"')
        if self.publish_commit not in ("flush_after", "flush_after_wake", "flush_first"):
            raise ConfigurationError(
                'transport option publish_commit must be "flush_after_wake", "flush_after" '
                'or "flush_first"'
            )
        if self.policies is not None:
            _policies(self.policies)
        _integer("max_message_bytes", self.max_message_bytes, 1, 1024**3)
        if self.metrics_port is not None:
            _integer("metrics_port", self.metrics_port, 1, 65535)


def _seconds(name: str, value: object, *, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"transport option {name} must be a number of seconds")
    if not math.isfinite(value) or value < low or value > 10 * 365 * 86400:
        raise ConfigurationError(f"transport option {name} is out of range: {value!r}")


def _integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(f"transport option {name} must be an int in [{low}, {high}]")


_LIMITS = frozenset({"max_concurrency", "max_size", "rate", "burst"})


def _keys(where: str, value: object, allowed: frozenset[str]) -> dict[Any, Any]:
    """``value``, a dict whose keys are among ``allowed``; else an error naming the bad key,
    with the one meant."""
    keys = ", ".join(sorted(allowed))
    if not isinstance(value, dict):
        raise ConfigurationError(
            f"transport option policies: {where} must be a dict with keys among {keys}, not "
            f"{type(value).__name__}"
        )
    unknown = sorted(set(value) - allowed, key=str)
    if unknown:
        named = ", ".join(f"{k!r}{meant(str(k), allowed)}" for k in unknown)
        raise ConfigurationError(
            f"transport option policies: {where}: unknown key(s) {named}; use keys among {keys}"
        )
    return value


def _limits(where: str, value: object) -> None:
    value = _keys(where, value, _LIMITS)
    for key in ("max_concurrency", "max_size"):
        if value.get(key) is not None:
            _integer(f"policies: {where}.{key}", value[key], 0, 2**31 - 1)
    try:
        burst_or_none(value.get("burst"), rate_or_none(value.get("rate")))
    except InvalidArgument as exc:
        raise ConfigurationError(f"transport option policies: {where}: {exc}") from None


_SETTINGS = frozenset({"dead_letter", "max_attempts", "dead_retention_ms"})
_SPEC = frozenset({"default", "channels", "settings"})


def _settings(queue: str, value: object) -> None:
    value = _keys(f"{queue}.settings", value, _SETTINGS)
    if "dead_letter" in value and not isinstance(value["dead_letter"], bool):
        raise ConfigurationError(
            f"transport option policies[{queue!r}].settings.dead_letter must be True or False"
        )
    if value.get("max_attempts") is not None:
        _integer(f"policies[{queue!r}].settings.max_attempts", value["max_attempts"], 1, 2**31 - 1)
    if "dead_retention_ms" in value:
        _integer(
            f"policies[{queue!r}].settings.dead_retention_ms",
            value["dead_retention_ms"],
            1,
            10 * 365 * 86400 * 1000,
        )


def _policies(policies: object) -> None:
    if not isinstance(policies, dict):
        raise ConfigurationError("transport option policies must be a dict keyed by queue name")
    for queue, spec in policies.items():
        if not isinstance(queue, str) or not isinstance(spec, dict):
            raise ConfigurationError(
                "transport option policies: each queue maps to a dict with 'default' and/or "
                "'channels'"
            )
        _keys(queue, spec, _SPEC)
        if "default" in spec:
            _limits(f"{queue}.default", spec["default"])
        if "settings" in spec:
            _settings(queue, spec["settings"])
        channels = spec.get("channels", {})
        if not isinstance(channels, dict):
            raise ConfigurationError(f"transport option policies[{queue!r}].channels: a dict")
        for channel, limits in channels.items():
            _limits(f"{queue}.channels[{channel!r}]", limits)
