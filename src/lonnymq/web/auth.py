"""Who may act: the access token, the signed-in session, CSRF tokens, and the audit log.

The web view is read-only unless started with actions enabled *and* a token
(:class:`Access`). A person signs in at ``/login`` with the token and a name; the session is a
cookie signed with a key derived from the token (HttpOnly, SameSite=Strict), valid for
``session_s`` seconds. Every action is a POST that carries a CSRF token derived from the
session, from a page on the same origin (checked on ``Origin``, else ``Referer``). Tokens and
signatures are compared in constant time. Every action, sign-in and refused attempt is logged
on :data:`audit` (logger ``lonnymq.web.audit``) with who (the name signed in with, the
host application's user when it has one, the remote address) and what.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

#: Actions, sign-ins and refusals.
audit = logging.getLogger("lonnymq.web.audit")

SESSION_COOKIE = "lonnymq_session"
LOGIN_COOKIE = "lonnymq_login"
MIN_TOKEN_LENGTH = 16
MAX_NAME_LENGTH = 64


class Forbidden(Exception):
    """An action refused (HTTP 403): read-only, not signed in, or a bad CSRF token."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    sid: str
    expires: float


class Access:
    """Actions on or off, and the token that unlocks them. ``token`` None: read-only."""

    def __init__(self, token: str | None, *, session_s: float = 12 * 3600) -> None:
        if token is not None and len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(f"the access token must be at least {MIN_TOKEN_LENGTH} characters")
        self.enabled = token is not None
        self._digest = hashlib.sha256((token or "").encode()).digest()
        self._key = hmac.new(self._digest, b"lonnymq-web session", hashlib.sha256).digest()
        self.session_s = session_s

    def check_token(self, candidate: str) -> bool:
        """Whether ``candidate`` is the token, in constant time (digests of equal length)."""
        if not self.enabled:
            return False
        given = hashlib.sha256(candidate.encode("utf-8", "replace")).digest()
        return hmac.compare_digest(given, self._digest)

    def _sign(self, purpose: str, data: str) -> str:
        mac = hmac.new(self._key, f"{purpose}\0{data}".encode(), hashlib.sha256).digest()
        return _b64(mac)

    # -- the session ------------------------------------------------------------------------

    def session_cookie(self, name: str) -> str:
        payload = _b64(
            json.dumps(
                {"n": name, "s": secrets.token_urlsafe(16), "e": time.time() + self.session_s}
            ).encode()
        )
        return f"{payload}.{self._sign('session', payload)}"

    def session(self, request: Request) -> Session | None:
        """The signed-in session of ``request``, if its cookie is good and not expired."""
        if not self.enabled:
            return None
        cookie = request.cookies.get(SESSION_COOKIE, "")
        payload, _, mac = cookie.partition(".")
        if not payload or not hmac.compare_digest(mac, self._sign("session", payload)):
            return None
        try:
            data = json.loads(_unb64(payload))
            session = Session(str(data["n"]), str(data["s"]), float(data["e"]))
        except (ValueError, KeyError, TypeError):
            return None
        return session if session.expires > time.time() else None

    def csrf_token(self, session: Session) -> str:
        return self._sign("csrf", session.sid)

    # -- the sign-in form's CSRF (double submit: a random cookie and its signature) ----------

    def login_nonce(self, request: Request) -> tuple[str, bool]:
        """The sign-in form's nonce (from its cookie, or a new one: ``True`` when it must be
        set)."""
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        if len(nonce) >= 16:
            return nonce, False
        return secrets.token_urlsafe(16), True

    def login_csrf(self, nonce: str) -> str:
        return self._sign("login", nonce)

    def check_login_csrf(self, request: Request, given: str) -> bool:
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        return len(nonce) >= 16 and hmac.compare_digest(given, self.login_csrf(nonce))

    def set_cookie(self, request: Request, response: Response, name: str, value: str) -> None:
        response.set_cookie(
            name,
            value,
            max_age=int(self.session_s),
            path=cookie_path(request),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    # -- checks of an action ----------------------------------------------------------------

    def require(self, request: Request, form: dict[str, str]) -> Session:
        """The session allowed to run the action POSTed in ``request`` with ``form``, or
        :class:`Forbidden` (logged)."""
        if not self.enabled:
            raise Forbidden("this web view is read-only (started without --allow-actions)")
        if not same_origin(request):
            refuse(request, "cross-origin request")
            raise Forbidden("cross-origin request refused")
        session = self.session(request)
        if session is None:
            refuse(request, "not signed in")
            raise Forbidden("sign in first")
        given = form.get("csrf", "")
        if not hmac.compare_digest(given, self.csrf_token(session)):
            refuse(request, "bad CSRF token", session)
            raise Forbidden("bad or missing CSRF token: reload the page and try again")
        return session


def cookie_path(request: Request) -> str:
    return (request.scope.get("root_path") or "") + "/"


def same_origin(request: Request) -> bool:
    """``Origin`` (else ``Referer``) names this host; a request with neither is refused
    (every browser sends one of them with a form POST)."""
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source or source == "null":
        return False
    host = request.headers.get("host", "")
    return urlsplit(source).netloc == host


def remote(request: Request) -> str:
    return request.client.host if request.client else "-"


def who(request: Request, session: Session | None) -> str:
    """Who is acting, for the log: the name signed in with, the host application's user (a
    Starlette or Django authentication middleware's ``request.user``) when there is one,
    and the remote address."""
    parts = [f"name={session.name!r}" if session else "name=-"]
    user: Any = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        shown = getattr(user, "display_name", None) or getattr(user, "username", None)
        parts.append(f"user={str(shown or user)!r}")
    parts.append(f"from={remote(request)}")
    return " ".join(parts)


def refuse(request: Request, why: str, session: Session | None = None) -> None:
    audit.warning(
        "refused %s %s: %s; %s", request.method, request.url.path, why, who(request, session)
    )


def clean_name(text: str) -> str:
    """The name a person signs in with: printable, trimmed, at most 64 characters."""
    name = "".join(ch for ch in text if ch.isprintable()).strip()
    return name[:MAX_NAME_LENGTH]
