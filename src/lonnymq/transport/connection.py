"""The Postgres connections of a transport, per process.

- :class:`PgClient`: the command connection (publish, dequeue, ack, heartbeat), shared by the
  threads of one process under a lock (acks arrive from pool threads), reconnected on demand.
- :class:`Waiter`: the LISTEN connection an idle consumer blocks on, apart from the command
  connection so acks never wait behind it.

Both are fork-safe (:mod:`.sessions`): a child process never touches (nor closes) a
connection its parent opened; it opens its own on first use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from .. import migrator
from ..exceptions import ConnectionLost, LonnyMQError, SchemaNotInstalled
from ..queue._checks import MAX_ID
from ..queue._ops import Op, async_commit, async_commit_if_woke, flush_op, run, translate
from ..queue.dequeue import Message
from . import pooler
from .handoff import Handoffs
from .notifications import Arrivals
from .sessions import LIVE, Forkable, open_connection

logger = logging.getLogger("lonnymq.transport")
T = TypeVar("T")

_INSTALLED: set[tuple[str, str]] = set()
_INSTALL_LOCK = threading.Lock()


class PgClient(Forkable):
    """The command connection of one transport in one process."""

    def __init__(
        self,
        conninfo: str,
        *,
        schema: str,
        connect_timeout: float | None = None,
        auto_install: bool = True,
        session_settings: dict[str, str] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.schema = schema
        self.connect_timeout = connect_timeout
        self.auto_install = auto_install
        self.session_settings = session_settings or {}
        self._conn = None
        self._lock = threading.RLock()
        self._finish: Callable[[], None] | None = None  # see hold
        LIVE.add(self)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._finish = None

    @property
    def mutex(self) -> threading.RLock:
        """Held by whoever uses the connection (re-entrant)."""
        return self._lock

    def hold(self, finish: Callable[[], None]) -> None:
        """Mark the connection busy with a statement in flight that the caller drives
        without holding :attr:`mutex` all along (the event loop's fetch, :mod:`.inloop`;
        the caller drives it under :attr:`mutex`), until :meth:`unhold`. Whoever wants the
        connection meanwhile, this thread or another, first calls ``finish``, which
        completes the statement (blocking) and unholds. The caller holds :attr:`mutex` and
        found the connection :attr:`free`."""
        self._finish = finish

    def unhold(self, *, lost: bool = False) -> None:
        """The held statement is done (``lost``: with the connection, which is forgotten)."""
        with self._lock:
            self._finish = None
            if lost:
                self.discard()

    def connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            finish = self._finish
            if finish is not None:  # (held by this thread: see hold)
                finish()
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                conn = open_connection(self.conninfo, self.connect_timeout, "command")
                try:
                    for name, value in self.session_settings.items():
                        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
                    self._ensure_schema(conn)
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
            return conn

    def _ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        key = (self.conninfo, self.schema)
        if key in _INSTALLED:
            return
        with _INSTALL_LOCK:
            try:
                migrator.check(conn, self.schema)
            except SchemaNotInstalled:
                if not self.auto_install:
                    raise
                applied = migrator.install(conn, self.schema)
                if applied:
                    logger.info("lonnymq: installed schema %r (%s)", self.schema, applied)
            except psycopg.Error as exc:
                raise translate(exc, self.schema) from exc
            _INSTALLED.add(key)

    @property
    def free(self) -> bool:
        """The connection is open and no other thread is using it: a call need neither
        connect nor wait first (it may still find the connection lost)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            conn = self._conn
            return self._finish is None and conn is not None and not conn.closed and not conn.broken
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def locked(self) -> Iterator[psycopg.Connection[Any]]:
        """The connection, held for a multi-statement job (a batch)."""
        with self._lock:
            try:
                yield self.connection()
            except ConnectionLost:
                self.discard()
                raise

    def run(self, op: Op[T]) -> T:
        """Run one operation, reconnecting first if the connection was lost."""
        return self._call(lambda conn: run(conn, op))

    def run_flushed(self, op: Op[T], *, only_if_woke: bool = False) -> T:
        """Run ``op`` (one statement, its own transaction) so that it is durable when this
        returns, and visible before it is flushed: committed without waiting for the WAL
        flush, then a flushing transaction (``flush_op``) commits on the same session (its
        flush covers the first). ``only_if_woke`` (``op`` is a publish): so only when it woke
        a consumer asleep on a queue it reached, in one durable transaction otherwise
        (``async_commit_if_woke``). Never on a new session: a flush there would not say
        whether a server that restarted meanwhile still has what ``op`` did (a lost
        connection raises). Through a pooler, which may run the two on different server
        sessions (of a server that restarted in between), ``op`` commits durably in one
        transaction."""

        def work(conn: psycopg.Connection[Any]) -> T:
            if pooler.pooled(conn):
                return run(conn, op)
            if only_if_woke:
                result, woke = run(conn, async_commit_if_woke(op))
            else:
                result, woke = run(conn, async_commit(op)), True
            if woke:
                run(conn, flush_op(op.schema))
            return result

        return self._call(work)

    def _call(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``work`` on the connection: a lost connection is forgotten (the next call
        reconnects); a schema that went away since this process checked it is installed
        (repaired) again with auto_install, and ``work`` retried once."""
        with self._lock:
            conn = self.connection()
            try:
                return work(conn)
            except ConnectionLost:
                self.discard()
                raise
            except SchemaNotInstalled:
                if not self.auto_install:
                    raise
                logger.warning(
                    "lonnymq: schema %r is missing or incomplete: installing it", self.schema
                )
                _INSTALLED.discard((self.conninfo, self.schema))
                self._ensure_schema(conn)
                return work(conn)

    def discard(self) -> None:
        """Forget the connection (after an error); the next call reconnects."""
        with self._lock:
            finish = self._finish
            if finish is not None:  # (held by this thread: see hold)
                finish()
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # the connection is already unusable
                conn.close()

    close = discard


#: Hints kept per queue until its next fetch: a consumer whose prefetch window stays full
#: while producers create keeps no more than this (a claim of more would not apply anyway:
#: what no ingest has seen is then more than the dequeue takes by hint).
MAX_HINTS = 64
_HINT_ID = re.compile(r"[0-9]{1,19}")


class Waiter(Forkable):
    """Where an idle consumer blocks: on LISTEN (a connection of its own, so acks never wait
    behind it) and on a self-pipe that :meth:`wake` writes to, so that another thread (an ack
    freeing a full prefetch window) can end the wait at once."""

    def __init__(
        self,
        conninfo: str,
        channel: str,
        connect_timeout: float | None = None,
        *,
        listen: bool = True,
        hint_channel: str | None = None,
        handoff_schema: str | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.channel = channel
        #: where creates name the message they made (``'<id> <queue>'``): see :meth:`hints`
        self.hint_channel = hint_channel
        #: what publishes hand to this session (None: no hand-off; see :mod:`.handoff`)
        self.handoffs = None if handoff_schema is None else Handoffs(handoff_schema)
        self.connect_timeout = connect_timeout
        self.listen = listen
        self._conn = None
        self._arrivals = Arrivals()
        self._hints: dict[str, set[int]] = {}
        # (its own lock: the fetch takes hints while another thread may wait on LISTEN)
        self._hints_lock = threading.Lock()
        self._lock = threading.RLock()
        self._failed_at = 0.0
        self._sessions = 0  # LISTEN connections opened so far
        self._pipe = self._new_pipe()
        LIVE.add(self)

    @staticmethod
    def _new_pipe() -> tuple[int, int]:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        return r, w

    def _after_fork(self) -> None:
        super()._after_fork()
        self._pipe = self._new_pipe()  # the parent's pipe stays the parent's
        self._hints_lock = threading.Lock()
        self._hints, self._arrivals = {}, Arrivals()  # (the parent's LISTEN session's)
        if self.handoffs is not None:  # (the parent's to deliver)
            self.handoffs = Handoffs(self.handoffs.schema)

    def wake(self) -> None:
        """End a wait in progress (or the next one) now. Safe from any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._pipe[1], b"!")

    @property
    def wake_fd(self) -> int:
        """The end of the wake-up pipe to watch (an event loop's reader); see :meth:`woken`."""
        return self._pipe[0]

    def woken(self) -> bool:
        """Empty the wake-up pipe; True when something was in it."""
        got = False
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._pipe[0], 4096):
                got = True
        return got

    def listening(self) -> tuple[psycopg.Connection[Any] | None, bool]:
        """The LISTEN connection, opened if needed (None: ``listen`` is off, or LISTEN is
        unavailable now and polling must do), and whether it was opened just now (then a
        NOTIFY sent before it took effect may be lost: look again)."""
        if not self.listen:
            return None, False
        with self._lock:
            fresh = self._conn is None or self._conn.closed or self._conn.broken
            conn = self._connection()
            return conn, fresh and conn is not None

    @property
    def session(self) -> int | None:
        """Which LISTEN session is live (a number that changes when it is reopened), or None
        when there is none now. Does not connect."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return None
        return self._sessions

    def run(self, op: Op[T], queues: Collection[str]) -> tuple[T, set[str]] | None:
        """Run ``op`` on the LISTEN session (the ``sleep`` keys live there). Returns its result
        and the queues among ``queues`` notified meanwhile (read while the statement ran, the
        loop's reader does not see them); None when the session failed: then it is closed,
        and what it held with it (the next :meth:`listening` reopens it)."""
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                return None
            try:
                result = run(conn, op)
            except LonnyMQError as exc:
                logger.warning("lonnymq: LISTEN connection lost (%s); reconnecting", exc)
                self.close()
                return None
            return result, self.notified(queues)

    def notified(self, queues: Collection[str]) -> set[str]:
        """Read the notifications that arrived (without blocking); returns the queues among
        ``queues`` they were for. A lost LISTEN connection is closed (the next
        :meth:`listening` reopens it) and counts as a wake-up of every queue."""
        with self._lock:
            conn = self._conn
            if conn is None:
                return set()
            try:
                found = set()
                woken: set[str] = set()  # (by something else than a hand-off)
                for n in self._arrivals.read(conn):
                    if self.handoffs is not None and n.channel == self.handoffs.channel:
                        handed = self.handoffs.receive(n.payload, queues)
                        if handed is not None:
                            found.add(handed)
                    elif n.channel == self.hint_channel:
                        ident, _, queue = n.payload.partition(" ")
                        if queue in queues:
                            self._hint(queue, ident)
                            found.add(queue)
                            woken.add(queue)
                    elif n.payload in queues:
                        found.add(n.payload)
                        woken.add(n.payload)
                with self._hints_lock:  # (those of queues no longer consumed go)
                    for queue in [q for q in self._hints if q not in queues]:
                        del self._hints[queue]
                if self.handoffs is not None:
                    self.handoffs.unconsumed(queues, woken)
                return found
            except psycopg.Error as exc:
                logger.warning("lonnymq: LISTEN connection lost (%s); reconnecting", exc)
                self.close()
                return set(queues)

    def _hint(self, queue: str, ident: str) -> None:
        """Keep a hint's id (any NOTIFY on the channel is read: what is not a message id is
        dropped)."""
        if _HINT_ID.fullmatch(ident) is None or not 0 < int(ident) <= MAX_ID:
            logger.debug("lonnymq: hint %r for queue %r ignored", ident, queue)
            return
        with self._hints_lock:
            held = self._hints.setdefault(queue, set())
            if len(held) < MAX_HINTS:  # (more: the dequeue finds them)
                held.add(int(ident))

    def pending(self, *, take: bool = True) -> list[Message]:
        """The messages handed and not delivered yet (see :meth:`.Handoffs.pending`)."""
        return [] if self.handoffs is None else self.handoffs.pending(take=take)

    def hints(self, queues: Collection[str]) -> list[int]:
        """Take the ids of the messages that creates of ``queues`` said they made since the
        last call for them (the ``hint_channel``'s notifications, read with the others): a
        consumer that was idle may take them by their ids (``message_dequeue_hinted_v1``)."""
        with self._hints_lock:
            found: set[int] = set()
            for queue in queues:
                found.update(self._hints.pop(queue, ()))
            return sorted(found)

    def _connection(self) -> psycopg.Connection[Any] | None:
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        if time.monotonic() - self._failed_at < 1.0:
            return None  # do not hammer a server that just refused us
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = open_connection(self.conninfo, self.connect_timeout, "listen")
            # through a pooler, LISTEN must work or the consumer refuses to start
            pooler.check_listen(
                conn,
                self.conninfo,
                lambda: open_connection(self.conninfo, self.connect_timeout, "check"),
            )
            if self.handoffs is not None:
                self.handoffs.adopt(conn)
            self._arrivals.attach(conn)
            handoff_channel = None if self.handoffs is None else self.handoffs.channel
            for channel in (self.channel, self.hint_channel, handoff_channel):
                if channel is not None:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException as exc:
            if conn is not None:  # (opened, then failed: not left open)
                with contextlib.suppress(Exception):
                    conn.close()
            if not isinstance(exc, (ConnectionLost, psycopg.Error)):
                raise
            self._failed_at = time.monotonic()
            logger.warning("lonnymq: LISTEN unavailable, polling instead: %s", exc)
            return None
        self._conn = conn
        self._sessions += 1
        return conn

    def wait(self, timeout: float, queues: Collection[str]) -> set[str] | bool:
        """Block until a notification for one of ``queues``, a :meth:`wake`, or ``timeout``
        seconds. Returns the queues notified (all of them when the LISTEN connection was
        lost, see :meth:`notified`); True when woken otherwise (a wake, a LISTEN opened just
        now: look at every queue); False at the timeout, or when LISTEN is down (poll)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            conn, fresh = self.listening()
            if fresh:
                # A NOTIFY sent before this LISTEN took effect is lost: have the caller
                # look again now that nothing can be missed.
                return True
            pipe = self._pipe[0]
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    watched = [pipe] if conn is None else [pipe, conn.fileno()]
                    ready, _, _ = select.select(
                        watched, [], [], min(left, 1.0) if conn is None and self.listen else left
                    )
                    if pipe in ready:
                        self.woken()
                        return True
                    if conn is not None and ready:
                        notified = self.notified(queues)
                        if notified:
                            return notified
                    elif conn is None and self.listen and not ready:
                        return True  # LISTEN down: let the caller poll, then retry LISTEN
            except psycopg.Error as exc:
                logger.warning("lonnymq: LISTEN connection lost (%s); reconnecting", exc)
                self.close()
                return True

    def close(self) -> None:
        """Close the LISTEN connection (the next wait opens a new one)."""
        with self._hints_lock:
            self._hints.clear()
        conn, self._conn = self._conn, None
        self._arrivals.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def dispose(self) -> None:
        """Close everything, the wake-up pipe included."""
        self.close()
        for fd in self._pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
