"""Exchanges, bindings and publish-with-routing: the operations the Kombu transport maps its
exchange and bind hooks onto. Routing happens inside Postgres, so a publish to any exchange
is one round trip and every process sees the same bindings."""

from __future__ import annotations

from dataclasses import dataclass

from .._compat import LiteralString
from ..exceptions import InvalidArgument
from . import _checks
from ._ops import Op, Rows, no_result, render

_PUBLISH: LiteralString = (
    "SELECT queue_name, result_code, message_id FROM {schema}.message_publish_v2("
    "%s::text, %s::text, %s::text, %s::text, %s::bytea, %s::integer, %s::bigint, %s::bigint, "
    "%s::boolean)"
)
_EXCHANGE_DECLARE: LiteralString = (
    "SELECT {schema}.exchange_declare_v1(%s::text, %s::text, %s::boolean, %s::boolean)"
)
_EXCHANGE_DELETE: LiteralString = "SELECT {schema}.exchange_delete_v1(%s::text)"
_EXCHANGE_GET: LiteralString = "SELECT type FROM {schema}.exchange WHERE name = %s"
_BIND: LiteralString = "SELECT {schema}.queue_bind_v1(%s::text, %s::text, %s::text, %s::text)"
_UNBIND: LiteralString = "SELECT {schema}.queue_unbind_v1(%s::text, %s::text, %s::text)"
_BINDINGS: LiteralString = (
    "SELECT b.exchange, b.routing_key, b.queue, b.pattern FROM {schema}.binding b "
    "WHERE b.exchange = %s ORDER BY b.routing_key, b.queue"
)
_ALL_BINDINGS: LiteralString = (
    "SELECT b.queue, b.exchange, b.routing_key FROM {schema}.binding b "
    "ORDER BY b.exchange, b.routing_key, b.queue"
)

EXCHANGE_TYPES = ("direct", "topic", "fanout")


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a publish went: one (queue, result) per queue reached; empty when unroutable."""

    results: list[tuple[str, str, int | None]]

    @property
    def queues(self) -> list[str]:
        return [queue for queue, _, _ in self.results]

    @property
    def dropped(self) -> list[str]:
        """Queues whose channel was full (nothing was written there)."""
        return [queue for queue, code, _ in self.results if code == "dropped"]


def publish_op(
    schema: str,
    exchange: str,
    routing_key: str,
    content: object,
    *,
    channel: str | None = None,
    name: str | None = None,
    delay_ms: float = 0,
    priority: int = 0,
    ttl_ms: float | None = None,
    max_message_bytes: int = _checks.DEFAULT_MAX_MESSAGE_BYTES,
    handoff: bool = False,
) -> Op[Routed]:
    """Publish ``content`` through ``exchange`` with ``routing_key``. ``handoff`` (schema
    version 21): the publish commits at once (not in a caller's transaction that goes on), so
    a message due now may be handed to a consumer asleep on its queue, locked for it from
    the create on (see docs/design.md, "The hand-off")."""
    _checks.optional_key(exchange, "exchange name")
    _checks.optional_key(routing_key, "routing key")
    if not exchange:
        _checks.name(routing_key, "queue")
    params = (
        exchange,
        routing_key,
        None if channel is None else _checks.name(channel, "channel"),
        *_checks.message(name, content, priority, delay_ms, ttl_ms, max_message_bytes),
        bool(handoff),
    )

    def parse(rows: Rows) -> Routed:
        return Routed([(r[0], r[1], r[2]) for r in rows])

    return Op(schema, render(_PUBLISH, schema), params, parse)


def exchange_declare_op(
    schema: str, exchange: str, type: str, *, durable: bool = True, auto_delete: bool = False
) -> Op[None]:
    if type not in EXCHANGE_TYPES:
        raise InvalidArgument(
            f"exchange type {type!r} is not supported (use one of {', '.join(EXCHANGE_TYPES)})"
        )
    params = (_checks.name(exchange, "exchange"), type, bool(durable), bool(auto_delete))
    return Op(schema, render(_EXCHANGE_DECLARE, schema), params, no_result)


def exchange_delete_op(schema: str, exchange: str) -> Op[None]:
    return Op(
        schema, render(_EXCHANGE_DELETE, schema), (_checks.name(exchange, "exchange"),), no_result
    )


def exchange_type_op(schema: str, exchange: str) -> Op[str | None]:
    def parse(rows: Rows) -> str | None:
        return str(rows[0][0]) if rows else None

    exchange = _checks.optional_key(exchange, "exchange name")
    return Op(schema, render(_EXCHANGE_GET, schema), (exchange,), parse)


def _literal(word: str) -> str:
    """``word`` as a Postgres regular expression matching itself: each ASCII character that is
    not a letter or digit is backslash-escaped (a backslash before a letter or digit would
    start an escape such as ``\\d``; other characters are not special)."""
    return "".join("\\" + c if c.isascii() and not c.isalnum() else c for c in word)


def topic_pattern(binding_key: str) -> str:
    """The Postgres regular expression of an AMQP topic binding key. Words are separated by
    dots; a word that is exactly ``*`` matches one word, exactly ``#`` zero or more words;
    any other word (``a*``, ``#b``) matches itself literally."""
    words: list[str] = []
    for word in binding_key.split("."):
        if not (word == "#" and words and words[-1] == "#"):  # "#.#" is "#"
            words.append(word)
    if words == ["#"]:
        return "^.*$"
    parts: list[str] = []
    for i, word in enumerate(words):
        if word == "#":
            # first: zero or more "word." before the next word; else: zero or more ".word"
            parts.append("(?:[^.]*\\.)*" if i == 0 else "(?:\\.[^.]*)*")
            continue
        if i > 0 and not (i == 1 and words[0] == "#"):
            parts.append("\\.")
        parts.append("[^.]*" if word == "*" else _literal(word))
    return "^" + "".join(parts) + "$"


def bind_op(
    schema: str, exchange: str, routing_key: str, queue: str, pattern: str | None
) -> Op[None]:
    params = (
        _checks.name(exchange, "exchange"),
        _checks.optional_key(routing_key, "binding key"),
        _checks.name(queue, "queue"),
        pattern,
    )
    return Op(schema, render(_BIND, schema), params, no_result)


def unbind_op(schema: str, exchange: str, routing_key: str, queue: str) -> Op[None]:
    params = (
        _checks.name(exchange, "exchange"),
        _checks.optional_key(routing_key, "binding key"),
        _checks.name(queue, "queue"),
    )
    return Op(schema, render(_UNBIND, schema), params, no_result)


def bindings_op(schema: str, exchange: str) -> Op[list[tuple[str, str, str, str | None]]]:
    def parse(rows: Rows) -> list[tuple[str, str, str, str | None]]:
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    exchange = _checks.optional_key(exchange, "exchange name")
    return Op(schema, render(_BINDINGS, schema), (exchange,), parse)


def all_bindings_op(schema: str) -> Op[list[tuple[str, str, str]]]:
    def parse(rows: Rows) -> list[tuple[str, str, str]]:
        return [(r[0], r[1], r[2]) for r in rows]

    return Op(schema, render(_ALL_BINDINGS, schema), (), parse)
