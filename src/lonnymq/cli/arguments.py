"""The command line's arguments, in one place: the parser (every command, its arguments and
their types), and :func:`main`, which runs the command parsed."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from datetime import datetime

from .. import migrator, roles
from ..exceptions import InvalidArgument, LonnyMQError
from ..queue.listing import STATES
from ..queue.rate import Rate
from . import term
from .messages import (
    cmd_messages_delete,
    cmd_messages_list,
    cmd_messages_retry,
    cmd_messages_show,
    cmd_messages_update,
    cmd_purge,
)
from .metrics import cmd_metrics
from .policies import UNSET, cmd_policy, cmd_queue
from .roles import cmd_grant
from .schema import cmd_housekeep, cmd_migrate
from .status import cmd_channels, cmd_stats, cmd_status, cmd_top
from .web import TOKEN_ENV, cmd_web


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


def _rate(text: str) -> Rate | None:
    if text.lower() in ("none", "null", "unlimited", "-"):
        return None
    try:
        return Rate.parse(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        return term.parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _on_off(text: str) -> bool:
    value = text.lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, not {text!r}")


def _port(text: str) -> int:
    value = _int(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError("must be 65535 or less")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.1 and 3600 seconds")
    return value


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
            p.add_argument(
                "--rate",
                type=_rate,
                default=None,
                metavar="N/s|N/m|N/h|none",
                help="at most N deliveries per second, minute or hour, across every consumer",
            )
            p.add_argument(
                "--burst",
                type=_positive,
                default=None,
                metavar="N",
                help="deliveries at once after the channel was idle (with --rate; default 1)",
            )
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
        default=UNSET,
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

    web = sub.add_parser(
        "web",
        parents=[common],
        help="serve the web view (read-only unless --allow-actions with a token)",
        description="Serve the web view of the schema: queues, channels, messages, dead "
        "letters (docs/web.md). Read-only unless --allow-actions and a token are given.",
    )
    web.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    web.add_argument("--port", type=_port, default=8808, help="port to listen on (8808)")
    web.add_argument(
        "--allow-actions",
        action="store_true",
        help="let people signed in with the token retry and delete messages, purge queues "
        "and set policies",
    )
    web.add_argument(
        "--token",
        default=None,
        help=f"the access token for actions (at least 16 characters; default ${TOKEN_ENV}; "
        "prefer the variable: a command line is visible to other users)",
    )
    web.add_argument(
        "--audit-log", metavar="PATH", help="append the audit log there (default: stderr)"
    )
    web.add_argument("--refresh", type=_seconds, default=2.0, help="seconds between refreshes (2)")
    web.add_argument(
        "--snapshot-warn",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="warn when a session has held a snapshot for longer (default 60)",
    )
    web.add_argument("--root-path", default="", help="the prefix a reverse proxy serves it at")
    web.add_argument(
        "--proxy-headers",
        action="store_true",
        help="trust X-Forwarded-For/-Proto from --forwarded-allow-ips (behind a proxy)",
    )
    web.add_argument("--forwarded-allow-ips", default="127.0.0.1", help="proxies to trust")
    web.add_argument("--access-log", action="store_true", help="log every request")
    web.set_defaults(func=cmd_web)

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
