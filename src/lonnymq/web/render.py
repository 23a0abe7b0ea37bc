"""What the pages and the actions share: the app's state (:class:`Web`), the templates
(autoescaped) with their filters, links under the prefix the app is mounted at, and
:class:`BadRequest`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse

from ..report import age
from .auth import Access, Session
from .data import Settings
from .db import Pool

HERE = Path(__file__).resolve().parent


class BadRequest(Exception):
    """A query parameter or form field that is not acceptable (HTTP 400)."""


@dataclass
class Web:
    """What the handlers share (``request.app.state.lonnymq``)."""

    settings: Settings
    pool: Pool
    access: Access
    templates: jinja2.Environment
    refresh_s: float

    def close(self) -> None:
        """Stop the background readings and close the database connections (a mounted app:
        call it from the host's shutdown)."""
        self.settings.readings.close()
        self.pool.close()


def web_of(request: Request) -> Web:
    web: Web = request.app.state.lonnymq
    return web


# -- templates ---------------------------------------------------------------------------------


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value = value / 1024  # type: ignore[assignment]
    return f"{value:,.1f} GiB"


def _when(value: str | datetime | None) -> str:
    if value is None:
        return "-"
    at = datetime.fromisoformat(value) if isinstance(value, str) else value
    return at.isoformat(sep=" ", timespec="seconds")


def _seconds_between(a: str | None, b: str | None) -> float | None:
    if a is None or b is None:
        return None
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def _ago(at: str | None, now: str) -> str:
    """ "5.0s ago", or "in 5.0s" for a time still to come."""
    seconds = _seconds_between(at, now)
    if seconds is None:
        return "-"
    return age(seconds) + " ago" if seconds >= 0 else "in " + age(-seconds)


def _since(at: str | None, now: str) -> str:
    """How long ago ``at`` was; "in 5.0s" for a time still to come."""
    seconds = _seconds_between(at, now)
    if seconds is None:
        return "-"
    return age(seconds) if seconds >= 0 else "in " + age(-seconds)


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        number=_number,
        rate=_rate,
        age=age,
        bytes=_bytes,
        when=_when,
        since=_since,
        ago=_ago,
        tojson=_tojson,
        pretty=_pretty,
    )
    return env


def _tojson(value: Any) -> Markup:
    """JSON for a ``data-`` attribute in single quotes: ``<``, ``>``, ``&`` and ``'`` are
    written as JSON escapes, so nothing in it can end the attribute or start a tag."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(ch, esc)
    return Markup(text)


def _pretty(value: Any) -> str:
    """A value as indented JSON text (escaped by autoescape where it is shown)."""
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def link(request: Request, path: str, **query: Any) -> str:
    """A link to ``path`` of this app (under the prefix it is mounted at), with ``query``
    (None values left out)."""
    base = request.scope.get("root_path") or ""
    params = {k: v for k, v in query.items() if v is not None and v != ""}
    return base + path + ("?" + urlencode(params) if params else "")


def render(
    request: Request, name: str, context: Mapping[str, Any], status_code: int = 200
) -> HTMLResponse:
    web = web_of(request)
    session: Session | None = web.access.session(request)
    base_context = {
        "request": request,
        "link": lambda path, **q: link(request, path, **q),
        "base": request.scope.get("root_path") or "",
        "schema": web.settings.broker.schema,
        "actions": web.access.enabled,
        "session": session,
        "csrf": web.access.csrf_token(session) if session else "",
        "refresh_ms": int(web.refresh_s * 1000),
        "page": "",
    }
    html = web.templates.get_template(name).render(base_context | dict(context))
    return HTMLResponse(html, status_code=status_code)
