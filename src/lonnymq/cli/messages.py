"""``lonnymq messages list|show|delete|retry|update`` and ``lonnymq purge``: the messages and
dead letters themselves."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from ..queue import Broker
from ..queue.listing import MessageInfo, state_arg
from ..report import TASK_PEEK, message_body, task_of
from . import term
from .common import confirm, connect, db_now, fields_of, print_json, style_of, usage_error

_STATE_STYLE = {"ready": "green", "delayed": "blue", "locked": "yellow", "dead": "red"}


def _message_dict(m: MessageInfo) -> dict[str, Any]:
    """A listed message, with its Celery task's name and arguments (None for others)."""
    out = {
        name: term.jsonable(value) for name, value in fields_of(m) if name not in ("head", "tail")
    }
    task = task_of(m.head, m.tail)
    return out | {"task": task and task["task"], "args": task and task["args"]}


def _when_text(m: MessageInfo, now: datetime) -> str:
    if m.state == "delayed" and m.dequeue_at is not None:
        return "due in " + term.age((m.dequeue_at - now).total_seconds())
    if m.state == "locked" and m.locked_until is not None:
        left = (m.locked_until - now).total_seconds()
        return ("lock ends in " + term.age(left)) if left > 0 else "lock expired"
    if m.state == "dead":
        return f"{m.reason}, {term.since(m.dead_at, now)} ago"
    if m.dequeue_at is not None:
        return "ready for " + term.since(m.dequeue_at, now)
    return "-"


def _list_filters(args: argparse.Namespace) -> dict[str, Any]:
    return {"queue": args.queue, "channel": args.channel, "state": args.state, "peek": TASK_PEEK}


def cmd_messages_list(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    out: list[MessageInfo] = []
    with connect(args) as conn:
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
        now = db_now(conn)
    if args.json:
        print_json([_message_dict(m) for m in out])
        if more:
            print(f"more: --after {out[-1].id}", file=sys.stderr)
        return 0
    if not out:
        print("no messages")
        return 0
    style = style_of(args)
    head = [
        "ID", "QUEUE", "CHANNEL", "STATE", "ATTEMPTS", "PRIO", "AGE", "WHEN", "TASK", "NAME",
        "BYTES",
    ]  # fmt: skip
    tasks = [task_of(m.head, m.tail) for m in out]
    rows = [
        [
            str(m.id),
            m.queue,
            m.channel,
            style(m.state, _STATE_STYLE[m.state]),
            str(m.attempts),
            str(m.priority),
            term.since(m.created_at, now),
            _when_text(m, now),
            "-" if task is None else str(task["task"]),
            m.name or "-",
            term.number(m.size),
        ]
        for m, task in zip(out, tasks, strict=True)
    ]
    print(term.table(head, rows, style, right=frozenset({0, 4, 5, 6, 10})))
    if more:
        print(
            style(f"more: lonnymq messages list ... --after {out[-1].id} (or --all)", "dim"),
            file=sys.stderr,
        )
    return 0


def cmd_messages_show(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    with connect(args) as conn:
        broker.check(conn)
        detail = broker.message(conn, args.id)
        now = db_now(conn)
    if detail is None:
        print(f"lonnymq: no message {args.id}", file=sys.stderr)
        return 1
    body, headers = message_body(detail)
    meta = {
        name: term.jsonable(value)
        for name, value in fields_of(detail)
        if name not in ("content", "saved_state")
    }
    if args.json:
        print_json(
            {
                **meta,
                "headers": headers,
                "body": body,
                "content_bytes": len(detail.content),
                "saved_state": term.jsonable(detail.saved_state),
            }
        )
        return 0
    style = style_of(args)
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
        ("created", f"{term.when(detail.created_at)} ({term.since(detail.created_at, now)} ago)"),
    ]
    if detail.expires_at is not None:
        rows.append(("expires", term.when(detail.expires_at)))
    if detail.state == "dead":
        rows.append(("dead since", term.when(detail.dead_at)))
        rows.append(("reason", detail.reason or "-"))
    if headers and headers.get("task"):
        rows.append(("task", str(headers["task"])))
    rows.append(("bytes", term.number(len(detail.content))))
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
            usage_error(f"messages {verb}: give ids or --all, not both")
        return list(dict.fromkeys(args.ids))
    if not args.all:
        usage_error(f"messages {verb}: give message ids, or --queue Q --all")
    if not args.queue:
        usage_error(f"messages {verb} --all needs --queue")
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
    if not confirm(f"{verb} {what} of {where}?", args):
        print("nothing done", file=sys.stderr)
        return None
    return ids


def _in_chunks(ids: list[int], what: str, call: Callable[[list[int]], None]) -> None:
    progress = term.Progress(what, len(ids))
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
    with connect(args) as conn:
        broker.check(conn)
        ids = _targets(conn, broker, args, "delete", None)
        if ids is None:
            return 1
        _in_chunks(ids, "deleting", lambda chunk: results.update(broker.remove(conn, chunk)))
    deleted = [i for i, r in results.items() if r == "deleted"]
    missing = [i for i, r in results.items() if r != "deleted"]
    if args.json:
        print_json({"deleted": deleted, "not_found": missing})
    else:
        print(f"deleted {len(deleted):,} message(s)")
        if missing:
            print(f"not found: {', '.join(map(str, missing[:20]))}", file=sys.stderr)
    return 1 if missing and args.ids else 0


def cmd_messages_retry(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    results = []
    with connect(args) as conn:
        broker.check(conn)
        ids = _targets(conn, broker, args, "retry", "dead")
        if ids is None:
            return 1
        _in_chunks(ids, "retrying", lambda chunk: results.extend(broker.retry(conn, chunk)))
    if args.json:
        print_json([{"id": r.id, "result": r.result, "new_id": r.new_id} for r in results])
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
            usage_error(f"messages update: cannot read {args.content_file}: {exc.strerror}")
    return None


def cmd_messages_update(args: argparse.Namespace) -> int:
    delay_ms = 0 if args.now else args.delay
    content = _content(args)
    if delay_ms is None and args.at is None and args.priority is None and content is None:
        usage_error("messages update: give --now, --in or --at, --priority, or --content")
    broker = Broker(args.schema)
    with connect(args) as conn:
        broker.check(conn)
        if content is not None:
            detail = broker.message(conn, args.id)
            headers = (detail.payload() or {}).get("headers") if detail else None
            if isinstance(headers, dict) and headers.get("task"):
                usage_error(
                    f"messages update: message {args.id} is a Celery task ({headers['task']}): "
                    "its content is the task's payload, which stays as Celery wrote it; "
                    "change its time (--now, --in, --at) or --priority"
                )
        result = broker.update(
            conn, args.id, delay_ms=delay_ms, at=args.at, priority=args.priority, content=content
        )
        now = db_now(conn)
    if args.json:
        print_json({"id": result.id, "dequeue_at": result.dequeue_at, "priority": result.priority})
        return 0
    left = (result.dequeue_at - now).total_seconds()
    when = f"due in {term.age(left)}" if left > 0 else "due now"
    print(
        f"message {result.id}: {when} ({term.when(result.dequeue_at)}), priority {result.priority}"
    )
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    broker = Broker(args.schema)
    queue = broker.queue(args.queue)
    with connect(args) as conn:
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
        if not confirm(question, args):
            print("nothing done", file=sys.stderr)
            return 1
        with term.working(f"purging {args.queue}"):
            n = queue.purge_dead(conn) if args.dead else queue.purge(conn)
    what = "dead letter(s)" if args.dead else "message(s)"
    if args.json:
        print_json({"queue": args.queue, "deleted": n, "dead": bool(args.dead)})
    else:
        print(f"purged {n:,} {what} from queue {args.queue!r}")
    return 0
