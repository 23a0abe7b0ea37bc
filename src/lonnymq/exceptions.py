"""Errors raised by lonnymq.

Every error derives from :class:`LonnyMQError`. Expected outcomes of queue operations (a
de-duplicated create, a stale lock token) are result values, not exceptions; see
:mod:`lonnymq.queue.results`. Driver (psycopg) errors are translated at the boundary and keep
the original as ``__cause__``.
"""

from __future__ import annotations


class LonnyMQError(Exception):
    """Root of every lonnymq error."""


class ConfigurationError(LonnyMQError, ValueError):
    """An option, URL or argument has an invalid value."""


class InvalidName(ConfigurationError):
    """A schema, queue, channel or message name is not acceptable."""


class InvalidArgument(ConfigurationError):
    """An argument of a queue operation is out of range (delay, priority, limit...)."""


class MessageTooLarge(InvalidArgument):
    """The message content is larger than the configured maximum."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"message content is {size} bytes, over the limit of {limit} bytes "
            "(raise max_message_bytes to accept larger messages)"
        )
        self.size = size
        self.limit = limit


class ListenUnavailable(ConfigurationError):
    """A consumer's LISTEN connection goes through a connection pooler in transaction mode,
    where notifications cannot reach it: set the transport option ``listen_dsn`` to a direct
    connection, or ``use_listen=False`` to poll (see docs/operations.md, "Behind PgBouncer")."""


class ChannelFull(LonnyMQError):
    """A create was refused because the channel holds ``max_size`` messages already.

    Nothing was written: the producer must retry later or drop the message itself.
    """

    def __init__(self, queue: str, channel: str) -> None:
        super().__init__(
            f"channel {channel!r} of queue {queue!r} is full (at its max_size); "
            "the message was not enqueued"
        )
        self.queue = queue
        self.channel = channel


class ChannelBusy(LonnyMQError):
    """A create into a channel with a ``max_size`` waited too long for another producer of
    that channel: producers of a limited channel take turns on its count until their
    transactions end, and one has kept its transaction open for longer than the wait (5 s).

    Nothing was written; retry, and keep transactions that create into limited channels short.
    Channels without a ``max_size`` never wait for one another.
    """


class MessageNotFound(LonnyMQError):
    """No waiting message has that id: it was never created, was acked or removed, or is a
    dead letter (``dead``: retry it first, see :meth:`lonnymq.Broker.retry`)."""

    def __init__(self, message_id: int, *, dead: bool = False) -> None:
        if dead:
            text = (
                f"message {message_id} is a dead letter; put it back with "
                f"`lonnymq messages retry {message_id}` first"
            )
        else:
            text = f"no message {message_id} (acked, removed, or never created)"
        super().__init__(text)
        self.message_id = message_id
        self.dead = dead


class MessageLocked(LonnyMQError):
    """The message is in flight: a consumer holds its lock (or held it, and it waits to be
    taken over once the lock expired). Only ready and delayed messages may be changed."""

    def __init__(self, message_id: int) -> None:
        super().__init__(
            f"message {message_id} is in flight (locked by a consumer); only a ready or "
            "delayed message can be changed"
        )
        self.message_id = message_id


class SchemaError(LonnyMQError):
    """The lonnymq schema in the database is missing, incomplete or of another version."""


class SchemaNotInstalled(SchemaError):
    """The schema (or part of it) is not installed."""

    def __init__(self, schema: str, detail: str = "") -> None:
        message = (
            f"the lonnymq schema {schema!r} is not installed (or is incomplete) in this "
            f"database; run `lonnymq migrate --schema {schema}` or call "
            "lonnymq.install(conn, schema=...)"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)
        self.schema = schema


class SchemaTooNew(SchemaError):
    """The schema was installed by a newer lonnymq; this version refuses to touch it."""

    def __init__(self, schema: str, installed: int, known: int) -> None:
        super().__init__(
            f"the lonnymq schema {schema!r} is at version {installed}, newer than the "
            f"version {known} this lonnymq knows; upgrade lonnymq"
        )
        self.schema = schema
        self.installed = installed
        self.known = known


class UnsupportedServer(LonnyMQError):
    """The Postgres server is older than the oldest version lonnymq supports; refused at
    install, before anything is written."""

    def __init__(self, version: str, oldest: int, newest: int) -> None:
        super().__init__(
            f"PostgreSQL {version} is not supported: lonnymq needs PostgreSQL {oldest} or "
            f"newer (it is tested on {oldest} to {newest}); nothing was installed. Upgrade "
            "the server, or point lonnymq at a newer one"
        )
        self.version = version
        self.oldest = oldest


class DatabaseError(LonnyMQError):
    """Postgres reported an error that lonnymq does not expect."""


class ConnectionLost(DatabaseError):
    """The connection to Postgres failed or was closed; the operation may be retried."""


class PermissionDenied(DatabaseError):
    """The database role may not do this: grant it the lonnymq role it needs
    (``lonnymq grant producer|worker|admin ROLE``, see :func:`lonnymq.grant`)."""
