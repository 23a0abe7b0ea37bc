"""Terminal output for the CLI: aligned tables, colour on a terminal (never when piped, or
with ``NO_COLOR`` set), human durations and ages, progress on stderr."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TextIO

from ..report import age as age
from ..report import jsonable as jsonable

_CODES = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def wants_colour(stream: TextIO, mode: str = "auto") -> bool:
    if mode == "always":
        return True
    if mode == "never" or os.environ.get("NO_COLOR"):
        return False
    return bool(getattr(stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"


class Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, *styles: str) -> str:
        if not self.enabled or not styles or not text:
            return text
        codes = ";".join(_CODES[s] for s in styles)
        return f"\x1b[{codes}m{text}\x1b[0m"


def visible_len(text: str) -> int:
    return len(_ANSI.sub("", text))


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    style: Style,
    *,
    right: frozenset[int] = frozenset(),
) -> str:
    """Columns aligned (``right``: indexes of right-aligned columns, the numbers), a bold
    header, two spaces between columns."""
    widths = [visible_len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], visible_len(cell))

    def line(cells: Sequence[str], head: bool = False) -> str:
        out = []
        for i, cell in enumerate(cells):
            pad = " " * (widths[i] - visible_len(cell))
            text = style(cell, "bold") if head else cell
            out.append(pad + text if i in right else text + pad)
        return "  ".join(out).rstrip()

    return "\n".join([line(headers, head=True), *(line(r) for r in rows)])


def number(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value:,}"


def rate(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def since(at: datetime | None, now: datetime) -> str:
    """How long ago ``at`` was; "in 5.0s" for a time still to come."""
    if at is None:
        return "-"
    seconds = (now - at).total_seconds()
    return age(seconds) if seconds >= 0 else "in " + age(-seconds)


def when(at: datetime | None) -> str:
    return "-" if at is None else at.isoformat(sep=" ", timespec="seconds")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_duration_ms(text: str) -> int:
    """``500ms``, ``30s``, ``15m``, ``36h``, ``14d``, ``2w``; a bare number is seconds."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 36h, 14d)")
    value = float(match[1]) * _UNIT_MS[match[2] or "s"]
    if value < 1:
        raise ValueError(f"duration too short: {text!r}")
    return int(value)


def duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    for unit in ("w", "d", "h", "m", "s"):
        size = _UNIT_MS[unit]
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


class Progress:
    """A one-line progress report on stderr when it is a terminal; silent otherwise."""

    def __init__(self, what: str, total: int | None = None, stream: TextIO | None = None):
        self.what = what
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled:
            of = f"/{self.total:,}" if self.total is not None else ""
            elapsed = time.monotonic() - self.started
            self.stream.write(f"\r{self.what}: {self.done:,}{of} ({age(elapsed)})\x1b[K")
            self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


@contextmanager
def working(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """A spinner with the elapsed time on stderr (a terminal only) while one long call runs."""
    out = stream or sys.stderr
    if not getattr(out, "isatty", lambda: False)():
        yield
        return
    stop = threading.Event()
    started = time.monotonic()

    def spin() -> None:
        frames = "|/-\\"
        i = 0
        while not stop.wait(0.1):
            out.write(f"\r{frames[i % 4]} {what} ({age(time.monotonic() - started)})\x1b[K")
            out.flush()
            i += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        out.write("\r\x1b[K")
        out.flush()
