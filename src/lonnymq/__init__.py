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

import functools
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
    """Make ``lonnymq://`` URLs work in kombu and Celery (kombu has no entry point for this),
    and fill a kombu ``Connection``'s fields from such a URL when it is made (see
    :func:`_fill_fields_when_made`)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault("lonnymq", TRANSPORT)
    _fill_fields_when_made()


def _is_lonnymq(transport: Any) -> bool:
    """Whether a kombu Connection's ``transport_cls`` (an alias, a class path or a class) is
    lonnymq's transport (or a subclass), without importing anything."""
    if isinstance(transport, str):
        from kombu.transport import TRANSPORT_ALIASES

        return TRANSPORT_ALIASES.get(transport, transport) == TRANSPORT
    return getattr(transport, "driver_type", None) == "lonnymq"


def _fill_fields_when_made() -> None:
    """kombu parses the URLs of amqp and redis into the Connection's fields (``hostname``,
    ``port``, ``userid``, ``password``, ``virtual_host``) when the Connection is made; it
    leaves a URL whole for a transport that parses its own (``can_parse_url``), as lonnymq
    must (libpq's URLs say more than kombu's parser takes). kombu has no hook for that, so
    ``Connection.__init__`` is wrapped once: for a lonnymq URL it then fills the fields, and
    the transport option ``connection_params`` with the URL's libpq parameters, as
    :func:`lonnymq.transport.url.adopt_url` does (after kombu set ``transport_options``). A URL
    that does not parse is left as it is, for the transport to refuse on first use."""
    from kombu.connection import Connection

    init: Any = Connection.__init__
    if getattr(init, "_lonnymq", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        hostname = self.hostname
        if isinstance(hostname, str) and "://" in hostname and _is_lonnymq(self.transport_cls):
            from .transport.url import fill_fields

            fill_fields(self)

    __init__._lonnymq = True  # type: ignore[attr-defined]
    Connection.__init__ = __init__  # type: ignore[method-assign]


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
