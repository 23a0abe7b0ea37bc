"""Database connection strings as people write them (``postgresql://`` or ``lonnymq://`` URLs,
libpq ``key=value`` strings), made fit to show: in error messages, logs, the command's output.
"""

from __future__ import annotations

import re

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
