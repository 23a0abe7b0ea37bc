"""What every command of the ``lonnymq`` command line uses: the database it is given, the
connection, usage errors, output (JSON, key-value lines, colour), confirmations."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from typing import Any, NoReturn

import psycopg

from ..dsn import mask_password, scheme_problem
from . import term


def to_libpq(dsn: str) -> str:
    """Accept the broker URL form too: ``lonnymq://`` means ``postgresql://``."""
    if dsn.startswith("lonnymq://"):
        return "postgresql://" + dsn[len("lonnymq://") :]
    return dsn


def dsn_of(args: argparse.Namespace) -> str:
    """The database to use: ``--dsn``, else ``$DATABASE_URL`` (see :func:`to_libpq`)."""
    dsn = args.dsn or os.environ.get("DATABASE_URL")
    if not dsn:
        raise SystemExit("lonnymq: no database given: pass --dsn or set DATABASE_URL")
    problem = scheme_problem(dsn)
    if problem:
        where = "--dsn" if args.dsn else "$DATABASE_URL"
        raise SystemExit(f"lonnymq: {where}: {problem}")
    return to_libpq(dsn)


def connect(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """An autocommit connection to that database; exits with the reason (the password
    masked) when there is none."""
    try:
        return psycopg.connect(dsn_of(args), autocommit=True)
    except psycopg.Error as exc:
        raise SystemExit(
            f"lonnymq: cannot connect to the database: {mask_password(str(exc)).strip()}"
        ) from None


def usage_error(message: str) -> NoReturn:
    """A usage error found after parsing: exit 2, as argparse does."""
    print(f"lonnymq: {message}", file=sys.stderr)
    raise SystemExit(2)


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database's clock: ages are computed against the times it stored."""
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def style_of(args: argparse.Namespace) -> term.Style:
    """Colours for stdout, as ``--color`` and the terminal have it."""
    return term.Style(term.wants_colour(sys.stdout, getattr(args, "color", "auto")))


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=term.jsonable))


def print_fields(data: dict[str, Any], as_json: bool) -> None:
    """``data`` as JSON, or as aligned ``key  value`` lines (a dict value as ``k=v`` pairs)."""
    if as_json:
        print_json(data)
        return
    width = max(len(k) for k in data)
    for key, value in data.items():
        if isinstance(value, dict):
            value = "  ".join(f"{k}={'-' if v is None else v}" for k, v in value.items())
        print(f"{key.ljust(width)}  {'-' if value is None else value}")


def fields_of(obj: Any) -> list[tuple[str, Any]]:
    """The fields of a result of the queue API (a slotted dataclass), by name."""
    return [(name, getattr(obj, name)) for name in obj.__slots__]


def confirm(question: str, args: argparse.Namespace) -> bool:
    """True with --yes; otherwise ask on stderr and read one line from stdin (a pipe works:
    ``yes | lonnymq purge q``); anything but y/yes, or end of input, means no."""
    if args.yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer or not sys.stdin.isatty():
        sys.stderr.write(answer.strip() + "\n")  # an answer from a pipe: show it
    return answer.strip().lower() in ("y", "yes")
