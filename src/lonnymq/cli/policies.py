"""``lonnymq policy`` (channel and queue-default policies) and ``lonnymq queue`` (a queue's
settings: dead letters, max attempts, retention)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..queue import Broker
from . import term
from .common import connect, print_fields, print_json, usage_error


def cmd_policy(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with connect(args) as conn:
        broker.check(conn)
        if args.action == "set":
            if args.burst is not None and args.rate is None:
                usage_error("--burst needs --rate (e.g. --rate 10/s --burst 5)")
            limits = {
                "max_concurrency": args.max_concurrency,
                "max_size": args.max_size,
                "rate": args.rate,
                "burst": args.burst,
            }
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
            if info.effective.rate is not None:
                shown["tokens"] = info.tokens
                shown["next_token_at"] = info.next_token_at
        else:
            shown = {"queue": args.queue, "queue_default": vars_of(queue.policy.get(conn))}
    print_fields(shown, args.json)
    return 0


def vars_of(policy: Any) -> dict[str, Any]:
    """A policy's limits; ``rate`` and ``burst`` only when it has a rate (the output of a
    policy without one is as it was before rates)."""
    shown = {"max_concurrency": policy.max_concurrency, "max_size": policy.max_size}
    if policy.rate is not None:
        shown.update(rate=str(policy.rate), burst=policy.burst)
    return shown


def cmd_queue(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with connect(args) as conn:
        broker.check(conn)
        if args.action == "set":
            changes: dict[str, Any] = {}
            if args.max_attempts is not UNSET:
                changes["max_attempts"] = args.max_attempts
            if args.dead_letter is not None:
                changes["dead_letter"] = args.dead_letter
            if args.dead_retention is not None:
                changes["dead_retention_ms"] = args.dead_retention
            if not changes:
                usage_error(
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
        print_json(shown)
    else:
        shown["dead_letter"] = "on" if settings.dead_letter else "off"
        shown["max_attempts"] = settings.max_attempts or "no limit"
        shown["dead_retention_ms"] = term.duration(settings.dead_retention_ms)
        shown["dead_retention"] = shown.pop("dead_retention_ms")
        print_fields(shown, False)
    return 0


UNSET: Any = object()
