"""Kombu transport for lonnymq: a message queue in PostgreSQL.

URL: ``lonnymq://USER:PASSWORD@HOST:PORT/DBNAME[?LIBPQ_PARAMETERS]`` after ``import lonnymq``
(which registers the alias), or ``transport="lonnymq.transport:Transport"`` /
Celery's ``broker_transport``. The query string takes libpq parameters (``sslmode``,
``connect_timeout``, ``target_session_attrs``, several ``HOST:PORT`` pairs separated by commas).

Features
- Exchanges (direct, topic, fanout), queues and bindings are stored in Postgres: every process
  routes alike, and a publish is routed inside Postgres in one round trip.
- Tenant channels: a message goes to the channel named by its ``x-channel`` header, else by its
  routing key. Channels of a queue are served round-robin with per-channel ``max_concurrency``
  and ``max_size`` policies (see :class:`lonnymq.Queue`). A full channel raises
  :class:`lonnymq.ChannelFull` at publish.
- ``x-dedup-name`` header: while a message of that name, in that queue and channel, was never
  delivered, publishing another is a no-op.
- Delays stay in Postgres: Celery's ``eta`` header (``countdown``/``eta``) or an ``x-delay-ms``
  header keep the message invisible to consumers until due. Priority: the ``priority``
  property (0-255, higher first, within a channel). Expiry: the ``expiration`` property and the
  ``x-message-ttl`` / ``x-expires`` queue arguments; kombu's ``Queue(expires=, message_ttl=,
  max_length=, max_priority=, auto_delete=)`` map onto them as on amqp (``x-max-length``: the
  queue's default ``max_size``; a priority above ``x-max-priority`` is taken as it; an
  ``auto_delete`` queue goes when its last consumer, of any process, does; arguments lonnymq
  cannot honour are refused). Every client of the schema sweeps what expired, at most every
  ``expire_interval`` (see :mod:`lonnymq.transport.sweep`); a publish to a queue that went is
  dropped rather than re-creating it.
- Consumers are registered in the schema (:mod:`lonnymq.transport.registry`) when they start
  and stop, and refreshed by the heartbeat thread every 5 s (never by a dequeue): who consumes
  each queue shows in ``lonnymq web`` and ``lonnymq status``.
- Celery: a task with an ``expires`` keeps no broker time to live, so the worker revokes it
  when it expires (REVOKED), as on RabbitMQ and Redis.
- Delivery: a consumer dequeues up to its free prefetch window across its queues in one round
  trip and locks the messages for ``visibility_timeout``; ack deletes; reject with requeue and
  the restore of unacked messages at shutdown unlock the same row; reject without requeue
  moves it to the queue's dead letters (``lonnymq messages list --state dead``), and so does
  a message delivered ``max_attempts`` times (default 20) whose consumers died. No-ack
  consumers delete on delivery. A live consumer extends the locks of every
  message it holds (prefetched or running) from a background thread; a dead consumer's
  messages come back after ``visibility_timeout``.
- Idle consumers wait on LISTEN/NOTIFY, and wake for delayed messages and expiring locks by
  timer; ``polling_interval`` is only a safety net.
- Asynchronous: a Celery worker runs the consumer in its event loop (``register_with_event_
  loop``; the prefork pool is then Celery's asynchronous pool), as with RabbitMQ and Redis;
  ``event_loop=False`` makes Celery use its blocking loop (``drain_events``) instead.

Connections per process: 1 for a producer; 2 for a consumer (commands, and LISTEN), and a
third when other threads ack while it drains (Celery's pools). Behind a transaction pooler
(PgBouncer): no prepared statements, and a consumer needs ``listen_dsn`` (else it raises
:class:`lonnymq.ListenUnavailable` at its first wait), see :mod:`lonnymq.transport.pooler`.

Transport options (``transport_options`` / Celery ``broker_transport_options``):
``schema`` (``"lonnymq"``), ``visibility_timeout`` (3600 s), ``heartbeat_interval``
(visibility_timeout / 4, at most 60 s), ``polling_interval`` (5 s), ``use_listen`` (True),
``listen_dsn`` (a direct connection for a consumer's LISTEN and dequeues behind PgBouncer),
``event_loop`` (True: a Celery worker runs the consumer in its event loop),
``refill_delay`` (0.005 s), ``batch_size`` (100), ``auto_install`` (True),
``max_message_bytes`` (8 MiB),
``expire_interval`` (10 s), ``consumer_commit`` (``"async"``), ``publish_commit``
(``"flush_after_wake"``), ``connect_timeout``,
``policies`` (channel policies and queue settings declared in configuration, applied when a
process first connects), ``metrics_port`` (serve the consuming process's Prometheus metrics).
Log events: the ``lonnymq.events`` logger (see :mod:`lonnymq.logs`).
See :class:`lonnymq.transport.options.Options` and ``docs/transport.md``. Unknown options are
errors.
"""

from __future__ import annotations

from .channel import Channel
from .qos import QoS
from .transport import Transport

__all__ = ["Channel", "QoS", "Transport"]
