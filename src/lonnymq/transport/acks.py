"""Acks sent with the consumer's next round trip instead of one round trip each.

While a thread runs the transport's ``drain_events`` (the *drainer*), acks are collected here:

- an ack made by a delivery callback on the drainer's own thread waits for the drainer's next
  dequeue, which carries it (one round trip for both), or for the end of ``drain_events`` at
  the latest. Callers see every ack of a callback applied once ``drain_events`` returns.
- an ack made by another thread (a Celery pool thread) while the drainer is fetching or
  waiting wakes the drainer, which sends it with its next dequeue, together with the other
  acks that came in meanwhile; the acking thread waits until it was sent, so ``ack()`` still
  returns after the row is gone. If the drainer does not take it within a short time (it went
  into a callback), the acking thread takes it back and sends it itself.

With no drainer, or while the drainer runs a callback, acks from other threads are sent at
once by the thread that acks, as before.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..queue.results import Outcome

logger = logging.getLogger("lonnymq.transport")

Held = tuple[int, uuid.UUID]

#: How long a thread waits for the drainer to send its ack before sending it itself.
HANDOFF_SECONDS = 0.2


@dataclass(eq=False)
class Ack:
    ref: Held
    #: set when the drainer has sent it (``failed`` then says whether that failed)
    sent: threading.Event | None = None
    failed: bool = False
    taken: bool = field(default=False)


class AckBuffer:
    IDLE, ACTIVE, DELIVERING = range(3)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = self.IDLE
        self._drainer: int | None = None
        self._pending: list[Ack] = []

    # -- the drainer ---------------------------------------------------------------------------

    def begin(self) -> bool:
        """Become the drainer; False when another thread already is (then this call buffers
        nothing)."""
        with self._lock:
            if self._state != self.IDLE:
                return False
            self._state = self.ACTIVE
            self._drainer = threading.get_ident()
            return True

    def end(self) -> list[Ack]:
        """Stop draining; returns the acks still to send (the caller sends them)."""
        with self._lock:
            self._state = self.IDLE
            self._drainer = None
            return self._take_locked()

    def delivering(self, on: bool) -> None:
        """The drainer enters (True) or leaves (False) delivery callbacks. Entering, it hands
        the acks of other threads that it has not taken back to them: a callback may block
        (Celery's prefork pool waits for a free process, which may wait for such an ack)."""
        with self._lock:
            if self._state == self.IDLE:
                return
            self._state = self.DELIVERING if on else self.ACTIVE
            if on:
                mine = []
                for ack in self._pending:
                    if ack.sent is None:
                        mine.append(ack)
                    else:
                        ack.failed = True  # "send it yourself"
                        ack.sent.set()
                self._pending = mine

    def take(self) -> list[Ack]:
        with self._lock:
            return self._take_locked()

    def _take_locked(self) -> list[Ack]:
        taken, self._pending = self._pending, []
        for ack in taken:
            ack.taken = True
        return taken

    def put_back(self, acks: list[Ack]) -> None:
        """Acks whose send failed: the drainer's own go back to the buffer (sent with the next
        round trip); another thread's are failed, and that thread sends its ack itself."""
        with self._lock:
            for ack in acks:
                if ack.sent is None:
                    ack.taken = False
                    self._pending.append(ack)
                else:
                    ack.failed = True
                    ack.sent.set()

    @staticmethod
    def done(acks: list[Ack]) -> None:
        for ack in acks:
            if ack.sent is not None:
                ack.sent.set()

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def beside_drainer(self) -> bool:
        """True on a thread other than the drainer's while a drainer is active: its own
        round trips should not hold the connection the drainer fetches on."""
        with self._lock:
            return self._state != self.IDLE and self._drainer != threading.get_ident()

    # -- any thread ----------------------------------------------------------------------------

    def offer(self, ref: Held) -> Ack | None:
        """Buffer an ack, or None when the caller must send it itself. An ack from another
        thread than the drainer's comes back with ``sent`` to wait on (and wake the drainer)."""
        me = threading.get_ident()
        with self._lock:
            if self._state == self.IDLE:
                return None
            if me == self._drainer:
                ack = Ack(ref)
            elif self._state == self.ACTIVE:
                ack = Ack(ref, threading.Event())
            else:
                return None
            self._pending.append(ack)
            return ack

    def wait(self, ack: Ack) -> bool:
        """Wait (another thread) until the drainer sent ``ack``. False when the caller must
        send it itself: the drainer went into a callback first, did not take it in time
        (withdrawn here), or its send failed."""
        assert ack.sent is not None
        deadline = time.monotonic() + HANDOFF_SECONDS
        while not ack.sent.wait(max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not ack.taken:
                    self._pending.remove(ack)
                    return False
            # taken: the drainer is sending it right now; wait for the answer
            deadline = time.monotonic() + 60.0
        return not ack.failed


def log_ignored(outcomes: dict[int, Outcome]) -> None:
    """Log the acks a dequeue carried that did not apply."""
    for message_id, outcome in outcomes.items():
        if outcome is not Outcome.OK:
            logger.warning(
                "lonnymq: ack of message %d ignored: %s (its lock expired and it was "
                "delivered again, or it is gone)",
                message_id,
                outcome.value,
            )
