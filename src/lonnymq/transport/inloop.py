"""A fetch that the event loop drives itself: a busy consumer's dequeue sent on the command
connection without blocking, its socket watched by the loop, its rows read when they come.

The fetch thread (:class:`~lonnymq.transport.loop.Fetcher`) runs a dequeue while the loop
feeds Celery's pool, but each of its waits on the socket gives the GIL away and takes it
back from the loop's thread: measured, psycopg's ``execute`` of a dequeue took 108-112 us of
CPU alone and 327-331 us beside a thread running Python, and the round trip 6.5 ms instead
of 0.47 (docs/benchmarks.md). Driven by the loop, the same dequeue costs what it costs alone
and nobody waits for the GIL. Used for the usual case only: one kombu channel to fetch for,
no change of the sleep keys, nothing handed to the consumer by publishes, the connection
open and not in use by another thread; anything else goes to the fetch thread as before.

While the dequeue is in flight the command connection is marked busy with it
(``PgClient.hold``); whoever wants the connection meanwhile, this thread (a reject from a
callback, a channel closing) or another, first completes the dequeue, blocking, and its
outcome waits for the loop's next look, which it asks for. Its statement is driven only
under the connection's mutex, by the loop's reader or by such a caller. (psycopg has no public
non-blocking ``execute`` on a sync connection: the cursor's statement generator, the one
its ``execute`` and its asyncio wait drive, is driven here; where it is missing, the fetch
thread is used.)
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import waiting

from ..exceptions import ConnectionLost, SchemaNotInstalled
from ..queue._ops import Op, translate
from ..queue.dequeue import DequeueResult
from .acks import Ack
from .interfaces import ChannelLike, Job, TransportLike

#: The results of a batch, the error that stopped it, and a sleep change's answer (always
#: None here): as the fetch thread's (``loop.Outcome``).
Outcome = tuple[list[tuple[ChannelLike, DequeueResult]], BaseException | None, None]


class LoopFetch:
    """One dequeue in flight for one kombu channel (see the module docstring). ``done`` is
    called on the loop's thread when its rows came; ``later`` (any thread: it wakes the
    loop) when it was completed by :meth:`finish`, for the loop to look soon after."""

    def __init__(
        self,
        transport: TransportLike,
        loop: Any,
        channel: ChannelLike,
        done: Callable[[], None],
        later: Callable[[], None],
    ) -> None:
        self.transport = transport
        self.loop = loop
        self.channel = channel
        self.done = done
        self.later = later
        self.outcome: Outcome | None = None
        self._acks: list[Ack] = []
        self._op: Op[DequeueResult] | None = None
        self._cursor: Any = None
        self._gen: Any = None
        self._fd = -1
        self._watched = False
        self._started = time.perf_counter()

    @classmethod
    def start(
        cls,
        transport: TransportLike,
        loop: Any,
        job: Job,
        done: Callable[[], None],
        later: Callable[[], None],
    ) -> LoopFetch | None:
        """Send ``job``'s dequeue (carrying the buffered acks) and watch for its rows. None
        when the connection is not open and free, the psycopg in use cannot, or the fetch
        is not the usual one (handed messages wait): nothing was taken, and the caller
        hands the job to the fetch thread. A fetch whose sending failed comes back with its
        outcome (the error) already set."""
        channel, queues, limit = job
        pg = transport.pg
        fetch = cls(transport, loop, channel, done, later)
        with pg.mutex:
            if not pg.free:
                return None
            conn = pg.connection()
            cursor = conn.cursor()
            if not callable(getattr(cursor, "_execute_gen", None)):
                return None
            prepared = transport.prepare_dequeue(queues, limit, idle=channel.idle)
            if prepared is None:
                return None
            fetch._acks, fetch._op = prepared
            fetch._cursor, fetch._fd = cursor, conn.pgconn.socket
            pg.hold(fetch.finish)
            try:
                op = fetch._op
                fetch._gen = cursor._execute_gen(op.query, op.params, binary=op.binary)
            except BaseException as exc:  # (the outcome's error, raised by the next look)
                fetch._end(exc)
                return fetch
            fetch._advance(None)
        return fetch

    def _advance(self, ready: waiting.Ready | None) -> None:
        """Drive the statement until it waits for its rows (the loop watches its socket),
        or until it ends."""
        try:
            state = next(self._gen) if ready is None else self._gen.send(ready)
            while state & waiting.Wait.W:  # (a large statement: its socket is nearly
                # always writable again at once)
                select.select([], [self._fd], [])
                state = self._gen.send(waiting.Ready.W)
        except StopIteration:
            self._unwatch()
            self._rows()
            return
        except BaseException as exc:
            self._unwatch()
            self._end(exc)
            return
        if not self._watched:
            self.loop.add_reader(self._fd, self._on_readable)
            self._watched = True

    def _on_readable(self) -> None:
        with self.transport.pg.mutex:
            if self.outcome is None:
                self._advance(waiting.Ready.R)
                if self.outcome is None:
                    return
        self.done()

    def _unwatch(self) -> None:
        if self._watched:
            self._watched = False
            with contextlib.suppress(Exception):  # (the loop may be closed already)
                self.loop.remove_reader(self._fd)

    def _rows(self) -> None:
        """The statement ended: its rows read into the dequeue's result."""
        assert self._op is not None
        try:
            got: DequeueResult | BaseException = self._op.parse(self._cursor.fetchall())
        except BaseException as exc:
            got = exc
        self._end(got)

    def finish(self) -> None:
        """Complete the dequeue now, blocking: the connection is wanted for something
        else (the caller holds its mutex), or the consumer leaves the loop. The loop is
        asked to look soon after, for its outcome."""
        with self.transport.pg.mutex:
            if self.outcome is not None:
                return
            self._unwatch()
            try:
                self._cursor.connection.wait(self._gen)
            except BaseException as exc:
                self._end(exc)
            else:
                self._rows()
        self.later()

    def _end(self, got: DequeueResult | BaseException) -> None:
        """Set the outcome, once, from the result or the error: the acks told or put back,
        the connection given back (forgotten when lost). A schema that went away is
        installed again and the dequeue run once more, blocking, as any call of the
        transport does (``PgClient.run``)."""
        transport, pg, op = self.transport, self.transport.pg, self._op
        assert op is not None
        if isinstance(got, psycopg.Error):
            got = translate(got, op.schema)
        pg.unhold(lost=isinstance(got, ConnectionLost))
        if isinstance(got, SchemaNotInstalled):
            try:
                got = pg.run(op)
            except BaseException as exc:
                got = exc
        if isinstance(got, BaseException):
            transport.acks.put_back(self._acks)
            self.outcome = ([], got, None)
            return
        transport.dequeued(self._acks, got, self._started)
        self.outcome = ([(self.channel, got)], None, None)
