"""Actions: retry and delete messages (dead letters, say), purge a queue or its dead letters,
set or clear a policy; and signing in and out. Only when the app was started with actions on
and a token (see :mod:`.auth`).

Each action is two requests: ``GET /actions/NAME?...`` shows what it will do, with a form
(the confirmation); ``POST /actions/NAME`` (signed in, with the session's CSRF token, from
this origin) does it and logs it on ``lonnymq.web.audit``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ..exceptions import InvalidName
from ..queue import _checks
from ..queue.policy import ChannelPolicy
from .auth import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Forbidden,
    Session,
    audit,
    clean_name,
    cookie_path,
    refuse,
    same_origin,
    who,
)
from .data import Conn, Settings
from .render import BadRequest, link, render, web_of

MAX_FORM_BYTES = 64 * 1024
#: Most message ids one action takes (a page's worth).
MAX_IDS = 500

Form = dict[str, list[str]]


async def read_form(request: Request) -> Form:
    """The POSTed form (``application/x-www-form-urlencoded``, at most 64 KiB)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise BadRequest("expected a form (application/x-www-form-urlencoded)")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise BadRequest("form too large")
    try:
        return parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_IDS + 20)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"bad form: {exc}") from None


def one(form: Form, key: str) -> str:
    values = form.get(key, [])
    if len(values) > 1:
        raise BadRequest(f"give {key!r} once")
    return values[0] if values else ""


def _name(value: str, what: str, *, required: bool) -> str | None:
    if not value:
        if required:
            raise BadRequest(f"{what} is required")
        return None
    try:
        return _checks.name(value, what)
    except InvalidName as exc:
        raise BadRequest(str(exc)) from None


def _ids(form: Form) -> list[int]:
    ids: list[int] = []
    for value in form.get("ids", []):
        for part in value.replace(",", " ").split():
            if not part.isascii() or not part.isdigit() or len(part) > 19 or int(part) < 1:
                raise BadRequest(f"not a message id: {part!r}")
            ids.append(int(part))
    ids = list(dict.fromkeys(ids))
    if not ids:
        raise BadRequest("no message ids given")
    if len(ids) > MAX_IDS:
        raise BadRequest(f"at most {MAX_IDS} message ids at once")
    return ids


def _limit(form: Form, key: str) -> int | None:
    text = one(form, key).strip()
    if text in ("", "none"):
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 10 or int(text) > 2**31 - 1:
        raise BadRequest(f"{key} must be a whole number (empty: no limit), not {text!r}")
    return int(text)


#: The policy fields this version of the queue API can set (``rate`` and ``burst`` where
#: it has them).
POLICY_FIELDS = tuple(
    p for p in inspect.signature(ChannelPolicy.set).parameters if p not in ("self", "conn")
)


@dataclass(frozen=True, slots=True)
class Action:
    title: str
    #: what it will do, for the confirmation (from the form's fields)
    describe: Callable[[Form], str]
    #: does it: (connection, settings, form) -> what it did, for the page and the log
    run: Callable[[Conn, Settings, Form], str]
    danger: bool = True


def _where(form: Form) -> str:
    queue = _name(one(form, "queue"), "queue", required=True)
    channel = _name(one(form, "channel"), "channel", required=False)
    return f"channel {channel!r} of queue {queue!r}" if channel else f"queue {queue!r} (default)"


def _retry(conn: Conn, s: Settings, form: Form) -> str:
    results = s.broker.retry(conn, _ids(form))
    return "; ".join(
        f"{r.id}: {r.result}" + (f" -> {r.new_id}" if r.new_id else "") for r in results
    )


def _delete(conn: Conn, s: Settings, form: Form) -> str:
    results = s.broker.remove(conn, _ids(form))
    return "; ".join(f"{i}: {r}" for i, r in results.items())


def _purge(conn: Conn, s: Settings, form: Form) -> str:
    queue = _name(one(form, "queue"), "queue", required=True)
    assert queue is not None
    return f"purged {s.broker.queue(queue).purge(conn):,} message(s) from queue {queue!r}"


def _purge_dead(conn: Conn, s: Settings, form: Form) -> str:
    queue = _name(one(form, "queue"), "queue", required=True)
    assert queue is not None
    n = s.broker.queue(queue).purge_dead(conn)
    return f"deleted {n:,} dead letter(s) of queue {queue!r}"


def _policy_handle(s: Settings, form: Form) -> Any:
    queue = _name(one(form, "queue"), "queue", required=True)
    channel = _name(one(form, "channel"), "channel", required=False)
    assert queue is not None
    handle = s.broker.queue(queue)
    return handle.channel(channel).policy if channel else handle.policy


def policy_values(form: Form) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key in POLICY_FIELDS:
        if key in ("max_concurrency", "max_size") or key == "burst":
            values[key] = _limit(form, key)
        else:  # rate: "10/s" and the like, checked by the queue API
            values[key] = one(form, key).strip() or None
    return values


def _policy_set(conn: Conn, s: Settings, form: Form) -> str:
    values = policy_values(form)
    _policy_handle(s, form).set(conn, **values)
    shown = ", ".join(f"{k}={'none' if v is None else v}" for k, v in values.items())
    return f"policy of {_where(form)} set: {shown}"


def _policy_clear(conn: Conn, s: Settings, form: Form) -> str:
    _policy_handle(s, form).clear(conn)
    return f"policy of {_where(form)} cleared"


ACTIONS: dict[str, Action] = {
    "retry": Action(
        "Retry messages",
        lambda f: (
            f"put {len(_ids(f))} message(s) back to be delivered now "
            "(dead letters back in their queue, delayed messages due now)"
        ),
        _retry,
        danger=False,
    ),
    "delete": Action(
        "Delete messages",
        lambda f: (
            f"delete {len(_ids(f))} message(s) for good, whatever their state "
            "(a consumer holding one finds it gone)"
        ),
        _delete,
    ),
    "purge": Action(
        "Purge a queue",
        lambda f: f"delete every message of queue {one(f, 'queue')!r} that no consumer holds",
        _purge,
    ),
    "purge_dead": Action(
        "Delete dead letters",
        lambda f: f"delete every dead letter of queue {one(f, 'queue')!r}",
        _purge_dead,
    ),
    "policy_set": Action(
        "Set a policy",
        lambda f: f"set the policy of {_where(f)} (empty: no limit)",
        _policy_set,
        danger=False,
    ),
    "policy_clear": Action(
        "Clear a policy",
        lambda f: (
            f"clear the policy of {_where(f)}"
            + (": the queue default applies again" if one(f, "channel") else ": no limits")
        ),
        _policy_clear,
    ),
}


def _action(request: Request) -> tuple[str, Action]:
    name = request.path_params["name"]
    action = ACTIONS.get(name)
    if action is None:
        raise BadRequest(f"no action {name!r}")
    return name, action


def _back(request: Request, form: Form) -> str:
    """Where to go after the action: the page it came from (a path of this app)."""
    target = one(form, "back")
    base = request.scope.get("root_path") or ""
    if target.startswith(base + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return link(request, "/")


def _form_of_query(request: Request) -> Form:
    form: Form = {}
    for key, value in request.query_params.multi_items():
        form.setdefault(key, []).append(value)
    return form


async def confirm(request: Request) -> Response:
    web = web_of(request)
    name, action = _action(request)
    if not web.access.enabled:
        raise Forbidden("this web view is read-only (started without --allow-actions)")
    form = _form_of_query(request)
    describe = action.describe(form)  # checks the fields
    session = web.access.session(request)
    if session is None:
        back = request.url.path + ("?" + request.url.query if request.url.query else "")
        return RedirectResponse(link(request, "/login", next=back), status_code=303)
    fields = {k: v for k, v in form.items() if k not in ("csrf",)}
    context = {
        "title": action.title,
        "page": "action",
        "name": name,
        "action": action,
        "describe": describe,
        "fields": fields,
        "policy_fields": POLICY_FIELDS if name == "policy_set" else (),
        "back": _back(request, form),
    }
    return render(request, "confirm.html", context)


async def perform(request: Request) -> Response:
    web = web_of(request)
    name, action = _action(request)
    if not web.access.enabled:
        refuse(request, "read-only")
        raise Forbidden("this web view is read-only (started without --allow-actions)")
    form = await read_form(request)
    session: Session = web.access.require(request, {"csrf": one(form, "csrf")})
    what = f"{name} {action.describe(form)}"

    def call() -> str:
        with web.pool.connection() as conn:
            return action.run(conn, web.settings, form)

    try:
        result = await run_in_threadpool(call)
    except Exception as exc:
        audit.warning("action failed: %s; %s: %s", what, who(request, session), exc)
        raise
    audit.info("action: %s; %s; result: %s", what, who(request, session), result)
    context = {"title": action.title, "page": "action", "result": result}
    return render(request, "done.html", context | {"back": _back(request, form)})


# -- signing in and out ------------------------------------------------------------------------


def _next(request: Request, target: str) -> str:
    base = request.scope.get("root_path") or ""
    if target.startswith(base + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return link(request, "/")


async def login(request: Request) -> Response:
    web = web_of(request)
    if not web.access.enabled:
        raise Forbidden("this web view is read-only (started without --allow-actions)")
    nonce, new = web.access.login_nonce(request)
    error = ""
    if request.method == "POST":
        form = await read_form(request)
        if not same_origin(request) or not web.access.check_login_csrf(request, one(form, "csrf")):
            refuse(request, "sign-in without a good CSRF token")
            raise Forbidden("bad or missing CSRF token: reload the sign-in page")
        name = clean_name(one(form, "name"))
        if not name:
            error = "give your name: it goes in the log of every action"
        elif web.access.check_token(one(form, "token")):
            audit.info("signed in: %s", who(request, Session(name, "", 0)))
            response = RedirectResponse(_next(request, one(form, "next")), status_code=303)
            web.access.set_cookie(
                request, response, SESSION_COOKIE, web.access.session_cookie(name)
            )
            return response
        else:
            refuse(request, f"wrong token (name given: {name!r})")
            await asyncio.sleep(1.0)  # slows down guessing
            error = "wrong token"
    context = {
        "title": "Sign in",
        "page": "login",
        "error": error,
        "login_csrf": web.access.login_csrf(nonce),
        "next": _next(request, request.query_params.get("next", "")),
    }
    page = render(request, "login.html", context, status_code=403 if error else 200)
    if new:
        web.access.set_cookie(request, page, LOGIN_COOKIE, nonce)
    return page


async def logout(request: Request) -> Response:
    web = web_of(request)
    form = await read_form(request)
    session = web.access.require(request, {"csrf": one(form, "csrf")})
    audit.info("signed out: %s", who(request, session))
    response = RedirectResponse(link(request, "/"), status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=cookie_path(request))
    return response


def routes() -> list[BaseRoute]:
    return [
        Route("/login", login, methods=["GET", "POST"], name="login"),
        Route("/logout", logout, methods=["POST"], name="logout"),
        Route("/actions/{name}", confirm, methods=["GET"], name="confirm"),
        Route("/actions/{name}", perform, methods=["POST"], name="perform"),
    ]
