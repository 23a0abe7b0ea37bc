"""``lonnymq migrate`` (install or upgrade the schema) and ``lonnymq housekeep`` (expire what
is past its time to live, prune old dead letters)."""

from __future__ import annotations

import argparse

from .. import migrator
from ..queue import Broker
from .common import connect, print_fields


def cmd_migrate(args: argparse.Namespace) -> int:
    with connect(args) as conn:
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


def cmd_housekeep(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with connect(args) as conn:
        broker.check(conn)
        messages = queues = 0
        while True:  # a run takes at most 10,000 messages past their time to live
            more, gone = broker.expire(conn, limit=10_000)
            messages, queues = messages + more, queues + gone
            if more < 10_000:
                break
        pruned = broker.housekeep(conn)
    result = {"expired_messages": messages, "expired_queues": queues, "dead_pruned": pruned}
    print_fields(result, args.json)
    return 0
