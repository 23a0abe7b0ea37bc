"""The pages and the JSON API behind them (read-only). Each page has its ``/api/...`` twin
returning the data it renders; a page's ``?part=live`` is the part that refreshes itself (the
page's script swaps it in every few seconds)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ..exceptions import InvalidName
from ..queue import _checks
from ..queue.listing import STATES
from . import data
from .data import MAX_PAGE
from .render import BadRequest, render, web_of

DEFAULT_CHANNELS = 50
DEFAULT_MESSAGES = 50


# -- query parameters ----------------------------------------------------------------------------


def _param(request: Request, key: str) -> str | None:
    values = request.query_params.getlist(key)
    if len(values) > 1:
        raise BadRequest(f"give {key!r} once, not {len(values)} times")
    return values[0] if values else None


def int_param(request: Request, key: str, default: int, low: int, high: int) -> int:
    text = _param(request, key)
    if text is None or text == "":
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise BadRequest(f"{key} must be a whole number from {low} to {high}, not {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise BadRequest(f"{key} must be from {low} to {high}, not {value}")
    return value


def name_param(request: Request, key: str, *, required: bool = False) -> str | None:
    """A queue or channel name: as the queue API accepts it (1 to 255 characters, no NUL)."""
    text = _param(request, key)
    if text is None or text == "":
        if required:
            raise BadRequest(f"{key} is required")
        return None
    try:
        return _checks.name(text, key)
    except InvalidName as exc:
        raise BadRequest(str(exc)) from None


def state_param(request: Request) -> Any:
    try:
        return data.parse_state(_param(request, "state"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _api(payload: dict[str, Any]) -> JSONResponse:
    return JSONResponse(payload)


async def _read(request: Request, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(conn, settings, ...)`` on a pooled connection, in a worker thread."""
    web = web_of(request)

    def call() -> Any:
        with web.pool.connection() as conn:
            return fn(conn, web.settings, *args, **kwargs)

    return await run_in_threadpool(call)


# -- overview ------------------------------------------------------------------------------------


def _include_all(request: Request) -> bool:
    return _param(request, "all") in ("1", "true", "yes")


async def overview(request: Request) -> Response:
    include_all = _include_all(request)
    view = await _read(request, data.overview, include_all=include_all)
    name = "overview_live.html" if _param(request, "part") == "live" else "overview.html"
    return render(request, name, {"view": view, "all": include_all, "page": "overview"})


async def api_status(request: Request) -> Response:
    return _api(await _read(request, data.overview, include_all=_include_all(request)))


# -- a queue and its channels --------------------------------------------------------------------


def _queue_args(request: Request) -> tuple[str, int]:
    name = name_param(request, "q", required=True)
    assert name is not None
    return name, int_param(request, "limit", DEFAULT_CHANNELS, 1, MAX_PAGE)


async def queue(request: Request) -> Response:
    name, limit = _queue_args(request)
    view = await _read(request, data.queue_page, name, limit=limit)
    live = _param(request, "part") == "live"
    context = {"view": view, "page": "queue", "title": name, "limits": (50, 200, MAX_PAGE)}
    return render(request, "queue_live.html" if live else "queue.html", context)


async def api_queue(request: Request) -> Response:
    name, limit = _queue_args(request)
    return _api(await _read(request, data.queue_page, name, limit=limit))


def _channel_args(request: Request) -> tuple[str, str]:
    queue_name = name_param(request, "queue", required=True)
    channel = name_param(request, "channel", required=True)
    assert queue_name is not None and channel is not None
    return queue_name, channel


async def channel(request: Request) -> Response:
    queue_name, name = _channel_args(request)
    view = await _read(request, data.channel_page, queue_name, name)
    live = _param(request, "part") == "live"
    context = {"view": view, "page": "channel", "title": f"{name} of {queue_name}"}
    return render(request, "channel_live.html" if live else "channel.html", context)


async def api_channel(request: Request) -> Response:
    return _api(await _read(request, data.channel_page, *_channel_args(request)))


# -- consumers -----------------------------------------------------------------------------------


async def consumers(request: Request) -> Response:
    view = await _read(request, data.consumers_page)
    return render(request, "consumers.html", {"view": view, "page": "consumers"})


async def api_consumers(request: Request) -> Response:
    return _api(await _read(request, data.consumers_page))


# -- messages ------------------------------------------------------------------------------------


def _after_due(request: Request) -> datetime | None:
    text = _param(request, "after_due")
    if not text:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(f"after_due must be an ISO 8601 time, not {text!r}") from None
    if at.tzinfo is None:
        raise BadRequest(f"after_due must have a time zone, not {text!r}")
    return at


def _list_args(request: Request) -> dict[str, Any]:
    channel = name_param(request, "channel")
    queue_name = name_param(request, "queue", required=channel is not None)
    state = state_param(request)
    try:
        order = data.parse_order(_param(request, "order"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if order == "due" and state == "dead":
        raise BadRequest("dead letters are not due: list them by id (order=id)")
    return {
        "queue": queue_name,
        "channel": channel,
        "state": state,
        "after": int_param(request, "after", 0, 0, _checks.MAX_ID),
        "limit": int_param(request, "limit", DEFAULT_MESSAGES, 1, MAX_PAGE),
        "order": order,
        "after_due": _after_due(request),
    }


async def messages(request: Request) -> Response:
    args = _list_args(request)
    view = await _read(request, data.messages_page, **args)
    title = "Dead letters" if args["state"] == "dead" else "Messages"
    context = {"view": view, "page": "messages", "title": title, "states": STATES}
    return render(request, "messages.html", context)


async def api_messages(request: Request) -> Response:
    return _api(await _read(request, data.messages_page, **_list_args(request)))


def _message_id(request: Request) -> int:
    value: int = request.path_params["id"]
    if not 1 <= value <= _checks.MAX_ID:
        raise BadRequest(f"no message id {value}: ids are from 1 to 2^63-1")
    return value


async def message(request: Request) -> Response:
    view = await _read(request, data.message_detail, _message_id(request))
    context = {"view": view, "page": "message", "title": f"Message {view['id']}"}
    return render(request, "message.html", context)


async def api_message(request: Request) -> Response:
    return _api(await _read(request, data.message_detail, _message_id(request)))


def _content(conn: Any, settings: data.Settings, message_id: int) -> bytes:
    detail = settings.broker.message(conn, message_id)
    if detail is None:
        raise data.NotFound(f"no message {message_id}")
    return detail.content


async def content(request: Request) -> Response:
    """The whole content, as a download (never rendered by the browser)."""
    message_id = _message_id(request)
    body: bytes = await _read(request, _content, message_id)
    return Response(
        body,
        media_type="application/octet-stream",
        headers={
            "content-disposition": f'attachment; filename="message-{message_id}.bin"',
            "content-security-policy": "default-src 'none'; sandbox",
        },
    )


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok")


def routes() -> list[BaseRoute]:
    return [
        Route("/", overview, name="overview"),
        Route("/api/status", api_status),
        Route("/queue", queue, name="queue"),
        Route("/api/queue", api_queue),
        Route("/channel", channel, name="channel"),
        Route("/api/channel", api_channel),
        Route("/consumers", consumers, name="consumers"),
        Route("/api/consumers", api_consumers),
        Route("/messages", messages, name="messages"),
        Route("/api/messages", api_messages),
        Route("/messages/{id:int}", message, name="message"),
        Route("/api/messages/{id:int}", api_message),
        Route("/messages/{id:int}/content", content, name="content"),
        Route("/healthz", healthz),
    ]
