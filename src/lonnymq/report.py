"""What an operator is shown of the queues, shared by the command line (``lonnymq status``,
``top``) and the web view (``lonnymq web``): a queue's status as a JSON-ready dict, the
rates between two readings, which queues are Kombu's idle plumbing, the warnings about a held
snapshot and queues past their ``x-expires``, and a message's body decoded as ``lonnymq
messages show`` prints it. Built on the queue API only."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg

from .queue import (
    Broker,
    ConsumerInfo,
    HorizonHolder,
    MessageDetail,
    QueueExpiry,
    QueueStatus,
    Rate,
    RateHeld,
)

#: The counters whose rates ``top`` and the web view show, in order.
RATE_COUNTERS = ("enqueued", "delivered", "acked", "dead")


def jsonable(value: Any) -> Any:
    """A value of a queue API result as JSON has it: times in ISO 8601, bytes as text, a rate
    as written (``"10/s"``)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Rate):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return value


def age(seconds: float | None) -> str:
    """3.2s, 4m05s, 2h10m, 3d04h."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def consumer_counts(consumers: Sequence[ConsumerInfo]) -> dict[str, int]:
    """The live consumers of each queue (those presumed gone not counted)."""
    counts: dict[str, int] = {}
    for c in consumers:
        if c.alive:
            counts[c.queue] = counts.get(c.queue, 0) + 1
    return counts


def status_dict(
    s: QueueStatus,
    now: datetime,
    expiry: QueueExpiry | None = None,
    held: RateHeld | None = None,
    consumers: int | None = None,
) -> dict[str, Any]:
    """One queue as ``lonnymq status --json`` prints it (``consumers``: its live Kombu
    consumers, None when not read)."""
    return {
        "queue": s.queue,
        "ready": s.ready,
        "delayed": s.delayed,
        "in_flight": s.in_flight,
        "dead": s.dead,
        "total": s.total,
        "oldest_ready_age_seconds": s.oldest_ready_age(now),
        "channels": s.channels,
        "consumers": consumers,
        "counters": {
            "enqueued": s.counters.enqueued,
            "delivered": s.counters.delivered,
            "redelivered": s.counters.redelivered,
            "acked": s.counters.acked,
            "deferred": s.counters.deferred,
            "dead": s.counters.dead,
            "expired": s.counters.expired,
            "dropped": s.counters.dropped,
        },
        "policy": {"max_concurrency": s.max_concurrency, "max_size": s.max_size},
        "settings": {
            "dead_letter": s.settings.dead_letter,
            "max_attempts": s.settings.max_attempts,
            "dead_retention_ms": s.settings.dead_retention_ms,
        },
        # messages due now that wait for their channel's rate (its next token)
        "rate_held": {
            "channels": 0 if held is None else held.channels,
            "messages": 0 if held is None else held.messages,
        },
        # x-expires: None for a queue without one
        "expiry": None
        if expiry is None
        else {
            "expires_ms": expiry.expires_ms,
            "unused_seconds": round(expiry.unused_seconds, 3),
            "expired": expiry.expired,
        },
    }


def rates(
    s: QueueStatus, before: Mapping[str, QueueStatus], elapsed: float | None
) -> list[float | None]:
    """Enqueued, delivered, acked and dead-lettered per second since the reading ``before``
    (``elapsed`` seconds ago); None without one."""
    prev = before.get(s.queue)
    if prev is None or not elapsed:
        return [None, None, None, None]
    a, b = prev.counters, s.counters
    return [
        max(0, b.enqueued - a.enqueued) / elapsed,
        max(0, b.delivered - a.delivered) / elapsed,
        max(0, b.acked - a.acked) / elapsed,
        max(0, b.dead - a.dead) / elapsed,
    ]


#: Seconds a message may wait in a consumed plumbing queue before the queue counts as busy.
PLUMBING_IDLE_S = 10.0


def is_plumbing(name: str) -> bool:
    """Kombu's and Celery's own queues: pidbox, events (gossip, ``celery events``, Flower),
    reply queues."""
    return (
        name.endswith(".pidbox")
        or name.startswith("celeryev.")
        or name.endswith(".reply.celery.pidbox")
        or (len(name) == 36 and name.count("-") == 4)  # a reply queue named by a uuid
    )


def is_internal(s: QueueStatus, now: datetime | None = None, consumers: int = 0) -> bool:
    """Kombu's and Celery's own plumbing while idle, hidden from status and top unless asked
    for: empty, or consumed (``consumers`` live ones) with nothing waiting there longer than
    :data:`PLUMBING_IDLE_S` (a worker's own event queue receives every worker's heartbeats
    and takes them as they come). Shown when something waits there with no consumer, or
    for longer (commands to a worker that is gone, results nobody reads), or is dead."""
    if not is_plumbing(s.queue) or s.dead or s.delayed:
        return False
    if s.total == 0:
        return True
    if not consumers:
        return False
    oldest = None if now is None else s.oldest_ready_age(now)
    return oldest is None or oldest < PLUMBING_IDLE_S


def expired_warning(expiries: Sequence[QueueExpiry], statuses: Sequence[QueueStatus]) -> str | None:
    """A warning naming the queues past their ``x-expires`` that are still there (leftovers of
    processes that are gone, which no client of the schema has swept since), with what they
    hold, else None."""
    expired = [e for e in expiries if e.expired]
    if not expired:
        return None
    totals = {s.queue: s.total for s in statuses}
    held = sum(totals.get(e.queue, 0) for e in expired)
    named = ", ".join(f"{e.queue} ({totals.get(e.queue, 0):,})" for e in expired[:10])
    more = f" and {len(expired) - 10} more" if len(expired) > 10 else ""
    return (
        f"warning: {len(expired)} queue(s) past their x-expires, holding {held:,} "
        f"message(s): {named}{more}. The next sweep deletes them (any client of the schema "
        "sweeps every expire_interval); with none running, run `lonnymq housekeep` "
        "(docs/operations.md, 'Housekeeping')"
    )


def old_holders(holders: Sequence[HorizonHolder], threshold: float) -> list[HorizonHolder]:
    """The holders of the cleanup horizon worth a warning: sessions and prepared transactions
    older than ``threshold`` seconds, replication slots that hold anything back."""
    return [
        h
        for h in holders
        if (h.kind in ("session", "prepared") and (h.age_s or 0) >= threshold)
        or (h.kind == "slot" and (h.xid_age or 0) > 0)
    ]


def horizon_text(holders: Sequence[HorizonHolder], threshold: float) -> str | None:
    """The warning of :func:`horizon_warning`, from holders already read."""
    hidden = sum(int(h.detail or 0) for h in holders if h.kind == "hidden")
    old = old_holders(holders, threshold)
    if not old:
        return None
    h = old[0]
    held = age(h.age_s) if h.age_s is not None else f"{h.xid_age} transactions"
    if h.kind == "session":
        who = (
            f"session pid {h.pid} (application {h.application_name or '-'!r}, "
            f"state {h.state or '-'}) has held a snapshot for {held}"
        )
    elif h.kind == "prepared":
        who = f"prepared transaction {h.application_name!r} has been open for {held}"
    else:
        who = f"replication slot {h.application_name!r} holds back {held}"
    more = f" ({len(old) - 1} more)" if len(old) > 1 else ""
    unseen = f"; {hidden} session(s) of other roles are not visible" if hidden else ""
    return (
        f"warning: {who}{more}{unseen}. Postgres keeps every row deleted since then: "
        "lonnymq's tables grow until it ends (docs/operations.md, 'A held snapshot')"
    )


def horizon_warning(conn: psycopg.Connection[Any], broker: Broker, threshold: float) -> str | None:
    """A warning naming what holds back the database's cleanup horizon, when the oldest
    session or prepared transaction is older than ``threshold`` seconds (or a replication
    slot holds it back), else None."""
    return horizon_text(broker.horizon(conn, limit=5), threshold)


def message_body(detail: MessageDetail) -> tuple[Any, dict[str, Any] | None]:
    """The kombu payload's body, decoded where it can be (base64, then JSON), and the
    payload's headers."""
    payload = detail.payload()
    if payload is None:
        return detail.content.decode("utf-8", "replace"), None
    body = payload.get("body")
    props = payload.get("properties") or {}
    if isinstance(body, str) and props.get("body_encoding") == "base64":
        try:
            body = base64.b64decode(body).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return body, payload.get("headers")
    if isinstance(body, str) and "json" in str(payload.get("content-type", "")):
        with contextlib.suppress(ValueError):
            body = json.loads(body)
    return body, payload.get("headers")


#: Bytes of each end of a message's content read for its Celery task (:func:`task_of`).
TASK_PEEK = 4096
#: Characters of a task's arguments shown in a list.
ARGS_PREVIEW = 120
_HEADERS_KEY = '"headers": '
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'


def _headers_of(head: bytes, tail: bytes | None) -> dict[str, Any] | None:
    """The headers of a Kombu message from the ends of its content (``tail`` None: ``head``
    is all of it). Kombu writes them after the body, so a long message's are in its tail."""
    text = (head if tail is None else tail).decode("utf-8", "replace")
    if tail is None:
        with contextlib.suppress(ValueError):
            payload = json.loads(text)
            headers = payload.get("headers") if isinstance(payload, dict) else None
            return headers if isinstance(headers, dict) else None
        return None
    at = text.rfind(_HEADERS_KEY)
    while at > 0 and text[at - 1] == "\\":  # inside the body, a JSON string of its own
        at = text.rfind(_HEADERS_KEY, 0, at)
    if at >= 0:
        with contextlib.suppress(ValueError):
            found, _ = json.JSONDecoder().raw_decode(text, at + len(_HEADERS_KEY))
            if isinstance(found, dict):
                return found
    # headers longer than the tail: the keys that are in it
    out: dict[str, Any] = {}
    for key in ("task", "argsrepr", "kwargsrepr"):
        match = re.search(f'"{key}": ({_JSON_STRING})', text)
        if match:
            with contextlib.suppress(ValueError):
                out[key] = json.loads(match[1])
    return out or None


def task_of(head: bytes | None, tail: bytes | None) -> dict[str, str | None] | None:
    """A listed message's Celery task, from the ends of its content (``Broker.messages(...,
    peek=TASK_PEEK)``): ``{"task": name, "args": preview}``, the preview made of the
    arguments as Celery wrote them for people (``argsrepr``, ``kwargsrepr``), cut at
    :data:`ARGS_PREVIEW` characters; None for a message that is not a Celery task."""
    if head is None:
        return None
    headers = _headers_of(head, tail)
    if not headers or not isinstance(headers.get("task"), str):
        return None
    args, kwargs = headers.get("argsrepr"), headers.get("kwargsrepr")
    parts = [str(args)] if args is not None else []
    if kwargs not in (None, "{}"):
        parts.append(str(kwargs))
    preview = " ".join(parts) if parts else None
    if preview is not None and len(preview) > ARGS_PREVIEW:
        preview = preview[: ARGS_PREVIEW - 1] + "…"
    return {"task": headers["task"], "args": preview}
