"""The kombu Transport on lonnymq (its spec is the docstring of :mod:`lonnymq.transport`)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeVar

import psycopg
from kombu.exceptions import ChannelError
from kombu.transport import virtual

from ..exceptions import ConnectionLost, LonnyMQError
from ..migrator import hint_channel, wake_channel
from ..queue import Broker
from ..queue._ops import Op, async_commit, run
from ..queue.dequeue import DequeueResult, dequeue_op
from ..queue.finalize import defer_op, delete_many_op
from ..queue.operate import configure_op
from . import events, rounds, url
from .acks import Ack, AckBuffer, Held, log_ignored
from .channel import Channel
from .connection import PgClient, Waiter
from .headers import QueueArguments
from .heartbeat import Heartbeat
from .loop import LoopConsumer
from .options import Options
from .registry import Registry
from .sleep import Owed, Settled, SleepKeys, Wanted, sooner
from .sweep import Sweeper, beside, sweeper_for

logger = logging.getLogger("lonnymq.transport")
_APPLIED: set[tuple[int, str, str, str]] = set()
_APPLIED_LOCK = threading.Lock()

T = TypeVar("T")


class Transport(virtual.Transport):
    """Kombu transport on lonnymq (its spec: the docstring of :mod:`lonnymq.transport`)."""

    Channel = Channel
    can_parse_url = True
    default_port = 5432  # type: ignore[assignment]
    driver_type = "lonnymq"
    driver_name = "lonnymq"
    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )
    # kombu's own (amqp's ConnectionError, ChannelError) too: kombu raises them itself, as
    # RecoverableConnectionError('channel disconnected') when a publish after a reconnect
    # declares an entity bound to the channel the lost connection closed
    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        ConnectionLost,
        psycopg.OperationalError,
        OSError,
    )
    channel_errors = (  # type: ignore[assignment]
        *virtual.Transport.channel_errors,
        LonnyMQError,
        psycopg.Error,
        ChannelError,
    )
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        url.check_alternates(list(getattr(client, "alt", None) or []))
        url.adopt_url(client)
        self.options = Options.from_mapping(
            dict(client.transport_options or {}), url.client_connect_timeout(client)
        )
        self.polling_interval = self.options.polling_interval
        self.conninfo = url.client_conninfo(client)
        self.pg = self._client(self.conninfo)
        self.exchange_types: dict[str, str] = {}
        #: x-expires (ms) of the queues this process declared: how often consumers touch them
        self.queue_expires: dict[str, int | None] = {}
        #: the queues this process declared (arguments, auto_delete) and bound, to declare
        #: them again should one go while consumed (see .registry)
        self.declared: dict[str, tuple[QueueArguments, bool]] = {}
        self.bound: dict[str, set[tuple[str, str]]] = {}
        self._waiter: Waiter | None = None
        self._sleep: SleepKeys | None = None
        # drain_events, across calls: why to fetch next (kept when a call returns with a look
        # still owed, e.g. in the channels whose sleep keys it just took), when its timer is
        # due, and when the fallback poll is (on its own schedule: wake-ups do not delay it)
        self._owed = Owed(Wanted(awake=True))
        self._timer_at: float | None = None
        self._poll_at: float | None = None
        self._heartbeat: Heartbeat | None = None
        self._sweeping: threading.Thread | None = None  # a sweep a publish started
        self._said_polling = False
        self._policies_applied = False
        self.acks = AckBuffer()
        #: this connection's consumers, as every process sees them (see .registry)
        self.registry = Registry(self, self.options.schema)
        self._side_pg: PgClient | None = None
        if not self.options.event_loop:  # Celery then drives the consumer by drain_events
            self.implements = type(self).implements.extend(asynchronous=False)
        self._looper: LoopConsumer | None = None  # while registered with an event loop

    @property
    def listen_conninfo(self) -> str:
        """Where the consumer's LISTEN connection goes (where it also sleeps, see
        :mod:`.sleep`): ``listen_dsn``, else the broker URL. Its dequeues hold no state of
        their session and go through the broker URL, a pooler too."""
        if self.options.listen_dsn:
            return url.to_conninfo(self.options.listen_dsn)
        return self.conninfo

    @property
    def side_pg(self) -> PgClient:
        """A second command connection, opened on first use: for the acks that threads other
        than the consumer's send themselves while the consumer drains (see :mod:`.acks`)."""
        if self._side_pg is None:
            self._side_pg = self._client(self.conninfo)
        return self._side_pg

    def _client(self, conninfo: str) -> PgClient:
        return PgClient(
            conninfo,
            schema=self.options.schema,
            connect_timeout=self.options.connect_timeout,
            auto_install=self.options.auto_install,
        )

    def consumer_op(self, op: Op[T]) -> Op[T]:
        return async_commit(op) if self.options.consumer_commit == "async" else op

    @property
    def sleep(self) -> SleepKeys:
        """The ``sleep`` keys held on the LISTEN session (see :mod:`.sleep`)."""
        if self._sleep is None:
            self._sleep = SleepKeys(self.waiter, self.options.schema, self.options.handoff_lock_ms)
        return self._sleep

    def ack_and_dequeue(
        self, queues: list[str], limit: int, *, idle: bool = False
    ) -> DequeueResult:
        """Delete the buffered acks and dequeue, in one statement. When that fails, the acks
        go back to the buffer (or to the threads that made them). ``idle``: the fetch is of a
        kombu channel whose last fetch found nothing; the messages whose creates woke it
        (their ids came with the NOTIFY) are then taken by their ids when nothing else of its
        queues waits (``message_dequeue_hinted_v1``). A busy channel's hints are dropped."""
        waiter = self._waiter
        handoffs = None if waiter is None else waiter.handoffs
        if handoffs is not None:  # (what publishes handed it: no round trip)
            handed = rounds.deliverable(self, handoffs, queues, limit, idle=idle)
            if handed is not None:
                return handed
        acks, op = self._dequeue_op(queues, limit, idle)
        started = time.perf_counter()
        result = self._carrying(acks, op)
        events.dequeue_time(time.perf_counter() - started)
        log_ignored(result.acked)
        return result

    def prepare_dequeue(
        self, queues: list[str], limit: int, *, idle: bool = False
    ) -> tuple[list[Ack], Op[DequeueResult]] | None:
        """The statement of :meth:`ack_and_dequeue` and the acks it takes from the buffer,
        for a caller that runs it itself (:mod:`.inloop`), then calls :meth:`dequeued`, or
        puts the acks back when it fails; None when messages handed by publishes wait for
        these queues (:meth:`ack_and_dequeue` delivers them without a round trip)."""
        handoffs = None if self._waiter is None else self._waiter.handoffs
        if handoffs is not None:
            if handoffs.waiting(queues):
                return None
            handoffs.woken_by_others(queues)  # (as a fetch that found nothing handed)
        acks, op = self._dequeue_op(queues, limit, idle)
        return acks, self.consumer_op(op)

    def _dequeue_op(
        self, queues: list[str], limit: int, idle: bool
    ) -> tuple[list[Ack], Op[DequeueResult]]:
        waiter = self._waiter
        hints = waiter.hints(queues) if waiter is not None else []
        acks = self.acks.take()
        try:
            op = dequeue_op(
                self.options.schema,
                queues,
                limit=limit,
                lock_ms=self.options.lock_ms,
                ack=[ack.ref for ack in acks],
                listen=False,  # the consumer sleeps on its LISTEN session (see .sleep)
                hints=hints if idle else (),
            )
        except BaseException:
            self.acks.put_back(acks)
            raise
        return acks, op

    def dequeued(self, acks: list[Ack], result: DequeueResult, started: float) -> None:
        """A dequeue carrying ``acks`` came back with ``result``: their threads told, its
        time counted, the acks that did not apply logged."""
        self.acks.done(acks)
        events.dequeue_time(time.perf_counter() - started)
        log_ignored(result.acked)

    def release(self, held: Iterable[Held]) -> None:
        """Unlock held messages (the same rows, back in their place): the unacked ones when
        a channel closes, or ones dequeued and never delivered; else they come back only when
        their lock expires. Works when their kombu channel is already closed."""
        schema = self.options.schema
        for ref in held:
            self.pg.run(self.consumer_op(defer_op(schema, ref[0], ref[1], delay_ms=None)))

    def send_acks(self, acks: list[Ack]) -> None:
        """Delete the buffered ``acks``. When that fails, they go back to the buffer (or to
        the threads that made them)."""
        if acks:
            op = delete_many_op(self.options.schema, [ack.ref for ack in acks])
            log_ignored(self._carrying(acks, op))

    def _carrying(self, acks: list[Ack], op: Op[T]) -> T:
        """Run ``op``, which carries ``acks``: tell their threads once it is done, or put
        them back for the next round trip when it fails."""
        try:
            result = self.pg.run(self.consumer_op(op))
        except BaseException:
            self.acks.put_back(acks)
            raise
        self.acks.done(acks)
        return result

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """The URL to show (``kombu.Connection.as_uri()``, logs, Celery's banner): the
        password masked unless asked for, from the URL or from the Connection's fields."""
        return url.for_client(self.client, uri, include_password, mask)

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def establish_connection(self) -> Any:
        self.pg.connection()
        if self.options.policies and not self._policies_applied:
            # once per process and database: Celery opens several connections
            key = (os.getpid(), self.conninfo, self.options.schema, repr(self.options.policies))
            with _APPLIED_LOCK:
                if key not in _APPLIED:
                    self._apply_policies(self.options.policies)
                    _APPLIED.add(key)
            self._policies_applied = True
        return super().establish_connection()

    def _apply_policies(self, policies: dict[str, Any]) -> None:
        """Apply the policies and queue settings declared in the transport options, in one
        transaction."""
        schema = self.options.schema
        batch = Broker(schema).batch()
        for queue, spec in policies.items():
            if "default" in spec:
                batch.queue(queue).policy.set(**spec["default"])
            for channel, limits in spec.get("channels", {}).items():
                batch.queue(queue).channel(channel).policy.set(**limits)
        with self.pg.locked() as conn, conn.transaction():
            batch.execute(conn)
            for queue, spec in policies.items():
                if "settings" in spec:
                    run(conn, configure_op(schema, queue, **spec["settings"]))
        logger.info("lonnymq: applied the channel policies of %d queue(s)", len(policies))

    def run_consumer_op(self, op: Op[T]) -> T:
        """Run one of the consumer's own operations (its commit as ``consumer_commit``)."""
        return self.pg.run(self.consumer_op(op))

    def _deliver(self, message: Any, queue: str) -> None:
        self.registry.delivered(queue)
        super()._deliver(message, queue)

    def close_connection(self, connection: Any) -> None:
        try:
            self._leave_loop()
            super().close_connection(connection)
            with contextlib.suppress(Exception):  # else the sweep removes them
                self.registry.sync()  # its consumers are gone (channels closed unsynced)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stopped.set()
                self._heartbeat = None
            if self._waiter is not None:
                with contextlib.suppress(LonnyMQError):  # else their locks expire
                    if self._sleep is not None and self._waiter.handoffs is not None:
                        # (no hand-off from now on, and those being made are committed)
                        self._sleep.apply(self._sleep.closing())
                    self._waiter.notified(())  # (those arrived and unread: orphans now)
                    rounds.give_back(self, self._waiter.pending())
                self._waiter.dispose()
                self._waiter = None
                self._sleep = None
            if self._side_pg is not None:
                self._side_pg.close()
                self._side_pg = None
            if self._sweeping is not None:  # (it would open the connection again)
                self._sweeping.join(timeout=5.0)
                self._sweeping = None
            self.pg.close()

    @property
    def sweeper(self) -> Sweeper:
        return sweeper_for(self.conninfo, self.options.schema, self.options.expire_interval)

    def sweep(self, *, background: bool = False) -> None:
        """Sweep what expired in the schema when this process is due to (every
        ``expire_interval``; see :mod:`.sweep`): on a consumer's background thread, or, when
        a publish finds one due, on a thread of its own that the publish does not wait for
        (then at most 1,000 messages, and at most 0.2 s of waiting for locks)."""
        if self._sweeping is not None and self._sweeping.is_alive():
            return
        sweeper = self.sweeper
        if not sweeper.due():
            return
        limit, lock_ms = (10_000, 1000) if background else (1_000, 200)

        def work() -> None:
            with contextlib.suppress(LonnyMQError), self.pg.locked() as conn:
                sweeper.sweep(conn, limit=limit, lock_timeout_ms=lock_ms)

        if background:
            work()
        else:
            self._sweeping = beside(work)

    def touch_seconds(self) -> float:
        """How often a consumer marks the queues it consumes used, so that no sweep takes a
        queue with a live consumer for unused: every 5 s, or often enough for the shortest
        ``x-expires`` among them that this process declared: half of it, at least 0.1 s
        (enough for an x-expires of 0.2 s or more). A touch writes only when the recorded
        use is further behind than the sweep allows for (``queue_use_lag_v1``: a tenth of
        the x-expires, at most a minute), so what keeps a queue is a touch within its
        x-expires."""
        active: set[str] = set()
        for channel in list(self.channels):
            active.update(channel._active_queues)
        known = [self.queue_expires.get(q) for q in active]
        shortest = min((ms for ms in known if ms), default=None)
        if shortest is None:
            return 5.0
        return min(5.0, max(0.1, shortest / 2000))

    def _ensure_heartbeat(self) -> None:
        beat = self._heartbeat
        if beat is None or not beat.is_alive() or beat.pid != os.getpid():
            self._heartbeat = Heartbeat(self)
            self._heartbeat.start()

    @property
    def waiter(self) -> Waiter:
        if self._waiter is None:
            self._waiter = Waiter(
                self.listen_conninfo,
                wake_channel(self.options.schema),
                self.options.connect_timeout,
                listen=self.options.use_listen,
                hint_channel=hint_channel(self.options.schema),
                handoff_schema=self.options.schema if self.options.handoff else None,
            )
        return self._waiter

    def wake(self) -> None:
        """End the consumer's wait now (an ack freed room in a full prefetch window, or wants
        sending with the next fetch)."""
        looper = self._looper
        if looper is not None:
            looper.want()
        if self._waiter is not None:
            self._waiter.wake()

    def loop_acked(self) -> None:
        """The event loop's own thread acked: the ack goes with a look of the loop (see
        :meth:`LoopConsumer.acked`), without the wake-up pipe."""
        looper = self._looper
        if looper is not None:
            looper.acked()
        else:
            self.wake()

    def _wait(self, seconds: float, queues: set[str]) -> set[str] | bool:
        if not self.options.use_listen and not self._said_polling:
            self._said_polling = True
            logger.info(
                "lonnymq: use_listen is off: idle consumers poll every %s s",
                self.options.polling_interval,
            )
        return self.waiter.wait(seconds, queues)

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        if not self.acks.begin():  # another thread drains: no ack buffering for this one
            return self._drain(timeout, owner=False)
        try:
            return self._drain(timeout, owner=True)
        finally:
            self.send_acks(self.acks.end())

    def _drain(self, timeout: float | None, *, owner: bool) -> None:
        """Fetch and deliver; wait (LISTEN, timers) while there is nothing. The owner of the
        ack buffer keeps fetching (each dequeue carrying the acks of the messages delivered
        before it) while deliveries keep coming, up to ``batch_size`` messages or 50 ms.
        Before it waits, the consumer sleeps on the queues of every idle channel (see
        :mod:`.sleep`), and looks once more where it took a key. Asleep, it stays so across
        calls (Celery's and kombu's loops call with a timeout of 1-2 s): it looks again when
        woken (a NOTIFY: in the channels of its queues), at a timer, or at the fallback
        poll (in every channel, every ``polling_interval``). A look owed when a call returns
        (keys taken after a delivery) is the next call's first."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interval = self.options.polling_interval
        total = 0
        while True:
            now = time.monotonic()
            if self._poll_at is None:
                self._poll_at = now + interval
            if now >= self._poll_at:
                self._poll_at = now + interval
                self._owed.add(Wanted(every=True, awake=True))
            timer = self._timer_at
            if timer is not None and now >= timer:
                self._timer_at = None
                self._owed.add(Wanted(awake=True))
            wanted = self._owed.take()
            if not wanted and not (owner and self.acks.pending()):
                if deadline is not None and now >= deadline:
                    raise TimeoutError()
                due = rounds.channel_timer(self, now)
                self._timer_at = sooner(self._timer_at, due)
                wake_at = min(t for t in (self._poll_at, self._timer_at, deadline) if t is not None)
                queues = {q for c in self.channels if c._consumers for q in c._active_queues}
                woken = self._wait(wake_at - now, queues)
                if woken is not False:
                    self._owed.add(
                        Wanted(queues=woken) if isinstance(woken, set) else Wanted(awake=True)
                    )
                continue  # woken, or a timer, the poll or the caller's timeout is due
            try:
                jobs, retry_ms = rounds.fetch_jobs(self, wanted)
                delivered, retry, again = rounds.deliver(self, rounds.run_fetches(self, jobs))
                retry_ms = sooner(retry_ms, retry)
                settled = self.settle_sleep()
            except BaseException:
                self._owed.add(wanted)  # still owed: the next call (after a reconnect) looks there
                raise
            if delivered or again:
                self._owed.add(Wanted(awake=True))
            if settled is not None:
                self._owed.add(Wanted(queues=set(settled.look_again)))
                retry_ms = sooner(retry_ms, settled.retry_ms)
            if retry_ms is not None:
                self._timer_at = sooner(self._timer_at, time.monotonic() + retry_ms / 1000 + 0.001)
            if delivered:
                total += delivered
                if owner and total < self.options.batch_size and time.monotonic() - started < 0.05:
                    continue
                return
            if total:
                return
            if owner and self.acks.pending():
                self.send_acks(self.acks.take())
                self._owed.add(Wanted(awake=True))  # acks free prefetch room: look again

    def settle_sleep(self) -> Settled | None:
        """Take and release ``sleep`` keys for the channels as they are now (None: nothing to
        change, or no LISTEN session)."""
        change = self.sleep.plan(self.channels)
        return None if change is None else self.sleep.apply(change)

    # -- Celery's event loop (see .loop) -------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        if not self.implements.asynchronous:
            return
        if self._looper is not None and self._looper.loop is loop:
            return
        self._leave_loop()
        self._looper = LoopConsumer(self, loop)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self._leave_loop()

    @property
    def in_event_loop(self) -> bool:
        return self._looper is not None

    def _leave_loop(self) -> None:
        looper, self._looper = self._looper, None
        if looper is not None:
            looper.close()
