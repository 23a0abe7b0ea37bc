"""Messages that publishes hand to this consumer's LISTEN session (schema version 21).

A publish that finds the session asleep on its queue creates the message locked for it and
sends it whole in a NOTIFY on the session's own channel, ``lonnymq_hand_<holder>``
(``handoff_v1``; docs/design.md, "The hand-off"). They are read with the session's other
notifications (:class:`~lonnymq.transport.connection.Waiter`) and kept here until the kombu
channel of their queue fetches: it then delivers them instead of dequeuing (see
``Transport.ack_and_dequeue``). Those of queues no longer consumed, and those left when the
connection closes, are released by the transport; the heartbeat extends the locks of those
still waiting (a full prefetch window).

A queue that this consumer takes without acks (schema version 23) is handed its messages
without a row: nothing to delete or release (:attr:`Message.stored` false); one that cannot be
delivered (its queue no longer consumed, or consumed with acks by now, the connection closing)
is created again (``rounds.give_back``), its time to live what is left of it.

Each LISTEN session has an id (``holder``) and a secret of its own, new with the session: a
session the client lost may still hold its keys on the server for a while, and publishes
would hand it messages. Any role may NOTIFY, so a payload without the secret is dropped.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg

from ..queue.dequeue import Message
from . import pooler

logger = logging.getLogger("lonnymq.transport")
#: The lock token of a message handed without a row (it has no lock).
NIL_TOKEN = uuid.UUID(int=0)

#: What a new LISTEN session asks of the server: to find a client that is gone within about
#: a minute (TCP keepalives), so that what is handed to a session nobody reads any more comes
#: back at its lock's expiry and its keys are not held longer.
_KEEPALIVES = (
    "SELECT set_config('tcp_keepalives_idle', '30', false), "
    "set_config('tcp_keepalives_interval', '10', false), "
    "set_config('tcp_keepalives_count', '3', false)"
)
_WHO = (
    "SELECT pg_backend_pid(), backend_start, extract(epoch FROM clock_timestamp()) "
    "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
)
_END = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND backend_start = %s"
)


@dataclass(frozen=True, slots=True)
class Unstored(Message):
    """A message handed without a row, to a consumer that takes its queue without acks
    (schema version 23): nothing to delete or release; created again if it cannot be
    delivered (see ``rounds.give_back``)."""

    #: when its time to live ends (this process's clock, epoch seconds; None: never)
    expires: float | None = None

    def ttl_ms(self) -> float | None:
        """What is left of its time to live, in ms (at least 1; None: none)."""
        return None if self.expires is None else max(1.0, (self.expires - time.time()) * 1000)


class Handoffs:
    """What publishes handed to one transport's LISTEN session, by queue. Thread-safe (the
    loop reads notifications while the fetch thread takes what was handed)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        #: the session's id and secret (None: no session opened yet)
        self.holder: int | None = None
        self.secret = ""
        self._handed: dict[str, list[Message]] = {}
        self._orphans: list[Message] = []
        self._backend: tuple[int, Any] | None = None  # (pid, start) of the last session
        #: the server's clock less this process's (seconds, measured at the session's start)
        self.offset = 0.0
        #: when each message's lock expires, by the server's clock (epoch seconds)
        self._until: dict[int, float] = {}
        self._woken: set[str] = set()
        self._lock = threading.Lock()

    @property
    def channel(self) -> str | None:
        """The NOTIFY channel of the session's hand-offs."""
        return None if self.holder is None else f"lonnymq_hand_{self.holder}"

    def adopt(self, conn: psycopg.Connection[Any]) -> None:
        """Make the new LISTEN session ``conn`` the one hand-offs go to: a new id and secret;
        the last session ended if the server still has it (a connection lost on this side
        only: publishes would go on handing it messages), unless through a pooler (that
        server session may be another client's by now); keepalives asked for."""
        conn.execute(_KEEPALIVES)
        before = time.time()
        row = conn.execute(_WHO).fetchone()
        if row is not None:
            self.offset = float(row[2]) - (before + time.time()) / 2
        old, self._backend = self._backend, None if row is None else (int(row[0]), row[1])
        if old is not None and not pooler.pooled(conn):
            with contextlib.suppress(psycopg.Error):  # (not ours to end: it stays)
                conn.execute(_END, old)
        self.holder, self.secret = secrets.randbits(62) + 1, secrets.token_hex(16)

    def receive(self, payload: str, queues: Collection[str]) -> str | None:
        """Keep a message handed to this session (``handoff_v1``'s payload); returns its
        queue when one of ``queues`` (those consumed). One for another queue is kept to be
        released (:meth:`orphans`). Any role may NOTIFY: a payload that is not signed with
        this session's secret, or not a hand-off at all, is dropped."""
        try:
            mac, _, body = payload.partition(" ")
            key = self.secret.encode()
            inner = hashlib.sha256(key + body.encode()).digest()
            if not hmac.compare_digest(
                mac.encode(), hashlib.sha256(key + inner).hexdigest().encode()
            ):
                raise ValueError("not signed with this session's secret")
            ident, token, prio, created, until, qlen, clen, rest = body.split(" ", 7)
            end = int(qlen) + int(clen)
            fields: dict[str, Any] = {
                "schema": self.schema,
                "id": int(ident),
                "queue": rest[: int(qlen)],
                "channel": rest[int(qlen) : end],
                "name": None,
                "priority": int(prio),
                "attempts": 1,
                "created_at": datetime.fromtimestamp(float(created), tz=timezone.utc),
                "content": base64.b64decode(rest[end:], validate=True),
                "state": None,
            }
            locked_until = 0.0
            message: Message
            if token == "-":  # (without a row: its time to live's end in place of a lock's)
                expires = None if until == "-" else float(until) - self.offset
                message = Unstored(**fields, lock_token=NIL_TOKEN, stored=False, expires=expires)
            else:
                message = Message(**fields, lock_token=uuid.UUID(token))
                locked_until = float(until)
        except Exception as exc:  # (whatever it was, it is not one of ours)
            logger.debug("lonnymq: hand-off %.80r ignored (%s)", payload, exc)
            return None
        with self._lock:
            if message.stored:
                self._until[message.id] = locked_until
            if message.queue in queues:
                self._handed.setdefault(message.queue, []).append(message)
                return message.queue
            self._orphans.append(message)
            return None

    def late(self, messages: list[Message], margin: float) -> list[Message]:
        """Those of ``messages`` whose lock expires within ``margin`` seconds, or has
        expired, by the server's clock: read late (another consumer may have them by now),
        to be checked before they are delivered."""
        now = time.time() + self.offset
        with self._lock:
            return [m for m in messages if m.stored and self._until.get(m.id, 0.0) - now < margin]

    def extended(self, ids: Collection[int], seconds: float) -> None:
        """Their locks were extended by ``seconds`` from now (the heartbeat, a check)."""
        until = time.time() + self.offset + seconds
        with self._lock:
            for ident in ids:
                if ident in self._until:
                    self._until[ident] = until

    def done(self, messages: Collection[Message]) -> None:
        """Forget the lock expiry of messages delivered or released."""
        with self._lock:
            for message in messages:
                self._until.pop(message.id, None)

    def unconsumed(self, queues: Collection[str], woken: Collection[str] = ()) -> None:
        """After a read of notifications: those of queues not among ``queues`` (no longer
        consumed) become orphans; ``woken``, queues that a notification other than a
        hand-off named (see :meth:`woken_by_others`)."""
        with self._lock:
            for queue in [q for q in self._handed if q not in queues]:
                self._orphans.extend(self._handed.pop(queue))
            self._woken.update(woken)

    def woken_by_others(self, queues: Collection[str]) -> bool:
        """Whether a plain NOTIFY or a hint named one of ``queues`` since the last call for
        them: then something else than what was handed waits (a hand-off sends neither), and
        a delivery of what was handed did not take all there was."""
        with self._lock:
            found = not self._woken.isdisjoint(queues)
            self._woken.difference_update(queues)
            return found

    def waiting(self, queues: Collection[str]) -> bool:
        """Whether messages handed for ``queues``, or orphans, wait (a fetch of ``queues``
        delivers or releases them first: ``rounds.deliverable``)."""
        with self._lock:
            return bool(self._orphans) or any(self._handed.get(q) for q in queues)

    def take(self, queues: Collection[str]) -> list[Message]:
        """Take the messages handed for ``queues``, by id (locked for this consumer: deliver
        them, or release them)."""
        with self._lock:
            found: list[Message] = []
            for queue in queues:
                found.extend(self._handed.pop(queue, ()))
            return sorted(found, key=lambda m: m.id)

    def orphans(self) -> list[Message]:
        """Take the messages handed for queues no longer consumed (to release)."""
        with self._lock:
            found, self._orphans = self._orphans, []
            return found

    def pending(self, *, take: bool = True) -> list[Message]:
        """The messages handed and not delivered yet, orphans included: taken (to release
        them), or only looked at (to extend their locks)."""
        with self._lock:
            found = [m for ms in self._handed.values() for m in ms] + self._orphans
            if take:
                self._handed, self._orphans = {}, []
            return found
