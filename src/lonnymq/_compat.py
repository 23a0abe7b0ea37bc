"""What the oldest Python lonnymq supports (3.10, see ``requires-python``) lacks."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from typing import LiteralString
else:  # typing_extensions is a dependency on 3.10 (and psycopg's)
    from typing_extensions import LiteralString

__all__ = ["LiteralString"]
