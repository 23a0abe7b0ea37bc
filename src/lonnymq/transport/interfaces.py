"""What the parts of the transport use of one another, as protocols.

The kombu :class:`~lonnymq.transport.transport.Transport` makes the channels, the event-loop
consumer (:mod:`.loop`) and the heartbeat (:mod:`.heartbeat`) and hands itself to them; a
channel makes its :class:`~lonnymq.transport.qos.QoS`. Each of those sees its maker through
a protocol of this module, not through its class, so that imports go one way only: the
transport imports its parts, and the parts import this module (and the queue API).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from ..queue._ops import Op
from ..queue.dequeue import DequeueResult, Message
from .acks import Ack, AckBuffer, Held
from .connection import PgClient, Waiter
from .headers import QueueArguments
from .options import Options
from .registry import Registry
from .sleep import SleepKeys

T = TypeVar("T")
#: where a delivered message came from: (queue, channel, attempts)
Where = tuple[str, str, int]
#: a dequeued message and its kombu payload, ready to deliver
Delivery = tuple[Message, dict[str, Any]]
#: a planned fetch: (kombu channel, queues, limit)
Job = tuple["ChannelLike", list[str], int]


class HeldLocks(Protocol):
    """A channel's QoS as the heartbeat sees it: the locks of the messages it holds."""

    def held(self) -> list[Held]: ...


class ChannelLike(Protocol):
    """A kombu channel of the transport (:class:`~lonnymq.transport.channel.Channel`), as
    its QoS, the event-loop consumer and the heartbeat use it."""

    @property
    def closed(self) -> bool: ...

    @property
    def options(self) -> Options: ...

    @property
    def connection(self) -> TransportLike: ...

    @property
    def qos(self) -> HeldLocks: ...

    @property
    def _consumers(self) -> set[str]:
        """The consumer tags of the channel (kombu's)."""

    @property
    def _active_queues(self) -> list[str]:
        """The queues it consumes (kombu's)."""

    @property
    def _no_ack_queues(self) -> set[str]:
        """Those of them it consumes without acks."""

    @property
    def idle(self) -> bool:
        """Its last fetch found nothing."""

    @property
    def busy_rounds(self) -> int:
        """Fetches in a row that brought messages."""

    #: When to look again: what its last fetch said (it found nothing, or took all there
    #: was), or when its refill wait is over (monotonic time; None: no timer).
    retry_at: float | None

    @property
    def has_room(self) -> bool:
        """Its prefetch window can take one more message."""

    @property
    def acks_nothing(self) -> bool:
        """It consumes only without acks."""

    def fetch_plan(self) -> tuple[list[str], int] | int | None: ...

    def accept(self, result: DequeueResult) -> tuple[list[Delivery], int | None]: ...

    def unhold(self, messages: list[Message]) -> None: ...

    def _finalize(
        self,
        ref: Held,
        *,
        requeue: bool,
        why: str,
        where: Where | None = None,
        beside: bool = False,
    ) -> None: ...


class TransportLike(Protocol):
    """The kombu transport (:class:`~lonnymq.transport.transport.Transport`), as its
    channels, their QoS, the event-loop consumer and the heartbeat use it."""

    @property
    def options(self) -> Options: ...

    @property
    def pg(self) -> PgClient:
        """The command connection."""

    @property
    def side_pg(self) -> PgClient:
        """The side command connection, for acks sent beside the consumer."""

    @property
    def waiter(self) -> Waiter:
        """The LISTEN connection and the wake-up pipe."""

    @property
    def acks(self) -> AckBuffer: ...

    @property
    def channels(self) -> list[ChannelLike]:
        """The kombu channels of the connection (kombu's)."""

    @property
    def exchange_types(self) -> dict[str, str]:
        """The type of each exchange, as declared or looked up."""

    @property
    def declared(self) -> dict[str, tuple[QueueArguments, bool]]:
        """The queues this process declared: their arguments and auto_delete."""

    @property
    def bound(self) -> dict[str, set[tuple[str, str]]]:
        """The (exchange, routing key) bindings this process made, by queue."""

    @property
    def queue_expires(self) -> dict[str, int | None]:
        """The x-expires (ms) of the queues this process declared."""

    @property
    def in_event_loop(self) -> bool: ...

    def loop_acked(self) -> None: ...

    @property
    def registry(self) -> Registry:
        """The connection's consumers, registered for every process to see."""

    def consumer_op(self, op: Op[T]) -> Op[T]: ...

    @property
    def sleep(self) -> SleepKeys:
        """The ``sleep`` keys held on the LISTEN session."""

    def ack_and_dequeue(
        self, queues: list[str], limit: int, *, idle: bool = False
    ) -> DequeueResult: ...

    def prepare_dequeue(
        self, queues: list[str], limit: int, *, idle: bool = False
    ) -> tuple[list[Ack], Op[DequeueResult]] | None: ...

    def dequeued(self, acks: list[Ack], result: DequeueResult, started: float) -> None: ...

    def release(self, held: Iterable[Held]) -> None: ...

    def send_acks(self, acks: list[Ack]) -> None: ...

    def sweep(self, *, background: bool = False) -> None: ...

    def touch_seconds(self) -> float: ...

    def wake(self) -> None: ...

    def _ensure_heartbeat(self) -> None: ...

    def _deliver(self, message: Any, queue: str) -> None:
        """Hand a message to its consumer's callback (kombu's)."""
