"""The expiry sweep any client of a schema runs now and then: messages past their time to live,
queues unused for longer than their ``x-expires`` (with their messages and bindings), dead
letters past their queue's retention. Queues whose processes are gone (the reply queue of a
Celery client that exited, the pidbox queue of a killed worker) go too, as long as some client
of the schema runs, or ``lonnymq housekeep`` does.

It stays cheap when many clients share a schema:

- per process, at most one sweep per ``expire_interval`` (:meth:`Sweeper.due`);
- across processes, a sweep is skipped while another client sweeps (an advisory key, only
  tried) and when the schema was swept less than ``expire_interval`` ago (the newest
  discovery row's ``expire_from`` is the time of the last sweep that found nothing left to
  do; roles that may not read the table skip only this check);
- a sweep waits at most a second (a producer's: 0.2 s) for the locks it needs, then gives up
  until next time.

A consumer sweeps from its heartbeat thread. A producer starts the sweep when a publish
finds one due, on a thread of its own (:func:`beside`): the caller of the publish does not
wait for it (it took 2-10 ms, every ``expire_interval``, on the way back from a publish); a
process that exits waits for the sweep it started (at most a few seconds), so a short-lived
producer (a script sending one task) still sweeps.

Roles without ``EXECUTE`` on ``expire_v1`` (the producer kind of :mod:`lonnymq.roles`) do not
sweep; without ``housekeep_v1`` they do not prune dead letters.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..exceptions import LonnyMQError
from ..queue._ops import run
from ..queue.expiry import expire_op, housekeep_op

logger = logging.getLogger("lonnymq.transport")


@dataclass(frozen=True, slots=True)
class Swept:
    """What one sweep removed: messages past their time to live, expired queues, dead
    letters pruned (None: not pruned, the role may not)."""

    messages: int
    queues: int
    dead_pruned: int | None


class Sweeper:
    """Sweeps of one schema from one process (see the module docstring)."""

    def __init__(self, schema: str, interval: float) -> None:
        self.schema = schema
        self.interval = interval
        #: the advisory key (hashed) a sweep holds for its transaction
        self.key = f"lonnymq:{schema}:sweep"
        self._next = 0.0  # the first sweep of a process is due at once
        self._lock = threading.Lock()
        self._rights: tuple[bool, bool, bool] | None = None

    def due(self) -> bool:
        """Whether this process should sweep now; if so, the next one is due in about
        ``interval`` (with some jitter, so that processes started together spread out)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                return False
            self._next = now + self.interval * random.uniform(1.0, 1.25)
            return True

    def _read_rights(self, conn: psycopg.Connection[Any]) -> tuple[bool, bool, bool]:
        if self._rights is None:
            expire = sql.Identifier(self.schema, "expire_v1").as_string(conn) + "(integer)"
            house = sql.Identifier(self.schema, "housekeep_v1").as_string(conn) + "(integer)"
            discovery = sql.Identifier(self.schema, "discovery").as_string(conn)
            row = conn.execute(
                "SELECT has_function_privilege(%s, 'EXECUTE'), "
                "has_function_privilege(%s, 'EXECUTE'), has_table_privilege(%s, 'SELECT')",
                (expire, house, discovery),
            ).fetchone()
            assert row is not None
            self._rights = (bool(row[0]), bool(row[1]), bool(row[2]))
            if not self._rights[0]:
                logger.info(
                    "lonnymq: role %s may not run expire_v1 on schema %r: this process does "
                    "not sweep expired messages and queues (a worker role does; or run "
                    "`lonnymq housekeep` on a schedule)",
                    conn.info.user,
                    self.schema,
                )
        return self._rights

    def sweep(
        self, conn: psycopg.Connection[Any], *, limit: int = 10_000, lock_timeout_ms: int = 1000
    ) -> Swept | None:
        """Sweep on ``conn`` (an autocommit connection, outside any transaction of the
        caller's) unless another client sweeps now or swept less than ``interval`` ago, or
        the role may not. At most ``limit`` messages past their time to live (every expired
        queue, whatever it holds); a lock waited for longer than ``lock_timeout_ms`` ends the
        sweep (nothing is removed; the next one tries again). Returns what was removed, or
        None when skipped."""
        try:
            may_expire, may_housekeep, may_read = self._read_rights(conn)
        except psycopg.Error as exc:  # the schema is being dropped, the connection is lost
            logger.debug("lonnymq: sweep of %r skipped: %s", self.schema, exc)
            return None
        if not may_expire:
            return None
        fresh: sql.Composable = sql.SQL("false")
        if may_read:
            fresh = sql.SQL(
                "coalesce((SELECT d.expire_from > clock_timestamp() - %s * interval '1 ms' "
                "FROM {} d ORDER BY d.id DESC LIMIT 1), false)"
            ).format(sql.Identifier(self.schema, "discovery"))
        query = sql.SQL(
            "SELECT set_config('lock_timeout', %s, true), "
            "pg_try_advisory_xact_lock(hashtextextended(%s, 0)), {}"
        ).format(fresh)
        params: tuple[Any, ...] = (f"{int(lock_timeout_ms)}ms", self.key)
        if may_read:
            params += (self.interval * 1000.0,)
        try:
            with conn.transaction():
                row = conn.execute(query, params).fetchone()
                assert row is not None
                if not row[1] or row[2]:  # another client sweeps now, or swept lately
                    return None
                messages, queues = run(conn, expire_op(self.schema, limit))
                pruned = (
                    run(conn, housekeep_op(self.schema, limit=limit)) if may_housekeep else None
                )
        except (psycopg.Error, LonnyMQError) as exc:  # a lock wait timed out, a lost connection
            logger.debug("lonnymq: sweep of %r failed, retried later: %s", self.schema, exc)
            return None
        if messages or queues or pruned:
            logger.info(
                "lonnymq: swept schema %r: %d expired message(s), %d expired queue(s), %s "
                "dead letter(s) pruned",
                self.schema,
                messages,
                queues,
                "-" if pruned is None else pruned,
            )
        return Swept(messages, queues, pruned)


_SWEEPERS: dict[tuple[int, str, str], Sweeper] = {}
_SWEEPERS_LOCK = threading.Lock()


def sweeper_for(conninfo: str, schema: str, interval: float) -> Sweeper:
    """The sweeper of ``schema`` in this process (shared by its transports: a Celery process
    opens several connections; one sweep per interval is enough)."""
    key = (os.getpid(), conninfo, schema)
    with _SWEEPERS_LOCK:
        sweeper = _SWEEPERS.get(key)
        if sweeper is None or sweeper.interval != interval:
            sweeper = _SWEEPERS[key] = Sweeper(schema, interval)
        return sweeper


#: Sweeps running beside their publishers (see :func:`beside`).
_RUNNING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def beside(work: Callable[[], None]) -> threading.Thread:
    """Run ``work`` (a producer's sweep) on a thread of its own, waited for at exit
    (:func:`join_running`)."""
    thread = threading.Thread(target=work, name="lonnymq-sweep", daemon=True)
    _RUNNING.add(thread)
    thread.start()
    return thread


def join_running(timeout: float) -> None:
    """Wait for the sweeps running beside their publishers, ``timeout`` seconds at most."""
    deadline = time.monotonic() + timeout
    for thread in list(_RUNNING):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
