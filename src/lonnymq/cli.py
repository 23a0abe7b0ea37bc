"""The ``lonnymq`` command (also ``python -m lonnymq``).

    lonnymq migrate [--print-sql]       install or upgrade the schema
    lonnymq policy set QUEUE [CHANNEL] [--max-concurrency N] [--max-size N]
    lonnymq policy clear QUEUE [CHANNEL]
    lonnymq policy show QUEUE [CHANNEL]
    lonnymq stats QUEUE [QUEUE...]

Every command reads the database from ``--dsn`` or ``$DATABASE_URL`` (a ``postgresql://`` or
``lonnymq://`` URL, or a libpq ``key=value`` string) and the schema from ``--schema``
(default ``lonnymq``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from . import migrator, roles
from ._url import mask_password
from .exceptions import LonnyMQError
from .queue import Broker


def to_libpq(dsn: str) -> str:
    """Accept the broker URL form too: ``lonnymq://`` means ``postgresql://``."""
    if dsn.startswith("lonnymq://"):
        return "postgresql://" + dsn[len("lonnymq://") :]
    return dsn


def _connect(args: argparse.Namespace) -> psycopg.Connection[Any]:
    dsn = args.dsn or os.environ.get("DATABASE_URL")
    if not dsn:
        raise SystemExit("lonnymq: no database given: pass --dsn or set DATABASE_URL")
    try:
        return psycopg.connect(to_libpq(dsn), autocommit=True)
    except psycopg.Error as exc:
        raise SystemExit(
            f"lonnymq: cannot connect to the database: {mask_password(str(exc)).strip()}"
        ) from None


def _limit(text: str) -> int | None:
    if text.lower() in ("none", "null", "unlimited", "-"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


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
        print(json.dumps(rows, indent=2))
    else:
        headers = ["queue", "total", "ready", "delayed", "in_flight", "channels"]
        table = [headers] + [[str(r[h]) for h in headers] for r in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
        for line in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    return 0


def _print(data: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        print(f"{key}: {value}")


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help="database URL or libpq string (default: $DATABASE_URL)")
    common.add_argument("--schema", default=migrator.DEFAULT_SCHEMA, help="lonnymq schema")
    common.add_argument("--json", action="store_true", help="print JSON")

    top = argparse.ArgumentParser(prog="lonnymq", description="lonnymq: a queue in Postgres")
    sub = top.add_subparsers(dest="command", required=True)

    migrate = sub.add_parser("migrate", parents=[common], help="install or upgrade the schema")
    migrate.add_argument(
        "--print-sql", action="store_true", help="print the SQL it would run, and run nothing"
    )
    migrate.set_defaults(func=cmd_migrate)

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

    grant = sub.add_parser(
        "grant", parents=[common], help="give a database role a lonnymq kind of rights"
    )
    grant.add_argument("kind", choices=roles.KINDS)
    grant.add_argument("role")
    grant.set_defaults(func=cmd_grant)
    revoke = sub.add_parser("revoke", parents=[common], help="take a role's lonnymq rights")
    revoke.add_argument("role")
    revoke.set_defaults(func=cmd_grant)

    stats = sub.add_parser("stats", parents=[common], help="counters of queues")
    stats.add_argument("queues", nargs="*", help="default: every queue")
    stats.set_defaults(func=cmd_stats)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except LonnyMQError as exc:
        print(f"lonnymq: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
