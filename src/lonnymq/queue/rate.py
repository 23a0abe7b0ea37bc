"""Rates of a channel policy: at most ``count`` deliveries per ``per_ms`` milliseconds, written
``"10/s"``, ``"600/m"``, ``"1/h"`` (also ``"5/10s"``: five per ten seconds), or given as a
:class:`Rate`. The broker enforces them in the dequeue (a GCRA, see docs/design.md, "Rate")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from ..exceptions import InvalidArgument
from . import _checks

#: the largest burst
MAX_BURST = 1_000_000
#: the longest interval a rate may have: a day
MAX_PER_MS = 24 * 3600 * 1000
_UNITS = {
    "ms": 1,
    "s": 1000,
    "sec": 1000,
    "second": 1000,
    "m": 60_000,
    "min": 60_000,
    "minute": 60_000,
    "h": 3_600_000,
    "hr": 3_600_000,
    "hour": 3_600_000,
}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` deliveries per ``per_ms`` milliseconds (on average: a channel may
    also take its ``burst`` at once after it was idle)."""

    count: int
    per_ms: int = 1000

    def __post_init__(self) -> None:
        _checks.integer(self.count, "rate count", low=1, high=_checks.MAX_INT4)
        _checks.integer(self.per_ms, "rate per_ms", low=1, high=MAX_PER_MS)

    @classmethod
    def parse(cls, value: object) -> Rate:
        """A rate from ``"N/s"``, ``"N/m"``, ``"N/h"`` (or ``"N/Ks"``...), or a Rate."""
        if isinstance(value, Rate):
            return value
        if not isinstance(value, str):
            raise InvalidArgument(
                f"rate must be a str such as '10/s' or a lonnymq.Rate, not {type(value).__name__}"
            )
        match = _RATE.fullmatch(value.lower())
        unit = _UNITS.get(match.group(3)) if match else None
        if match is None or unit is None:
            raise InvalidArgument(
                f"rate {value!r} is not of the form N/s, N/m or N/h (e.g. '10/s', '600/m')"
            )
        times = int(match.group(2)) if match.group(2) else 1
        if times < 1:
            raise InvalidArgument(f"rate {value!r}: the interval must be at least 1")
        return cls(int(match.group(1)), times * unit)

    @property
    def interval(self) -> timedelta:
        """The time between two deliveries at this rate, on average."""
        return timedelta(milliseconds=self.per_ms / self.count)

    @property
    def per_second(self) -> float:
        return self.count * 1000 / self.per_ms

    def __str__(self) -> str:
        for unit, ms in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
            if self.per_ms == ms:
                return f"{self.count}/{unit}"
            if self.per_ms % ms == 0:
                return f"{self.count}/{self.per_ms // ms}{unit}"
        return f"{self.count}/{self.per_ms}ms"


def rate_or_none(value: object) -> Rate | None:
    return None if value is None else Rate.parse(value)


def rate_of(count: int | None, per_ms: int | None) -> Rate | None:
    """The rate of a row's (count, per_ms) columns (None: no rate)."""
    return None if count is None or per_ms is None else Rate(count, per_ms)


def burst_or_none(value: object, rate: Rate | None) -> int | None:
    """A burst: an int of at least 1, only with a rate (default 1 when a rate is given)."""
    if value is None:
        return None if rate is None else 1
    if rate is None:
        raise InvalidArgument("burst needs a rate: give rate= too (e.g. rate='10/s', burst=5)")
    return _checks.integer(value, "burst", low=1, high=MAX_BURST)
