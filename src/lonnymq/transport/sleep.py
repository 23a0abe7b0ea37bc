"""Which queues an idle consumer sleeps on: the ``sleep`` keys its LISTEN session holds.

A producer sends a NOTIFY only while some session holds the ``sleep`` key of its queue
(``wake_v1``), so that a busy queue's producers pay for none. A transport holds, on its
LISTEN session, the keys of every queue that one of its consuming kombu channels found empty
on its last fetch (its *idle* channels): a publish to any of them wakes it, whichever channel
consumes it. A Celery worker's task queues, its pidbox, gossip and event queues and an rpc
reply queue are all kombu channels of one connection, fetched one after the other.

The keys live on the LISTEN session, not on the command connection: they go with the LISTEN
when that connection is lost (and come back with it), and a transaction-mode pooler between
the commands and Postgres cannot hand them to another client.

Taking a key races a producer that looked for sleepers just before. As in the dequeue's own
sleep (its step 6), the consumer takes the key, sees which of its queues have a producer
transaction open (``sleep_v1``'s answer), then looks again; while such a transaction stays
open it looks again every :data:`UNSETTLED_RETRY_MS`, and once more when it has ended.

A key is released when its queue is no longer consumed, and when the channels consuming it
delivered on two fetches in a row (a busy queue: its producers stop paying a NOTIFY each).
Released on the first delivery already, a lightly loaded queue would cost a release and a
take per message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ..queue.dequeue import sleep_op
from .connection import Waiter

#: How soon to look again while a producer transaction that may not NOTIFY is open.
UNSETTLED_RETRY_MS = 20


When = TypeVar("When", int, float)


def sooner(ms: When | None, other: When | None) -> When | None:
    """The sooner of two delays in ms, or of two due times (None: nothing is due)."""
    if ms is None:
        return other
    return ms if other is None else min(ms, other)


class Consuming(Protocol):
    """A kombu channel of the transport, as seen here."""

    @property
    def closed(self) -> bool: ...

    @property
    def _consumers(self) -> set[str]: ...

    @property
    def _active_queues(self) -> list[str]: ...

    @property
    def _no_ack_queues(self) -> set[str]: ...

    @property
    def idle(self) -> bool: ...

    @property
    def busy_rounds(self) -> int: ...

    @property
    def retry_at(self) -> float | None: ...

    @property
    def has_room(self) -> bool: ...


@dataclass(frozen=True)
class Change:
    """Keys to take and to release, queues to check for open producer transactions; and the
    queues consumed (whose notifications count as a wake-up)."""

    take: tuple[str, ...]
    drop: tuple[str, ...]
    check: tuple[str, ...]
    consumed: frozenset[str]
    #: the hand-off keys (``asleep <holder>``) to take and to release: held for the queues
    #: of channels asleep with room in their prefetch window (see :mod:`.handoff`)
    hand_take: tuple[str, ...] = ()
    hand_drop: tuple[str, ...] = ()
    #: of ``consumed``, those that no channel consumes with acks (handed without a row)
    no_ack: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Settled:
    """What applying a :class:`Change` asks of the consumer: to look again now in the
    channels of ``look_again`` (keys taken, producer transactions ended, notifications read
    meanwhile; all of them after a failure), and to look again in ``retry_ms`` (a producer
    transaction is still open)."""

    look_again: frozenset[str]
    retry_ms: int | None


@dataclass
class Wanted:
    """Which kombu channels to fetch for: ``every`` one (the fallback poll), those ``awake``
    (not asleep on their queues, see :meth:`SleepKeys.asleep`), those consuming ``queues``
    (a NOTIFY was for them, or the consumer must look again there)."""

    every: bool = False
    awake: bool = False
    queues: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return self.every or self.awake or bool(self.queues)

    def add(self, other: Wanted) -> None:
        self.every = self.every or other.every
        self.awake = self.awake or other.awake
        self.queues.update(other.queues)


class Owed:
    """Why a consumer is to fetch next: added to from any thread (a NOTIFY, an ack, a timer,
    a look owed after keys were taken), taken whole by the thread that fetches. What a call
    takes and cannot act on (it failed) it adds back."""

    def __init__(self, wanted: Wanted) -> None:
        self._wanted = wanted
        self._lock = threading.Lock()

    def add(self, wanted: Wanted) -> None:
        with self._lock:
            self._wanted.add(wanted)

    def take(self) -> Wanted:
        with self._lock:
            wanted, self._wanted = self._wanted, Wanted()
        return wanted


class SleepKeys:
    """The ``sleep`` keys one transport holds on its LISTEN session (see the module
    docstring). :meth:`plan` and :meth:`apply` are never run at the same time."""

    def __init__(self, waiter: Waiter, schema: str, handoff_lock_ms: int = 0) -> None:
        self.waiter = waiter
        self.schema = schema
        #: the lock of a message handed to this consumer (see Options.handoff_lock_ms)
        self.handoff_lock_ms = handoff_lock_ms
        #: the queues its sleeper row names, and those of them it consumes without acks
        #: (hand-offs; None: none written on this session)
        self.registered: tuple[frozenset[str], frozenset[str]] | None = None
        self.held: set[str] = set()
        #: queues whose hand-off key this session holds
        self.handing: set[str] = set()
        #: queues checked with a producer transaction open
        self.unsettled: set[str] = set()
        self._session: int | None = None

    def plan(self, channels: Iterable[Consuming]) -> Change | None:
        """What to change for ``channels`` as they are now (None: nothing, or no LISTEN
        session to hold keys on; then the consumer polls)."""
        session = self.waiter.session
        if session != self._session:  # a new session holds nothing yet
            self.held.clear()
            self.unsettled.clear()
            self.handing.clear()
            self.registered = None
            self._session = session
        if session is None:
            return None
        idle: set[str] = set()
        busy: set[str] = set()
        roomy: set[str] = set()  # (of idle channels with room: hand-offs welcome)
        full: set[str] = set()
        consumed: set[str] = set()
        acked: set[str] = set()
        for channel in channels:
            if channel.closed or not channel._consumers:
                continue
            queues = channel._active_queues
            consumed.update(queues)
            acked.update(q for q in queues if q not in channel._no_ack_queues)
            if channel.idle:
                idle.update(queues)
            elif channel.busy_rounds >= 2:
                busy.update(queues)
            (roomy if channel.idle and channel.has_room else full).update(queues)
        take = idle - self.held
        drop = {q for q in self.held if q not in consumed or (q in busy and q not in idle)}
        check = (take | self.unsettled) & idle
        handing = (roomy - full) & (self.held | take) - drop if self.waiter.handoffs else set()
        hand_take, hand_drop = handing - self.handing, self.handing - handing
        # (the sleeper row follows what is consumed, and how, also when no key changes)
        handoffs = self.waiter.handoffs
        register = (
            handoffs is not None
            and handoffs.holder is not None
            and (frozenset(consumed), frozenset(consumed - acked)) != self.registered
        )
        if not (take or drop or check or hand_take or hand_drop or register):
            return None
        return Change(
            tuple(sorted(take)),
            tuple(sorted(drop)),
            tuple(sorted(check)),
            frozenset(consumed),
            tuple(sorted(hand_take)),
            tuple(sorted(hand_drop)),
            frozenset(consumed - acked),
        )

    def closing(self) -> Change:
        """The change that releases every key and the hand-off registration (the consumer
        closes: see ``sleep_v3``)."""
        return Change(
            (), tuple(sorted(self.held)), (), frozenset(), (), tuple(sorted(self.handing))
        )

    def asleep(self, channel: Consuming, now: float | None = None) -> bool:
        """The channel found nothing, its keys are held and settled and no timer of its is
        due: a publish to its queues sends a NOTIFY, so there is no need to fetch for it
        until then."""
        if not channel.idle or not self.held.issuperset(channel._active_queues):
            return False
        if self.unsettled.intersection(channel._active_queues):
            return False
        due = channel.retry_at
        return due is None or due > (time.monotonic() if now is None else now) + 0.002

    def wanted(self, channel: Consuming, wanted: Wanted, now: float) -> bool:
        """Whether ``wanted`` asks to fetch for ``channel``."""
        if wanted.every or not wanted.queues.isdisjoint(channel._active_queues):
            return True
        return wanted.awake and not self.asleep(channel, now)

    def apply(self, change: Change) -> Settled:
        """Apply ``change`` on the LISTEN session (from any thread)."""
        handoffs = self.waiter.handoffs
        holder = None if handoffs is None else handoffs.holder
        queues = None
        registration = (change.consumed, change.no_ack)
        if holder is not None and registration != self.registered:
            queues = sorted(change.consumed)
        op = sleep_op(
            self.schema,
            change.take,
            change.drop,
            change.check,
            hand_take=change.hand_take if holder is not None else (),
            hand_drop=change.hand_drop if holder is not None else (),
            holder=holder,
            secret=None if handoffs is None or holder is None else handoffs.secret,
            lock_ms=None if holder is None else self.handoff_lock_ms,
            queues=queues,
            no_ack=sorted(change.no_ack) if queues is not None else (),
        )
        done = self.waiter.run(op, change.consumed)
        if done is None:  # the session failed: its keys went with it
            self.held.clear()
            self.unsettled.clear()
            self.handing.clear()
            self.registered = None
            return Settled(change.consumed, None)
        if queues is not None:
            self.registered = registration
        if holder is not None:
            self.handing.update(change.hand_take)
            self.handing.difference_update(change.hand_drop)
        still_open, notified = done
        self.held.update(change.take)
        self.held.difference_update(change.drop)
        was_open = self.unsettled
        self.unsettled = (was_open - set(change.check) - set(change.drop)) | set(still_open)
        ended = was_open & (set(change.check) - set(still_open))
        retry_ms = UNSETTLED_RETRY_MS if self.unsettled else None
        return Settled(frozenset(change.take) | ended | notified, retry_ms)
