"""Readings that cost more than a page may: kept, and refreshed in the background.

The queues' status (its ready/delayed split reads every waiting message) and a queue's channel
listing (it sums the counts of every channel of the queue) grow with the backlog: on a queue
of 1,000,000 messages in 100,000 channels they take seconds (docs/web.md, "Timings"). A page
must not wait for them each time, so each is kept here with the time it was read. A page gets
the kept reading; one older than its refresh interval is read again in a background thread
(one at a time per reading), and the next refresh of the page shows it. The interval is the
app's refresh interval, or five times what the reading took, whichever is longer: a reading
that takes 3 s is made at most every 15 s, one that takes 5 ms every refresh. Nobody looking,
nothing read: a refresh starts only when a page asks. Only the first page that needs a reading
waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .db import Conn, Pool

T = TypeVar("T")
log = logging.getLogger("lonnymq.web")

#: Readings kept at most (a queue's channel listing is one per queue and page size).
MAX_KEPT = 64


@dataclass
class Reading(Generic[T]):
    value: T
    #: time.monotonic() when the reading was made, and how long it took
    at: float
    took: float

    def age(self) -> float:
        return time.monotonic() - self.at


class Readings:
    def __init__(self, pool: Pool, *, interval_s: float = 2.0, factor: float = 5.0) -> None:
        self._pool = pool
        self.interval_s = interval_s
        self.factor = factor
        self._kept: OrderedDict[Hashable, Reading[Any]] = OrderedDict()
        self._refreshing: dict[Hashable, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _read(self, conn: Conn, read: Callable[[Conn], T]) -> Reading[T]:
        started = time.monotonic()
        value = read(conn)
        return Reading(value, started, time.monotonic() - started)

    def _keep(self, key: Hashable, reading: Reading[Any]) -> None:
        with self._lock:
            self._kept[key] = reading
            self._kept.move_to_end(key)
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)

    def get(self, conn: Conn, key: Hashable, read: Callable[[Conn], T]) -> Reading[T]:
        """The kept reading of ``key`` (made by ``read`` on ``conn`` now if there is none),
        refreshed in the background when it is older than its interval."""
        with self._lock:
            kept = self._kept.get(key)
        if kept is None:
            reading = self._read(conn, read)
            self._keep(key, reading)
            return reading
        if kept.age() >= max(self.interval_s, self.factor * kept.took):
            self._refresh(key, read)
        return kept

    def _refresh(self, key: Hashable, read: Callable[[Conn], Any]) -> None:
        with self._lock:
            if self._closed or key in self._refreshing:
                return

            def run() -> None:
                try:
                    with self._pool.connection() as conn:
                        self._keep(key, self._read(conn, read))
                except Exception as exc:  # the next page asks again
                    log.warning("background reading %r failed: %s", key, exc)
                finally:
                    with self._lock:
                        self._refreshing.pop(key, None)

            thread = threading.Thread(target=run, name="lonnymq-web-reading", daemon=True)
            self._refreshing[key] = thread
        thread.start()

    def close(self, timeout: float = 15.0) -> None:
        """Start no more refreshes and wait for those running."""
        with self._lock:
            self._closed = True
            running = list(self._refreshing.values())
        deadline = time.monotonic() + timeout
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
