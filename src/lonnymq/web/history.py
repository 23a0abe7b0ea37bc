"""Rates per second, from the counters of the readings the web view makes.

Every reading of the queues' status (a page or an API call) is offered to :class:`History`,
which keeps at most one a second for the last ``keep_s`` seconds (ten minutes by default).
A queue's rates are its counters' increase since the kept reading closest to ``window_s``
seconds before (at least one second before); the chart's series is the total rate at each
reading over the few seconds before it. Nothing is read from the database for it: with
nobody looking, no reading is made, and the chart starts when someone opens a page.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..queue import ChannelStatus, QueueStatus
from ..report import RATE_COUNTERS

Counts = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class _Reading:
    mono: float
    wall: float
    counters: dict[str, Counts]


def _counters(s: QueueStatus) -> Counts:
    c = s.counters
    return (c.enqueued, c.delivered, c.acked, c.dead)


def channel_counts(c: ChannelStatus) -> Counts:
    """A channel's counters, in the order of :data:`RATE_COUNTERS`."""
    return (c.enqueued, c.delivered, c.acked, c.dead)


class History:
    def __init__(self, *, keep_s: float = 600.0, window_s: float = 10.0) -> None:
        self.keep_s = keep_s
        self.window_s = window_s
        self._readings: deque[_Reading] = deque()
        self._lock = threading.Lock()

    def add(self, statuses: Sequence[QueueStatus]) -> dict[str, dict[str, float | None]]:
        """Record a reading (unless one was kept less than a second ago) and return each
        queue's rates: ``{queue: {"enqueued": per_s, "delivered": ..., "acked": ...,
        "dead": ...}}``, None until there is an earlier reading."""
        return self.add_counts({s.queue: _counters(s) for s in statuses})

    def add_counts(self, counts: dict[str, Counts]) -> dict[str, dict[str, float | None]]:
        """:meth:`add` of counters by key (a queue, a channel)."""
        now = time.monotonic()
        reading = _Reading(now, time.time(), counts)
        with self._lock:
            while self._readings and now - self._readings[0].mono > self.keep_s:
                self._readings.popleft()
            base = None
            for r in reversed(self._readings):
                if now - r.mono >= 1.0:
                    base = r
                    if now - r.mono >= self.window_s:
                        break
            if not self._readings or now - self._readings[-1].mono >= 1.0:
                self._readings.append(reading)
        out: dict[str, dict[str, float | None]] = {}
        for key, now_counts in reading.counters.items():
            before = None if base is None else base.counters.get(key)
            if before is None or base is None:
                out[key] = dict.fromkeys(RATE_COUNTERS)
                continue
            elapsed = now - base.mono
            out[key] = {
                name: max(0, b - a) / elapsed
                for name, a, b in zip(RATE_COUNTERS, before, now_counts, strict=True)
            }
        return out

    def series(self, smooth_s: float = 6.0) -> list[dict[str, float]]:
        """The total rates at each kept reading, oldest first, each over the ``smooth_s``
        seconds before it (or since the reading before, if that is longer): ``{"t": unix time
        of the reading, "enqueued": per_s, ...}``. A queue that appears or goes in between
        does not count in that point."""
        with self._lock:
            readings = list(self._readings)
        points: list[dict[str, float]] = []
        for i in range(1, len(readings)):
            b = readings[i]
            j = i - 1
            while j > 0 and b.mono - readings[j - 1].mono <= smooth_s:
                j -= 1
            a = readings[j]
            elapsed = b.mono - a.mono
            totals = [0.0, 0.0, 0.0, 0.0]
            for queue, counts in b.counters.items():
                before = a.counters.get(queue)
                if before is None:
                    continue
                for k in range(4):
                    totals[k] += max(0, counts[k] - before[k])
            point = {"t": round(b.wall, 3)}
            point.update(
                {name: round(v / elapsed, 3) for name, v in zip(RATE_COUNTERS, totals, strict=True)}
            )
            points.append(point)
        return points


class Histories:
    """A :class:`History` per key (a queue's channel), for the pages that show one: at most
    ``keep`` of them, the least recently used dropped first."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._kept: OrderedDict[tuple[str, str], History] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, key: tuple[str, str]) -> History:
        with self._lock:
            history = self._kept.get(key)
            if history is None:
                history = self._kept[key] = History()
            self._kept.move_to_end(key)
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
            return history
