"""The consumer in Celery's event loop (a kombu Hub), for a transport registered with one.

A Celery worker whose transport is asynchronous runs its consumer in an event loop (with the
prefork pool, also the asynchronous pool, which feeds the pool processes from the same loop)
instead of calling ``drain_events``. Here the consumer *looks* for messages when woken: by a
NOTIFY on the LISTEN connection (whose socket the loop watches), by the wake-up pipe (an ack
from a pool thread, a fetch came back), by an ack of the loop's own thread (a look before the
loop polls again, one for all such acks, see :meth:`LoopConsumer.acked`), by a timer (a
delayed message or a prefetch refill is due; every second while LISTEN is down), or by the
fallback poll every ``polling_interval``.

A look plans a fetch for every consuming kombu channel (queues, free prefetch window). A
busy consumer's fetch of one channel is driven by the loop (:mod:`.inloop`): its dequeue,
carrying the acks made since the last, is sent without blocking and its rows are read when
the loop sees them come, while the loop goes on feeding the pool. Other batches (several
channels, a change of the sleep keys, messages handed by publishes, a connection to open)
go to a fetch thread, which runs them meanwhile and wakes the loop when they are back.
Either way the loop's thread delivers the messages, as Celery requires (those of different
channels in the order they were created), and looks again. A consumer whose last fetch
brought nothing (idle: a NOTIFY, a timer or the poll woke it) fetches on the loop's thread
instead, at once, when its connection is open and no other thread holds it: a wake-up does
not wait for two thread switches, and an idle loop has nothing else to do meanwhile. Before
a fetch, the same thread takes the ``sleep`` keys of the queues of channels that found
nothing and releases those of busy ones, on the LISTEN session (see :mod:`.sleep`); after
taking a key it looks again. A channel asleep on its queues is fetched for only when a
NOTIFY names one of them, at its timer, or at the fallback poll. One batch is in flight at a
time. The loop's thread holds the ack buffer: its own acks return at once and go with the
next fetch, which they trigger. Errors of a fetch (a lost connection) are raised on the
loop's thread, where Celery handles them as it does for RabbitMQ.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from ..exceptions import LonnyMQError
from ..queue.dequeue import DequeueResult
from . import rounds
from .inloop import LoopFetch
from .interfaces import ChannelLike, Job, TransportLike
from .sleep import Change, Owed, Settled, Wanted, sooner

logger = logging.getLogger("lonnymq.transport")

#: What came back: the results of the fetches done, the error that stopped the rest, and
#: what the sleep change asks (None: there was none).
Outcome = tuple[list[tuple[ChannelLike, DequeueResult]], BaseException | None, Settled | None]


class Fetcher(threading.Thread):
    """Runs one batch at a time off the loop's thread: a change of the sleep keys (first,
    see :mod:`.sleep`), then the fetches; ``done`` is called (from this thread) when a batch
    is back."""

    def __init__(self, transport: TransportLike, done: Callable[[], None]) -> None:
        super().__init__(name="lonnymq-fetch", daemon=True)
        self.transport = transport
        self.done = done
        self._cond = threading.Condition()
        self._batch: tuple[list[Job], Change | None] | None = None
        self._outcome: Outcome | None = None
        self._busy = False
        self._stopped = False

    @property
    def busy(self) -> bool:
        """A batch is in flight, or back and not yet taken."""
        with self._cond:
            return self._busy

    def submit(self, jobs: list[Job], change: Change | None = None) -> None:
        """Apply ``change``, then fetch for ``jobs`` (none: only send the buffered acks)."""
        with self._cond:
            assert not self._busy
            self._busy = True
            self._batch = (jobs, change)
            self._cond.notify()

    def take(self) -> Outcome | None:
        """The outcome of the last batch once it is back (then no batch is in flight)."""
        with self._cond:
            outcome, self._outcome = self._outcome, None
            if outcome is not None:
                self._busy = False
            return outcome

    def stop(self, timeout: float) -> Outcome | None:
        """Stop the thread, after the batch in flight; returns that batch's outcome."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            deadline = time.monotonic() + timeout
            while self._busy and self._outcome is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.take()

    def run(self) -> None:
        while True:
            with self._cond:
                while self._batch is None and not self._stopped:
                    self._cond.wait()
                if self._batch is None:
                    return
                (jobs, change), self._batch = self._batch, None
            outcome = self.execute(jobs, change)
            with self._cond:
                self._outcome = outcome
                self._cond.notify_all()
            self.done()

    def execute(self, jobs: list[Job], change: Change | None) -> Outcome:
        """Run a batch on the calling thread (this one's, or the loop's when no batch is in
        flight); its errors are returned, to be raised on the loop's thread."""
        transport = self.transport
        results: list[tuple[ChannelLike, DequeueResult]] = []
        settled: Settled | None = None
        error: BaseException | None = None
        try:
            if change is not None:
                settled = transport.sleep.apply(change)
            if not jobs:
                transport.send_acks(transport.acks.take())
            results = rounds.run_fetches(transport, jobs)
        except BaseException as exc:  # raised on the loop's thread
            error = exc
        return results, error, settled


class LoopConsumer:
    """The consumer of ``transport`` in the event loop ``loop`` (see the module docstring)."""

    def __init__(self, transport: TransportLike, loop: Any) -> None:
        self.transport = transport
        self.loop = loop
        self.waiter = transport.waiter
        self.owner = False  # the loop's thread holds the ack buffer
        self.listen_fd: int | None = None
        self.retry_at: float | None = None
        self.retry_timer: Any = None
        self._owed = Owed(Wanted(awake=True))  # why to fetch (taken when a fetch starts)
        self.fetcher = Fetcher(transport, self.waiter.wake)
        self.fetcher.start()
        loop.add_reader(self.waiter.wake_fd, self.on_wake)
        self.poll_timer = loop.call_repeatedly(transport.options.polling_interval, self.on_poll)
        self.closed = False
        self.idle = True  # the last batch delivered nothing: run the next one on this thread
        self.look_soon = False  # a look is asked of the loop's next round (see acked)
        self.pending: LoopFetch | None = None  # a fetch this thread drives (see .inloop)
        loop.on_tick.add(self.on_tick)
        self.waiter.wake()  # first look as soon as the loop runs

    def want(self, queues: Collection[str] | None = None, *, every: bool = False) -> None:
        """There may be something to fetch, or acks to send (any thread; wake the loop too):
        in the channels consuming ``queues``; None: in those awake (``every``: in every
        channel, those asleep too)."""
        self._owed.add(
            Wanted(every=every, awake=True) if queues is None else Wanted(queues=set(queues))
        )

    def close(self) -> None:
        """Leave the loop: the fetch in flight is waited for (its messages are released,
        not delivered), and the buffered acks are sent."""
        if self.closed:
            return
        self.closed = True
        self.loop.on_tick.discard(self.on_tick)
        for fd in (self.waiter.wake_fd, self.listen_fd):
            if fd is not None:
                with contextlib.suppress(Exception):  # the loop may be closed already
                    self.loop.remove_reader(fd)
        for timer in (self.poll_timer, self.retry_timer):
            if timer is not None:
                with contextlib.suppress(Exception):
                    timer.cancel()
        transport = self.transport
        for outcome in (self._take_pending(finish=True), self.fetcher.stop(timeout=30.0)):
            if outcome is not None:
                rounds.release(transport, outcome[0])
        if self.owner:
            self.owner = False
            try:
                transport.send_acks(transport.acks.end())
            except LonnyMQError as exc:  # not lost: their locks expire and they come back
                logger.warning("lonnymq: could not send acks when leaving the event loop: %s", exc)

    # -- wake-ups ------------------------------------------------------------------------------

    def on_wake(self) -> None:
        self.waiter.woken()
        self.look()

    def acked(self) -> None:
        """An ack of the loop's own thread (a Celery callback in the loop): it goes with the
        next fetch, or alone (see :meth:`_look`). One look before the loop next polls
        (:meth:`on_tick`) serves every ack made meanwhile, without the wake-up pipe's two
        system calls and round of the loop each; none while a fetch is in flight: its
        return makes that look. (Celery's pool acks from its result readers and the loop's
        callbacks, before the ticks; an ack made by a tick callback that runs after this
        one would wait for the next round of the loop, as any ``call_soon`` of the loop's
        own thread does.)"""
        self.want()
        if not self.busy:
            self.look_soon = True

    @property
    def busy(self) -> bool:
        """A batch is in flight (on the fetch thread or driven here), or back and not
        taken."""
        return self.pending is not None or self.fetcher.busy

    def _take_pending(self, *, finish: bool = False) -> Outcome | None:
        """The outcome of the fetch driven here once it is back (``finish``: completed
        now, blocking)."""
        pending = self.pending
        if pending is None:
            return None
        if finish:
            pending.finish()
        if pending.outcome is None:
            return None
        self.pending = None
        return pending.outcome

    def on_tick(self) -> None:
        """Run by the loop before each poll."""
        if self.look_soon:
            self.look_soon = False
            self.look()

    def _consumed(self) -> set[str]:
        return {q for channel in list(self.transport.channels) for q in channel._active_queues}

    def on_notify(self) -> None:
        notified = self.waiter.notified(self._consumed())
        if notified:
            self.want(notified)  # only the channels of those queues: the others sleep on
            self.look()

    def on_retry(self) -> None:
        self.retry_at = self.retry_timer = None
        self.want()
        self.look()

    def on_poll(self) -> None:
        """The fallback poll: a look in every channel, asleep or not (see docs/design.md,
        "Wake-ups")."""
        self.want(every=True)
        self.look()

    # -- looking -------------------------------------------------------------------------------

    def look(self) -> None:
        """Deliver what a fetch brought back; plan and start the next batch (a change of the
        sleep keys, fetches); arrange for the next look. A consumer whose last batch left
        nothing to fetch at once (it delivered nothing, or all there was: its channels are
        asleep again) runs the next one on the loop's thread, at once, when its connection
        is open and not in use by another thread (a wake-up: two thread switches less, 0.1-0.3
        ms each here); a busy one sends its fetch and lets the loop watch for its rows
        (:mod:`.inloop`), or, when that cannot be (see :meth:`_drive`), hands it to the
        fetch thread, so that the loop goes on feeding the pool meanwhile. What a batch run
        here brought is delivered by the next look of this call, with nothing in between
        that could raise and leave it undelivered and locked."""
        outcome: Outcome | None = None
        while not self.closed:
            outcome = self._look(outcome)
            if outcome is None:
                return

    def _look(self, outcome: Outcome | None) -> Outcome | None:
        """One look; returns the outcome of a batch it ran on this thread (to look again
        with), else None."""
        transport = self.transport
        if not self.owner:
            self.owner = transport.acks.begin()
        retry_ms: int | None = None
        inline: tuple[list[Job], Change | None] | None = None
        if outcome is None:
            outcome = self._take_pending() or self.fetcher.take()
        if outcome is not None:
            results, error, settled = outcome
            _, retry_ms, again = rounds.deliver(transport, results)
            self.idle = not again  # (what it delivered, if anything, was all there was)
            if again:
                self.want()  # there may be more
            if settled is not None:
                self.want(settled.look_again)
                retry_ms = sooner(retry_ms, settled.retry_ms)
            if error is not None:
                raise error
        if not self.busy:
            change = transport.sleep.plan(transport.channels)
            if change is not None and change.take:
                self.want(change.take)  # look again there once the keys are taken
            # notifications already read? (a control message published before a task: its
            # channel is fetched in the same round as the task's, see rounds.deliver_in_order)
            self.want(self.waiter.notified(change.consumed if change else self._consumed()))
            jobs: list[Job] = []
            wanted = self._owed.take()
            if wanted:
                jobs, wait = rounds.fetch_jobs(transport, wanted)
                retry_ms = sooner(retry_ms, wait)
            if jobs and self.idle and transport.pg.free:
                inline = (jobs, change)  # run last, once nothing else of this look can raise
            elif len(jobs) == 1 and change is None and self._drive(jobs[0]):
                pass  # (in flight, driven by the loop: see .inloop)
            elif jobs or change is not None:
                self.fetcher.submit(jobs, change)
            elif self.owner and transport.acks.pending() and (retry_ms is None or retry_ms > 5):
                self.fetcher.submit([])  # no fetch within a few ms to carry them: send them
        if retry_ms is not None:
            self.retry_in(retry_ms / 1000 + 0.001)
        now = time.monotonic()
        due = rounds.channel_timer(transport, now)
        if due is not None:
            self.retry_in(due - now)
        self.sync_listen()
        if self.closed:
            return None
        if inline is None:
            return self._take_pending()  # (one whose sending failed: at once)
        return self.fetcher.execute(*inline)  # (its errors come back in the outcome)

    def _drive(self, job: Job) -> bool:
        """Send ``job``'s dequeue and let the loop watch for its rows (see .inloop); False
        when that cannot be now (the job goes to the fetch thread)."""
        # (one completed by a use of the connection that came first, on any thread, wakes
        # the loop for its outcome: the loop may be asleep)
        self.pending = LoopFetch.start(self.transport, self.loop, job, self.look, self.waiter.wake)
        return self.pending is not None

    def retry_in(self, seconds: float) -> None:
        """Look again in ``seconds`` (or sooner, if a look is already due sooner)."""
        due = time.monotonic() + seconds
        if self.retry_at is not None and self.retry_at <= due:
            return
        if self.retry_timer is not None:
            self.retry_timer.cancel()
        self.retry_at = due
        self.retry_timer = self.loop.call_later(seconds, self.on_retry)

    def sync_listen(self) -> None:
        """Watch the LISTEN connection (it may have been reopened since the last look)."""
        conn, fresh = self.waiter.listening()
        fd = None if conn is None else conn.fileno()
        if fresh or fd != self.listen_fd:
            if self.listen_fd is not None:
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(self.listen_fd)
            self.listen_fd = fd
            if fd is not None:
                self.loop.add_reader(fd, self.on_notify)
        if fresh:
            self.waiter.wake()  # a NOTIFY sent before the LISTEN took effect is lost: look again
        elif conn is None and self.transport.options.use_listen:
            self.retry_in(1.0)  # LISTEN is down: poll (and retry it) every second
