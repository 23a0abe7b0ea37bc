"""Typed results of queue operations: expected outcomes are values, not exceptions."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Created:
    """The message was created."""

    id: int


@dataclass(frozen=True, slots=True)
class Deduplicated:
    """A never-dequeued message with the same name exists in the channel: nothing was
    created; ``id`` is the existing message."""

    id: int


@dataclass(frozen=True, slots=True)
class Dropped:
    """The channel is at its ``max_size``: nothing was created."""

    queue: str
    channel: str


CreateResult = Created | Deduplicated | Dropped


class Outcome(enum.Enum):
    """Outcome of a delete (ack) or defer of a dequeued message."""

    OK = "ok"
    #: The message is held under another lock token (its lock expired and another consumer
    #: dequeued it) or is not held at all: this holder may no longer finalize it.
    STATE_INVALID = "state_invalid"
    #: The message no longer exists (deleted already, or purged).
    NOT_FOUND = "not_found"

    def __bool__(self) -> bool:
        return self is Outcome.OK


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counters of a queue. ``ready`` and ``delayed`` are None unless counted."""

    queue: str
    total: int
    in_flight: int
    ready: int | None
    delayed: int | None
    channels: int
    max_concurrency: int | None
    max_size: int | None

    @property
    def waiting(self) -> int:
        """Messages not held by a consumer (ready and delayed)."""
        return self.total - self.in_flight
