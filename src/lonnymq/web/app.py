"""The ASGI application: :func:`create_app` wires the pages (:mod:`.pages`), the actions
(:mod:`.actions`), the static files, the error pages and the security headers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import migrator
from ..exceptions import ConfigurationError, DatabaseError, SchemaError
from ..queue import Broker
from . import actions, pages
from .auth import Access, Forbidden
from .data import NotFound, Settings
from .db import Pool, Unavailable
from .history import History
from .readings import Readings
from .render import HERE, BadRequest, Web, render, templates

log = logging.getLogger("lonnymq.web")

#: Sent with every response: no script, style or frame from anywhere else, no inline script.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}


# -- errors ------------------------------------------------------------------------------------


def _wants_json(request: Request) -> bool:
    root = request.scope.get("root_path") or ""
    return request.url.path.startswith(root + "/api/")


def _error(request: Request, status: int, message: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"error": message}, status_code=status)
    titles = {400: "Bad request", 403: "Forbidden", 404: "Not found", 503: "Unavailable"}
    context = {"title": titles.get(status, "Error"), "status": status, "message": message}
    try:
        return render(request, "error.html", context, status_code=status)
    except Exception:  # the error page itself failed: plain text
        log.exception("error page failed")
        return Response(message, status_code=status, media_type="text/plain; charset=utf-8")


async def _bad_request(request: Request, exc: Exception) -> Response:
    return _error(request, 400, str(exc))


async def _forbidden(request: Request, exc: Exception) -> Response:
    return _error(request, 403, str(exc))


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(request, 404, str(exc))


async def _unavailable(request: Request, exc: Exception) -> Response:
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return _error(request, 503, str(exc).splitlines()[0])


async def _http(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or ""
    return _error(request, status, str(detail))


# -- headers -----------------------------------------------------------------------------------


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response, and ``Cache-Control: no-store`` to
    every response but the static files."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = "/static/" in scope.get("path", "")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                for key, value in SECURITY_HEADERS.items():
                    if key.encode() not in present:
                        headers.append((key.encode(), value.encode()))
                if not static and b"cache-control" not in present:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


# -- the app -----------------------------------------------------------------------------------


def create_app(
    dsn: str,
    *,
    schema: str = migrator.DEFAULT_SCHEMA,
    allow_actions: bool = False,
    token: str | None = None,
    snapshot_warn_s: float = 60.0,
    refresh_s: float = 2.0,
    pool_size: int = 4,
    statement_timeout_ms: int = 10_000,
) -> Starlette:
    """The web view of the lonnymq ``schema`` in the database ``dsn``, as an ASGI app.

    Read-only unless ``allow_actions`` is true *and* a ``token`` (at least 16 characters) is
    given: then a person who signs in with the token may retry and delete dead letters, purge
    queues and set or clear policies. Connections (at most ``pool_size``) are opened on first
    use; the app's shutdown closes them (mounted inside another app, whose shutdown does not
    reach it, call ``app.state.lonnymq.close()`` from the host's)."""
    if allow_actions and not token:
        raise ConfigurationError("actions need an access token (--token or LONNYMQ_WEB_TOKEN)")
    broker = Broker(schema)
    pool = Pool(dsn, size=pool_size, statement_timeout_ms=statement_timeout_ms)
    readings = Readings(pool, interval_s=refresh_s)
    web = Web(
        settings=Settings(broker, History(), readings, snapshot_warn_s),
        pool=pool,
        access=Access(token if allow_actions else None),
        templates=templates(),
        refresh_s=refresh_s,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            web.close()

    routes = [
        *pages.routes(),
        *actions.routes(),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            BadRequest: _bad_request,
            ConfigurationError: _bad_request,
            Forbidden: _forbidden,
            NotFound: _not_found,
            Unavailable: _unavailable,
            SchemaError: _unavailable,
            DatabaseError: _unavailable,
            404: _http,
            405: _http,
        },
    )
    app.state.lonnymq = web
    app.add_middleware(SecurityHeaders)
    return app
