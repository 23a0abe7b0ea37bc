"""Database connection strings as people write them (``postgresql://`` or ``lonnymq://`` URLs,
libpq ``key=value`` strings), made fit to show: in error messages, logs, the command's output.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

#: The password in a URL's user info: groups ``scheme://user:``, the password, ``@``.
PASSWORD_IN_URL = re.compile(r"^([a-z0-9+.-]+://[^:/@?#]*:)([^@/?#]*)(@)", re.IGNORECASE)
# password and sslpassword (the passphrase of the client key), in a URL query or key=value
_PASSWORD_IN_QUERY = re.compile(r"([?&](?:ssl)?password=)([^&#]*)", re.IGNORECASE)
_PASSWORD_IN_KV = re.compile(
    r"((?<![?&\w])(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)", re.IGNORECASE
)


def mask_password(text: str, mask: str = "**") -> str:
    """``text`` (a URL or a libpq key=value string) with any password replaced by ``mask``."""
    text = PASSWORD_IN_URL.sub(lambda m: m[1] + mask + m[3], text)
    text = _PASSWORD_IN_QUERY.sub(lambda m: m[1] + mask, text)
    return _PASSWORD_IN_KV.sub(lambda m: m[1] + mask, text)


#: The URL schemes a database may be given with: libpq's, and the broker URL's.
SCHEMES = ("lonnymq", "postgresql", "postgres")


def meant(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to a misspelt ``word``, else ``""``."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def scheme_problem(dsn: str) -> str | None:
    """What is wrong with the form of a connection string, said for a person: an unknown URL
    scheme (with the schemes accepted and the one meant), or text that is neither a URL nor
    libpq's ``key=value`` form; None when its form is fine (libpq judges the rest)."""
    if "://" in dsn:
        scheme = dsn.split("://", 1)[0]
        if scheme.lower() in SCHEMES:
            return None
        close = difflib.get_close_matches(scheme.lower(), SCHEMES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}://?" if close else ""
        return (
            f"unknown URL scheme {scheme!r} in {mask_password(dsn)!r}: the accepted schemes are "
            f"{', '.join(s + '://' for s in SCHEMES)} (or a libpq key=value string){hint}"
        )
    if dsn.strip() and "=" not in dsn:
        return (
            f"{mask_password(dsn)!r} is neither a URL (postgresql://USER@HOST:PORT/DBNAME, "
            "lonnymq://...) nor a libpq key=value string (host=... dbname=...)"
        )
    return None
