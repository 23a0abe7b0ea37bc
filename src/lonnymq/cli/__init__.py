"""The ``lonnymq`` command (also ``python -m lonnymq``).

    lonnymq migrate [--print-sql]                 install or upgrade the schema
    lonnymq status [QUEUE...]                     per queue: ready, delayed, in flight, dead...
    lonnymq top [--interval S]                    the same, live, with rates per second
    lonnymq channels QUEUE [--limit N]            the largest channels, policies and counters
    lonnymq policy set|clear|show QUEUE [CHANNEL] channel and queue-default policies
    lonnymq queue show|set QUEUE                  dead letters, max attempts, retention
    lonnymq messages list [--queue Q] [--channel C] [--state S] [--after ID] [--limit N]
    lonnymq messages show ID                      one message, headers and body
    lonnymq messages delete ID... | --queue Q [--state S] --all
    lonnymq messages retry ID... | --queue Q --all (dead letters back; delayed due now)
    lonnymq messages update ID [--now | --in D | --at T] [--priority N] [--content C]
                                                  reschedule or edit a waiting message
    lonnymq purge QUEUE [--dead] [--yes]          delete waiting messages (or dead letters)
    lonnymq metrics --port N                      serve Prometheus metrics for the database
    lonnymq housekeep                             expire, prune dead letters (clients do it too)
    lonnymq grant producer|worker|admin ROLE / revoke ROLE

Every command reads the database from ``--dsn`` or ``$DATABASE_URL`` (a ``postgresql://`` or
``lonnymq://`` URL, or a libpq ``key=value`` string) and the schema from ``--schema``
(default ``lonnymq``). Listings take ``--json``. Tables are coloured on a terminal
(``--color auto|always|never``, ``NO_COLOR``), plain when piped.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn

import psycopg

from .. import migrator, roles
from ..dsn import mask_password
from ..exceptions import InvalidArgument, LonnyMQError
from ..queue import Broker, QueueExpiry, QueueStatus
from ..queue.operate import STATES, MessageDetail, MessageInfo, state_arg
from . import term as _term

# -- plumbing --------------------------------------------------------------------------------


def to_libpq(dsn: str) -> str:
    """Accept the broker URL form too: ``lonnymq://`` means ``postgresql://``."""
    if dsn.startswith("lonnymq://"):
        return "postgresql://" + dsn[len("lonnymq://") :]
    return dsn


def _dsn(args: argparse.Namespace) -> str:
    dsn = args.dsn or os.environ.get("DATABASE_URL")
    if not dsn:
        raise SystemExit("lonnymq: no database given: pass --dsn or set DATABASE_URL")
    return to_libpq(dsn)


def _connect(args: argparse.Namespace) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(_dsn(args), autocommit=True)
    except psycopg.Error as exc:
        raise SystemExit(
            f"lonnymq: cannot connect to the database: {mask_password(str(exc)).strip()}"
        ) from None


def _usage(message: str) -> NoReturn:
    """A usage error found after parsing: exit 2, as argparse does."""
    print(f"lonnymq: {message}", file=sys.stderr)
    raise SystemExit(2)


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database's clock: ages are computed against the times it stored."""
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _style(args: argparse.Namespace) -> _term.Style:
    return _term.Style(_term.wants_colour(sys.stdout, getattr(args, "color", "auto")))


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {low} or more")
    return value


def _limit(text: str) -> int | None:
    if text.lower() in ("none", "null", "unlimited", "-"):
        return None
    return _int(text, 0)


def _positive(text: str) -> int:
    return _int(text, 1)


def _priority(text: str) -> int:
    value = _int(text, 0)
    if value > 255:
        raise argparse.ArgumentTypeError("must be 255 or less")
    return value


def _attempts(text: str) -> int | None:
    value = _limit(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more, or none")
    return value


def _duration(text: str) -> int:
    try:
        return _term.parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _on_off(text: str) -> bool:
    value = text.lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, not {text!r}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.1 and 3600 seconds")
    return value


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_term.jsonable))


def _confirm(question: str, args: argparse.Namespace) -> bool:
    """True with --yes; otherwise ask on stderr and read one line from stdin (a pipe works:
    ``yes | lonnymq purge q``); anything but y/yes, or end of input, means no."""
    if args.yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer or not sys.stdin.isatty():
        sys.stderr.write(answer.strip() + "\n")  # an answer from a pipe: show it
    return answer.strip().lower() in ("y", "yes")


# -- migrate, grant, policy --------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        if args.print_sql:
            text = migrator.pending_sql(conn, args.schema)
            print(text if text else f"-- schema {args.schema!r} is up to date")
            return 0
        applied = migrator.install(conn, args.schema)
    if applied:
        print(f"schema {args.schema!r}: applied {', '.join(applied)}")
    else:
        print(f"schema {args.schema!r} is up to date (version {migrator.CURRENT_VERSION})")
    return 0


def cmd_grant(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        if args.command == "grant":
            roles.grant(conn, args.kind, args.role, schema=args.schema)
            print(f"role {args.role!r} may now act as a lonnymq {args.kind} on {args.schema!r}")
        else:
            roles.revoke(conn, args.role, schema=args.schema)
            print(f"role {args.role!r} has no lonnymq rights on {args.schema!r} any more")
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with _connect(args) as conn:
        broker.check(conn)
        if args.action == "set":
            limits = {"max_concurrency": args.max_concurrency, "max_size": args.max_size}
            if args.channel:
                queue.channel(args.channel).policy.set(conn, **limits)
            else:
                queue.policy.set(conn, **limits)
        elif args.action == "clear":
            if args.channel:
                queue.channel(args.channel).policy.clear(conn)
            else:
                queue.policy.clear(conn)
        if args.channel:
            info = queue.channel(args.channel).info(conn)
            shown: dict[str, Any] = {
                "queue": args.queue,
                "channel": args.channel,
                "own_policy": None if info.own is None else vars_of(info.own),
                "queue_default": vars_of(info.default),
                "effective": vars_of(info.effective),
                "size": info.size,
                "in_flight": info.in_flight,
            }
        else:
            shown = {"queue": args.queue, "queue_default": vars_of(queue.policy.get(conn))}
    _print(shown, args.json)
    return 0


def vars_of(policy: Any) -> dict[str, Any]:
    return {"max_concurrency": policy.max_concurrency, "max_size": policy.max_size}


def _print(data: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(data)
        return
    width = max(len(k) for k in data)
    for key, value in data.items():
        if isinstance(value, dict):
            value = "  ".join(f"{k}={'-' if v is None else v}" for k, v in value.items())
        print(f"{key.ljust(width)}  {'-' if value is None else value}")


# -- status, top, channels, stats ----------------------------------------------------------------


def _status_dict(
    s: QueueStatus, now: datetime, expiry: QueueExpiry | None = None
) -> dict[str, Any]:
    return {
        "queue": s.queue,
        "ready": s.ready,
        "delayed": s.delayed,
        "in_flight": s.in_flight,
        "dead": s.dead,
        "total": s.total,
        "oldest_ready_age_seconds": s.oldest_ready_age(now),
        "channels": s.channels,
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
        # x-expires: None for a queue without one
        "expiry": None
        if expiry is None
        else {
            "expires_ms": expiry.expires_ms,
            "unused_seconds": round(expiry.unused_seconds, 3),
            "expired": expiry.expired,
        },
    }


def _read_status(
    conn: psycopg.Connection[Any],
    broker: Broker,
    args: argparse.Namespace,
    keep: frozenset[str] = frozenset(),
) -> tuple[list[QueueStatus], datetime]:
    statuses = broker.status(conn, count_ready=not args.no_count)
    now = _db_now(conn)
    if args.queues:
        wanted = set(args.queues)
        statuses = [s for s in statuses if s.queue in wanted]
        missing = sorted(wanted - {s.queue for s in statuses})
        if missing:
            print(f"lonnymq: no such queue: {', '.join(missing)}", file=sys.stderr)
    elif not args.all:
        statuses = [s for s in statuses if s.queue in keep or not _is_internal(s)]
    return statuses, now


def expired_warning(expiries: list[QueueExpiry], statuses: list[QueueStatus]) -> str | None:
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


def _is_internal(s: QueueStatus) -> bool:
    """Kombu's and Celery's own plumbing (pidbox, events, reply queues) when idle: hidden from
    status and top unless --all, or unless something is waiting there."""
    name = s.queue
    plumbing = (
        name.endswith(".pidbox")
        or name.startswith("celeryev.")
        or name.endswith(".reply.celery.pidbox")
        or (len(name) == 36 and name.count("-") == 4)  # a reply queue named by a uuid
    )
    return plumbing and s.total == 0 and s.dead == 0


_STATUS_HEAD = ["QUEUE", "READY", "DELAYED", "IN FLIGHT", "DEAD", "OLDEST READY", "CHANNELS"]


def _status_row(s: QueueStatus, now: datetime, style: _term.Style) -> list[str]:
    oldest = s.oldest_ready_age(now)
    oldest_text = _term.age(oldest)
    if oldest is not None and oldest >= 60:
        oldest_text = style(oldest_text, "yellow" if oldest < 600 else "red")
    dead = _term.number(s.dead)
    return [
        style(s.queue, "cyan"),
        _term.number(s.ready),
        _term.number(s.delayed),
        _term.number(s.in_flight),
        style(dead, "red") if s.dead else dead,
        oldest_text,
        _term.number(s.channels),
    ]


def horizon_warning(conn: psycopg.Connection[Any], broker: Broker, threshold: float) -> str | None:
    """A warning naming what holds back the database's cleanup horizon, when the oldest
    session or prepared transaction is older than ``threshold`` seconds (or a replication
    slot holds it back), else None."""
    holders = broker.horizon(conn, limit=5)
    hidden = sum(int(h.detail or 0) for h in holders if h.kind == "hidden")
    old = [
        h
        for h in holders
        if (h.kind in ("session", "prepared") and (h.age_s or 0) >= threshold)
        or (h.kind == "slot" and (h.xid_age or 0) > 0)
    ]
    if not old:
        return None
    h = old[0]
    age = _term.age(h.age_s) if h.age_s is not None else f"{h.xid_age} transactions"
    if h.kind == "session":
        who = (
            f"session pid {h.pid} (application {h.application_name or '-'!r}, "
            f"state {h.state or '-'}) has held a snapshot for {age}"
        )
    elif h.kind == "prepared":
        who = f"prepared transaction {h.application_name!r} has been open for {age}"
    else:
        who = f"replication slot {h.application_name!r} holds back {age}"
    more = f" ({len(old) - 1} more)" if len(old) > 1 else ""
    unseen = f"; {hidden} session(s) of other roles are not visible" if hidden else ""
    return (
        f"warning: {who}{more}{unseen}. Postgres keeps every row deleted since then: "
        "lonnymq's tables grow until it ends (docs/operations.md, 'A held snapshot')"
    )


def cmd_status(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        expiries = broker.expiring(conn)
        if args.queues:
            expiries = [e for e in expiries if e.queue in set(args.queues)]
        expired = frozenset(e.queue for e in expiries if e.expired)
        statuses, now = _read_status(conn, broker, args, keep=expired)
        warning = horizon_warning(conn, broker, args.snapshot_warn)
    leftovers = expired_warning(expiries, statuses)
    by_queue = {e.queue: e for e in expiries}
    code = 1 if args.queues and len(statuses) < len(set(args.queues)) else 0
    if args.json:
        _print_json([_status_dict(s, now, by_queue.get(s.queue)) for s in statuses])
        for line in (warning, leftovers):
            if line:
                print(line, file=sys.stderr)
        return code
    style = _style(args)
    if not statuses:
        if not args.queues:
            print("no queues")
    else:
        rows = [_status_row(s, now, style) for s in statuses]
        print(_term.table(_STATUS_HEAD, rows, style, right=frozenset(range(1, 7))))
    for line in (warning, leftovers):
        if line:
            print(style(line, "yellow"))
    return code


def cmd_stats(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        names = args.queues or broker.queues(conn)
        rows = []
        for name in names:
            s = broker.queue(name).stats(conn)
            rows.append(
                {
                    "queue": s.queue,
                    "total": s.total,
                    "ready": s.ready,
                    "delayed": s.delayed,
                    "in_flight": s.in_flight,
                    "channels": s.channels,
                }
            )
    if args.json:
        _print_json(rows)
    else:
        headers = ["queue", "total", "ready", "delayed", "in_flight", "channels"]
        table = [[str(r[h]) for h in headers] for r in rows]
        print(_term.table(headers, table, _style(args), right=frozenset(range(1, 6))))
    return 0


_TOP_HEAD = [*_STATUS_HEAD, "ENQ/S", "DELIV/S", "ACK/S", "DEAD/S"]


def _rates(
    s: QueueStatus, before: dict[str, QueueStatus], elapsed: float | None
) -> list[float | None]:
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


def cmd_top(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    style = _style(args)
    live = sys.stdout.isatty() and not args.json
    before: dict[str, QueueStatus] = {}
    last: float | None = None
    shown = 0
    where = mask_password(_dsn(args))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with _connect(args) as conn:
            broker.check(conn)
            while True:
                statuses, now = _read_status(conn, broker, args)
                tick = time.monotonic()
                elapsed = None if last is None else tick - last
                if args.json:
                    print(
                        json.dumps(
                            {
                                "time": now.isoformat(),
                                "queues": [
                                    {
                                        **_status_dict(s, now),
                                        "rates": dict(
                                            zip(
                                                ("enqueued", "delivered", "acked", "dead"),
                                                _rates(s, before, elapsed),
                                                strict=True,
                                            )
                                        ),
                                    }
                                    for s in statuses
                                ],
                            },
                            default=_term.jsonable,
                        ),
                        flush=True,
                    )
                else:
                    rows = []
                    totals = [0.0, 0.0, 0.0, 0.0]
                    ready = sum(s.ready or 0 for s in statuses)
                    for s in statuses:
                        rates = _rates(s, before, elapsed)
                        for i, r in enumerate(rates):
                            totals[i] += r or 0.0
                        rows.append(_status_row(s, now, style) + [_term.rate(r) for r in rates])
                    title = style(
                        f"lonnymq top  {where}  schema {args.schema}  "
                        f"{now.astimezone().strftime('%Y-%m-%d %H:%M:%S')}",
                        "bold",
                    )
                    summary = (
                        f"{len(statuses)} queue(s)  "
                        f"ready {_term.number(None if args.no_count else ready)}  "
                        f"in flight {_term.number(sum(s.in_flight for s in statuses))}  "
                        f"dead {_term.number(sum(s.dead for s in statuses))}  "
                        + (
                            f"enq/s {_term.rate(totals[0])}  deliv/s {_term.rate(totals[1])}  "
                            f"ack/s {_term.rate(totals[2])}  dead/s {_term.rate(totals[3])}"
                            if elapsed
                            else "rates after the next refresh"
                        )
                    )
                    body = _term.table(_TOP_HEAD, rows, style, right=frozenset(range(1, 11)))
                    text = f"{title}\n{summary}\n\n{body}\n"
                    warning = horizon_warning(conn, broker, args.snapshot_warn)
                    if warning:
                        text += style(warning, "yellow") + "\n"
                    if live:
                        sys.stdout.write("\x1b[H\x1b[2J" + text)
                        sys.stdout.write(
                            style(f"\nrefresh every {args.interval:g}s, Ctrl-C to quit", "dim")
                            + "\n"
                        )
                    else:
                        sys.stdout.write(text + "\n")
                    sys.stdout.flush()
                before = {s.queue: s for s in statuses}
                last = tick
                shown += 1
                if args.iterations and shown >= args.iterations:
                    return 0
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def cmd_channels(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        channels = broker.queue(args.queue).channels(conn, limit=args.limit)
        now = _db_now(conn)
    if args.json:
        _print_json([dict(_term_fields(c)) for c in channels])
        return 0
    style = _style(args)
    if not channels:
        print(f"queue {args.queue!r} has no channels")
        return 0
    head = [
        "CHANNEL", "SIZE", "IN FLIGHT", "MAX CONC", "MAX SIZE", "POLICY", "WAITING",
        "ENQUEUED", "ACKED", "DEAD",
    ]  # fmt: skip
    rows = []
    for c in channels:
        full = c.max_size is not None and c.size >= c.max_size
        busy = c.max_concurrency is not None and c.in_flight >= c.max_concurrency
        size = _term.number(c.size)
        conc = _term.number(c.in_flight)
        rows.append(
            [
                style(c.channel, "cyan"),
                style(size, "red") if full else size,
                style(conc, "yellow") if busy else conc,
                _term.number(c.max_concurrency),
                _term.number(c.max_size),
                "own" if c.has_policy else "queue",
                _term.since(c.waiting_since, now),
                _term.number(c.enqueued),
                _term.number(c.acked),
                _term.number(c.dead),
            ]
        )
    print(_term.table(head, rows, style, right=frozenset({1, 2, 3, 4, 6, 7, 8, 9})))
    return 0


def _term_fields(obj: Any) -> list[tuple[str, Any]]:
    return [(name, getattr(obj, name)) for name in obj.__slots__]


# -- queue settings ------------------------------------------------------------------------------


def cmd_queue(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with _connect(args) as conn:
        broker.check(conn)
        if args.action == "set":
            changes: dict[str, Any] = {}
            if args.max_attempts is not _UNSET:
                changes["max_attempts"] = args.max_attempts
            if args.dead_letter is not None:
                changes["dead_letter"] = args.dead_letter
            if args.dead_retention is not None:
                changes["dead_retention_ms"] = args.dead_retention
            if not changes:
                _usage(
                    "queue set: nothing to change (--max-attempts, --dead-letter, --dead-retention)"
                )
            queue.configure(conn, **changes)
        settings = queue.settings(conn)
        policy = queue.policy.get(conn)
        if args.queue not in broker.queues(conn):
            print(f"queue {args.queue!r} does not exist yet: its defaults", file=sys.stderr)
    shown = {
        "queue": args.queue,
        "dead_letter": settings.dead_letter,
        "max_attempts": settings.max_attempts,
        "dead_retention_ms": settings.dead_retention_ms,
        "max_concurrency": policy.max_concurrency,
        "max_size": policy.max_size,
    }
    if args.json:
        _print_json(shown)
    else:
        shown["dead_letter"] = "on" if settings.dead_letter else "off"
        shown["max_attempts"] = settings.max_attempts or "no limit"
        shown["dead_retention_ms"] = _term.duration(settings.dead_retention_ms)
        shown["dead_retention"] = shown.pop("dead_retention_ms")
        _print(shown, False)
    return 0


_UNSET: Any = object()


# -- messages ------------------------------------------------------------------------------------


_STATE_STYLE = {"ready": "green", "delayed": "blue", "locked": "yellow", "dead": "red"}


def _message_dict(m: MessageInfo) -> dict[str, Any]:
    return {name: _term.jsonable(value) for name, value in _term_fields(m)}


def _when_text(m: MessageInfo, now: datetime) -> str:
    if m.state == "delayed" and m.dequeue_at is not None:
        return "due in " + _term.age((m.dequeue_at - now).total_seconds())
    if m.state == "locked" and m.locked_until is not None:
        left = (m.locked_until - now).total_seconds()
        return ("lock ends in " + _term.age(left)) if left > 0 else "lock expired"
    if m.state == "dead":
        return f"{m.reason}, {_term.since(m.dead_at, now)} ago"
    if m.dequeue_at is not None:
        return "ready for " + _term.since(m.dequeue_at, now)
    return "-"


def _list_filters(args: argparse.Namespace) -> dict[str, Any]:
    return {"queue": args.queue, "channel": args.channel, "state": args.state}


def cmd_messages_list(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    out: list[MessageInfo] = []
    with _connect(args) as conn:
        broker.check(conn)
        after = args.after
        more = False
        if args.all:
            while True:
                page = broker.messages(conn, **_list_filters(args), after=after, limit=1000)
                out.extend(page)
                if len(page) < 1000:
                    break
                after = page[-1].id
        else:  # one more than asked for, to know whether a next page exists
            page = broker.messages(
                conn, **_list_filters(args), after=after, limit=min(args.limit + 1, 10_000)
            )
            more = len(page) > args.limit
            out = page[: args.limit]
        now = _db_now(conn)
    if args.json:
        _print_json([_message_dict(m) for m in out])
        if more:
            print(f"more: --after {out[-1].id}", file=sys.stderr)
        return 0
    if not out:
        print("no messages")
        return 0
    style = _style(args)
    head = ["ID", "QUEUE", "CHANNEL", "STATE", "ATTEMPTS", "PRIO", "AGE", "WHEN", "NAME", "BYTES"]
    rows = [
        [
            str(m.id),
            m.queue,
            m.channel,
            style(m.state, _STATE_STYLE[m.state]),
            str(m.attempts),
            str(m.priority),
            _term.since(m.created_at, now),
            _when_text(m, now),
            m.name or "-",
            _term.number(m.size),
        ]
        for m in out
    ]
    print(_term.table(head, rows, style, right=frozenset({0, 4, 5, 6, 9})))
    if more:
        print(
            style(f"more: lonnymq messages list ... --after {out[-1].id} (or --all)", "dim"),
            file=sys.stderr,
        )
    return 0


def _body(detail: MessageDetail) -> tuple[Any, dict[str, Any] | None]:
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


def cmd_messages_show(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        detail = broker.message(conn, args.id)
        now = _db_now(conn)
    if detail is None:
        print(f"lonnymq: no message {args.id}", file=sys.stderr)
        return 1
    body, headers = _body(detail)
    meta = {
        name: _term.jsonable(value)
        for name, value in _term_fields(detail)
        if name not in ("content", "saved_state")
    }
    if args.json:
        _print_json(
            {
                **meta,
                "headers": headers,
                "body": body,
                "content_bytes": len(detail.content),
                "saved_state": _term.jsonable(detail.saved_state),
            }
        )
        return 0
    style = _style(args)
    info = MessageInfo(
        detail.id, detail.queue, detail.channel, detail.name, detail.priority,
        detail.attempts, detail.state, detail.dequeue_at, detail.locked_until,
        detail.created_at, detail.dead_at, detail.reason, len(detail.content),
    )  # fmt: skip
    rows = [
        ("id", str(detail.id)),
        ("queue", detail.queue),
        ("channel", detail.channel),
        ("state", style(detail.state, _STATE_STYLE[detail.state]) + "  " + _when_text(info, now)),
        ("attempts", str(detail.attempts)),
        ("priority", str(detail.priority)),
        ("name", detail.name or "-"),
        ("created", f"{_term.when(detail.created_at)} ({_term.since(detail.created_at, now)} ago)"),
    ]
    if detail.expires_at is not None:
        rows.append(("expires", _term.when(detail.expires_at)))
    if detail.state == "dead":
        rows.append(("dead since", _term.when(detail.dead_at)))
        rows.append(("reason", detail.reason or "-"))
    if headers and headers.get("task"):
        rows.append(("task", str(headers["task"])))
    rows.append(("bytes", _term.number(len(detail.content))))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{style(key.ljust(width), 'bold')}  {value}")
    if headers:
        print(style("headers", "bold"))
        print(json.dumps(headers, indent=2, default=str))
    print(style("body", "bold"))
    print(body if isinstance(body, str) else json.dumps(body, indent=2, default=str))
    return 0


def _bulk(
    conn: psycopg.Connection[Any], broker: Broker, args: argparse.Namespace, state: str | None
) -> list[MessageInfo]:
    found: list[MessageInfo] = []
    after = 0
    while True:
        page = broker.messages(
            conn,
            queue=args.queue,
            channel=args.channel,
            state=state_arg(state),
            after=after,
            limit=1000,
        )
        found.extend(page)
        if len(page) < 1000:
            return found
        after = page[-1].id


def _targets(
    conn: psycopg.Connection[Any],
    broker: Broker,
    args: argparse.Namespace,
    verb: str,
    default_state: str | None,
) -> list[int] | None:
    """The ids given, or with --all those matching the filters (after a confirmation)."""
    if args.ids:
        if args.all:
            _usage(f"messages {verb}: give ids or --all, not both")
        return list(dict.fromkeys(args.ids))
    if not args.all:
        _usage(f"messages {verb}: give message ids, or --queue Q --all")
    if not args.queue:
        _usage(f"messages {verb} --all needs --queue")
    state = args.state or default_state
    found = _bulk(conn, broker, args, state)
    if not found:
        return []
    ids = [m.id for m in found]
    what = f"{len(ids):,} {state or ''} message(s)".replace("  ", " ")
    where = f"queue {args.queue!r}" + (f" channel {args.channel!r}" if args.channel else "")
    held = sum(1 for m in found if m.state == "locked")
    if held and verb == "delete":
        where += f", {held:,} of them held by consumers now (their acks will find them gone)"
    if not _confirm(f"{verb} {what} of {where}?", args):
        print("nothing done", file=sys.stderr)
        return None
    return ids


def _in_chunks(ids: list[int], what: str, call: Callable[[list[int]], None]) -> None:
    progress = _term.Progress(what, len(ids))
    try:
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            call(chunk)
            progress.add(len(chunk))
    finally:
        progress.finish()


def cmd_messages_delete(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    results: dict[int, str] = {}
    with _connect(args) as conn:
        broker.check(conn)
        ids = _targets(conn, broker, args, "delete", None)
        if ids is None:
            return 1
        _in_chunks(ids, "deleting", lambda chunk: results.update(broker.remove(conn, chunk)))
    deleted = [i for i, r in results.items() if r == "deleted"]
    missing = [i for i, r in results.items() if r != "deleted"]
    if args.json:
        _print_json({"deleted": deleted, "not_found": missing})
    else:
        print(f"deleted {len(deleted):,} message(s)")
        if missing:
            print(f"not found: {', '.join(map(str, missing[:20]))}", file=sys.stderr)
    return 1 if missing and args.ids else 0


def cmd_messages_retry(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    results = []
    with _connect(args) as conn:
        broker.check(conn)
        ids = _targets(conn, broker, args, "retry", "dead")
        if ids is None:
            return 1
        _in_chunks(ids, "retrying", lambda chunk: results.extend(broker.retry(conn, chunk)))
    if args.json:
        _print_json([{"id": r.id, "result": r.result, "new_id": r.new_id} for r in results])
    else:
        counts: dict[str, int] = {}
        for r in results:
            counts[r.result] = counts.get(r.result, 0) + 1
        for r in results[:50]:
            extra = f" -> message {r.new_id}" if r.new_id else ""
            print(f"{r.id}: {r.result}{extra}")
        if len(results) > 50:
            print(f"... {len(results) - 50:,} more")
        print(", ".join(f"{n:,} {what}" for what, n in sorted(counts.items())) or "nothing")
    failed = [
        r for r in results if r.result in ("not_found", "channel_full", "locked", "deduplicated")
    ]
    return 1 if failed else 0


def _at(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (e.g. 2030-01-31T09:00:00+00:00)"
        ) from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"give the time with its UTC offset, e.g. {text}+00:00 or {text}Z"
        )
    return when


def _content(args: argparse.Namespace) -> bytes | None:
    if args.content is not None:
        return str(args.content).encode("utf-8")
    if args.content_file is not None:
        if args.content_file == "-":
            return sys.stdin.buffer.read()
        try:
            with open(args.content_file, "rb") as f:
                return f.read()
        except OSError as exc:
            _usage(f"messages update: cannot read {args.content_file}: {exc.strerror}")
    return None


def cmd_messages_update(args: argparse.Namespace) -> int:
    delay_ms = 0 if args.now else args.delay
    content = _content(args)
    if delay_ms is None and args.at is None and args.priority is None and content is None:
        _usage("messages update: give --now, --in or --at, --priority, or --content")
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        if content is not None:
            detail = broker.message(conn, args.id)
            headers = (detail.payload() or {}).get("headers") if detail else None
            if isinstance(headers, dict) and headers.get("task"):
                _usage(
                    f"messages update: message {args.id} is a Celery task ({headers['task']}): "
                    "its content is the task's payload, which stays as Celery wrote it; "
                    "change its time (--now, --in, --at) or --priority"
                )
        result = broker.update(
            conn, args.id, delay_ms=delay_ms, at=args.at, priority=args.priority, content=content
        )
        now = _db_now(conn)
    if args.json:
        _print_json({"id": result.id, "dequeue_at": result.dequeue_at, "priority": result.priority})
        return 0
    left = (result.dequeue_at - now).total_seconds()
    when = f"due in {_term.age(left)}" if left > 0 else "due now"
    print(
        f"message {result.id}: {when} ({_term.when(result.dequeue_at)}), priority {result.priority}"
    )
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with _connect(args) as conn:
        broker.check(conn)
        known = {s.queue: s for s in broker.status(conn, count_ready=False)}
        if args.queue not in known:
            print(f"lonnymq: no queue {args.queue!r}", file=sys.stderr)
            return 1
        s = known[args.queue]
        if args.dead:
            question = f"delete the {s.dead:,} dead letter(s) of queue {args.queue!r}?"
        else:
            question = (
                f"delete the {s.waiting:,} waiting message(s) of queue {args.queue!r} "
                f"({s.in_flight:,} held by consumers stay)?"
            )
        if not _confirm(question, args):
            print("nothing done", file=sys.stderr)
            return 1
        with _term.working(f"purging {args.queue}"):
            n = queue.purge_dead(conn) if args.dead else queue.purge(conn)
    what = "dead letter(s)" if args.dead else "message(s)"
    if args.json:
        _print_json({"queue": args.queue, "deleted": n, "dead": bool(args.dead)})
    else:
        print(f"purged {n:,} {what} from queue {args.queue!r}")
    return 0


# -- metrics, housekeeping --------------------------------------------------------------------


def cmd_metrics(args: argparse.Namespace) -> int:
    from .. import metrics

    dsn = _dsn(args)
    try:
        server = metrics.serve(
            dsn, args.schema, port=args.port, addr=args.addr, count_ready=not args.no_count
        )
    except OSError as exc:
        raise SystemExit(f"lonnymq metrics: cannot listen on port {args.port}: {exc}") from None
    print(
        f"serving lonnymq metrics of {mask_password(dsn)} schema {args.schema!r} on "
        f"http://{args.addr}:{server.port}/metrics",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()


def cmd_housekeep(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with _connect(args) as conn:
        broker.check(conn)
        messages = queues = 0
        while True:  # a run takes at most 10,000 messages past their time to live
            more, gone = broker.expire(conn, limit=10_000)
            messages, queues = messages + more, queues + gone
            if more < 10_000:
                break
        pruned = broker.housekeep(conn)
    result = {"expired_messages": messages, "expired_queues": queues, "dead_pruned": pruned}
    _print(result, args.json)
    return 0


# -- the parser ----------------------------------------------------------------------------------


def parser(dsn: str | None = None, schema: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``dsn`` and ``schema``: defaults of ``--dsn`` and ``--schema``
    (``celery -A proj lonnymq`` gives those of the Celery app)."""
    where = "the Celery app's broker_url" if dsn else "$DATABASE_URL"
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn", default=dsn, help=f"database URL or libpq string (default: {where})"
    )
    common.add_argument(
        "--schema", default=schema or migrator.DEFAULT_SCHEMA, help="lonnymq schema"
    )
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the output (auto: on a terminal, unless NO_COLOR is set)",
    )

    top = argparse.ArgumentParser(prog="lonnymq", description="lonnymq: a queue in Postgres")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = sub.add_parser("migrate", parents=[common], help="install or upgrade the schema")
    migrate.add_argument(
        "--print-sql", action="store_true", help="print the SQL it would run, and run nothing"
    )
    migrate.set_defaults(func=cmd_migrate)

    def status_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("queues", nargs="*", metavar="QUEUE", help="default: every queue")
        p.add_argument(
            "--no-count",
            action="store_true",
            help="skip counting ready/delayed messages (cost grows with the backlog)",
        )
        p.add_argument(
            "--all", action="store_true", help="also show idle Celery/kombu plumbing queues"
        )
        p.add_argument(
            "--snapshot-warn",
            type=_seconds,
            default=60.0,
            metavar="SECONDS",
            help="warn when a session has held a snapshot for longer (default 60)",
        )

    status = sub.add_parser(
        "status", parents=[common], help="per queue: ready, delayed, in flight, dead, oldest"
    )
    status_args(status)
    status.set_defaults(func=cmd_status)

    topp = sub.add_parser("top", parents=[common], help="status, refreshing, with rates")
    status_args(topp)
    topp.add_argument("--interval", type=_seconds, default=2.0, help="seconds between refreshes")
    topp.add_argument("--iterations", type=_positive, default=None, help="stop after N refreshes")
    topp.set_defaults(func=cmd_top)

    channels = sub.add_parser("channels", parents=[common], help="the largest channels of a queue")
    channels.add_argument("queue")
    channels.add_argument("--limit", type=_positive, default=20)
    channels.set_defaults(func=cmd_channels)

    policy = sub.add_parser("policy", help="channel and queue-default policies")
    actions = policy.add_subparsers(dest="action", required=True)
    for action in ("set", "clear", "show"):
        p = actions.add_parser(action, parents=[common])
        p.add_argument("queue")
        p.add_argument("channel", nargs="?", help="omit for the queue-wide default")
        if action == "set":
            p.add_argument("--max-concurrency", type=_limit, default=None, metavar="N|none")
            p.add_argument("--max-size", type=_limit, default=None, metavar="N|none")
        p.set_defaults(func=cmd_policy)

    queue = sub.add_parser("queue", help="a queue's settings: dead letters, attempts, retention")
    qactions = queue.add_subparsers(dest="action", required=True)
    qshow = qactions.add_parser("show", parents=[common])
    qshow.add_argument("queue")
    qshow.set_defaults(func=cmd_queue)
    qset = qactions.add_parser("set", parents=[common])
    qset.add_argument("queue")
    qset.add_argument(
        "--max-attempts",
        type=_attempts,
        default=_UNSET,
        metavar="N|none",
        help="deliveries before a message is dead-lettered (default 20)",
    )
    qset.add_argument(
        "--dead-letter", type=_on_off, default=None, metavar="on|off", help="keep dead letters"
    )
    qset.add_argument(
        "--dead-retention",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="how long dead letters are kept, e.g. 14d, 36h",
    )
    qset.set_defaults(func=cmd_queue)

    messages = sub.add_parser("messages", help="list, show, delete, retry, update messages")
    mactions = messages.add_subparsers(dest="action", required=True)

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument("--queue")
        p.add_argument("--channel")
        p.add_argument("--state", choices=STATES)

    mlist = mactions.add_parser("list", parents=[common], help="messages by id, paged")
    filters(mlist)
    mlist.add_argument("--after", type=int, default=0, metavar="ID", help="the page after ID")
    mlist.add_argument("--limit", type=_positive, default=50)
    mlist.add_argument("--all", action="store_true", help="every page")
    mlist.set_defaults(func=cmd_messages_list)
    mshow = mactions.add_parser("show", parents=[common], help="one message with its body")
    mshow.add_argument("id", type=_positive)
    mshow.set_defaults(func=cmd_messages_show)
    for verb, func, doc in (
        ("delete", cmd_messages_delete, "delete messages or dead letters"),
        ("retry", cmd_messages_retry, "dead letters back to their queue; delayed due now"),
    ):
        p = mactions.add_parser(verb, parents=[common], help=doc)
        p.add_argument("ids", nargs="*", type=_positive, metavar="ID")
        filters(p)
        p.add_argument("--all", action="store_true", help="every message matching the filters")
        p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
        p.set_defaults(func=func)

    mupdate = mactions.add_parser(
        "update",
        parents=[common],
        help="reschedule or edit a ready or delayed message (refused when in flight)",
    )
    mupdate.add_argument("id", type=_positive)
    when = mupdate.add_mutually_exclusive_group()
    when.add_argument(
        "--now", action="store_true", help="due now (a Celery task's eta header is removed)"
    )
    when.add_argument(
        "--in",
        dest="delay",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="due that long from now, e.g. 30s, 15m, 2h",
    )
    when.add_argument(
        "--at", type=_at, default=None, metavar="TIME", help="due at an ISO 8601 time with offset"
    )
    mupdate.add_argument("--priority", type=_priority, default=None, help="0 to 255")
    body = mupdate.add_mutually_exclusive_group()
    body.add_argument("--content", help="new content, as text (not for Celery tasks)")
    body.add_argument("--content-file", metavar="PATH", help="new content from a file ('-': stdin)")
    mupdate.set_defaults(func=cmd_messages_update)

    purge = sub.add_parser("purge", parents=[common], help="delete a queue's waiting messages")
    purge.add_argument("queue")
    purge.add_argument("--dead", action="store_true", help="delete its dead letters instead")
    purge.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(func=cmd_purge)

    metrics = sub.add_parser(
        "metrics", parents=[common], help="serve Prometheus metrics for the whole database"
    )
    metrics.add_argument("--port", type=int, default=9808)
    metrics.add_argument("--addr", default="0.0.0.0")
    metrics.add_argument(
        "--no-count", action="store_true", help="skip counting ready/delayed messages"
    )
    metrics.set_defaults(func=cmd_metrics)

    housekeep = sub.add_parser(
        "housekeep", parents=[common], help="expire messages, prune old dead letters"
    )
    housekeep.set_defaults(func=cmd_housekeep)

    grant = sub.add_parser(
        "grant", parents=[common], help="give a database role a lonnymq kind of rights"
    )
    grant.add_argument("kind", choices=roles.KINDS)
    grant.add_argument("role")
    grant.set_defaults(func=cmd_grant)
    revoke = sub.add_parser("revoke", parents=[common], help="take a role's lonnymq rights")
    revoke.add_argument("role")
    revoke.set_defaults(func=cmd_grant)

    stats = sub.add_parser("stats", parents=[common], help="counters of queues (see status)")
    stats.add_argument("queues", nargs="*", help="default: every queue")
    stats.set_defaults(func=cmd_stats)
    return top


def main(
    argv: Sequence[str] | None = None, *, dsn: str | None = None, schema: str | None = None
) -> int:
    """Run the command; ``dsn`` and ``schema`` are defaults that ``--dsn`` and ``--schema``
    override (``dsn`` also overrides ``$DATABASE_URL``)."""
    args = parser(dsn, schema).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="lonnymq: %(message)s")
    try:
        code: int = args.func(args)
    except (LonnyMQError, InvalidArgument) as exc:
        print(f"lonnymq: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `lonnymq messages list --all | head`
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
