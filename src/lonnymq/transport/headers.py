"""How a kombu message's headers and properties map onto a lonnymq create (tenant channel,
de-duplication name, delay, priority, time to live), and a queue's declare arguments onto its
settings."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from typing import Any

from ..exceptions import InvalidArgument


def int_arg(arguments: dict[str, Any], key: str) -> int | None:
    value = arguments.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"queue argument {key} must be an integer, not {value!r}") from None


@dataclass(frozen=True, slots=True)
class QueueArguments:
    """What lonnymq does with a queue's declare arguments (kombu's ``Queue(expires=,
    message_ttl=, max_length=, max_priority=)`` arrive as these, in milliseconds, through
    ``Channel.prepare_queue_arguments``)."""

    #: ``x-expires``: the queue goes when unused (no consumer, no declare) that long
    expires_ms: int | None
    #: ``x-message-ttl``: a message not delivered within that long after it is due goes
    message_ttl_ms: int | None
    #: ``x-max-length``: the queue's default ``max_size`` (each channel without a policy of
    #: its own holds at most that many; a publish over it raises ChannelFull)
    max_length: int | None
    #: ``x-max-priority``: checked (1-255); priorities 0-255 are always honoured
    max_priority: int | None


_OVERFLOW_OK = (None, "reject-publish")


def queue_arguments(arguments: dict[str, Any]) -> QueueArguments:
    """The declare arguments lonnymq honours, checked; one it cannot honour is an error
    (:class:`InvalidArgument`) rather than silently ignored."""
    if arguments.get("x-max-length-bytes") is not None:
        raise InvalidArgument(
            "queue argument x-max-length-bytes (kombu's max_length_bytes) is not supported "
            "by lonnymq: limit the number of messages with x-max-length (max_length), and "
            "the size of each with the max_message_bytes transport option"
        )
    overflow = arguments.get("x-overflow")
    if overflow not in _OVERFLOW_OK:
        raise InvalidArgument(
            f"queue argument x-overflow={overflow!r} is not supported by lonnymq: a full "
            "queue refuses the publish (lonnymq.ChannelFull), as with 'reject-publish'; it "
            "never drops the oldest message"
        )
    max_length = int_arg(arguments, "x-max-length")
    if max_length is not None and not 0 <= max_length <= 2**31 - 1:
        raise InvalidArgument(
            f"queue argument x-max-length must be between 0 and {2**31 - 1}, not {max_length}"
        )
    max_priority = int_arg(arguments, "x-max-priority")
    if max_priority is not None and not 1 <= max_priority <= 255:
        raise InvalidArgument(
            f"queue argument x-max-priority must be between 1 and 255 (message priorities "
            f"are 0-255), not {max_priority}"
        )
    return QueueArguments(
        expires_ms=int_arg(arguments, "x-expires"),
        message_ttl_ms=int_arg(arguments, "x-message-ttl"),
        max_length=max_length,
        max_priority=max_priority,
    )


#: kombu's ``Queue(...)`` keywords in seconds (amqp's ``x-`` arguments are in ms), and the
#: least each may be.
_KOMBU_SECONDS = {"expires": 0.001, "message_ttl": 0.0}
#: kombu's ``Queue(...)`` keywords that are counts, and their ranges.
_KOMBU_COUNTS = {"max_length": (0, 2**31 - 1), "max_priority": (1, 255)}


def check_kombu_queue_kwargs(options: dict[str, Any]) -> None:
    """kombu's ``Queue(expires=, message_ttl=, max_length=, max_priority=)``, checked in the
    caller's units (seconds, for the first two) before kombu turns them into amqp's ``x-``
    arguments in milliseconds, so that an error speaks of what the caller wrote
    (``message_ttl=-1``, not ``-1000``)."""
    for key, low in _KOMBU_SECONDS.items():
        value = options.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value != value or not low <= value <= 2**62 / 1000:
            least = "0" if low == 0 else f"{low} (1 ms)"
            raise InvalidArgument(
                f"Queue({key}={value!r}): {key} is in seconds (x-{key.replace('_', '-')} is "
                f"its milliseconds) and must be a number of at least {least}"
            )
    for key, (lo, hi) in _KOMBU_COUNTS.items():
        value = options.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(
                f"Queue({key}={value!r}): {key} (x-{key.replace('_', '-')}) must be an int "
                f"from {lo} to {hi}"
            )


def str_or_none(value: Any, what: str) -> str | None:
    """A name header (``x-channel``, ``x-dedup-name``): a string, or an int (a tenant's id),
    taken as its digits; None when absent or empty."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise InvalidArgument(f"the {what} header must be a string (or an int), not {value!r}")


def priority(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise InvalidArgument(f"message priority must be an int from 0 to 255, not {value!r}")
    return value


def expiration_ms(value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"message expiration must be milliseconds, not {value!r}") from None
    if ms != ms or ms < 0:  # (RabbitMQ refuses it too: the message was dropped at once)
        raise InvalidArgument(f"message expiration must be milliseconds >= 0, not {value!r}")
    return ms


def is_celery_task(headers: dict[str, Any]) -> bool:
    """Whether a message is a Celery task (message protocol 2: ``task`` and ``id`` headers)."""
    return bool(headers.get("task")) and bool(headers.get("id"))


def ttl_ms(headers: dict[str, Any], properties: dict[str, Any]) -> float | None:
    """A message's time to live (ms): its ``expiration`` property, except for a Celery task
    with an ``expires``. Celery sends ``expires`` as the message's expiration too; a broker
    that drops such a message when it expires leaves the task PENDING for ever
    (``result.get()`` waits, monitoring never hears of it). Kept until a worker receives it,
    the worker revokes it as expired (REVOKED, ``TaskRevokedError``, a ``task-revoked``
    event), as on RabbitMQ and Redis."""
    if is_celery_task(headers) and headers.get("expires"):
        return None
    return expiration_ms(properties.get("expiration"))


def celery_zone() -> tzinfo:
    """The zone a naive ``eta`` is in: the current Celery app's ``timezone`` setting (UTC
    when unset and ``enable_utc`` is on, as in Celery) when Celery is loaded, else UTC."""
    celery = sys.modules.get("celery")
    if celery is not None:
        try:
            zone = celery.current_app.timezone
        except Exception:  # a half-configured app: fall back to UTC
            return timezone.utc
        if isinstance(zone, tzinfo):
            return zone
    return timezone.utc


def _parse_eta(eta: Any) -> datetime:
    if isinstance(eta, datetime):
        return eta
    if isinstance(eta, str):
        try:
            return datetime.fromisoformat(eta)
        except ValueError:
            raise InvalidArgument(f"eta header is not an ISO 8601 datetime: {eta!r}") from None
    raise InvalidArgument(f"eta header is not a datetime: {eta!r}")


def make_eta_aware(headers: dict[str, Any], zone: tzinfo | None = None) -> None:
    """Give a naive ``eta`` header the zone of the Celery app (``zone``, else
    :func:`celery_zone`), in place, so that the due time stored in Postgres and the eta the
    worker reads agree (a Celery worker would otherwise take a naive eta as UTC)."""
    eta = headers.get("eta")
    if not eta:
        return
    when = _parse_eta(eta)
    if when.tzinfo is None:
        headers["eta"] = when.replace(tzinfo=zone or celery_zone()).isoformat()


def delay_ms(headers: dict[str, Any]) -> float:
    """Delay from Celery's ``eta`` header (ISO 8601; a naive one is in the zone of
    :func:`celery_zone`, see :func:`make_eta_aware`) or ``x-delay-ms``."""
    if headers.get("x-delay-ms") is not None:
        try:
            if isinstance(headers["x-delay-ms"], bool):
                raise TypeError
            delay = float(headers["x-delay-ms"])
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"x-delay-ms must be a number of milliseconds, not {headers['x-delay-ms']!r}"
            ) from None
        if delay != delay or delay < 0:
            raise InvalidArgument(
                f"x-delay-ms must be a number of milliseconds >= 0, not {headers['x-delay-ms']!r}"
            )
        return delay
    eta = headers.get("eta")
    if not eta:
        return 0.0
    when = _parse_eta(eta)
    if when.tzinfo is None:
        when = when.replace(tzinfo=celery_zone())
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds() * 1000)
