"""Broker URLs: ``lonnymq://USER:PASSWORD@HOST:PORT/DBNAME?libpq-parameters``.

The URL is a libpq connection URI under another scheme, so everything libpq accepts works:
several hosts (``lonnymq://u:p@db1:5432,db2:5432/app?target_session_attrs=read-write``),
``sslmode``, ``sslrootcert``, ``connect_timeout``, ``application_name``... A kombu
connection given as separate fields (hostname, userid, password, port, virtual_host as the
database name) works too.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .exceptions import ConfigurationError

SCHEMES = ("lonnymq", "postgresql", "postgres")
_PASSWORD_IN_URL = re.compile(r"^([a-z0-9+.-]+://[^:/@?#]*:)([^@/?#]*)(@)", re.IGNORECASE)
# password and sslpassword (the passphrase of the client key), in a URL query or key=value
_PASSWORD_IN_QUERY = re.compile(r"([?&](?:ssl)?password=)([^&#]*)", re.IGNORECASE)
_PASSWORD_IN_KV = re.compile(
    r"((?<![?&\w])(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)", re.IGNORECASE
)


def mask_password(text: str, mask: str = "**") -> str:
    """``text`` (a URL or a libpq key=value string) with any password replaced by ``mask``."""
    text = _PASSWORD_IN_URL.sub(lambda m: m[1] + mask + m[3], text)
    text = _PASSWORD_IN_QUERY.sub(lambda m: m[1] + mask, text)
    return _PASSWORD_IN_KV.sub(lambda m: m[1] + mask, text)


def to_conninfo(url: str) -> str:
    """The libpq connection string for a broker URL; raises ConfigurationError if invalid."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError("the broker URL must be a non-empty string")
    if "://" in url:
        scheme, rest = url.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise ConfigurationError(
                f"unsupported URL scheme {scheme!r} in {mask_password(url)!r}: use lonnymq://"
            )
        url = "postgresql://" + rest
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"invalid broker URL {mask_password(url)!r}: {mask_password(str(exc))}"
        ) from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigurationError(f"invalid port {port!r} in broker URL {mask_password(url)!r}")
    check_params(params, url)
    return url


#: libpq parameters whose value is one of a few words: a typo is a configuration error (which
#: kombu and Celery do not retry), not a connection failure to retry forever.
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
}
_INTEGERS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval")


def check_params(params: dict[str, Any], url: str) -> None:
    for key, choices in _CHOICES.items():
        value = params.get(key)
        if value is not None and str(value) not in choices:
            raise ConfigurationError(
                f"invalid {key} {str(value)!r} in broker URL {mask_password(url)!r}: "
                f"expected one of {', '.join(choices)}"
            )
    for key in _INTEGERS:
        value = params.get(key)
        if value is not None and not str(value).strip().lstrip("-").isdigit():
            raise ConfigurationError(
                f"invalid {key} {str(value)!r} in broker URL {mask_password(url)!r}: "
                "expected an integer"
            )


def from_fields(
    hostname: str | None,
    port: int | None,
    userid: str | None,
    password: str | None,
    database: str | None,
    **extra: Any,
) -> str:
    """A libpq connection string from kombu's separate connection fields."""
    params = {
        "host": hostname or None,
        "port": port or None,
        "user": userid or None,
        "password": password or None,
        "dbname": database or None,
        **extra,
    }
    try:
        return make_conninfo("", **{k: v for k, v in params.items() if v is not None})
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid connection parameters: {exc}") from None


def as_uri(url: str, include_password: bool = False, mask: str = "**") -> str:
    """The URL to show (in logs, ``kombu.Connection.as_uri()``): password masked unless asked."""
    if "://" not in url:
        return url if include_password else mask_password(url, mask)
    scheme, rest = url.split("://", 1)
    shown = f"lonnymq://{rest}" if scheme.lower() in SCHEMES else url
    return shown if include_password else mask_password(shown, quote(mask, safe="*"))
