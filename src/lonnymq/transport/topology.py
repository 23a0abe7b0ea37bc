"""The exchanges, queues and bindings of a kombu channel, kept in Postgres so that every
process routes alike (:class:`TopologyChannel`); the :class:`~lonnymq.transport.channel.Channel`
adds publishing and consuming to it."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from amqp.exceptions import PreconditionFailed
from amqp.protocol import queue_declare_ok_t
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from ..exceptions import InvalidArgument
from ..queue._ops import Op, run
from ..queue.consumers import consumer_list_op
from ..queue.policy import queue_get_op, queue_set_op
from ..queue.queues import delete_queue_op, purge_op, queue_declare_op, queue_exists_op, stats_op
from ..queue.routing import (
    all_bindings_op,
    bind_op,
    bindings_op,
    exchange_declare_op,
    exchange_delete_op,
    exchange_type_op,
    topic_pattern,
    unbind_op,
)
from .headers import QueueArguments, check_kombu_queue_kwargs, queue_arguments
from .interfaces import TransportLike
from .options import Options


class TopologyChannel(virtual.Channel):
    """A kombu channel's declarations: exchanges (direct, topic, fanout), queues with their
    arguments, bindings, all stored in the schema."""

    connection: TransportLike

    # -- helpers -----------------------------------------------------------------------------

    @property
    def options(self) -> Options:
        return self.connection.options

    def _run(self, op: Op[Any]) -> Any:
        return self.connection.pg.run(op)

    def _exchange_type(self, exchange: str) -> str:
        cache = self.connection.exchange_types
        if exchange not in cache:
            found = self._run(exchange_type_op(self.options.schema, exchange))
            if found is None:
                return "direct"
            cache[exchange] = found
        return cache[exchange]

    # -- exchanges, queues, bindings -----------------------------------------------------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        type = type or "direct"
        exchange = exchange or f"amq.{type}"
        if passive:
            if self._run(exchange_type_op(self.options.schema, exchange)) is None:
                raise ChannelError(
                    f"NOT_FOUND - no exchange {exchange!r}",
                    (50, 10),
                    "Channel.exchange_declare",
                    "404",
                )
            return
        op = exchange_declare_op(
            self.options.schema, exchange, type, durable=durable, auto_delete=auto_delete
        )
        try:
            self._run(op)
        except InvalidArgument as exc:  # (it exists with another type: as RabbitMQ refuses it)
            if getattr(exc.__cause__, "sqlstate", None) != "LM001":
                raise
            raise PreconditionFailed(
                f"PRECONDITION_FAILED - {exc}", (40, 10), "Channel.exchange_declare", 406
            ) from exc
        self.connection.exchange_types[exchange] = type

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self._run(exchange_delete_op(self.options.schema, exchange))
        self.connection.exchange_types.pop(exchange, None)

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        queue = queue or f"amq.gen-{uuid.uuid4()}"
        if passive:
            if not self._run(queue_exists_op(self.options.schema, queue)):
                raise ChannelError(
                    f"NOT_FOUND - no queue {queue!r}", (50, 10), "Channel.queue_declare", "404"
                )
            # (a passive declare, to look at a queue, counts its consumers as RabbitMQ does;
            # a declare, which Celery's rpc:// client makes before every task, does not look)
            consumers = len(self._run(consumer_list_op(self.options.schema, queue)))
            return queue_declare_ok_t(queue, self._size(queue), consumers)
        arguments = queue_arguments(kwargs.get("arguments") or {})
        waiting = self._declare(queue, arguments, auto_delete=bool(kwargs.get("auto_delete")))
        return queue_declare_ok_t(queue, waiting, 0)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """kombu's ``Queue(expires=, message_ttl=, max_length=, max_length_bytes=,
        max_priority=)`` as the ``x-`` arguments of amqp (seconds become milliseconds), as
        kombu's amqp and redis transports map them; ``queue_declare`` then takes both
        spellings alike (see ``queue_arguments``)."""
        check_kombu_queue_kwargs(kwargs)
        return to_rabbitmq_queue_arguments(arguments or {}, **kwargs)

    def _declare(self, queue: str, arguments: QueueArguments, *, auto_delete: bool) -> int:
        """Declare ``queue`` with its arguments (``auto_delete``: it goes when its last
        consumer does); ``x-max-length`` sets the queue's default ``max_size`` (in the same
        transaction; only when it differs, so that a role without policy rights may
        redeclare). Returns the messages waiting."""
        schema = self.options.schema
        op = queue_declare_op(
            schema,
            queue,
            expires_ms=arguments.expires_ms,
            message_ttl_ms=arguments.message_ttl_ms,
            auto_delete=auto_delete,
            max_priority=arguments.max_priority,
        )
        if arguments.max_length is None:
            waiting, _ = self._run(op)
        else:
            with self.connection.pg.locked() as conn, conn.transaction():
                waiting, _ = run(conn, op)
                default = run(conn, queue_get_op(schema, queue))
                if default.max_size != arguments.max_length:
                    run(
                        conn,
                        queue_set_op(schema, queue, default.max_concurrency, arguments.max_length),
                    )
        self.connection.queue_expires[queue] = arguments.expires_ms
        self.connection.declared[queue] = (arguments, auto_delete)
        return int(waiting)

    def redeclare(self, queue: str) -> bool:
        """Declare ``queue`` again with the arguments and bindings this process gave it (it
        went while consumed: its consumers were presumed gone during a long cut from the
        database, as RabbitMQ drops an auto_delete queue with a connection it lost); whether
        this process had declared it."""
        known = self.connection.declared.get(queue)
        if known is None:
            return False
        arguments, auto_delete = known
        self._declare(queue, arguments, auto_delete=auto_delete)
        for exchange, routing_key in sorted(self.connection.bound.get(queue, ())):
            self.queue_bind(queue, exchange, routing_key)
        return True

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        kind = self._exchange_type(exchange)
        pattern = topic_pattern(routing_key or "") if kind == "topic" else None
        self._run(bind_op(self.options.schema, exchange, routing_key or "", queue, pattern))
        self.connection.bound.setdefault(queue, set()).add((exchange, routing_key or ""))

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        self._run(unbind_op(self.options.schema, exchange, routing_key, queue))
        self.connection.bound.get(queue, set()).discard((exchange, routing_key))

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int | None:
        # (a queue that is not empty, or has a consumer of any process, is not deleted when
        # asked so: as on kombu's other transports, the call returns None)
        if if_empty and self._size(queue):
            return None
        if if_unused and self._run(consumer_list_op(self.options.schema, queue)):
            return None
        self._forget(queue)
        return int(self._run(delete_queue_op(self.options.schema, queue)))

    def _forget(self, queue: str) -> None:
        """A queue deleted on purpose is not declared again (see :meth:`redeclare`)."""
        self.connection.declared.pop(queue, None)
        self.connection.bound.pop(queue, None)

    def after_reply_message_received(self, queue: str) -> None:
        """kombu's virtual transports delete a pidbox reply queue after each collection of
        replies (``celery inspect``, mingle). As on RabbitMQ, that queue is ``auto_delete``
        (and has an ``x-expires``): it goes when its last consumer cancels, which takes no
        right to delete queues (a worker role has none), and not while another process
        still collects from it."""

    def queue_purge(self, queue: str, **kwargs: Any) -> int:
        return int(self._run(purge_op(self.options.schema, queue)))

    def _purge(self, queue: str) -> int:
        return self.queue_purge(queue)

    def _size(self, queue: str) -> int:
        stats = self._run(stats_op(self.options.schema, queue, count_ready=False))
        return int(stats.waiting)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._forget(queue)
        self._run(delete_queue_op(self.options.schema, queue))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self._run(queue_exists_op(self.options.schema, queue)))

    def get_table(self, exchange: str) -> list[tuple[str, str | None, str]]:
        rows = self._run(bindings_op(self.options.schema, exchange))
        return [(rkey, pattern, queue) for _, rkey, queue, pattern in rows]

    def list_bindings(self) -> Iterable[tuple[str, str, str]]:
        return iter(self._run(all_bindings_op(self.options.schema)))

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        return self.exchange_types[self._exchange_type(exchange) or default]
