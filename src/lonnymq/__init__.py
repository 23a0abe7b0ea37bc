"""lonnymq: a multi-tenant message queue in PostgreSQL, for Kombu and Celery.

The queue API::

    import psycopg
    from lonnymq import Queue

    queue = Queue("default", schema="lonnymq")
    with psycopg.connect(dsn, autocommit=True) as conn:
        lonnymq.install(conn)
        queue.channel("tenant-1").message.create(conn, b"hello")
        result = queue.dequeue(conn, limit=10, lock_ms=30_000)
        for message in result.messages:
            message.delete(conn)
"""

from __future__ import annotations

from typing import Any

import psycopg

from . import migrator
from .enqueue import transaction
from .exceptions import (
    ChannelBusy,
    ChannelFull,
    ConfigurationError,
    ConnectionLost,
    DatabaseError,
    InvalidArgument,
    InvalidName,
    ListenUnavailable,
    LonnyMQError,
    MessageLocked,
    MessageNotFound,
    MessageTooLarge,
    PermissionDenied,
    SchemaError,
    SchemaNotInstalled,
    SchemaTooNew,
    UnsupportedServer,
)
from .migrator import CURRENT_VERSION, DEFAULT_SCHEMA, migrations
from .queue import (
    KEEP,
    Batch,
    Broker,
    Channel,
    ChannelInfo,
    Created,
    CreateResult,
    Deduplicated,
    DequeueResult,
    Dropped,
    Message,
    Outcome,
    Pending,
    Policy,
    Queue,
    QueueStats,
    Rate,
)
from .roles import grant, revoke

__version__ = "0.1.0"

#: The class path of the Kombu transport, for ``transport=`` or Celery's ``broker_transport``.
TRANSPORT = "lonnymq.transport:Transport"


def _register_transport() -> None:
    """Make ``lonnymq://`` URLs work in kombu and Celery (kombu has no entry point for this)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault("lonnymq", TRANSPORT)


_register_transport()


def install(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[str]:
    """Install or upgrade the lonnymq schema; returns the migrations applied. Safe under
    concurrent callers, a no-op when current (see :func:`lonnymq.migrator.install`)."""
    return migrator.install(conn, schema)


__all__ = [
    "CURRENT_VERSION",
    "TRANSPORT",
    "DEFAULT_SCHEMA",
    "KEEP",
    "Batch",
    "Broker",
    "Channel",
    "ChannelBusy",
    "ChannelFull",
    "ChannelInfo",
    "ConfigurationError",
    "ConnectionLost",
    "CreateResult",
    "Created",
    "DatabaseError",
    "Deduplicated",
    "DequeueResult",
    "Dropped",
    "InvalidArgument",
    "InvalidName",
    "ListenUnavailable",
    "LonnyMQError",
    "Message",
    "MessageLocked",
    "MessageNotFound",
    "MessageTooLarge",
    "Outcome",
    "PermissionDenied",
    "Pending",
    "Policy",
    "Queue",
    "QueueStats",
    "Rate",
    "SchemaError",
    "SchemaNotInstalled",
    "SchemaTooNew",
    "UnsupportedServer",
    "grant",
    "install",
    "migrations",
    "revoke",
    "transaction",
]
