"""Validation of arguments before they reach Postgres: every bad value gets a clear, typed
error naming the problem, and nothing is written."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from typing import Protocol

from ..exceptions import ConfigurationError, InvalidArgument, InvalidName, MessageTooLarge

MAX_NAME_LENGTH = 255
MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000  # ten years
MAX_LOCK_MS = 366 * 24 * 3600 * 1000  # a year
MAX_LIMIT = 10_000
MAX_PRIORITY = 255
MAX_INT4 = 2**31 - 1
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
Content = bytes | bytearray | memoryview | str


def name(value: object, what: str) -> str:
    """A name (a queue, a channel...): as :func:`optional_key`, and not empty."""
    key = optional_key(value, f"{what} name")
    if not key:
        raise InvalidName(f"{what} name must not be empty")
    return key


def optional_key(value: object, what: str) -> str:
    """A name that may be empty (an exchange, a routing key): a str of at most
    ``MAX_NAME_LENGTH`` characters, no NUL, valid UTF-8."""
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a str, not {type(value).__name__}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidName(
            f"{what} is {len(value)} characters long, over the limit of {MAX_NAME_LENGTH}"
        )
    if "\x00" in value:
        raise InvalidName(f"{what} must not contain NUL characters")
    _utf8(value, what, InvalidName)
    return value


def _utf8(value: str, what: str, error: type[ConfigurationError]) -> bytes:
    """``value`` encoded; a str that cannot be (a lone surrogate) is a clear error."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end]
        raise error(
            f"{what} is not valid Unicode text: {bad!r} at position {exc.start} cannot be "
            "encoded as UTF-8"
        ) from None


def optional_name(value: object, what: str) -> str | None:
    return None if value is None else name(value, what)


def content(value: object, limit: int) -> bytes:
    if isinstance(value, str):
        data = _utf8(value, "message content", InvalidArgument)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise InvalidArgument(f"message content must be bytes or str, not {type(value).__name__}")
    if len(data) > limit:
        raise MessageTooLarge(len(data), limit)
    return data


def message(
    name: object, body: object, priority: object, delay_ms: object, ttl_ms: object, limit: int
) -> tuple[str | None, bytes, int, int, int | None]:
    """What a create and a publish say of the message: its name, content (at most ``limit``
    bytes), priority, delay and time to live, checked in that order."""
    return (
        optional_name(name, "message"),
        content(body, limit),
        integer(priority, "priority", low=0, high=MAX_PRIORITY),
        milliseconds(delay_ms, "delay_ms", low=0, high=MAX_DELAY_MS),
        None if ttl_ms is None else milliseconds(ttl_ms, "ttl_ms", low=0, high=MAX_DELAY_MS),
    )


def optional_bytes(value: object, what: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"{what} must be bytes or None, not {type(value).__name__}")


def milliseconds(value: object, what: str, *, low: int, high: int) -> int:
    """A duration in milliseconds (int or float, rounded up) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of milliseconds, not {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{what} must be finite, not {value!r}")
        value = math.ceil(value)
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be between {low} and {high} ms, not {value}")
    return int(value)


def integer(value: object, what: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an int, not {value!r}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be between {low} and {high}, not {value}")
    return value


#: The largest id a message (a Postgres bigint) can have.
MAX_ID = 2**63 - 1


def message_id(value: object, what: str = "message id") -> int:
    """A message's id: an int from 1 to :data:`MAX_ID`."""
    return integer(value, what, low=1, high=MAX_ID)


def lock_token(value: object, what: str = "lock token") -> uuid.UUID:
    """A held message's lock token: a UUID (or its text)."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidArgument(f"{what} must be a UUID (a held message's lock_token), not {value!r}")


class HeldMessage(Protocol):
    """A held message as the API gives it back (:class:`lonnymq.Message`)."""

    @property
    def id(self) -> int: ...
    @property
    def lock_token(self) -> uuid.UUID: ...


#: A held message given to an ack, a heartbeat or a dequeue's acks: a Message or the pair.
Held = HeldMessage | tuple[int, uuid.UUID]


def held_pair(message_id_: object, token: object) -> tuple[int, uuid.UUID]:
    """One held message's (id, lock token), checked."""
    return message_id(message_id_), lock_token(token)


def held(values: Iterable[object], what: str = "held message") -> list[tuple[int, uuid.UUID]]:
    """Held messages as (id, lock token) pairs: each a Message (anything with ``id`` and
    ``lock_token``) or such a pair."""
    pairs = []
    for value in values:
        if isinstance(value, tuple) and len(value) == 2:
            ident, token = value
        elif hasattr(value, "id") and hasattr(value, "lock_token"):
            ident, token = value.id, value.lock_token
        else:
            raise InvalidArgument(
                f"a {what} is a Message or an (id, lock_token) pair, not {value!r}"
            )
        pairs.append(held_pair(ident, token))
    return pairs


def boolean(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, not {value!r}")
    return value


def limit_or_none(value: object, what: str) -> int | None:
    return None if value is None else integer(value, what, low=0, high=MAX_INT4)


def queues(values: object) -> list[str]:
    if isinstance(values, str) or not isinstance(values, (list, tuple, set, frozenset)):
        raise InvalidArgument("queues must be a list of queue names")
    out = [name(v, "queue") for v in values]
    if not out:
        raise InvalidArgument("queues must name at least one queue")
    return out
