"""``lonnymq status``, ``top``, ``channels`` and ``stats``: what the queues hold, live or once,
with the warnings an operator should see (a held snapshot, queues past their x-expires)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from datetime import datetime
from typing import Any

import psycopg

from ..dsn import mask_password
from ..queue import Broker, QueueStatus
from ..report import consumer_counts, expired_warning, horizon_warning
from ..report import is_internal as _is_internal
from ..report import rates as _rates
from ..report import status_dict as _status_dict
from . import term
from .common import connect, db_now, dsn_of, fields_of, print_json, style_of


def _read_status(
    conn: psycopg.Connection[Any],
    broker: Broker,
    args: argparse.Namespace,
    keep: frozenset[str] = frozenset(),
) -> tuple[list[QueueStatus], datetime, dict[str, int]]:
    """The queues' status (the ones asked for; idle plumbing hidden unless ``--all``), the
    database's time, and each queue's live consumers."""
    statuses = broker.status(conn, count_ready=not args.no_count)
    now = db_now(conn)
    consumers = consumer_counts(broker.consumers(conn))
    if args.queues:
        wanted = set(args.queues)
        statuses = [s for s in statuses if s.queue in wanted]
        missing = sorted(wanted - {s.queue for s in statuses})
        if missing:
            print(f"lonnymq: no such queue: {', '.join(missing)}", file=sys.stderr)
    elif not args.all:
        statuses = [
            s
            for s in statuses
            if s.queue in keep or not _is_internal(s, now, consumers.get(s.queue, 0))
        ]
    return statuses, now, consumers


_STATUS_HEAD = [
    "QUEUE",
    "READY",
    "DELAYED",
    "IN FLIGHT",
    "DEAD",
    "OLDEST READY",
    "CHANNELS",
    "CONSUMERS",
]


def _status_row(
    s: QueueStatus, now: datetime, style: term.Style, consumers: dict[str, int]
) -> list[str]:
    oldest = s.oldest_ready_age(now)
    oldest_text = term.age(oldest)
    if oldest is not None and oldest >= 60:
        oldest_text = style(oldest_text, "yellow" if oldest < 600 else "red")
    dead = term.number(s.dead)
    return [
        style(s.queue, "cyan"),
        term.number(s.ready),
        term.number(s.delayed),
        term.number(s.in_flight),
        style(dead, "red") if s.dead else dead,
        oldest_text,
        term.number(s.channels),
        term.number(consumers.get(s.queue, 0)),
    ]


def cmd_status(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with connect(args) as conn:
        broker.check(conn)
        expiries = broker.expiring(conn)
        if args.queues:
            expiries = [e for e in expiries if e.queue in set(args.queues)]
        expired = frozenset(e.queue for e in expiries if e.expired)
        statuses, now, consumers = _read_status(conn, broker, args, keep=expired)
        warning = horizon_warning(conn, broker, args.snapshot_warn)
        held = {h.queue: h for h in broker.rate_held(conn)}
    leftovers = expired_warning(expiries, statuses)
    by_queue = {e.queue: e for e in expiries}
    code = 1 if args.queues and len(statuses) < len(set(args.queues)) else 0
    if args.json:
        print_json(
            [
                _status_dict(
                    s, now, by_queue.get(s.queue), held.get(s.queue), consumers.get(s.queue, 0)
                )
                for s in statuses
            ]
        )
        for line in (warning, leftovers):
            if line:
                print(line, file=sys.stderr)
        return code
    style = style_of(args)
    if not statuses:
        if not args.queues:
            print("no queues")
    else:
        rows = [_status_row(s, now, style, consumers) for s in statuses]
        print(term.table(_STATUS_HEAD, rows, style, right=frozenset(range(1, 8))))
        for s in statuses:
            h = held.get(s.queue)
            if h is not None:
                print(
                    f"{s.queue}: {h.messages:,} message(s) due now wait for the rate of "
                    f"{h.channels:,} channel(s) (`lonnymq channels {s.queue}`)"
                )
    for line in (warning, leftovers):
        if line:
            print(style(line, "yellow"))
    return code


def cmd_stats(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with connect(args) as conn:
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
        print_json(rows)
    else:
        headers = ["queue", "total", "ready", "delayed", "in_flight", "channels"]
        table = [[str(r[h]) for h in headers] for r in rows]
        print(term.table(headers, table, style_of(args), right=frozenset(range(1, 6))))
    return 0


_TOP_HEAD = [*_STATUS_HEAD, "ENQ/S", "DELIV/S", "ACK/S", "DEAD/S"]


def cmd_top(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    style = style_of(args)
    live = sys.stdout.isatty() and not args.json
    before: dict[str, QueueStatus] = {}
    last: float | None = None
    shown = 0
    where = mask_password(dsn_of(args))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with connect(args) as conn:
            broker.check(conn)
            while True:
                statuses, now, consumers = _read_status(conn, broker, args)
                tick = time.monotonic()
                elapsed = None if last is None else tick - last
                if args.json:
                    print(
                        json.dumps(
                            {
                                "time": now.isoformat(),
                                "queues": [
                                    {
                                        **_status_dict(s, now, consumers=consumers.get(s.queue, 0)),
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
                            default=term.jsonable,
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
                        rows.append(
                            _status_row(s, now, style, consumers) + [term.rate(r) for r in rates]
                        )
                    title = style(
                        f"lonnymq top  {where}  schema {args.schema}  "
                        f"{now.astimezone().strftime('%Y-%m-%d %H:%M:%S')}",
                        "bold",
                    )
                    summary = (
                        f"{len(statuses)} queue(s)  "
                        f"ready {term.number(None if args.no_count else ready)}  "
                        f"in flight {term.number(sum(s.in_flight for s in statuses))}  "
                        f"dead {term.number(sum(s.dead for s in statuses))}  "
                        + (
                            f"enq/s {term.rate(totals[0])}  deliv/s {term.rate(totals[1])}  "
                            f"ack/s {term.rate(totals[2])}  dead/s {term.rate(totals[3])}"
                            if elapsed
                            else "rates after the next refresh"
                        )
                    )
                    body = term.table(_TOP_HEAD, rows, style, right=frozenset(range(1, 12)))
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
    with connect(args) as conn:
        broker.check(conn)
        channels = broker.queue(args.queue).channels(conn, limit=args.limit)
        now = db_now(conn)
    if args.json:
        print_json([dict(fields_of(c)) for c in channels])
        return 0
    style = style_of(args)
    if not channels:
        print(f"queue {args.queue!r} has no channels")
        return 0
    head = [
        "CHANNEL", "SIZE", "IN FLIGHT", "MAX CONC", "MAX SIZE", "RATE", "TOKENS", "POLICY",
        "WAITING", "ENQUEUED", "ACKED", "DEAD",
    ]  # fmt: skip
    rows = []
    for c in channels:
        rate = "-" if c.rate is None else f"{c.rate} x{c.burst}"
        if c.rate is None:
            tokens = "-"
        elif c.next_token_at is not None and c.next_token_at > now:
            # waiting for its next token: in how long
            tokens = style(f"next in {(c.next_token_at - now).total_seconds():.2f}s", "yellow")
        else:
            tokens = term.number(c.tokens)
        full = c.max_size is not None and c.size >= c.max_size
        busy = c.max_concurrency is not None and c.in_flight >= c.max_concurrency
        size = term.number(c.size)
        conc = term.number(c.in_flight)
        rows.append(
            [
                style(c.channel, "cyan"),
                style(size, "red") if full else size,
                style(conc, "yellow") if busy else conc,
                term.number(c.max_concurrency),
                term.number(c.max_size),
                rate,
                tokens,
                "own" if c.has_policy else "queue",
                term.since(c.waiting_since, now),
                term.number(c.enqueued),
                term.number(c.acked),
                term.number(c.dead),
            ]
        )
    print(term.table(head, rows, style, right=frozenset({1, 2, 3, 4, 8, 9, 10, 11})))
    return 0
