"""The data of each page, as JSON-ready dicts: what ``/api/...`` returns and what the
templates render. Every function reads through the queue API (one SQL function call each,
bounded by its limit) and :mod:`lonnymq.report`, the code behind ``lonnymq status --json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ..queue import (
    Broker,
    ChannelStatus,
    HorizonHolder,
    MessageDetail,
    MessageInfo,
    QueueStatus,
)
from ..queue.consumers import ConsumerInfo
from ..queue.listing import ORDERS, STATES, Order, State
from ..report import (
    RATE_COUNTERS,
    TASK_PEEK,
    consumer_counts,
    expired_warning,
    horizon_text,
    is_internal,
    jsonable,
    message_body,
    status_dict,
    task_of,
)
from .history import Histories, History, channel_counts
from .readings import Reading, Readings

Conn = psycopg.Connection[Any]

#: Most channels or messages one page shows.
MAX_PAGE = 500
#: Bytes of a message's content shown in a page or the API before it is cut (the full
#: content is at ``/messages/ID/content``).
MAX_BODY = 64 * 1024
#: Largest content decoded (JSON, base64) for a page; a larger one is shown as raw text.
MAX_DECODE = 4 * 1024 * 1024
#: Characters of one header value shown before it is cut.
MAX_HEADER = 2048


class NotFound(Exception):
    """No such queue or message (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What the pages need to know of the app: its broker, its rates, its kept readings, the
    age at which a held snapshot is worth a warning."""

    broker: Broker
    history: History
    readings: Readings
    snapshot_warn_s: float = 60.0
    #: the rates of the channels whose page someone looks at
    channel_history: Histories = field(default_factory=Histories)


StatusReading = tuple[list[QueueStatus], datetime, dict[str, dict[str, float | None]]]


def status_reading(conn: Conn, app: Settings) -> Reading[StatusReading]:
    """Every queue's status (kept: see :mod:`.readings`), the database's time then, and the
    rates since the reading before."""

    def read(c: Conn) -> StatusReading:
        statuses = app.broker.status(c)
        return statuses, db_now(c), app.history.add(statuses)

    return app.readings.get(conn, "status", read)


def _reading_info(reading: Reading[Any]) -> dict[str, float]:
    return {"age_seconds": round(reading.age(), 3), "took_seconds": round(reading.took, 3)}


def fields(obj: Any) -> dict[str, Any]:
    """A result of the queue API (a slotted dataclass) as a JSON-ready dict."""
    return {name: jsonable(getattr(obj, name)) for name in obj.__slots__}


def db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now: datetime = row[0]
    return now


def _holder(h: HorizonHolder) -> dict[str, Any]:
    return fields(h)


def overview(conn: Conn, app: Settings, *, include_all: bool = False) -> dict[str, Any]:
    """``/api/status``: every queue as ``lonnymq status --json`` gives it, each with its
    ``rates`` (as ``lonnymq top --json``), the warnings ``lonnymq status`` prints, the
    sessions holding back the cleanup horizon, and the chart's series."""
    broker = app.broker
    expiries = broker.expiring(conn)
    holders = broker.horizon(conn, limit=5)
    held = {h.queue: h for h in broker.rate_held(conn)}
    reading = status_reading(conn, app)
    statuses, now, rates = reading.value
    consumers = consumer_counts(broker.consumers(conn))
    expired = {e.queue for e in expiries if e.expired}
    shown = [
        s
        for s in statuses
        if include_all or s.queue in expired or not is_internal(s, now, consumers.get(s.queue, 0))
    ]
    by_queue = {e.queue: e for e in expiries}
    queues = [
        status_dict(s, now, by_queue.get(s.queue), held.get(s.queue), consumers.get(s.queue, 0))
        | {"rates": rates[s.queue]}
        for s in shown
    ]
    warnings = [
        w
        for w in (
            horizon_text(holders, app.snapshot_warn_s),
            expired_warning(expiries, statuses),
        )
        if w
    ]
    totals = {
        key: sum(q[key] or 0 for q in queues) for key in ("ready", "delayed", "in_flight", "dead")
    }
    rate_totals = {
        key: sum(q["rates"][key] or 0.0 for q in queues) for key in ("enqueued", "delivered")
    }
    return {
        "time": now.isoformat(),
        "schema": broker.schema,
        "queues": queues,
        "hidden": len(statuses) - len(shown),
        "totals": totals | {"rates": rate_totals},
        "warnings": warnings,
        "horizon": [_holder(h) for h in holders if h.kind != "hidden"],
        "history": app.history.series(),
        "reading": _reading_info(reading),
    }


def channel_dict(c: ChannelStatus, now: datetime) -> dict[str, Any]:
    """A channel as ``lonnymq channels --json`` gives it, with the seconds it has waited for
    its turn, how long its oldest ready message has waited and, for a channel waiting for its
    rate's next token, the seconds until then."""
    out = fields(c)
    out["waiting_seconds"] = (
        None if c.waiting_since is None else max(0.0, (now - c.waiting_since).total_seconds())
    )
    out["oldest_ready_seconds"] = (
        None if c.oldest_ready_at is None else max(0.0, (now - c.oldest_ready_at).total_seconds())
    )
    out["next_token_seconds"] = (
        None
        if c.next_token_at is None or c.next_token_at <= now
        else (c.next_token_at - now).total_seconds()
    )
    return out


def queue_page(conn: Conn, app: Settings, name: str, *, limit: int = 50) -> dict[str, Any]:
    """``/api/queue``: a queue's status (as in ``/api/status``) and its largest channels,
    by backlog, at most ``limit``."""
    broker = app.broker
    statuses, _, rates = status_reading(conn, app).value
    found = [s for s in statuses if s.queue == name]
    if not found:
        raise NotFound(f"no queue {name!r}")

    def read(c: Conn) -> tuple[list[ChannelStatus], datetime]:
        return broker.queue(name).channels(c, limit=limit), db_now(c)

    reading = app.readings.get(conn, ("channels", name, limit), read)
    channels, now = reading.value
    held = [h for h in broker.rate_held(conn) if h.queue == name]
    consumers = [consumer_dict(c, now) for c in broker.consumers(conn, name)]
    alive = sum(1 for c in consumers if c["alive"])
    status = status_dict(found[0], now, None, held[0] if held else None, alive)
    status["rates"] = rates[name]
    default = broker.queue(name).policy.get(conn)
    if default.rate is not None:
        status["policy"] = status["policy"] | {"rate": str(default.rate), "burst": default.burst}
    rows = [channel_dict(c, now) for c in channels]
    return {
        "time": now.isoformat(),
        "reading": _reading_info(reading),
        "schema": broker.schema,
        "queue": status,
        "channels": rows,
        "limit": limit,
        "has_rate": any(r["rate"] is not None for r in rows),
        "largest": max((r["size"] for r in rows), default=0),
        "consumers": consumers,
    }


def _seconds(now: datetime, at: datetime | None) -> float | None:
    return None if at is None else max(0.0, (now - at).total_seconds())


def consumer_dict(c: ConsumerInfo, now: datetime) -> dict[str, Any]:
    """A consumer as ``/api/consumers`` lists it, with how long it has consumed, since its
    last delivery and since it was last heard of, in seconds."""
    return fields(c) | {
        "consuming_seconds": _seconds(now, c.started_at),
        "delivered_seconds": _seconds(now, c.delivered_at),
        "seen_seconds": _seconds(now, c.seen_at),
    }


def channel_info(conn: Conn, app: Settings, queue: str, channel: str) -> dict[str, Any]:
    """A channel's own policy (None: the queue default applies), the queue default, the
    limits in force, its size and messages in flight."""
    info = app.broker.queue(queue).channel(channel).info(conn)

    def policy(p: Any) -> dict[str, Any] | None:
        return None if p is None else fields(p)

    return {
        "queue": queue,
        "channel": channel,
        "own_policy": policy(info.own),
        "queue_default": policy(info.default),
        "effective": policy(info.effective),
        "size": info.size,
        "in_flight": info.in_flight,
    }


def message_row(m: MessageInfo) -> dict[str, Any]:
    """A listed message as ``lonnymq messages list --json`` gives it, with its Celery task's
    name and a preview of its arguments (``task``, ``args``; None for other messages)."""
    row = {k: v for k, v in fields(m).items() if k not in ("head", "tail")}
    task = task_of(m.head, m.tail)
    return row | {"task": None if task is None else task["task"], "args": task and task["args"]}


def messages_page(
    conn: Conn,
    app: Settings,
    *,
    queue: str | None,
    channel: str | None,
    state: State | None,
    after: int,
    limit: int,
    order: Order | None = None,
    after_due: datetime | None = None,
) -> dict[str, Any]:
    """``/api/messages``: messages by id after ``after``, as ``lonnymq messages list --json``
    with each one's Celery task (:func:`message_row`); ``next_after``: the ``after`` of the
    next page (None: this is the last one). Delayed messages come in the order they fall
    due (``order`` "due", the default for them; ``next_after_due`` and ``next_after`` page
    on)."""
    if order is None:
        order = "due" if state == "delayed" else "id"
    page = app.broker.messages(
        conn,
        queue=queue,
        channel=channel,
        state=state,
        after=after,
        limit=limit + 1,
        order=order,
        after_due=after_due if order == "due" else None,
        peek=TASK_PEEK,
    )
    more = len(page) > limit
    page = page[:limit]
    now = db_now(conn)
    last = page[-1] if more else None
    return {
        "time": now.isoformat(),
        "filters": {"queue": queue, "channel": channel, "state": state},
        "order": order,
        "after": after,
        "after_due": None if after_due is None else after_due.isoformat(),
        "limit": limit,
        "messages": [message_row(m) for m in page],
        "next_after": None if last is None else last.id,
        "next_after_due": None
        if last is None or order != "due" or last.dequeue_at is None
        else last.dequeue_at.isoformat(),
        "channel": None
        if queue is None or channel is None
        else channel_info(conn, app, queue, channel),
    }


def _celery(headers: dict[str, Any] | None, body: Any) -> dict[str, Any] | None:
    """The task of a Celery message (protocol 2: a ``task`` header and a body ``[args,
    kwargs, embed]``; protocol 1: a body with ``task``, ``args``, ``kwargs``), else None."""
    if isinstance(headers, dict) and headers.get("task"):
        args = kwargs = None
        if isinstance(body, list) and len(body) >= 2:
            args, kwargs = body[0], body[1]
        keys = ("id", "retries", "eta", "expires", "root_id", "parent_id", "origin")
        return {
            "task": str(headers["task"]),
            "args": args,
            "kwargs": kwargs,
            "argsrepr": headers.get("argsrepr"),
            "kwargsrepr": headers.get("kwargsrepr"),
            **{k: headers.get(k) for k in keys},
        }
    if isinstance(body, dict) and isinstance(body.get("task"), str) and "args" in body:
        short = ("id", "retries", "eta", "expires")
        return {
            "task": body["task"],
            "args": body.get("args"),
            "kwargs": body.get("kwargs"),
            "argsrepr": None,
            "kwargsrepr": None,
            **{k: body.get(k) for k in short},
            "root_id": None,
            "parent_id": None,
            "origin": None,
        }
    return None


def as_text(value: Any) -> str:
    """A body, header or argument as text: a str as it is, anything else as indented JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def message_detail(
    conn: Conn, app: Settings, message_id: int, *, max_body: int = MAX_BODY
) -> dict[str, Any]:
    """``/api/messages/ID``: as ``lonnymq messages show --json`` (its fields, ``headers``,
    ``body``, ``content_bytes``, ``saved_state``), with ``celery`` (the task, its id and
    arguments; None for other messages). A body longer than ``max_body`` characters (as
    text; content over ``MAX_DECODE`` bytes is not decoded) is cut: ``body`` is None,
    ``body_truncated`` true and ``body_preview`` its first ``max_body`` characters; the
    whole content is at ``/messages/ID/content``."""
    detail: MessageDetail | None = app.broker.message(conn, message_id)
    if detail is None:
        raise NotFound(f"no message {message_id}")
    now = db_now(conn)
    meta = {k: v for k, v in fields(detail).items() if k not in ("content", "saved_state")}
    size = len(detail.content)
    if size <= MAX_DECODE:
        body, headers = message_body(detail)
        text = as_text(body)
    else:
        body, headers, text = None, None, detail.content[: max_body + 1].decode("utf-8", "replace")
    truncated = size > MAX_DECODE or len(text) > max_body
    preview = text[:max_body] if truncated else None
    if truncated:
        body = None
    state = None if detail.saved_state is None else jsonable(detail.saved_state[:max_body])
    return meta | {
        "time": now.isoformat(),
        "headers": headers,
        "body": body,
        "body_truncated": truncated,
        "body_preview": preview,
        "content_bytes": size,
        "saved_state": state,
        "celery": _celery(headers, body),
    }


def parse_state(value: str | None) -> State | None:
    if value in (None, "", "all"):
        return None
    for state in STATES:
        if value == state:
            return state
    raise ValueError(f"state must be one of {', '.join(STATES)} or all, not {value!r}")


def parse_order(value: str | None) -> Order | None:
    if value in (None, ""):
        return None
    for order in ORDERS:
        if value == order:
            return order
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {value!r}")


def channel_page(conn: Conn, app: Settings, queue: str, channel: str) -> dict[str, Any]:
    """``/api/channel``: a channel's policy (as ``lonnymq policy show --json``), its figures
    and counters (as ``lonnymq channels --json`` lists it; None for a channel that never held
    a message), its rates (``enqueued``, ``delivered``, ``acked``, ``dead`` per second since
    a reading about 10 s before; null until there are two) and the chart's series, from the
    readings the page made while someone looked at it."""
    history = app.channel_history.of((queue, channel))

    def read(c: Conn) -> tuple[ChannelStatus | None, datetime, dict[str, float | None] | None]:
        status = app.broker.queue(queue).channel_status(c, channel)
        rates = None if status is None else history.add_counts({channel: channel_counts(status)})
        return status, db_now(c), None if rates is None else rates[channel]

    reading = app.readings.get(conn, ("channel", queue, channel), read)
    status, now, rates = reading.value
    return channel_info(conn, app, queue, channel) | {
        "time": now.isoformat(),
        "status": None if status is None else channel_dict(status, now),
        "rates": rates or dict.fromkeys(RATE_COUNTERS),
        "history": history.series(),
        "reading": _reading_info(reading),
    }


def consumers_page(conn: Conn, app: Settings) -> dict[str, Any]:
    """``/api/consumers``: every Kombu consumer, by queue (``consumers``, as
    :func:`consumer_dict`), and the processes they belong to (``processes``: host, pid, Celery
    node, their queues, since when, their last delivery)."""
    found = app.broker.consumers(conn)
    now = db_now(conn)
    rows = [consumer_dict(c, now) for c in found]
    processes: dict[tuple[str, int, str | None], dict[str, Any]] = {}
    for c in found:
        p = processes.setdefault(
            (c.host, c.pid, c.node),
            {"host": c.host, "pid": c.pid, "node": c.node, "queues": [], "alive": False,
             "started_at": c.started_at, "delivered_at": None},
        )  # fmt: skip
        p["queues"].append(c.queue)
        p["alive"] = p["alive"] or c.alive
        p["started_at"] = min(p["started_at"], c.started_at)
        if c.delivered_at is not None and (
            p["delivered_at"] is None or c.delivered_at > p["delivered_at"]
        ):
            p["delivered_at"] = c.delivered_at
    procs = [
        {k: jsonable(v) for k, v in p.items()}
        | {"consuming_seconds": _seconds(now, p["started_at"]),
           "delivered_seconds": _seconds(now, p["delivered_at"])}
        for p in sorted(processes.values(), key=lambda p: (p["host"], p["pid"]))
    ]  # fmt: skip
    return {
        "time": now.isoformat(),
        "consumers": rows,
        "processes": procs,
        "queues": consumer_counts(found),
    }
